package cli

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/internal/demo"
)

// envDemoPostgres names a running Postgres (a superuser DSN) for the
// demo's Postgres story instead of a throwaway one: the variable the tests
// use for their Postgres (package pgtest), so the demo runs where they do.
const envDemoPostgres = "FENCELINE_TEST_PG"

func (a *app) demoCommand() *cobra.Command {
	var keep bool
	var ui string
	c := &cobra.Command{
		Use:   "demo",
		Short: "Tell the whole lease story on a throwaway embedded bus (doubles as a smoke test)",
		Long: `Start an embedded bus on a free port with its own temporary store (never the
default bus or your state dir, so it runs beside a real bus) and show, for
` + demo.Repo + `: two agents racing for overlapping scopes, a disjoint
scope granted alongside, a crashed holder's lease reclaimed by the sweeper,
fence tokens rising, an operator's revoke seen by the holder, the audit
trail; then a real git server behind the git fence, a throwaway Postgres
behind the Postgres fence (when its binaries are found), and a pool of
worktree shards with agents as real child processes under the file-write
guard. Exits 0 when every expectation held, 1 naming the one that did not.
With --ui, the run UI shows it all live.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if ui != "" {
				if _, _, err := net.SplitHostPort(ui); err != nil {
					return usagef("--ui %q: want host:port (127.0.0.1:0 picks a free port)", ui)
				}
			}
			exe, err := os.Executable()
			if err != nil {
				return fmt.Errorf("find the fenceline binary for the demo's git hook: %w", err)
			}
			return demo.Run(cmd.Context(), demo.Config{
				Out:       a.stdout,
				Fenceline: exe,
				Command: func(ctx context.Context, args []string, stdout, stderr io.Writer) int {
					return run(ctx, args, stdout, stderr, a.defaultURL, a.cfg)
				},
				Keep:        keep,
				UI:          ui,
				PostgresDSN: a.cfg.DemoPostgres,
			})
		},
	}
	c.Flags().BoolVar(&keep, "keep", false, "keep the demo bus running (until Ctrl-C) and its store on disk, to inspect it with --nats")
	c.Flags().StringVar(&ui, "ui", "", "serve the run UI of the demo bus on this host:port, and keep it up (until Ctrl-C) once the story is told")
	return c
}
