package attempt

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/BurntSushi/toml"
)

// StateChanges is what the agent changed in its private HOME.
type StateChanges struct {
	// Settings are the changed settings that run a program or widen what
	// runs without asking (ExecSetting), in the JSON and TOML files.
	Settings []SettingChange
	Other    int // other settings changed in those files
	// Programs are the executable files and the instructions and rules
	// files (instructionFile) added or changed.
	Programs []FileChange
	Files    []FileChange // every file, dir or symlink added, changed or removed
}

// SettingChange is one changed setting of a settings file.
type SettingChange struct {
	File   string // ~/rel
	Key    string // e.g. hooks.SessionStart[0].hooks[0].command
	Change string // added, changed, removed
	Value  string // the new value as JSON, shortened; "" when removed
}

// FileChange is one path of the private HOME the agent changed.
type FileChange struct {
	Path   string // ~/rel
	Change string // added, changed, removed
}

// execKeys are the settings keys (lower case, without _ and -) under
// which a change runs a program at the CLI's next start or widens what
// runs without asking: Claude Code's hooks, statusLine, apiKeyHelper and
// the other helpers, MCP servers, env, permissions, plugins and trust;
// Codex's notify, MCP servers, shell environment, approval and sandbox
// policies, model providers and project trust; and any command or args.
var execKeys = []string{
	"hooks", "disableallhooks", "statusline", "apikeyhelper", "awsauthrefresh", "awscredentialexport",
	"gcpauthrefresh", "otelheadershelper", "filesuggestion", "mcpservers", "enabledmcpjsonservers",
	"enableallprojectmcpservers", "env", "permissions", "allowedtools", "hastrustdialogaccepted",
	"enabledplugins", "extraknownmarketplaces", "sandbox", "command", "args",
	"notify", "shellenvironmentpolicy", "approvalpolicy", "sandboxmode", "sandboxworkspacewrite",
	"modelproviders", "trustlevel", "shell", "zshpath",
}

// ExecSetting reports whether a change of the setting key (as
// SettingChange.Key spells it) may run a program or widen what runs: some
// key along it is one of execKeys.
func ExecSetting(key string) bool {
	for _, seg := range keySegments(key) {
		n := strings.NewReplacer("_", "", "-", "").Replace(strings.ToLower(seg))
		if slices.Contains(execKeys, n) {
			return true
		}
	}
	return false
}

// keySegments splits a.b[0]["c.d"] into a, b, c.d (indexes dropped).
func keySegments(key string) []string {
	var segs []string
	for key != "" {
		switch {
		case strings.HasPrefix(key, "."):
			key = key[1:]
		case strings.HasPrefix(key, `["`):
			q, err := strconv.QuotedPrefix(key[1:])
			if err != nil {
				return append(segs, key)
			}
			s, _ := strconv.Unquote(q)
			segs = append(segs, s)
			key = strings.TrimPrefix(key[1+len(q):], "]")
		case strings.HasPrefix(key, "["):
			i := strings.IndexByte(key, ']')
			if i < 0 {
				return segs
			}
			key = key[i+1:]
		default:
			i := strings.IndexAny(key, ".[")
			if i < 0 {
				i = len(key)
			}
			segs = append(segs, key[:i])
			key = key[i:]
		}
	}
	return segs
}

// settingsFile reports whether name is a settings file whose settings are
// diffed: JSON (settings.json, .claude.json, ...) or TOML (config.toml).
func settingsFile(name string) bool {
	ext := strings.ToLower(path.Ext(name))
	return ext == ".json" || ext == ".toml"
}

// instructionFile reports whether name is a file a CLI follows at its
// start: CLAUDE.md, AGENTS.md (and its override), Codex's *.rules.
func instructionFile(name string) bool {
	base := path.Base(name)
	return base == "CLAUDE.md" || strings.HasPrefix(base, "AGENTS") && strings.HasSuffix(base, ".md") || path.Ext(base) == ".rules"
}

