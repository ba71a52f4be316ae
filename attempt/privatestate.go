package attempt

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/fsguard"
)

// StateSpec names the user's CLI state (~/.claude, ~/.claude.json,
// ~/.codex, ...) an attempt gives its agent as a private copy instead of
// letting it write the originals: what the agent changes there (a hook,
// an MCP server, a notify command) would run, unguarded, at the user's
// next plain run of the CLI. See PrivateHome.
type StateSpec struct {
	Home  string   // the user's HOME, absolute; every path lies beneath it
	Paths []string // absolute and clean (StatePaths); missing ones copy nothing
	// Limit is the most the copy may hold, in bytes (0: DefaultStateLimit).
	Limit int64
	// Hidden are secrets the agent may not read (HiddenPaths' roots): a
	// path inside one is refused, one inside a path is left out.
	Hidden []string
}

// DefaultStateLimit bounds a private copy: a CLI's state dir with years of
// transcripts is better named narrower than copied for every run.
const DefaultStateLimit = 1 << 30

// StateEnv are the variables the CLIs read their state dir from instead
// of HOME; when one names a path inside a copied one, the agent's points
// at the copy.
var StateEnv = []string{"CODEX_HOME", "CLAUDE_CONFIG_DIR"}

// StatePaths checks the paths of flag against home: each is made absolute
// and clean, and must lie strictly beneath home (its place in the private
// HOME is where it lies in the user's). Paths inside another are dropped.
func StatePaths(flag, home string, ps []string) ([]string, error) {
	if len(ps) == 0 {
		return nil, nil
	}
	if home == "" || !filepath.IsAbs(home) {
		return nil, invalidf("%s needs HOME set to an absolute path (it is %q): the copies keep their place beneath it", flag, home)
	}
	home = filepath.Clean(home)
	var out []string
	for _, p := range ps {
		abs, err := filepath.Abs(p)
		if err != nil {
			return nil, invalidf("%s %s: %v", flag, p, err)
		}
		if abs == home || !Within(abs, home) {
			return nil, invalidf("%s %s: not beneath HOME %s: name a CLI's state in your HOME, e.g. %s ~/.claude", flag, p, home, flag)
		}
		out = append(out, abs)
	}
	slices.Sort(out) // a path before the paths inside it
	var kept []string
	for _, p := range out {
		if !slices.ContainsFunc(kept, func(k string) bool { return Within(p, k) }) {
			kept = append(kept, p)
		}
	}
	return kept, nil
}

// PrivateHome is one attempt's private HOME: a fresh directory, writable
// by the agent alone among the attempts, holding a copy of each path of a
// StateSpec at its place relative to HOME. The agent's HOME (and
// CODEX_HOME, CLAUDE_CONFIG_DIR when they name a copied path) point at it,
// while the originals stay read-only to it. Changes, at settle, says what
// the agent changed there — naming each setting that runs a program or
// widens what runs — and Discard removes it, so nothing of it reaches the
// user's next run.
//
// The copy never follows a symlink inside a named path: one that resolves
// within the named path is copied as a symlink, any other is left out
// (Skipped). A named path that is itself a symlink is followed, since the
// user named it. Sockets, devices and FIFOs are left out; set-id bits are
// dropped.
type PrivateHome struct {
	Dir     string   // the private HOME (real, absolute)
	Skipped []string // what the copy left out, and why
	Files   int      // regular files copied
	Bytes   int64    // their size

	home   string
	paths  []string
	hidden []string             // secrets' paths, spelled and real: never copied
	seed   map[string]seedEntry // by slash path relative to Dir
}

// seedEntry is what the copy put at one path.
type seedEntry struct {
	mode fs.FileMode // type bits only
	exec bool        // a regular file with an execute bit
	sum  [sha256.Size]byte
	link string
	data []byte // a settings file's content (settingsFile), to diff at settle
	big  bool   // a settings file over maxSettingsFile: data is nil
}

// maxSettingsFile bounds the settings files kept and parsed to diff.
const maxSettingsFile = 4 << 20

// NewPrivateHome makes the private HOME of spec in a new directory
// beneath tmp (os.TempDir when ""): every attempt gets its own.
func NewPrivateHome(spec StateSpec, tmp string) (h *PrivateHome, err error) {
	dir, err := os.MkdirTemp(tmp, "fenceline-home-")
	if err != nil {
		return nil, fmt.Errorf("private state: %w", err)
	}
	if dir, err = filepath.EvalSymlinks(dir); err != nil {
		return nil, fmt.Errorf("private state: %w", err)
	}
	h = &PrivateHome{Dir: dir, home: filepath.Clean(spec.Home), paths: spec.Paths, seed: map[string]seedEntry{}}
	defer func() {
		if err != nil {
			os.RemoveAll(dir)
		}
	}()
	limit := spec.Limit
	if limit <= 0 {
		limit = DefaultStateLimit
	}
	for _, s := range spec.Hidden {
		if abs, err := filepath.Abs(s); err == nil && s != "" {
			h.hidden = append(h.hidden, abs)
			if real, err := filepath.EvalSymlinks(abs); err == nil {
				h.hidden = append(h.hidden, real)
			}
		}
	}
	for _, p := range spec.Paths {
		if err := h.copyPath(p, limit); err != nil {
			return nil, err
		}
	}
	return h, nil
}

