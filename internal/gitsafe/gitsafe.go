// Package gitsafe is how fenceline runs git: never a program the
// repository names.
//
// A repository's own configuration and hooks can make git run programs:
// hooks, core.fsmonitor, filter drivers, textconv and external diff,
// merge drivers, pagers, editors, credential helpers, gpg, ssh, askpass,
// and whatever an include.path (to a file anywhere) adds to those. An
// agent with a writable git dir can plant any of them, and fenceline runs
// git itself, unconfined, on repositories agents worked in: when it
// cleans a shard, keeps an attempt's work, finds a checkout, mirrors an
// upstream, or judges a push in the pre-receive hook.
//
// Every such git command goes through Git. It
//   - starts git with none of the caller's GIT_* variables (unless the
//     caller keeps its environment, as the hook must), none of the
//     variables naming programs (GIT_EXTERNAL_DIFF, GIT_PAGER, GIT_EDITOR,
//     GIT_ASKPASS, GIT_SSH, ...), and GIT_ALLOW_PROTOCOL=file:http:https;
//   - sets, as command-line configuration (which wins over every file),
//     core.hooksPath=/dev/null, core.fsmonitor=false, empty askPass,
//     sshCommand, gitProxy and credential helpers, no pager, no gpg, no
//     automatic gc or maintenance, no submodule recursion;
//   - first reads the configuration git would use (git config --list,
//     includes followed, which executes nothing) and neutralizes every
//     entry that names a program, whatever its section or subsection:
//     filter.<driver>.clean/smudge/process, diff.<driver>.textconv and
//     command, merge.<driver>.driver, gpg.*.program, pager.<cmd>,
//     remote.<name>.uploadpack/receivepack, core.alternateRefsCommand ...;
//   - refuses what it cannot neutralize (git takes the first of several
//     remote.<name>.uploadpack, receivepack or vcs values): a command that
//     uses a remote by name, and any command in a partial clone whose
//     promisor remote configures one (git fetches a missing object from it
//     by itself).
package gitsafe

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// Git runs git in a directory without running anything the repository
// configures. The zero value runs "git" in the current directory.
type Git struct {
	// Bin is the git binary (default "git").
	Bin string
	// Dir is where git runs (git -C Dir); "" the current directory.
	Dir string
	// Env is added to git's environment (GIT_DIR, GIT_WORK_TREE,
	// GIT_INDEX_FILE, an identity ...).
	Env []string
	// KeepEnv keeps this process's GIT_* variables: a pre-receive hook's
	// GIT_DIR and quarantine. Variables that name programs still go.
	KeepEnv bool
}

// baseConfig is set on every command, whatever the repository says.
var baseConfig = [][2]string{
	{"core.hooksPath", "/dev/null"},
	{"core.fsmonitor", "false"},
	{"core.askPass", ""},
	{"core.sshCommand", ""},
	{"core.gitProxy", ""},
	{"core.pager", "cat"},
	{"core.editor", ":"},
	{"sequence.editor", ":"},
	{"diff.external", ""},
	{"credential.helper", ""}, // an empty helper empties the list
	{"gpg.program", ""},
	{"commit.gpgSign", "false"},
	{"tag.gpgSign", "false"},
	{"log.showSignature", "false"},
	{"gc.auto", "0"},
	{"maintenance.auto", "false"},
	{"submodule.recurse", "false"},
	{"fetch.recurseSubmodules", "false"},
	{"diff.ignoreSubmodules", "all"},
	{"status.submoduleSummary", "false"},
	{"protocol.ext.allow", "never"},
	{"core.untrackedCache", "false"},
}

// programKeys are the last components of configuration keys whose value
// is a program (or a shell command) git runs, with the neutral value that
// replaces it.
var programKeys = map[string]string{
	"hookspath": "/dev/null", "fsmonitor": "false",
	"textconv": "", "command": "", "cmd": "", "clean": "", "smudge": "", "process": "",
	"driver": "", "program": "", "helper": "", "editor": ":", "pager": "cat", "askpass": "",
	"sshcommand": "", "gitproxy": "", "defaultkeycommand": "", "alternaterefscommand": "",
	"external": "", "proxycommand": "", "trustexitcode": "false",
	"uploadpack": "git-upload-pack", "receivepack": "git-receive-pack",
}