// Changes compares the private HOME with what the copy put there. It
// reads the private HOME through an os.Root: a symlink the agent planted
// there is never followed out of it. Call it only once the agent's
// processes are gone.
func (h *PrivateHome) Changes() (StateChanges, error) {
	root, err := os.OpenRoot(h.Dir)
	if err != nil {
		return StateChanges{}, fmt.Errorf("private state: %w", err)
	}
	defer root.Close()
	c, err := stateTree{seed: h.seed, shown: h.shownRel}.changes(root, ".")
	if err != nil {
		return c, fmt.Errorf("private state: read %s: %w", h.Dir, err)
	}
	return c, nil
}

// stateTree is a tree of CLI state as it was (seed, by slash path
// relative to a root) and how to walk it again.
type stateTree struct {
	seed  map[string]seedEntry
	shown func(rel string) string // rel as a person reads it
	// filter, when set, says whether a path is part of the state and,
	// for a directory, whether to walk into it (nil: every path is, and
	// every directory is walked).
	filter func(rel string, d fs.DirEntry) (part, walk bool)
	// unreadable are the directories that could not be read before the
	// attempt either: not named again.
	unreadable map[string]bool
}

// changes walks root from start and says what differs from the seed.
func (t stateTree) changes(root *os.Root, start string) (StateChanges, error) {
	var c StateChanges
	seen := map[string]bool{}
	err := fs.WalkDir(root.FS(), start, func(p string, d fs.DirEntry, err error) error {
		if err != nil && p != start && d != nil {
			// A dir the agent made unreadable: named, not examined.
			if !t.unreadable[p] {
				c.Files = append(c.Files, FileChange{Path: t.shown(p), Change: "unreadable"})
			}
			return fs.SkipDir
		}
		if err != nil {
			if p == start && errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if p == "." {
			return nil
		}
		if t.filter != nil {
			part, walk := t.filter(p, d)
			if d.IsDir() && !walk {
				return fs.SkipDir
			}
			if !part {
				return nil
			}
		}
		seen[p] = true
		old, had := t.seed[p]
		now, err := entryAt(root, p, d)
		if err != nil {
			if errors.Is(err, errUnreadable) {
				c.Files = append(c.Files, FileChange{Path: t.shown(p), Change: "unreadable"})
				return nil
			}
			return err
		}
		change := "changed"
		switch {
		case !had:
			change = "added"
		case old.mode == now.mode && old.sum == now.sum && old.link == now.link && old.exec == now.exec:
			return nil
		}
		c.Files = append(c.Files, FileChange{Path: t.shown(p), Change: change})
		switch {
		case !now.mode.IsRegular():
		case settingsFile(p) && (now.big || old.big):
			c.Settings = append(c.Settings, SettingChange{File: t.shown(p), Key: "(whole file)", Change: change,
				Value: fmt.Sprintf("over %s: not examined", sizeString(maxSettingsFile))})
		case settingsFile(p):
			c.diffSettings(t.shown(p), old.data, now.data)
		case now.exec || instructionFile(p):
			c.Programs = append(c.Programs, FileChange{Path: t.shown(p), Change: change})
		}
		return nil
	})
	if err != nil {
		return c, err
	}
	var gone []string
	for p := range t.seed {
		if !seen[p] && (start == "." || p == start || strings.HasPrefix(p, start+"/")) {
			gone = append(gone, p)
		}
	}
	slices.Sort(gone)
	for _, p := range gone {
		c.Files = append(c.Files, FileChange{Path: t.shown(p), Change: "removed"})
		if e := t.seed[p]; e.mode.IsRegular() && settingsFile(p) && !e.big {
			c.diffSettings(t.shown(p), e.data, nil)
		}
	}
	return c, nil
}

// errUnreadable is a regular file of the state that could not be read.
var errUnreadable = errors.New("unreadable")

// entryAt is what is at p (d) in root now: its type, and a file's hash,
// execute bit and (a settings file's) content, or a symlink's target.
func entryAt(root *os.Root, p string, d fs.DirEntry) (seedEntry, error) {
	now := seedEntry{mode: d.Type() & fs.ModeType}
	switch {
	case d.IsDir():
		now.mode = fs.ModeDir
	case d.Type()&fs.ModeSymlink != 0:
		link, err := root.Readlink(p)
		if err != nil {
			return now, err
		}
		now.link = link
	case d.Type().IsRegular():
		e, err := readEntry(root, p)
		if err != nil {
			return now, fmt.Errorf("%s: %w", p, errUnreadable)
		}
		info, err := d.Info()
		if err != nil {
			return now, err
		}
		now = e
		now.exec = info.Mode().Perm()&0o111 != 0
	}
	return now, nil
}

// shownRel is the path rel of the private HOME as the user's ~/rel.
func (h *PrivateHome) shownRel(rel string) string { return "~/" + rel }

// readEntry hashes the regular file p of root, keeping a settings file's
// content.
func readEntry(root *os.Root, p string) (seedEntry, error) {
	e := seedEntry{}
	f, err := root.Open(p)
	if err != nil {
		return e, err
	}
	defer f.Close()
	sum := sha256.New()
	var keep bytes.Buffer
	w := io.Writer(sum)
	if settingsFile(p) {
		w = io.MultiWriter(sum, &limitedBuffer{b: &keep, n: maxSettingsFile})
	}
	n, err := io.Copy(w, f)
	if err != nil {
		return e, err
	}
	copy(e.sum[:], sum.Sum(nil))
	if settingsFile(p) {
		e.data, e.big = keep.Bytes(), n > maxSettingsFile
	}
	return e, nil
}

// diffSettings adds the settings that differ between old and now, the
// contents of the settings file file before and after (nil: absent).
func (c *StateChanges) diffSettings(file string, old, now []byte) {
	before, _ := parseSettings(file, old) // the user's own: a bad one is theirs
	after, err := parseSettings(file, now)
	if err != nil {
		c.Settings = append(c.Settings, SettingChange{File: file, Key: "(whole file)", Change: "changed",
			Value: "unreadable as settings: " + err.Error()})
		return
	}
	var keys []string
	for k := range before {
		keys = append(keys, k)
	}
	for k := range after {
		if _, ok := before[k]; !ok {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	for _, k := range keys {
		b, inBefore := before[k]
		a, inAfter := after[k]
		ch := SettingChange{File: file, Key: k, Value: shorten(a)}
		switch {
		case inBefore && inAfter && a == b:
			continue
		case !inBefore:
			ch.Change = "added"
		case !inAfter:
			ch.Change, ch.Value = "removed", ""
		default:
			ch.Change = "changed"
		}
		if ExecSetting(k) {
			c.Settings = append(c.Settings, ch)
		} else {
			c.Other++
		}
	}
}

// parseSettings flattens a JSON or TOML settings file into its leaves,
// each as JSON: key -> value. Arrays of scalars are one leaf.
func parseSettings(file string, data []byte) (map[string]string, error) {
	out := map[string]string{}
	if data == nil {
		return out, nil
	}
	var v any
	if strings.EqualFold(path.Ext(file), ".toml") {
		var m map[string]any
		if _, err := toml.Decode(string(data), &m); err != nil {
			return nil, err
		}
		v = m
	} else if err := json.Unmarshal(data, &v); err != nil {
		return nil, err
	}
	flatten("", v, out)
	return out, nil
}

func flatten(prefix string, v any, out map[string]string) {
	switch t := v.(type) {
	case map[string]any:
		if len(t) == 0 {
			out[prefix] = "{}"
		}
		for k, x := range t {
			flatten(joinKey(prefix, k), x, out)
		}
	case []map[string]any: // TOML's arrays of tables
		if len(t) == 0 {
			out[prefix] = "[]"
		}
		for i, x := range t {
			flatten(fmt.Sprintf("%s[%d]", prefix, i), x, out)
		}
	case []any:
		if !slices.ContainsFunc(t, composite) {
			out[prefix] = jsonText(t)
			return
		}
		for i, x := range t {
			flatten(fmt.Sprintf("%s[%d]", prefix, i), x, out)
		}
	default:
		out[prefix] = jsonText(t)
	}
}

func composite(v any) bool {
	switch v.(type) {
	case map[string]any, []any, []map[string]any:
		return true
	}
	return false
}

// joinKey spells key k under prefix: .k for a plain name, ["k"] else.
func joinKey(prefix, k string) string {
	plain := k != "" && !strings.ContainsFunc(k, func(r rune) bool {
		return !(r == '_' || r == '-' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z')
	})
	switch {
	case !plain:
		return prefix + "[" + strconv.Quote(k) + "]"
	case prefix == "":
		return k
	}
	return prefix + "." + k
}

func jsonText(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

func shorten(s string) string {
	const max = 160
	if len(s) <= max {
		return s
	}
	return s[:max] + "…"
}

// Lines says what the agent changed, for a person: the settings that run
// a program or widen what runs (the leaves of one entry in one line),
// then the paths (at most maxFiles of them).
func (c StateChanges) Lines(maxFiles int) []string {
	if len(c.Files) == 0 {
		return []string{"private state: the agent changed nothing in its copy"}
	}
	ls := c.settingLines("private state: DISCARDED", "it would run a program or widen what runs at the CLI's next start")
	for _, f := range c.Programs {
		ls = append(ls, fmt.Sprintf("private state: DISCARDED %s %s (a program or instructions the CLI may run or follow)", f.Change, f.Path))
	}
	var fs []string
	for i, f := range c.Files {
		if i == maxFiles {
			fs = append(fs, fmt.Sprintf("and %d more", len(c.Files)-maxFiles))
			break
		}
		fs = append(fs, f.Path+" ("+f.Change+")")
	}
	other := ""
	if c.Other > 0 {
		other = fmt.Sprintf(" (and %d other settings in them)", c.Other)
	}
	return append(ls, fmt.Sprintf("private state: the agent changed %d paths of its copy%s, all discarded: %s", len(c.Files), other, strings.Join(fs, ", ")))
}

// settingLines are the settings that run a program or widen what runs,
// one line each (the leaves of one entry in one line): head, the change,
// the key and file, the value, and why in parentheses.
func (c StateChanges) settingLines(head, why string) []string {
	var ls []string
	for i := 0; i < len(c.Settings); {
		s := c.Settings[i]
		parent, leaf := splitKey(s.Key)
		j := i + 1
		if parent != "" {
			for j < len(c.Settings) {
				n := c.Settings[j]
				if p, _ := splitKey(n.Key); p != parent || n.File != s.File || n.Change != s.Change {
					break
				}
				j++
			}
		}
		l := fmt.Sprintf("%s %s %s in %s", head, s.Change, s.Key, s.File)
		if j > i+1 {
			var vs []string
			for _, n := range c.Settings[i:j] {
				_, leaf = splitKey(n.Key)
				vs = append(vs, leaf+" = "+n.Value)
			}
			l = fmt.Sprintf("%s %s %s in %s: %s", head, s.Change, parent, s.File, strings.Join(vs, ", "))
		} else if s.Value != "" {
			l += " = " + s.Value
		}
		ls = append(ls, l+" ("+why+")")
		i = j
	}
	return ls
}

// splitKey splits a setting's key into its parent and its last segment:
// hooks.X[0].command is hooks.X[0] and command; notify is "" and notify.
func splitKey(key string) (parent, leaf string) {
	last, quoted := -1, false
	for i := 0; i < len(key); i++ {
		switch ch := key[i]; {
		case quoted && ch == '\\':
			i++
		case ch == '"':
			quoted = !quoted
		case !quoted && (ch == '.' || ch == '['):
			last = i
		}
	}
	if last < 0 {
		return "", key
	}
	return key[:last], strings.TrimPrefix(key[last:], ".")
}
