package cli

import (
	"path/filepath"

	"github.com/spf13/pflag"

	"github.com/fenceline/fenceline/attempt"
)

// registerPrivateState adds --private-state to a command that runs an
// agent.
func registerPrivateState(f *pflag.FlagSet, into *[]string) {
	f.StringArrayVar(into, "private-state", nil, "a CLI's state in your HOME (e.g. ~/.claude, ~/.claude.json, ~/.codex) the agent gets a private, writable copy of in a HOME of its own, discarded at the end with every changed setting that runs a program named; yours stay read-only (repeatable)")
}

// privateState checks --private-state paths against home ($HOME) and
// against the --allow-write paths (real), none of which may make a copied
// path's original writable.
func privateState(home string, paths, allowWrite []string) (attempt.StateSpec, error) {
	ps, err := attempt.StatePaths("--private-state", home, paths)
	if err != nil || len(ps) == 0 {
		return attempt.StateSpec{}, err
	}
	for _, p := range ps {
		real := p
		if r, err := filepath.EvalSymlinks(p); err == nil {
			real = r
		}
		for _, w := range allowWrite {
			if attempt.Within(real, w) || attempt.Within(w, real) {
				return attempt.StateSpec{}, usagef("--allow-write %s makes your own %s writable to the agent, which --private-state gives a copy of instead: drop the --allow-write", w, p)
			}
		}
	}
	return attempt.StateSpec{Home: home, Paths: ps}, nil
}
