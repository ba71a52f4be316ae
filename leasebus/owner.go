package leasebus

import (
	"os"
	"os/user"
)

// DefaultAgentID is the agent id of an owner that names none, for a lease
// taken on this machine: "user@hostname", the user being name (the CLI
// passes $USER), else the OS account's name, else "cli"; without a
// hostname, the user alone.
func DefaultAgentID(name string) string {
	if name == "" {
		if u, err := user.Current(); err == nil {
			name = u.Username
		}
	}
	if name == "" {
		name = "cli"
	}
	if host, err := os.Hostname(); err == nil && host != "" {
		name += "@" + host
	}
	return name
}
