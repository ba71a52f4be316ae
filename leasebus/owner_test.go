package leasebus

import (
	"os"
	"os/user"
	"testing"
)

// TestDefaultAgentID: $USER@hostname; without $USER, the OS account's
// name.
func TestDefaultAgentID(t *testing.T) {
	host, err := os.Hostname()
	if err != nil || host == "" {
		t.Skipf("no hostname: %q, %v", host, err)
	}
	t.Setenv("USER", "ada")
	if got, want := DefaultAgentID(), "ada@"+host; got != want {
		t.Errorf("with USER=ada: %q, want %q", got, want)
	}
	u, err := user.Current()
	if err != nil || u.Username == "" {
		t.Skipf("no OS account name: %v", err)
	}
	t.Setenv("USER", "")
	if got, want := DefaultAgentID(), u.Username+"@"+host; got != want {
		t.Errorf("without USER: %q, want %q", got, want)
	}
}
