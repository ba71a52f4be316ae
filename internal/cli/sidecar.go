package cli

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/proxy"
)

// fenceFlags configure the fences of run and sidecar.
type fenceFlags struct {
	gitUpstream, gitListen, gitCA string
	gitForward                    bool
	gitObjects, gitHeaders        []string
	allowForcePush, allowDelete   bool
	pgUpstream, pgListen          string
	pgSecretFile                  string
	pgAllowOpaque                 bool
	stateDir                      string
}

func (ff *fenceFlags) register(c *cobra.Command) {
	f := c.Flags()
	f.StringVar(&ff.gitUpstream, "git-upstream", "", "URL of the agent's git server (http or https); pushes to it go through the git fence")
	f.StringVar(&ff.gitListen, "git-listen", "127.0.0.1:0", "address of the git fence")
	f.BoolVar(&ff.gitForward, "git-forward", false, "serve an https upstream as a forward proxy with a local CA (git http.proxy) instead of a reverse proxy")
	f.StringArrayVar(&ff.gitObjects, "git-objects", nil, "git dir whose objects resolve pushed packs, e.g. the agent's repo/.git (repeatable)")
	f.StringArrayVar(&ff.gitHeaders, "git-upstream-header", nil, `header added to upstream git requests, "Name: value" (repeatable; env FENCELINE_GIT_UPSTREAM_HEADER)`)
	f.StringVar(&ff.gitCA, "git-upstream-ca", "", "CA bundle for an https git upstream (default: the system's)")
	f.BoolVar(&ff.allowForcePush, "allow-force-push", false, "let path leases push non-fast-forward updates (policy)")
	f.BoolVar(&ff.allowDelete, "allow-ref-delete", false, "let path leases delete refs (policy)")
	f.StringVar(&ff.pgUpstream, "pg-upstream", "", "host:port of the agent's Postgres; its connections go through the Postgres fence")
	f.StringVar(&ff.pgListen, "pg-listen", "127.0.0.1:0", "address of the Postgres fence")
	f.StringVar(&ff.pgSecretFile, "pg-secret-file", "", "fence-signing secret from \"fenceline pg install\" (default $XDG_STATE_HOME/fenceline/pg-secret.key when it exists)")
	f.BoolVar(&ff.pgAllowOpaque, "pg-allow-opaque", false, "let writes whose tables cannot be named (DO, CALL, GRANT…) through under a live lease (policy)")
	f.StringVar(&ff.stateDir, "state-dir", "", "where the sidecar keeps mirrors, its CA and spooled packs (default <state dir>/sidecar/<lease>)")
}

func (ff *fenceFlags) config(held *heldLease, s *session, audit *leasebus.Auditor, log *slog.Logger) (proxy.Config, error) {
	headers := http.Header{}
	hs := ff.gitHeaders
	if v := os.Getenv("FENCELINE_GIT_UPSTREAM_HEADER"); v != "" {
		hs = append(hs, v)
	}
	for _, h := range hs {
		k, v, ok := strings.Cut(h, ":")
		if !ok || strings.TrimSpace(k) == "" {
			return proxy.Config{}, usagef("--git-upstream-header %q: want \"Name: value\"", h)
		}
		headers.Add(strings.TrimSpace(k), strings.TrimSpace(v))
	}
	var secret []byte
	if ff.pgUpstream != "" {
		file := ff.pgSecretFile
		if file == "" {
			if _, err := os.Stat(defaultPGSecretFile()); err == nil {
				file = defaultPGSecretFile()
			}
		}
		if file != "" {
			var err error
			if secret, err = ReadPGSecret(file); err != nil {
				return proxy.Config{}, err
			}
		} else {
			log.Warn("no Postgres fence secret: writes to fenced tables will be rejected by Postgres (run fenceline pg install, or pass --pg-secret-file)")
		}
	}
	state := ff.stateDir
	if state == "" {
		state = filepath.Join(leasebus.StateDir(), "sidecar", held.holder.Lease().LeaseID)
	}
	return proxy.Config{
		Lease:             held.holder,
		Bus:               s.client,
		Audit:             audit,
		GitUpstream:       ff.gitUpstream,
		GitListen:         ff.gitListen,
		GitForward:        ff.gitForward,
		GitPolicy:         gitproxy.Policy{AllowForcePush: ff.allowForcePush, AllowRefDelete: ff.allowDelete},
		GitObjectDirs:     ff.gitObjects,
		GitUpstreamHeader: headers,
		GitUpstreamCAFile: ff.gitCA,
		PGUpstream:        ff.pgUpstream,
		PGListen:          ff.pgListen,
		PGSecret:          secret,
		PGAllowOpaque:     ff.pgAllowOpaque,
		StateDir:          state,
		Logger:            log,
	}, nil
}

