#!/usr/bin/env bash
# What Postgres runs, and for how long, while pgbench's tpcb-like load goes
# through the Postgres fence: every statement's duration is logged
# (log_min_duration_statement = 0) and summed by its first words, the
# fence's own queries (its catalog lookups: WITH RECURSIVE ...) among them.
# docs/benchmarks.md counts the lookups a second with it.
#
#   [MODE=prepared] scripts/trace-pg-fence.sh [SECONDS, default 4] [CLIENTS, default 8] [SCALE, default 1]
#
# Needs what scripts/bench-pg.sh needs (Postgres server binaries and
# headers, gcc, Go). Everything listens on 127.0.0.1 (free ports) and is
# stopped by its process id on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-4}
CLIENTS=${2:-8}
SCALE=${3:-1}
MODE=${MODE:-simple} # or prepared, extended: pgbench -M
BIN=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")
WORK=$(mktemp -d /tmp/fenceline-trace-pg.XXXXXX)
RUNAS=()
if [ "$(id -u)" = 0 ]; then
	chown nobody:nogroup "$WORK"
	RUNAS=(setpriv --reuid=nobody --regid=nogroup --clear-groups)
fi
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P=$(freeport) FL=$(freeport)
FLPID=
cleanup() {
	[ -n "$FLPID" ] && kill "$FLPID" 2>/dev/null || true
	"${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/data" -m fast -w stop >/dev/null 2>&1 || true
	rm -rf "$WORK"
}
trap cleanup EXIT
"${RUNAS[@]}" "$BIN/initdb" -D "$WORK/data" -U postgres --auth=trust --no-sync -E UTF8 --locale=C >/dev/null
"${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/data" -l "$WORK/pg.log" -w -o \
	"-p $P -k $WORK -c listen_addresses=127.0.0.1 -c synchronous_commit=off -c autovacuum=off" start >/dev/null
"$BIN/createdb" -h 127.0.0.1 -p "$P" -U postgres fenced
"$BIN/pgbench" -h 127.0.0.1 -p "$P" -U postgres -i -q -s "$SCALE" fenced >/dev/null 2>&1
INC=$("$BIN/pg_config" --includedir-server)
CLIB=$WORK/fenceline_fence_gate.so
# shellcheck disable=SC2046 # pg_config prints flags to split
gcc $("$BIN/pg_config" --cflags --cflags_sl --cppflags) -shared -I "$INC" -o "$CLIB" pgproxy/cfence/fenceline_fence_gate.c
chmod 0755 "$CLIB"
go build -o "$WORK/benchproxy" ./pgproxy/internal/benchproxy
"$WORK/benchproxy" -listen "127.0.0.1:$FL" -upstream "$WORK/.s.PGSQL.$P" \
	-tables public.pgbench_accounts,public.pgbench_branches,public.pgbench_tellers,public.pgbench_history \
	-install "postgres://postgres@127.0.0.1:$P/fenced?sslmode=disable" -trigger auto -c-library "$CLIB" >"$WORK/fl.log" 2>&1 &
FLPID=$!
for _ in $(seq 100); do "$BIN/pg_isready" -q -h 127.0.0.1 -p "$FL" && break; sleep 0.1; done
"$BIN/psql" -X -q -h 127.0.0.1 -p "$P" -U postgres fenced -c "ALTER SYSTEM SET log_min_duration_statement = 0" -c "SELECT pg_reload_conf()" >/dev/null
from=$(($(wc -l <"$WORK/pg.log") + 1))
"$BIN/pgbench" -h 127.0.0.1 -p "$FL" -U postgres -c "$CLIENTS" -j 2 -T "$DUR" -M "$MODE" -n fenced | grep -E '^(tps|latency)'
echo "== statements Postgres ran in ${DUR}s (by their first words): mean ms, count"
tail -n +"$from" "$WORK/pg.log" | grep -E 'duration: [0-9.]+ ms +(execute|statement)' |
	sed -E 's/.*duration: ([0-9.]+) ms +(execute [^:]*|statement): (.{0,40}).*/\1 \3/' |
	awk '{k=$2" "$3" "$4; s[k]+=$1; n[k]++} END {for (k in s) printf "%8.3f %7d  %s\n", s[k]/n[k], n[k], k}' | sort -k2 -rn