// secret returns the hidden path p (as spelled, or real) lies in, if any.
func (h *PrivateHome) secret(paths ...string) string {
	for _, p := range paths {
		for _, s := range h.hidden {
			if Within(p, s) {
				return s
			}
		}
	}
	return ""
}

// Shown is p as a person spells it: ~/rel beneath the user's HOME.
func (h *PrivateHome) Shown(p string) string {
	if rel, err := filepath.Rel(h.home, p); err == nil && Within(p, h.home) {
		return "~/" + filepath.ToSlash(rel)
	}
	return p
}

// copyPath copies the user's path p to its place in Dir.
func (h *PrivateHome) copyPath(p string, limit int64) error {
	rel, _ := filepath.Rel(h.home, p)
	dst := filepath.Join(h.Dir, rel)
	src, err := filepath.EvalSymlinks(p) // the user named it: follow it
	if errors.Is(err, fs.ErrNotExist) {
		h.Skipped = append(h.Skipped, h.Shown(p)+": does not exist (the agent starts without it)")
		return nil
	}
	if err != nil {
		return fmt.Errorf("private state %s: %w", h.Shown(p), err)
	}
	if s := h.secret(p, src); s != "" {
		return invalidf("private state %s: it lies in %s, which holds fenceline's secrets and is hidden from the agent", h.Shown(p), s)
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return fmt.Errorf("private state: %w", err)
	}
	for d := filepath.Dir(rel); d != "."; d = filepath.Dir(d) {
		h.seed[filepath.ToSlash(d)] = seedEntry{mode: fs.ModeDir}
	}
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("private state %s: %w", h.Shown(p), err)
		}
		sub, _ := filepath.Rel(src, path)
		to := filepath.Join(dst, sub)
		key := filepath.ToSlash(filepath.Join(rel, sub))
		shown := h.Shown(filepath.Join(p, sub))
		if s := h.secret(filepath.Join(p, sub), path); s != "" {
			h.Skipped = append(h.Skipped, fmt.Sprintf("%s: fenceline's secrets, hidden from the agent", shown))
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return fmt.Errorf("private state %s: %w", shown, err)
		}
		switch {
		case d.IsDir():
			if err := os.Mkdir(to, info.Mode().Perm()|0o700); err != nil {
				return fmt.Errorf("private state: %w", err)
			}
			h.seed[key] = seedEntry{mode: fs.ModeDir}
		case d.Type()&fs.ModeSymlink != 0:
			target, err := os.Readlink(path)
			if err != nil {
				return fmt.Errorf("private state %s: %w", shown, err)
			}
			if filepath.IsAbs(target) || !Within(filepath.Join(filepath.Dir(path), target), src) {
				h.Skipped = append(h.Skipped, fmt.Sprintf("%s: a symlink to %s, outside %s", shown, target, h.Shown(p)))
				return nil
			}
			if err := os.Symlink(target, to); err != nil {
				return fmt.Errorf("private state: %w", err)
			}
			h.seed[key] = seedEntry{mode: fs.ModeSymlink, link: target}
		case d.Type().IsRegular():
			if h.Bytes+info.Size() > limit {
				return invalidf("private state: %s is more than %s (at %s): name narrower paths (e.g. the settings and credentials files) or leave big ones out", h.Shown(p), sizeString(limit), shown)
			}
			e, n, err := copyFile(path, to, info.Mode().Perm())
			if err != nil {
				return fmt.Errorf("private state %s: %w", shown, err)
			}
			h.Files++
			h.Bytes += n
			h.seed[key] = e
		default:
			h.Skipped = append(h.Skipped, fmt.Sprintf("%s: not a file, directory or symlink", shown))
		}
		return nil
	})
}

// copyFile copies the regular file src to dst (never following a
// symlink at src) with perm and returns what it copied.
func copyFile(src, dst string, perm fs.FileMode) (seedEntry, int64, error) {
	e := seedEntry{}
	in, err := os.OpenFile(src, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return e, 0, err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm|0o600)
	if err != nil {
		return e, 0, err
	}
	sum := sha256.New()
	var keep bytes.Buffer
	w := io.MultiWriter(out, sum)
	if settingsFile(dst) {
		w = io.MultiWriter(w, &limitedBuffer{b: &keep, n: maxSettingsFile})
	}
	n, err := io.Copy(w, in)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return e, n, err
	}
	e.mode, e.exec = 0, perm&0o111 != 0
	copy(e.sum[:], sum.Sum(nil))
	if settingsFile(dst) {
		e.data, e.big = keep.Bytes(), n > maxSettingsFile
	}
	return e, n, nil
}

