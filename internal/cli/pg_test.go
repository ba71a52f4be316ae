//go:build integration

package cli

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/internal/pgtest"
)

// TestPGInstallTrigger: "pg install" installs the trigger --trigger asks
// for, says which one the tables carry and, for auto, why not C; a C
// library the server cannot load fails --trigger c with the library and
// what to run, and bad flags are usage errors.
func TestPGInstallTrigger(t *testing.T) {
	isolate(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	pg, err := pgtest.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := pg.Stop(); err != nil {
			t.Errorf("stop postgres: %v", err)
		}
	})
	admin, err := pgx.Connect(ctx, pg.AdminDSN(""))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "DROP TABLE IF EXISTS public.cli_install; CREATE TABLE public.cli_install (id int)"); err != nil {
		t.Fatal(err)
	}
	triggerLang := func() string {
		t.Helper()
		var lang string
		if err := admin.QueryRow(ctx, `SELECT l.lanname FROM pg_trigger tg JOIN pg_proc p ON p.oid = tg.tgfoid
			JOIN pg_language l ON l.oid = p.prolang
			WHERE tg.tgname = 'fenceline_fence' AND tg.tgrelid = 'public.cli_install'::regclass`).Scan(&lang); err != nil {
			t.Fatal(err)
		}
		return lang
	}
	secret := filepath.Join(t.TempDir(), "pg.key")
	install := func(args ...string) result {
		t.Helper()
		return fl(t, append([]string{"pg", "install", "--dsn", pg.AdminDSN(""), "--table", "public.cli_install", "--secret-file", secret}, args...)...)
	}
	type installed struct {
		Tables     []string `json:"tables"`
		Trigger    string   `json:"trigger"`
		CLibrary   string   `json:"cLibrary"`
		WhyNotC    string   `json:"whyNotC"`
		SecretFile string   `json:"secretFile"`
	}
	installJSON := func(args ...string) installed {
		t.Helper()
		r := install(append(args, "--json")...).want(t, ExitOK)
		var in installed
		if err := json.Unmarshal([]byte(r.stdout), &in); err != nil {
			t.Fatalf("pg install --json printed %q: %v", r.stdout, err)
		}
		return in
	}

	in := installJSON("--trigger", "plpgsql")
	if in.Trigger != "plpgsql" || in.WhyNotC != "" || in.SecretFile != secret || triggerLang() != "plpgsql" {
		t.Fatalf("--trigger plpgsql: printed %+v, trigger language %s", in, triggerLang())
	}
	key, err := os.ReadFile(secret)
	if err != nil || len(strings.TrimSpace(string(key))) != 64 {
		t.Fatalf("secret file: %q (%v), want 32 bytes in hex", key, err)
	}

	const missing = "/nonexistent/fenceline_fence.so"
	in = installJSON("--c-library", missing) // --trigger auto
	if in.Trigger != "plpgsql" || !strings.Contains(in.WhyNotC, missing) || triggerLang() != "plpgsql" {
		t.Fatalf("auto with a library the server cannot load: printed %+v, trigger language %s", in, triggerLang())
	}
	r := install("--c-library", missing).want(t, ExitOK)
	mustContain(t, "auto's text output", r.stdout, "(plpgsql trigger)", "not the C trigger:", missing, "make -C pgproxy/cfence install")

	// A failed install leaves the secret file alone.
	const untouched = "untouched\n"
	if err := os.WriteFile(secret, []byte(untouched), 0o600); err != nil {
		t.Fatal(err)
	}
	r = install("--trigger", "c", "--c-library", missing).want(t, ExitError)
	mustContain(t, "--trigger c with a missing library", r.stderr, missing, "make -C pgproxy/cfence install")
	// The old spelling still means --trigger c, and its notice stays out
	// of the JSON on stdout.
	r = install("--c-trigger="+missing, "--json").want(t, ExitError)
	mustContain(t, "--c-trigger=LIB with a missing library", r.stderr, missing, "--c-trigger is deprecated")
	if r.stdout != "" {
		t.Fatalf("a failed --json install printed %q on stdout", r.stdout)
	}
	if b, err := os.ReadFile(secret); err != nil || string(b) != untouched {
		t.Fatalf("a failed install rewrote the secret file: %q (%v)", b, err)
	}

	r = install("--trigger", "fast").want(t, ExitUsage)
	mustContain(t, "--trigger fast", r.stderr, `"fast"`, "auto, c or plpgsql")
	r = install("--trigger", "plpgsql", "--c-trigger").want(t, ExitUsage)
	mustContain(t, "--c-trigger with --trigger plpgsql", r.stderr, "--trigger c --c-library")
	r = install("--trigger", "plpgsql", "--c-library", missing).want(t, ExitUsage)
	mustContain(t, "--c-library with --trigger plpgsql", r.stderr, "--c-library", "--trigger plpgsql")
}
