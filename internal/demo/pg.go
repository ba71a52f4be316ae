package demo

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceline/fenceline/internal/pgserver"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/pgproxy"
	"github.com/fenceline/fenceline/sidecar"
)

// pgStory is the Postgres part of the demo, told when a Postgres can be
// started from the machine's binaries (or Config.PostgresDSN names one).
func (d *demo) pgStory(ctx context.Context, dir string) error {
	var pg *pgserver.Server
	if dsn := d.cfg.PostgresDSN; dsn != "" {
		var err error
		if pg, err = pgserver.Attach(dsn); err != nil {
			return fmt.Errorf("the demo's Postgres (Config.PostgresDSN): %w", err)
		}
	} else {
		if _, err := pgserver.BinDir(); err != nil {
			d.section("8. The Postgres fence")
			fmt.Fprintf(d.out, "skipped: no Postgres server binaries on this machine (%v)\n", err)
			return nil
		}
		var err error
		if pg, err = pgserver.Start(ctx, pgserver.Config{}); err != nil {
			return fmt.Errorf("the demo's Postgres: %w", err)
		}
	}
	defer pg.Stop()
	admin, err := pgx.Connect(ctx, pg.AdminDSN(""))
	if err != nil {
		return fmt.Errorf("the demo's Postgres: %w", err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	for _, q := range []string{
		"DROP TABLE IF EXISTS public.invoices, public.rates",
		"CREATE TABLE public.invoices (id serial PRIMARY KEY, amount numeric)",
		"CREATE TABLE public.rates (region text PRIMARY KEY, rate numeric)",
		"INSERT INTO public.rates VALUES ('eu', 0.20)",
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			return fmt.Errorf("the demo's tables: %w", err)
		}
	}
	in, err := pgproxy.Install(ctx, admin, []string{"public.*"}, pgproxy.InstallOptions{})
	if err != nil {
		return err
	}
	secret := in.Secret
	// What "fenceline bus fence-secret set --repo R --postgres FILE" does:
	// the database's secret goes to the lease service, never to a sidecar.
	if err := leasebus.WriteFenceSecret(d.secrets, Repo, lease.StoragePostgres, secret); err != nil {
		return err
	}
	d.section("8. The Postgres fence")
	fmt.Fprintf(d.out, "a throwaway Postgres at %s; fenceline pg install fenced public.invoices and public.rates (%s trigger).\n", pg.Addr(), in.Trigger)

	p, err := d.pgAgent(ctx, dir, "agent-p", "public.invoices", 30*time.Second, 0, pg.Addr(), secret)
	if err != nil {
		return err
	}
	defer p.close(ctx)
	addr := p.sc.PGAddr().String()
	fmt.Fprintf(d.out, "agent-p holds %s tables=[public.invoices] (fence %d); its Postgres fence is %s (PGHOST/PGPORT, DATABASE_URL).\n",
		p.lease.LeaseID, p.lease.Fence, addr)
	conn, err := pgx.Connect(ctx, dsnVia(pg.AdminDSN(""), addr))
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var rate float64
	if err := conn.QueryRow(ctx, "SELECT rate FROM public.rates WHERE region = 'eu'").Scan(&rate); err != nil {
		return fail("agent-p's read of public.rates should flow: %v", err)
	}
	fmt.Fprintf(d.out, "  SELECT rate FROM rates: %.2f (reads always flow)\n", rate)
	if _, err := conn.Exec(ctx, "INSERT INTO public.invoices (amount) VALUES (120)"); err != nil {
		return fail("agent-p's in-scope INSERT should land: %v", err)
	}
	fmt.Fprintln(d.out, "  INSERT INTO invoices: landed, with its fence checked by Postgres in the same transaction")
	_, err = conn.Exec(ctx, "UPDATE public.rates SET rate = 0.25 WHERE region = 'eu'")
	if err == nil || !strings.Contains(err.Error(), p.lease.LeaseID) {
		return fail("agent-p's UPDATE of public.rates should be refused naming its lease: %v", err)
	}
	fmt.Fprintf(d.out, "  UPDATE rates: refused: %v\n", pgMessage(err))

	// The zombie, at the database.
	fmt.Fprintln(d.out, "\nagent-q takes tables=[public.rates] with a 1s ttl; its sidecar freezes:")
	q, err := d.pgAgent(ctx, dir, "agent-q", "public.rates", time.Second, 0, pg.Addr(), secret)
	if err != nil {
		return err
	}
	q.holder.Orphan()
	q.sc.Close(ctx)
	zombie, err := pgproxy.Listen(ctx, pgproxy.Config{Upstream: pg.Addr(), Lease: leasebus.Frozen{Record: *q.lease}, Audit: d.auditor})
	if err != nil {
		return err
	}
	defer zombie.Close()
	zconn, err := pgx.Connect(ctx, dsnVia(pg.AdminDSN(""), zombie.Addr().String()))
	if err != nil {
		return err
	}
	defer zconn.Close(context.WithoutCancel(ctx))
	r, err := d.pgAgent(ctx, dir, "agent-r", "public.rates", 30*time.Second, 5*time.Second, pg.Addr(), secret)
	if err != nil {
		return err
	}
	defer r.close(ctx)
	rconn, err := pgx.Connect(ctx, dsnVia(pg.AdminDSN(""), r.sc.PGAddr().String()))
	if err != nil {
		return err
	}
	defer rconn.Close(context.WithoutCancel(ctx))
	if _, err := rconn.Exec(ctx, "UPDATE public.rates SET rate = 0.21 WHERE region = 'eu'"); err != nil {
		return fail("agent-r's UPDATE should land: %v", err)
	}
	fmt.Fprintf(d.out, "  agent-r got %s tables=[public.rates] (fence %d > %d) after the reclaim and updated the rate\n",
		r.lease.LeaseID, r.lease.Fence, q.lease.Fence)
	_, err = zconn.Exec(ctx, "UPDATE public.rates SET rate = 0.99 WHERE region = 'eu'")
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "40001" {
		return fail("the zombie's UPDATE should be rejected by Postgres with 40001: %v", err)
	}
	fmt.Fprintf(d.out, "  agent-q wakes up and writes with fence %d: Postgres itself rejects it: %s (SQLSTATE %s)\n", q.lease.Fence, pe.Message, pe.Code)
	if err := admin.QueryRow(ctx, "SELECT rate FROM public.rates WHERE region = 'eu'").Scan(&rate); err != nil || rate != 0.21 {
		return fail("the rate should be agent-r's 0.21, is %v (%v)", rate, err)
	}
	fmt.Fprintf(d.out, "  the rate is %.2f: agent-r's\n", rate)
	return nil
}

func (d *demo) pgAgent(ctx context.Context, dir, name, table string, ttl, wait time.Duration, upstream string, secret []byte) (*demoAgent, error) {
	claim, err := scope.New(nil, false, []string{table})
	if err != nil {
		return nil, err
	}
	return d.startAgent(ctx, name, claim, ttl, wait, sidecar.Config{PGUpstream: upstream, StateDir: filepath.Join(dir, "sidecar-"+name)})
}

// dsnVia points dsn at addr.
func dsnVia(dsn, addr string) string {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return dsn
	}
	return fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", cfg.User, addr, cfg.Database)
}

func pgMessage(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Message
	}
	return err.Error()
}
