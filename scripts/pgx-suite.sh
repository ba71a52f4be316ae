#!/usr/bin/env bash
# pgx v5's own test suite (the version in go.mod, from the module cache),
# run twice against one throwaway Postgres: straight to it, and through the
# fenceline Postgres fence (pgproxy/internal/benchproxy: a live lease
# claiming public.*, writes of unnamed tables allowed, as
# --pg-allow-opaque). Prints pass/fail/skip counts side by side and every
# test that passes direct but fails through the fence; exits 1 when such a
# test is not one of the exceptions (what a lease does not grant) listed in pgproxy/doc.go
# ("# pgx suite exceptions").
#
# pgx's tests read PGX_TEST_DATABASE (CONTRIBUTING.md: a database with
# hstore, ltree and domain uint64); tests of other connection methods
# (PGX_TEST_UNIX_SOCKET_CONN_STRING, PGX_TEST_TLS_CONN_STRING, ...) are
# skipped in both runs.
#
# Needs: Postgres server binaries (/usr/lib/postgresql/*/bin, contrib for
# hstore and ltree), psql, Go, python3.
# Usage: scripts/pgx-suite.sh [go test package patterns, default ./...]
# KEEP=1 keeps the work directory (the go test -json logs).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PKGS=("${@:-./...}")
BIN=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")
PSQL=$(command -v psql || echo "$BIN/psql")
PGXDIR=$(go list -m -f '{{.Dir}}' github.com/jackc/pgx/v5)
PGXVER=$(go list -m -f '{{.Version}}' github.com/jackc/pgx/v5)

WORK=$(mktemp -d /tmp/fenceline-pgx-suite.XXXXXX)
RUNAS=()
if [ "$(id -u)" = 0 ]; then
	chown nobody:nogroup "$WORK"
	RUNAS=(setpriv --reuid=nobody --regid=nogroup --clear-groups)
fi
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PGPORT=$(freeport)
FLPORT=$(freeport)
FLPID=
cleanup() {
	local rc=$?
	[ "$rc" != 0 ] && [ -s "$WORK/fl.log" ] && { echo "--- fence log (last lines)"; tail -5 "$WORK/fl.log"; } >&2
	[ -n "$FLPID" ] && kill "$FLPID" 2>/dev/null && wait "$FLPID" 2>/dev/null
	"${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/data" -m fast -w stop >/dev/null 2>&1 || true
	if [ -n "${KEEP:-}" ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 143' INT TERM

echo "== pgx $PGXVER, postgres $("$BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$PGPORT, fence on 127.0.0.1:$FLPORT"
"${RUNAS[@]}" "$BIN/initdb" -D "$WORK/data" -U postgres --auth=trust --no-sync -E UTF8 --locale=C >/dev/null
"${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/data" -l "$WORK/pg.log" -w -o \
	"-p $PGPORT -k $WORK -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=off -c max_prepared_transactions=10" start >/dev/null
for q in "CREATE DATABASE pgx_test" ; do
	"$PSQL" -qX -h 127.0.0.1 -p "$PGPORT" -U postgres -d postgres -c "$q" >/dev/null
done
"$PSQL" -qX -h 127.0.0.1 -p "$PGPORT" -U postgres -d pgx_test -v ON_ERROR_STOP=1 >/dev/null <<'SQL'
CREATE EXTENSION hstore;
CREATE EXTENSION ltree;
CREATE DOMAIN uint64 AS numeric(20,0);
SQL

go build -o "$WORK/benchproxy" ./pgproxy/internal/benchproxy
"$WORK/benchproxy" -listen "127.0.0.1:$FLPORT" -upstream "$WORK/.s.PGSQL.$PGPORT" -tables 'public.*' -allow-opaque \
	>"$WORK/fl.out" 2>"$WORK/fl.log" &
FLPID=$!
for _ in $(seq 100); do grep -q listening "$WORK/fl.out" 2>/dev/null && break; sleep 0.1; done
grep -q listening "$WORK/fl.out" || { echo "the fence did not start"; exit 1; }

# pgx's module, writable, so go test can build and run it.
cp -r "$PGXDIR" "$WORK/pgx"
chmod -R u+w "$WORK/pgx"

run() { # name dsn
	echo "== $1: PGX_TEST_DATABASE=$2 go test -p 1 ${PKGS[*]}"
	local start=$SECONDS
	(cd "$WORK/pgx" && env -u PGHOST -u PGPORT -u PGUSER -u PGDATABASE PGX_TEST_DATABASE="$2" \
		go test -p 1 -count=1 -timeout 20m -json "${PKGS[@]}" >"$WORK/$1.json" 2>"$WORK/$1.err") || true
	echo "   $((SECONDS - start))s"
}
run direct "postgres://postgres@127.0.0.1:$PGPORT/pgx_test?sslmode=disable"
run fence "postgres://postgres@127.0.0.1:$FLPORT/pgx_test?sslmode=disable"

python3 - "$WORK/direct.json" "$WORK/fence.json" "$ROOT/pgproxy/doc.go" <<'PY'
import json, re, sys

def results(path):
    r = {}
    for line in open(path, errors="replace"):
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("Test") and ev.get("Action") in ("pass", "fail", "skip"):
            r[ev["Package"].removeprefix("github.com/jackc/pgx/v5") + "." + ev["Test"]] = ev["Action"]
    return r

direct, fence = results(sys.argv[1]), results(sys.argv[2])
exceptions, on = {}, False
for line in open(sys.argv[3]):
    if line.startswith("// # "):
        on = line.strip() == "// # pgx suite exceptions"
        continue
    m = on and re.match(r"//\s+- (\S+): (.*)", line)
    if m:
        exceptions[m.group(1)] = m.group(2)

def count(r):
    return {a: sum(1 for v in r.values() if v == a) for a in ("pass", "fail", "skip")}
cd, cf = count(direct), count(fence)
print("%-8s %7s %7s %7s" % ("", "pass", "fail", "skip"))
print("%-8s %7d %7d %7d" % ("direct", cd["pass"], cd["fail"], cd["skip"]))
print("%-8s %7d %7d %7d" % ("fence", cf["pass"], cf["fail"], cf["skip"]))

def listed(name):
    test = name.split(".", 1)[1]  # without the package
    return any(test == e or test.startswith(e + "/") for e in exceptions)
worse = sorted(t for t, a in fence.items() if a == "fail" and direct.get(t) == "pass")
unexpected = [t for t in worse if not listed(t)]
print("fail through the fence, pass direct: %d (%d listed in pgproxy/doc.go as policy)" % (len(worse), len(worse) - len(unexpected)))
for t in worse:
    print("  %s %s" % ("exception" if listed(t) else "FENCE", t))
better = sorted(t for t, a in direct.items() if a == "fail" and fence.get(t) == "pass")
if better:
    print("fail direct, pass through the fence: %d (flaky?)" % len(better))
    for t in better:
        print("  " + t)
sys.exit(1 if unexpected else 0)
PY
