package cli

import (
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/internal/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/pgproxy"
)

// pgCommand is "fenceline pg": the Postgres side of the fence.
func (a *app) pgCommand() *cobra.Command {
	c := &cobra.Command{
		Use:   "pg",
		Short: "Set up the Postgres side of the fence",
		Args:  groupArgs,
		RunE:  showHelp,
	}
	c.AddCommand(a.pgInstallCommand())
	return c
}

func (a *app) pgInstallCommand() *cobra.Command {
	var (
		dsn, secretFile string
		cLibrary        string
		tables          []string
		asJSON          bool
	)
	c := &cobra.Command{
		Use:   "install --dsn ADMIN_DSN --table SCHEMA.TABLE ...",
		Short: "Install the fence (schema fenceline, trigger, secret) on Postgres tables",
		Long: `Install the storage-side fence in the database ADMIN_DSN names: schema
fenceline with the signing secret (readable only by the installing role),
one epoch per fenced table and a statement trigger that rejects a write
whose fence token is missing, forged or stale (SQLSTATE 40001).

Run it as a role that owns the tables and that agents' roles are not.
Running it again is safe: the secret is kept and new tables are attached.
The secret is written to --secret-file (mode 0600); give it to the sidecar.

The trigger is plpgsql, which every Postgres runs. --c-trigger uses the C
one instead (the same checks for a fraction of the CPU per write; needs a
superuser and "make -C pgproxy/cfence install" on the database server);
--c-trigger=LIB names another library. Installing again without the flag
switches the named tables back to plpgsql.`,
		Args: cobra.NoArgs,
		Example: `  fenceline pg install --dsn postgres://admin@db/app --table public.users --table 'billing.*'
  fenceline pg install --dsn "$ADMIN_DSN" --table public.orders --secret-file /etc/fenceline/pg.key --json
  fenceline pg install --dsn "$ADMIN_DSN" --table 'public.*' --c-trigger
  fenceline pg install --dsn "$ADMIN_DSN" --table 'public.*' --c-trigger=/opt/fenceline/fenceline_fence.so`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dsn == "" {
				return usagef("--dsn is required: the admin connection string, e.g. postgres://admin@localhost/app")
			}
			if len(tables) == 0 {
				return usagef("no --table: name at least one table to fence, schema.table or schema.*")
			}
			norm := make([]string, 0, len(tables))
			for _, t := range tables {
				n, err := scope.NormalizeTable(t)
				if err != nil {
					return &usageError{err: err}
				}
				norm = append(norm, n)
			}
			if secretFile == "" {
				secretFile = defaultPGSecretFile()
			}
			ctx := cmd.Context()
			conn, err := pgx.Connect(ctx, dsn)
			if err != nil {
				return fmt.Errorf("pg install: connect: %w", err)
			}
			defer conn.Close(ctx)
			key, err := pgproxy.Install(ctx, conn, norm, pgproxy.InstallOptions{CLibrary: cLibrary})
			if err != nil {
				return err
			}
			if err := os.MkdirAll(filepath.Dir(secretFile), 0o700); err != nil {
				return fmt.Errorf("pg install: secret file: %w", err)
			}
			if err := os.WriteFile(secretFile, []byte(hex.EncodeToString(key)+"\n"), 0o600); err != nil {
				return fmt.Errorf("pg install: write secret file %s: %w", secretFile, err)
			}
			trigger := "plpgsql"
			if cLibrary != "" {
				trigger = "c (" + cLibrary + ")"
			}
			if asJSON {
				return writeJSON(a.stdout, struct {
					Tables     []string `json:"tables"`
					Trigger    string   `json:"trigger"`
					SecretFile string   `json:"secretFile"`
				}{norm, trigger, secretFile})
			}
			fmt.Fprintf(a.stdout, "fence installed: %s (%s trigger)\n", strings.Join(norm, ", "), trigger)
			fmt.Fprintf(a.stdout, "secret: %s\n", secretFile)
			return nil
		},
	}
	f := c.Flags()
	f.StringVar(&dsn, "dsn", "", "admin connection string of the database to fence (required)")
	f.StringArrayVar(&tables, "table", nil, "table to fence, schema.table or schema.* (repeatable)")
	f.StringVar(&secretFile, "secret-file", "", "where to write the signing secret (hex; default $XDG_STATE_HOME/fenceline/pg-secret.key)")
	f.StringVar(&cLibrary, "c-trigger", "", "use the C trigger; --c-trigger=LIB names its shared library (alone: "+pgproxy.CTriggerLibrary+")")
	f.Lookup("c-trigger").NoOptDefVal = pgproxy.CTriggerLibrary
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return c
}

// ReadPGSecret reads a secret file written by "pg install".
func ReadPGSecret(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read postgres fence secret: %w", err)
	}
	key, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil {
		return nil, fmt.Errorf("postgres fence secret %s: not hex: %w", path, err)
	}
	return key, nil
}

// defaultPGSecretFile is where "pg install" keeps the signing secret and
// where the sidecar looks for it.
func defaultPGSecretFile() string { return filepath.Join(leasebus.StateDir(), "pg-secret.key") }