// limitedBuffer keeps up to n bytes and drops the rest.
type limitedBuffer struct {
	b *bytes.Buffer
	n int
}

func (l *limitedBuffer) Write(p []byte) (int, error) {
	if room := l.n - l.b.Len(); room > 0 {
		l.b.Write(p[:min(room, len(p))])
	}
	return len(p), nil
}

// Env points env's HOME at the private HOME, and each of StateEnv that
// names a path inside a copied one at its copy. notes says which of
// StateEnv still name the user's own state (read-only to the agent).
func (h *PrivateHome) Env(env []string) (out []string, notes []string) {
	out = SetEnv(slices.Clone(env), "HOME", h.Dir)
	for _, k := range StateEnv {
		v, ok := lookupEnv(env, k)
		if !ok || v == "" {
			continue
		}
		abs := filepath.Clean(v)
		if !filepath.IsAbs(abs) {
			notes = append(notes, fmt.Sprintf("%s=%s is relative: the agent's CLI resolves it in its working directory", k, v))
			continue
		}
		i := slices.IndexFunc(h.paths, func(p string) bool { return Within(abs, p) })
		if i < 0 {
			notes = append(notes, fmt.Sprintf("%s=%s is outside the agent's private state: the agent's CLI reads your own state there, read-only to it", k, v))
			continue
		}
		rel, _ := filepath.Rel(h.home, abs)
		out = SetEnv(out, k, filepath.Join(h.Dir, rel))
	}
	return out, notes
}

func lookupEnv(env []string, key string) (string, bool) {
	for i := len(env) - 1; i >= 0; i-- {
		if k, v, _ := strings.Cut(env[i], "="); k == key {
			return v, true
		}
	}
	return "", false
}

// Summary says in one line what the agent got.
func (h *PrivateHome) Summary() string {
	var names []string
	for _, p := range h.paths {
		names = append(names, h.Shown(p))
	}
	return fmt.Sprintf("private state: the agent's HOME is %s, a copy of %s (%d files, %s) it may write; yours stay read-only to it, and the copy is discarded when the attempt settles",
		h.Dir, strings.Join(names, ", "), h.Files, sizeString(h.Bytes))
}

// Discard removes the private HOME. The agent's processes must all be
// gone (the attempt settled): nothing may race the removal.
func (h *PrivateHome) Discard() error {
	if h == nil || h.Dir == "" {
		return nil
	}
	// Directories the agent made unreadable or unwritable are opened up
	// first (chmod of a real directory: nothing runs to swap it).
	filepath.WalkDir(h.Dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			os.Chmod(p, 0o700)
		}
		return nil
	})
	if err := os.RemoveAll(h.Dir); err != nil {
		return fmt.Errorf("private state: remove %s: %w", h.Dir, err)
	}
	return nil
}

func sizeString(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// openPrivateState makes the private HOME of spec when it names paths,
// lets pol write it and points env at it; say reports what it did. A nil
// home means no private state. Nothing in hidden (fenceline's secrets,
// see HiddenPaths) is copied.
func openPrivateState(spec StateSpec, hidden []string, pol *fsguard.Policy, env []string, say func(string)) (*PrivateHome, []string, error) {
	if len(spec.Paths) == 0 {
		return nil, env, nil
	}
	spec.Hidden = append(slices.Clone(spec.Hidden), hidden...)
	h, err := NewPrivateHome(spec, "")
	if err != nil {
		return nil, env, err
	}
	pol.Writable = append(pol.Writable, h.Dir)
	say(h.Summary())
	for _, s := range h.Skipped {
		say("private state: not copied: " + s)
	}
	env, notes := h.Env(env)
	for _, n := range notes {
		say("private state: " + n)
	}
	return h, env, nil
}

// settlePrivateState says what the agent changed in its private HOME and
// discards it; every process of the attempt must be gone.
func settlePrivateState(h *PrivateHome, say func(string)) {
	if h == nil {
		return
	}
	c, err := h.Changes()
	if err != nil {
		say(err.Error())
	} else {
		for _, l := range c.Lines(10) {
			say(l)
		}
	}
	if err := h.Discard(); err != nil {
		say(err.Error() + ": remove it by hand; no CLI reads it")
		return
	}
	say(fmt.Sprintf("private state: discarded %s; nothing the agent wrote there reaches your next run", h.Dir))
}
