package attempt

import (
	"fmt"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// ProjectState is the agent CLIs' project settings in the part of the
// user's own checkout an attempt may write (its claims, or the whole
// checkout for an exclusive attempt without a pool), as they were before
// it started. Claude Code and Codex read settings from the directory they
// start in — .claude/settings.json, .claude/settings.local.json (which
// Claude Code keeps out of git: no diff shows it), .mcp.json,
// .codex/config.toml, CLAUDE.md, AGENTS.md — and the user's next plain
// run there executes their hooks, MCP server commands and notify
// programs, unguarded. --private-state keeps the user's own state from
// the agent; these files are the agent's work product, so settle names
// each setting the attempt added or changed in them that runs a program
// (Changes, Lines), for the user to review before running a CLI there.
type ProjectState struct {
	top   string
	roots []string // slash paths relative to top ("." for all of it)
	seed  map[string]seedEntry
	// unreadable are the directories the snapshot could not read (the
	// user's: a build's root-owned cache).
	unreadable map[string]bool
}

// projectFile reports whether rel (a slash path in a checkout) is one of
// the agent CLIs' project settings or instructions: anything under a
// .claude or .codex directory, .mcp.json, and the instruction files.
func projectFile(rel string) bool {
	base := path.Base(rel)
	if base == ".mcp.json" || base == "CLAUDE.local.md" || instructionFile(base) {
		return true
	}
	for _, seg := range strings.Split(path.Dir(rel), "/") {
		if seg == ".claude" || seg == ".codex" {
			return true
		}
	}
	return false
}

// projectPath is the walk's filter: git dirs are not walked into; the
// project files, and the directories inside .claude or .codex, are the
// state.
func projectPath(rel string, d fs.DirEntry) (part, walk bool) {
	if d.IsDir() {
		return projectFile(rel + "/x"), path.Base(rel) != ".git"
	}
	return projectFile(rel), false
}

// SnapshotProjectState records the project settings under roots
// (absolute paths inside top, the checkout's work tree).
func SnapshotProjectState(top string, roots []string) (*ProjectState, error) {
	ps := &ProjectState{top: top, seed: map[string]seedEntry{}, unreadable: map[string]bool{}}
	for _, r := range roots {
		rel, err := filepath.Rel(top, r)
		if err != nil || !Within(r, top) {
			return nil, fmt.Errorf("project settings: %s is not inside the checkout %s", r, top)
		}
		ps.roots = append(ps.roots, filepath.ToSlash(rel))
	}
	root, err := os.OpenRoot(top)
	if err != nil {
		return nil, fmt.Errorf("project settings: %w", err)
	}
	defer root.Close()
	for _, start := range ps.roots {
		err := fs.WalkDir(root.FS(), start, func(p string, d fs.DirEntry, err error) error {
			switch {
			case err != nil && p == start && os.IsNotExist(err):
				return nil
			case err != nil && d != nil && d.IsDir() && p != start:
				ps.unreadable[p] = true // the user's: what the agent makes readable there is added
				return fs.SkipDir
			case err != nil:
				return err
			case p == ".":
				return nil
			}
			part, walk := projectPath(p, d)
			if part {
				if e, err := entryAt(root, p, d); err == nil { // unreadable before the attempt: the user's
					ps.seed[p] = e
				}
			}
			if d.IsDir() && !walk {
				return fs.SkipDir
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("project settings under %s: %w", filepath.Join(top, start), err)
		}
	}
	return ps, nil
}

// Changes says which project settings the attempt added, changed or
// removed. Call it once every process of the attempt is gone.
func (ps *ProjectState) Changes() (StateChanges, error) {
	var all StateChanges
	root, err := os.OpenRoot(ps.top)
	if err != nil {
		return all, fmt.Errorf("project settings: %w", err)
	}
	defer root.Close()
	t := stateTree{seed: ps.seed, shown: func(rel string) string { return rel }, filter: projectPath, unreadable: ps.unreadable}
	for _, start := range ps.roots {
		c, err := t.changes(root, start)
		if err != nil {
			return all, fmt.Errorf("project settings under %s: %w", filepath.Join(ps.top, start), err)
		}
		all.Settings = append(all.Settings, c.Settings...)
		all.Other += c.Other
		all.Programs = append(all.Programs, c.Programs...)
		all.Files = append(all.Files, c.Files...)
	}
	return all, nil
}

// ProjectLines says, for a person, what the attempt changed in the
// project settings of the checkout (nothing when it changed none).
func (c StateChanges) ProjectLines(maxFiles int) []string {
	if len(c.Files) == 0 {
		return nil
	}
	ls := c.settingLines("project settings: REVIEW", "claude or codex started there runs it, unguarded")
	for _, f := range c.Programs {
		ls = append(ls, fmt.Sprintf("project settings: REVIEW %s %s (a program or instructions claude or codex started there may run or follow)", f.Change, f.Path))
	}
	var fs []string
	for i, f := range c.Files {
		if i == maxFiles {
			fs = append(fs, fmt.Sprintf("and %d more", len(c.Files)-maxFiles))
			break
		}
		fs = append(fs, f.Path+" ("+f.Change+")")
	}
	return append(ls, fmt.Sprintf("project settings: the agent changed %d paths of the CLIs' project settings in the checkout (kept: they are its work; review them before you run claude or codex there): %s",
		len(c.Files), strings.Join(fs, ", ")))
}