// programEnv are environment variables that make git run a program.
var programEnv = []string{
	"GIT_EXTERNAL_DIFF", "GIT_PAGER", "PAGER", "GIT_EDITOR", "GIT_SEQUENCE_EDITOR", "EDITOR", "VISUAL",
	"GIT_ASKPASS", "SSH_ASKPASS", "GIT_SSH", "GIT_SSH_COMMAND", "GIT_PROXY_COMMAND",
	"GIT_CONFIG_PARAMETERS", "GIT_CONFIG_COUNT", "GIT_EXEC_PATH", "GIT_TEMPLATE_DIR",
	"GIT_ALLOW_PROTOCOL", "GIT_PROTOCOL_FROM_USER", "GIT_TRACE", "GIT_TRACE2", "GIT_TRACE2_EVENT",
}

// Overrides returns the configuration that neutralizes every entry of
// listed (the NUL-separated output of git config --list --null) that
// names a program, as key/value pairs.
func Overrides(listed []byte) [][2]string {
	out, _ := overrides(listed)
	return out
}

// overrides also returns the keys no later value can neutralize: git takes
// the first of several remote.<name>.uploadpack or receivepack values.
func overrides(listed []byte) (out [][2]string, firstWins []string) {
	seen := map[string]bool{}
	for _, ent := range bytes.Split(listed, []byte{0}) {
		key, _, _ := bytes.Cut(ent, []byte{'\n'})
		k := string(key)
		if k == "" || seen[k] {
			continue
		}
		seen[k] = true
		section, rest, ok := strings.Cut(k, ".")
		if !ok {
			continue
		}
		last := rest[strings.LastIndexByte(rest, '.')+1:]
		switch {
		case section == "pager": // pager.<command>: false pages nothing
			out = append(out, [2]string{k, "false"})
		case section == "filter" && last == "required":
			out = append(out, [2]string{k, "false"})
		case section == "uploadpack" && last == "packobjectshook":
			// Only read from protected (not repository) configuration.
		case section == "remote" && (last == "uploadpack" || last == "receivepack" || last == "vcs"):
			firstWins = append(firstWins, k)
		default:
			if v, ok := programKeys[strings.ToLower(last)]; ok {
				out = append(out, [2]string{k, v})
			}
		}
	}
	return out, firstWins
}

// promisorPrograms are the keys of firstWins (remote.<name>.uploadpack,
// receivepack, vcs) that belong to a promisor remote of listed: one named
// by extensions.partialClone, or with remote.<name>.promisor set.
func promisorPrograms(listed []byte, firstWins []string) []string {
	if len(firstWins) == 0 {
		return nil
	}
	promisor := map[string]bool{}
	for _, ent := range bytes.Split(listed, []byte{0}) {
		key, val, _ := bytes.Cut(ent, []byte{'\n'})
		k := strings.ToLower(string(key))
		switch {
		case k == "extensions.partialclone":
			promisor[string(val)] = true
		case strings.HasPrefix(k, "remote.") && strings.HasSuffix(k, ".promisor"):
			if v := strings.ToLower(string(val)); v != "false" && v != "no" && v != "off" && v != "0" {
				promisor[string(key[len("remote."):len(key)-len(".promisor")])] = true
			}
		}
	}
	var out []string
	for _, k := range firstWins {
		name := k[len("remote."):strings.LastIndexByte(k, '.')]
		if promisor[name] {
			out = append(out, k)
		}
	}
	return out
}

