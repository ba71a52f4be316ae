package cli

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/lease/scope"
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
		trigger         string
		cLibrary        string
		cTrigger        string // deprecated --c-trigger[=LIB]
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
The secret is written to --secret-file (mode 0600); register it with the
lease service where it runs (fenceline bus fence-secret set --repo R
--postgres FILE), then delete the copy. No sidecar holds it: the service
gives each lease a grant key for its own fence and tables.

--trigger chooses the trigger function. c is the C one of pgproxy/cfence:
the same checks for a fraction of the CPU per write; it needs a superuser
and the library on the database server ("make -C pgproxy/cfence install",
or --c-library PATH). plpgsql runs on every Postgres, managed services
included. auto, the default, uses c when the server loads the library and
plpgsql otherwise, and says which it chose and why. Installing again
switches the named tables to the trigger chosen then.`,
		Args: cobra.NoArgs,
		Example: `  fenceline pg install --dsn postgres://admin@db/app --table public.users --table 'billing.*'
  fenceline pg install --dsn "$ADMIN_DSN" --table public.orders --secret-file /etc/fenceline/pg.key --json
  fenceline pg install --dsn "$ADMIN_DSN" --table 'public.*' --trigger c
  fenceline pg install --dsn "$ADMIN_DSN" --table 'public.*' --trigger c --c-library /opt/fenceline/fenceline_fence_gate.so
  fenceline pg install --dsn "$ADMIN_DSN" --table 'public.*' --trigger plpgsql`,
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
			trig, err := pgproxy.ParseTrigger(trigger)
			if err != nil {
				return &usageError{err: fmt.Errorf("--trigger: %w", err)}
			}
			if cmd.Flags().Changed("c-trigger") {
				if cmd.Flags().Changed("trigger") && trig != pgproxy.TriggerC || cmd.Flags().Changed("c-library") {
					return usagef("--c-trigger is the old spelling of --trigger c --c-library LIB; use those instead")
				}
				trig, cLibrary = pgproxy.TriggerC, cTrigger
				fmt.Fprintln(a.stderr, "fenceline: --c-trigger is deprecated: use --trigger c (and --c-library LIB)")
			}
			if trig == pgproxy.TriggerPLpgSQL && cLibrary != "" {
				return usagef("--c-library names the C trigger's library, and --trigger plpgsql does not use one; drop one of them")
			}
			if secretFile == "" {
				secretFile = pgproxy.DefaultSecretFile(a.stateDir)
			}
			in, err := pgproxy.InstallDSN(cmd.Context(), dsn, norm, pgproxy.InstallOptions{Trigger: trig, CLibrary: cLibrary}, secretFile)
			if err != nil {
				return err
			}
			noC, noGuard := "", ""
			if in.NoC != nil {
				noC = in.NoC.Error()
			}
			if in.NoGuard != nil {
				noGuard = in.NoGuard.Error()
			}
			if asJSON {
				return writeJSON(a.stdout, struct {
					Tables     []string `json:"tables"`
					Trigger    string   `json:"trigger"`
					CLibrary   string   `json:"cLibrary,omitempty"`
					NoC        string   `json:"whyNotC,omitempty"`
					NoGuard    string   `json:"whyNotGuarded,omitempty"`
					SecretFile string   `json:"secretFile"`
				}{norm, string(in.Trigger), in.CLibrary, noC, noGuard, secretFile})
			}
			how := string(in.Trigger) + " trigger"
			if in.Trigger == pgproxy.TriggerC {
				how += ", " + in.CLibrary
			}
			fmt.Fprintf(a.stdout, "fence installed: %s (%s)\n", strings.Join(norm, ", "), how)
			if in.NoC != nil {
				fmt.Fprintf(a.stdout, "not the C trigger: %s\n  (for it: \"make -C pgproxy/cfence install\" on the database server, and install as a superuser; --trigger plpgsql says plpgsql is meant)\n", noC)
			}
			if in.NoGuard != nil {
				fmt.Fprintf(a.stdout, "not guarded: %s\n  (install as a superuser for the guard)\n", noGuard)
			}
			fmt.Fprintf(a.stdout, "secret: %s (register it with the lease service: fenceline bus fence-secret set --repo REPO --postgres %s; no sidecar may hold it)\n", secretFile, secretFile)
			return nil
		},
	}
	f := c.Flags()
	f.StringVar(&dsn, "dsn", "", "admin connection string of the database to fence (required)")
	f.StringArrayVar(&tables, "table", nil, "table to fence, schema.table or schema.* (repeatable)")
	f.StringVar(&secretFile, "secret-file", "", "where to write the signing secret (hex; default $XDG_STATE_HOME/fenceline/pg-secret.key)")
	f.StringVar(&trigger, "trigger", "auto", "trigger function: auto (c when the server loads it, else plpgsql), c or plpgsql")
	f.StringVar(&cLibrary, "c-library", "", "the C trigger's shared library as the server names it (default "+pgproxy.CTriggerLibrary+")")
	f.StringVar(&cTrigger, "c-trigger", "", "old spelling of --trigger c [--c-library LIB]")
	f.Lookup("c-trigger").NoOptDefVal = pgproxy.CTriggerLibrary
	// Hidden, not cobra-deprecated: cobra would print its notice to stdout,
	// into --json output.
	_ = f.MarkHidden("c-trigger")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return c
}
