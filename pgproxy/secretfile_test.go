package pgproxy

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestSecretFileRoundTrip: WriteSecretFile makes the file (0600) and its
// directory (0700), ReadSecretFile reads back the same bytes, and a file
// that is missing or not hex is an error naming what is wrong.
func TestSecretFileRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state", "fenceline")
	file := filepath.Join(dir, "pg-secret.key")
	secret := bytes.Repeat([]byte{0xab, 0x01}, 16)
	if err := WriteSecretFile(file, secret); err != nil {
		t.Fatal(err)
	}
	testutil.WantPerm(t, file, 0o600)
	testutil.WantPerm(t, dir, 0o700)
	got, err := ReadSecretFile(file)
	if err != nil || !bytes.Equal(got, secret) {
		t.Fatalf("ReadSecretFile = %x, %v; want %x", got, err, secret)
	}

	if _, err := ReadSecretFile(filepath.Join(dir, "missing.key")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("missing file: %v, want fs.ErrNotExist", err)
	}
	bad := filepath.Join(dir, "bad.key")
	if err := os.WriteFile(bad, []byte("not a secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadSecretFile(bad); err == nil || !strings.Contains(err.Error(), "not hex") || !strings.Contains(err.Error(), bad) {
		t.Errorf("not hex: %v", err)
	}
	// A file in the way of the directory: the error says which step failed.
	if err := WriteSecretFile(filepath.Join(bad, "x.key"), secret); err == nil || !strings.HasPrefix(err.Error(), "secret file: ") {
		t.Errorf("WriteSecretFile under a file: %v", err)
	}
}

// TestLoadSecret: with no file named, LoadSecret reads the default file
// when it exists and returns nothing when it does not; a named file is
// read and checked as Config.Validate does, and errors name the file.
func TestLoadSecret(t *testing.T) {
	state := t.TempDir()
	if s, path, err := LoadSecret(state, ""); s != nil || path != "" || err != nil {
		t.Fatalf("no default file: %x, %q, %v", s, path, err)
	}
	secret := bytes.Repeat([]byte{7}, 32)
	if err := WriteSecretFile(DefaultSecretFile(state), secret); err != nil {
		t.Fatal(err)
	}
	if s, path, err := LoadSecret(state, ""); !bytes.Equal(s, secret) || path != DefaultSecretFile(state) || err != nil {
		t.Fatalf("default file: %x, %q, %v", s, path, err)
	}

	named := filepath.Join(t.TempDir(), "named.key")
	other := bytes.Repeat([]byte{9}, 32)
	if err := WriteSecretFile(named, other); err != nil {
		t.Fatal(err)
	}
	if s, path, err := LoadSecret("", named); !bytes.Equal(s, other) || path != named || err != nil {
		t.Fatalf("named file: %x, %q, %v", s, path, err)
	}
	short := filepath.Join(t.TempDir(), "short.key")
	if err := WriteSecretFile(short, []byte("too short")); err != nil {
		t.Fatal(err)
	}
	if s, path, err := LoadSecret("", short); s != nil || path != short || err == nil || !strings.Contains(err.Error(), "has 9 bytes") {
		t.Fatalf("short secret: %x, %q, %v", s, path, err)
	}
	missing := filepath.Join(t.TempDir(), "missing.key")
	if _, path, err := LoadSecret("", missing); path != missing || !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("missing named file: %q, %v", path, err)
	}
}

// TestInstallDSN: InstallDSN fences the named table of a real database
// and writes the installed secret to the file; installing again keeps the
// secret. A DSN it cannot connect to writes no file.
func TestInstallDSN(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	const db = testDB + "_installdsn"
	admin, err := pgx.Connect(ctx, pg.AdminDSN(""))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(ctx)
	for _, q := range []string{"DROP DATABASE IF EXISTS " + db, "CREATE DATABASE " + db} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() { admin.Exec(context.Background(), "DROP DATABASE IF EXISTS "+db) })
	conn, err := pgx.Connect(ctx, pg.AdminDSN(db))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE TABLE public.orders (id int PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}

	file := filepath.Join(t.TempDir(), "keys", "pg.key")
	in, err := InstallDSN(ctx, pg.AdminDSN(db), []string{"public.orders"}, InstallOptions{Trigger: TriggerPLpgSQL}, file)
	if err != nil {
		t.Fatal(err)
	}
	if in.Trigger != TriggerPLpgSQL || len(in.Secret) != 32 {
		t.Fatalf("installed %+v", in)
	}
	testutil.WantPerm(t, file, 0o600)
	if got, err := ReadSecretFile(file); err != nil || !bytes.Equal(got, in.Secret) {
		t.Fatalf("secret file holds %x (%v), installed %x", got, err, in.Secret)
	}
	var triggers int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_trigger WHERE tgrelid = 'public.orders'::regclass AND NOT tgisinternal").Scan(&triggers); err != nil {
		t.Fatal(err)
	}
	if triggers == 0 {
		t.Fatal("public.orders carries no trigger after InstallDSN")
	}

	again := filepath.Join(t.TempDir(), "again.key")
	in2, err := InstallDSN(ctx, pg.AdminDSN(db), []string{"public.orders"}, InstallOptions{Trigger: TriggerPLpgSQL}, again)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := ReadSecretFile(again); !bytes.Equal(in2.Secret, in.Secret) || !bytes.Equal(got, in.Secret) {
		t.Fatal("installing again changed the secret")
	}

	nowhere := filepath.Join(t.TempDir(), "nowhere.key")
	if _, err := InstallDSN(ctx, "postgres://nobody@127.0.0.1:1/none?connect_timeout=5", []string{"public.orders"}, InstallOptions{}, nowhere); err == nil || !strings.HasPrefix(err.Error(), "pg install: connect: ") {
		t.Fatalf("unreachable DSN: %v", err)
	}
	if _, err := os.Stat(nowhere); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a failed install wrote the secret file: %v", err)
	}
}
