// Package gittrap plants, for tests, everything a repository can make git
// run: every hook and every configuration entry that names a program
// (also through an include), each a script that appends its name to a
// marker file. A test then runs fenceline's git against the repository
// and checks the marker stays absent.
package gittrap

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// Hooks are the hooks git runs (all of them are planted).
var Hooks = []string{
	"applypatch-msg", "pre-applypatch", "post-applypatch", "pre-commit", "pre-merge-commit",
	"prepare-commit-msg", "commit-msg", "post-commit", "pre-rebase", "post-checkout", "post-merge",
	"pre-push", "pre-receive", "update", "proc-receive", "post-receive", "post-update",
	"reference-transaction", "push-to-checkout", "pre-auto-gc", "post-rewrite", "sendemail-validate",
	"fsmonitor-watchman", "post-index-change",
}

// Plant writes the traps into gitDir (its config, hooks and
// info/attributes) and, when workTree is not "", a .gitattributes there
// that sends every file through the trap drivers. Every trap appends a
// line to marker. scripts is a directory for the trap programs.
func Plant(gitDir, workTree, scripts, marker string) error {
	if err := os.MkdirAll(scripts, 0o755); err != nil {
		return err
	}
	trap := filepath.Join(scripts, "trap.sh")
	// Filters must pass content through; everything else just reports.
	body := fmt.Sprintf("#!/bin/sh\necho \"ran: $*\" >> %q\ncase \"$1\" in filter) cat ;; esac\nexit 0\n", marker)
	if err := os.WriteFile(trap, []byte(body), 0o755); err != nil {
		return err
	}
	hooks := []string{filepath.Join(gitDir, "hooks"), filepath.Join(scripts, "hooks")}
	for _, dir := range hooks {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		for _, h := range Hooks {
			s := fmt.Sprintf("#!/bin/sh\necho \"ran: hook %s\" >> %q\nexit 0\n", h, marker)
			if err := os.WriteFile(filepath.Join(dir, h), []byte(s), 0o755); err != nil {
				return err
			}
		}
	}
	cmd := func(what string) string { return trap + " " + what }
	included := filepath.Join(scripts, "included.cfg")
	inc := strings.Join([]string{
		"[filter \"inc\"]",
		"\tclean = " + cmd("filter inc-clean"),
		"\tsmudge = " + cmd("filter inc-smudge"),
		"\trequired = true",
		"[diff \"inc\"]",
		"\ttextconv = " + cmd("inc-textconv"),
		"[core]",
		"\tfsmonitor = " + cmd("inc-fsmonitor"),
		"",
	}, "\n")
	if err := os.WriteFile(included, []byte(inc), 0o644); err != nil {
		return err
	}
	cfg := strings.Join([]string{
		"[core]",
		"\tfsmonitor = " + cmd("fsmonitor"),
		"\thooksPath = " + hooks[1],
		"\tpager = " + cmd("pager"),
		"\teditor = " + cmd("editor"),
		"\taskPass = " + cmd("askpass"),
		"\tsshCommand = " + cmd("ssh"),
		"\tgitProxy = " + cmd("gitproxy"),
		"\talternateRefsCommand = " + cmd("alternate-refs"),
		"[sequence]",
		"\teditor = " + cmd("sequence-editor"),
		"[pager]",
		"\tstatus = " + cmd("pager-status"),
		"\tlog = " + cmd("pager-log"),
		"\tdiff = " + cmd("pager-diff"),
		"[diff]",
		"\texternal = " + cmd("diff-external"),
		"[diff \"trap\"]",
		"\ttextconv = " + cmd("textconv"),
		"\tcommand = " + cmd("diff-command"),
		"[filter \"trap\"]",
		"\tclean = " + cmd("filter clean"),
		"\tsmudge = " + cmd("filter smudge"),
		"\tprocess = " + cmd("filter-process"),
		"\trequired = true",
		"[merge \"trap\"]",
		"\tdriver = " + cmd("merge-driver"),
		"[credential]",
		"\thelper = " + cmd("credential"),
		"[credential \"http://127.0.0.1\"]",
		"\thelper = " + cmd("credential-url"),
		"[gpg]",
		"\tprogram = " + cmd("gpg"),
		"[gpg \"ssh\"]",
		"\tprogram = " + cmd("gpg-ssh"),
		"\tdefaultKeyCommand = " + cmd("gpg-ssh-key"),
		"[commit]",
		"\tgpgSign = true",
		"[log]",
		"\tshowSignature = true",
		"[uploadpack]",
		"\tpackObjectsHook = " + cmd("pack-objects-hook"),
		"[remote \"trap\"]",
		"\turl = /nonexistent",
		"\tuploadpack = " + cmd("uploadpack"),
		"\treceivepack = " + cmd("receivepack"),
		"[include]",
		"\tpath = " + included,
		"[includeIf \"gitdir:/\"]",
		"\tpath = " + included,
		"",
	}, "\n")
	f, err := os.OpenFile(filepath.Join(gitDir, "config"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(cfg); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	attrs := "* filter=trap diff=trap merge=trap\n*.inc filter=inc diff=inc\n"
	if err := os.MkdirAll(filepath.Join(gitDir, "info"), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(gitDir, "info", "attributes"), []byte(attrs), 0o644); err != nil {
		return err
	}
	if workTree != "" {
		return os.WriteFile(filepath.Join(workTree, ".gitattributes"), []byte(attrs), 0o644)
	}
	return nil
}

// Ran returns what ran (the marker's lines), "" when nothing did.
func Ran(marker string) string {
	b, _ := os.ReadFile(marker)
	return strings.TrimSpace(string(b))
}
