// Package pgtest gives tests a real Postgres: a throwaway server started
// by package pgserver, with the users the proxy's authentication tests log
// in as (scram_user by SCRAM, md5_user by MD5), or the existing server
// FENCELINE_TEST_PG names (a superuser DSN).
//
// Share one server per test binary: start it in TestMain and stop it there.
//
//	var pg *pgtest.Server
//	func TestMain(m *testing.M) {
//		pg = pgtest.MustStart()
//		code := m.Run()
//		pg.Stop()
//		os.Exit(code)
//	}
package pgtest

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/fenceline/fenceline/internal/pgserver"
)

// EnvDSN names the variable that points tests at an existing server.
const EnvDSN = "FENCELINE_TEST_PG"

// Server is a running Postgres.
type Server = pgserver.Server

// MustStart is Start for TestMain: it panics when Postgres cannot start,
// naming what to install.
func MustStart() *Server {
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	s, err := Start(ctx)
	if err != nil {
		panic(err)
	}
	return s
}

// Start returns the server named by FENCELINE_TEST_PG, or initializes and
// starts a new one.
func Start(ctx context.Context) (*Server, error) {
	if dsn := os.Getenv(EnvDSN); dsn != "" {
		s, err := pgserver.Attach(dsn)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", EnvDSN, err)
		}
		return s, nil
	}
	s, err := pgserver.Start(ctx, pgserver.Config{HBA: []string{
		"host all scram_user 127.0.0.1/32 scram-sha-256",
		"host all md5_user 127.0.0.1/32 md5",
	}})
	if err != nil {
		return nil, fmt.Errorf("%w (or set %s to a superuser DSN)", err, EnvDSN)
	}
	return s, nil
}

// BinDir finds the Postgres server binaries (pgserver.BinDir).
func BinDir() (string, error) {
	dir, err := pgserver.BinDir()
	if err != nil {
		return "", fmt.Errorf("%w (or set %s to a superuser DSN)", err, EnvDSN)
	}
	return dir, nil
}