func (a *app) sidecarCommand() *cobra.Command {
	var (
		lf       leaseFlags
		ff       fenceFlags
		attachID string
		cred     string
		envFile  string
	)
	c := &cobra.Command{
		Use:   "sidecar --repo R [claim flags] [--git-upstream URL] [--pg-upstream HOST:PORT] [--env-file FILE]",
		Short: "Hold an agent's lease and serve its fences (the pod mode)",
		Long: `Acquire the agent's lease (or attach to one with --lease), keep it alive, and
serve the fences the agent is routed through until SIGTERM or Ctrl-C; then
drain the fences and release the lease.

The agent needs no change: the environment it must run with (git config
entries passed as GIT_CONFIG_COUNT/GIT_CONFIG_KEY_n/GIT_CONFIG_VALUE_n that
route its git remote through the git fence; PGHOST/PGPORT, and DATABASE_URL
rewritten, for the Postgres fence) is printed, and written to --env-file
(KEY=VALUE lines) for the agent's container.

While the lease is lost or its state unknown, every write is refused at
the fences; reads keep flowing.`,
		Args: cobra.NoArgs,
		Example: `  fenceline sidecar --repo github.com/acme/payments --scope services/billing --workspace exclusive \
    --git-upstream http://git.internal/payments.git --env-file /shared/agent.env`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if ff.gitUpstream == "" && ff.pgUpstream == "" {
				return usagef("nothing to fence: give --git-upstream URL and/or --pg-upstream HOST:PORT")
			}
			ctx := cmd.Context()
			s, err := a.dialHolder()
			if err != nil {
				return err
			}
			defer s.Close()
			held, err := a.holdLease(ctx, s, &lf, attachID, leasebus.Credential(cred))
			if err != nil {
				return err
			}
			defer held.finish(ctx)
			audit, err := leasebus.NewAuditor(s.nc)
			if err != nil {
				return err
			}
			log := slog.New(slog.NewJSONHandler(a.stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
			cfg, err := ff.config(held, s, audit, log)
			if err != nil {
				return err
			}
			sc, err := proxy.Start(ctx, cfg)
			if err != nil {
				return err
			}
			l := held.holder.Lease()
			var base []string
			if v, ok := os.LookupEnv("DATABASE_URL"); ok {
				base = append(base, "DATABASE_URL="+v)
			}
			env := sc.AgentEnv(base)
			fmt.Fprintf(a.stdout, "sidecar: lease %s %s, workspace %s (%s), fence %d\n", l.LeaseID, l.Scope, l.WorkspaceID, l.WorkspaceMode, l.Fence)
			if sc.GitURL() != "" {
				fmt.Fprintf(a.stdout, "git fence: %s -> %s\n", sc.GitURL(), ff.gitUpstream)
			}
			if pa := sc.PGAddr(); pa != nil {
				fmt.Fprintf(a.stdout, "postgres fence: %s -> %s\n", pa, ff.pgUpstream)
			}
			fmt.Fprintln(a.stdout, "agent environment:")
			for _, kv := range env {
				fmt.Fprintf(a.stdout, "  %s\n", kv)
			}
			if envFile != "" {
				if err := writeEnvFile(envFile, env); err != nil {
					sc.Close(ctx)
					return err
				}
				fmt.Fprintf(a.stdout, "written to %s\n", envFile)
			}
			select {
			case <-ctx.Done():
			case err = <-sc.Err():
			}
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			if cerr := sc.Close(dctx); err == nil {
				err = cerr
			}
			fmt.Fprintf(a.stdout, "sidecar stopping: fences drained, lease %s %s\n", l.LeaseID, map[bool]string{true: "released", false: "left to its owner"}[held.acquired])
			return err
		},
	}
	lf.register(c.Flags())
	ff.register(c)
	c.Flags().StringVar(&attachID, "lease", "", "attach to this lease instead of acquiring one")
	c.Flags().StringVar(&cred, "credential", "", "owner credential of --lease (default: this machine's credential file)")
	c.Flags().StringVar(&envFile, "env-file", "", "write the agent's environment to this file")
	c.MarkFlagsMutuallyExclusive("scope", "whole-repo")
	return c
}

// writeEnvFile writes KEY=VALUE lines atomically.
func writeEnvFile(path string, env []string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(strings.Join(env, "\n")+"\n"), 0o644); err != nil {
		return fmt.Errorf("write env file: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write env file: %w", err)
	}
	return nil
}
