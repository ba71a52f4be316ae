package test

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPackageDocs checks that every package of the module has exactly one
// package comment, starting "Package <name>" (or "Command <name>" for main).
func TestPackageDocs(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	dirs := map[string]bool{}
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata") && p != root {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(p, ".go") && !strings.HasSuffix(p, "_test.go") {
			dirs[filepath.Dir(p)] = true
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(dirs) < 3 {
		t.Fatalf("found only %d packages under %s", len(dirs), root)
	}
	for dir := range dirs {
		rel, _ := filepath.Rel(root, dir)
		fset := token.NewFileSet()
		pkgs, err := parser.ParseDir(fset, dir, func(fi os.FileInfo) bool { return !strings.HasSuffix(fi.Name(), "_test.go") }, parser.ParseComments|parser.PackageClauseOnly)
		if err != nil {
			t.Fatalf("%s: %v", rel, err)
		}
		for name, pkg := range pkgs {
			var docs []string
			for fname, f := range pkg.Files {
				if f.Doc != nil {
					docs = append(docs, filepath.Base(fname))
					text := f.Doc.Text()
					if !strings.HasPrefix(text, "Package "+name+" ") && !(name == "main" && strings.HasPrefix(text, "Command ")) {
						t.Errorf("%s/%s: package comment should start %q, got %q", rel, filepath.Base(fname), "Package "+name, firstLine(text))
					}
				}
			}
			if len(docs) != 1 {
				t.Errorf("%s: package %s has %d package comments (%v), want exactly 1", rel, name, len(docs), docs)
			}
		}
	}
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