// env is git's environment without the neutralizing configuration.
func (g Git) env() []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if !g.KeepEnv && strings.HasPrefix(k, "GIT_") {
			continue
		}
		if strings.HasPrefix(k, "GIT_CONFIG_KEY_") || strings.HasPrefix(k, "GIT_CONFIG_VALUE_") {
			continue
		}
		if isProgramEnv(k) {
			continue
		}
		env = append(env, kv)
	}
	env = append(env, "GIT_TERMINAL_PROMPT=0", "GIT_ALLOW_PROTOCOL=file:http:https", "GIT_OPTIONAL_LOCKS=0", "GIT_NO_REPLACE_OBJECTS=1")
	for _, kv := range g.Env {
		k, _, _ := strings.Cut(kv, "=")
		if !isProgramEnv(k) && !strings.HasPrefix(k, "GIT_CONFIG_KEY_") && !strings.HasPrefix(k, "GIT_CONFIG_VALUE_") {
			env = append(env, kv)
		}
	}
	return env
}

func isProgramEnv(k string) bool {
	for _, p := range programEnv {
		if k == p {
			return true
		}
	}
	return false
}

func (g Git) bin() string {
	if g.Bin == "" {
		return "git"
	}
	return g.Bin
}

func (g Git) argv(args []string) []string {
	a := []string{"--no-pager"}
	if g.Dir != "" {
		a = append(a, "-C", g.Dir)
	}
	return append(a, args...)
}

func withConfig(env []string, cfg [][2]string) []string {
	env = append(env, "GIT_CONFIG_COUNT="+strconv.Itoa(len(cfg)))
	for i, kv := range cfg {
		env = append(env, fmt.Sprintf("GIT_CONFIG_KEY_%d=%s", i, kv[0]), fmt.Sprintf("GIT_CONFIG_VALUE_%d=%s", i, kv[1]))
	}
	return env
}

// remoteCommands use a remote by name, whose configuration may name the
// program to run on the other side.
var remoteCommands = map[string]bool{"fetch": true, "pull": true, "push": true, "ls-remote": true, "remote": true, "submodule": true, "archive": true}

// Command returns the git command for args: the repository's
// configuration is read first (executing nothing) to neutralize what in
// it names a program. Diffs are made without external diff or textconv.
// A command that can use a remote by name is refused when the repository
// configures a remote's programs (git would take the first of several
// values, the repository's).
func (g Git) Command(ctx context.Context, args ...string) (*exec.Cmd, error) {
	env := g.env()
	cfg := baseConfig
	list := exec.CommandContext(ctx, g.bin(), g.argv([]string{"config", "--list", "--null"})...)
	list.Env = withConfig(env, baseConfig)
	if out, err := list.Output(); err == nil { // no repository: nothing to neutralize
		more, firstWins := overrides(out)
		if len(firstWins) > 0 && len(args) > 0 && remoteCommands[args[0]] {
			return nil, fmt.Errorf("git %s: refused: the repository configures %s, a program git would run", args[0], strings.Join(firstWins, ", "))
		}
		// A partial clone fetches a missing object from its promisor
		// remote by itself, whatever the command: "git fetch <remote>",
		// which runs the remote's configured programs.
		if lazy := promisorPrograms(out, firstWins); len(lazy) > 0 {
			return nil, fmt.Errorf("git %s: refused: the repository configures %s, a program git would run to fetch a missing object from its promisor remote", strings.Join(args, " "), strings.Join(lazy, ", "))
		}
		cfg = append(append([][2]string(nil), baseConfig...), more...)
	}
	if len(args) > 0 && (args[0] == "diff" || args[0] == "log" || args[0] == "show") {
		args = append([]string{args[0], "--no-ext-diff", "--no-textconv"}, args[1:]...)
	}
	cmd := exec.CommandContext(ctx, g.bin(), g.argv(args)...)
	cmd.Env = withConfig(env, cfg)
	return cmd, nil
}

// Output runs git and returns its stdout; an error carries its stderr.
func (g Git) Output(ctx context.Context, args ...string) (string, error) {
	cmd, err := g.Command(ctx, args...)
	if err != nil {
		return "", err
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		if msg := strings.TrimSpace(stderr.String()); msg != "" {
			return stdout.String(), fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, msg)
		}
		return stdout.String(), fmt.Errorf("git %s: %w", strings.Join(args, " "), err)
	}
	return stdout.String(), nil
}
