package leasebus

import (
	"os"
	"os/user"
	"testing"
)

// TestDefaultAgentID: user@hostname; without a user name, the OS
// account's name.
func TestDefaultAgentID(t *testing.T) {
	t.Parallel()
	host, err := os.Hostname()
	if err != nil || host == "" {
		t.Skipf("no hostname: %q, %v", host, err)
	}
	if got, want := DefaultAgentID("ada"), "ada@"+host; got != want {
		t.Errorf("as ada: %q, want %q", got, want)
	}
	u, err := user.Current()
	if err != nil || u.Username == "" {
		t.Skipf("no OS account name: %v", err)
	}
	if got, want := DefaultAgentID(""), u.Username+"@"+host; got != want {
		t.Errorf("without a user name: %q, want %q", got, want)
	}
}
