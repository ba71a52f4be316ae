#!/usr/bin/env bash
# Side-by-side pgbench: direct Postgres vs through the fenceline Postgres
# fence vs through PgBouncer (session mode), 8 clients, in one run on one
# server: select-only (-S) with the simple protocol, select-only with
# -M prepared, and tpcb-like (writes, fenced by the storage-side trigger;
# the fl-unfenced row is the same proxy on an unfenced copy of the tables,
# which shows what the trigger costs). The go-relay row is
# pgproxy/internal/barerelay, io.Copy both ways and nothing else: what a
# relay written in Go costs here before it parses a single message.
#
# Needs: Postgres server binaries (/usr/lib/postgresql/*/bin), pgbench,
# pgbouncer (Debian: apt-get install postgresql pgbouncer), Go.
# Usage: scripts/bench-pg.sh [SECONDS per run, default 15] [SCALE, default 10]
# FL_CPUPROFILE=FILE writes a CPU profile of the fenceline proxy over the
# whole run (go tool pprof FILE).
#
# pgbench always reaches its target over TCP (127.0.0.1). Both proxies reach
# Postgres over its Unix socket, as a single-machine deployment would (and as
# PgBouncer usually does); UPSTREAM=tcp makes both use 127.0.0.1 instead.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-15}
SCALE=${2:-10}
CLIENTS=8
BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
PGBENCH=${PGBENCH:-$(command -v pgbench || echo "$BIN/pgbench")}
command -v pgbouncer >/dev/null || { echo "pgbouncer not installed (apt-get install pgbouncer)"; exit 1; }

WORK=$(mktemp -d /tmp/fenceline-bench-pg.XXXXXX)
RUNAS=()
if [ "$(id -u)" = 0 ]; then
	chown nobody:nogroup "$WORK"
	RUNAS=(setpriv --reuid=nobody --regid=nogroup --clear-groups)
fi
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PGPORT_DIRECT=$(freeport); FLPORT=$(freeport); BOUNCEPORT=$(freeport); RELAYPORT=$(freeport)
PIDS=()
cleanup() {
	for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${PIDS[@]}"; do while kill -0 "$p" 2>/dev/null; do sleep 0.1; done; done
	"${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/data" -m fast -w stop >/dev/null 2>&1 || true
	rm -rf "$WORK"
}
trap cleanup EXIT

echo "== postgres $("$BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$PGPORT_DIRECT (scale $SCALE, $CLIENTS clients, ${DUR}s per run)"
"${RUNAS[@]}" "$BIN/initdb" -D "$WORK/data" -U postgres --auth=trust --no-sync -E UTF8 --locale=C >/dev/null
"${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/data" -l "$WORK/pg.log" -w -o \
	"-p $PGPORT_DIRECT -k $WORK -c listen_addresses=127.0.0.1 -c max_connections=100 -c shared_buffers=256MB -c synchronous_commit=off" start >/dev/null
# Direct and PgBouncer use database "postgres"; fenceline uses "fenced", an
# identical copy whose tables carry the storage-side fence (a direct write
# there fails without a token).
"$BIN/createdb" -h 127.0.0.1 -p "$PGPORT_DIRECT" -U postgres fenced
for db in postgres fenced; do
	"$PGBENCH" -h 127.0.0.1 -p "$PGPORT_DIRECT" -U postgres -i -q -s "$SCALE" "$db" >/dev/null 2>&1
done

UPSTREAM=${UPSTREAM:-unix}
case $UPSTREAM in
unix) FL_UP=$WORK/.s.PGSQL.$PGPORT_DIRECT; BOUNCE_HOST=$WORK ;;
tcp) FL_UP=127.0.0.1:$PGPORT_DIRECT; BOUNCE_HOST=127.0.0.1 ;;
*) echo "UPSTREAM=$UPSTREAM: want unix or tcp" >&2; exit 2 ;;
esac
echo "== fenceline fence on 127.0.0.1:$FLPORT -> $FL_UP (fence installed on public.pgbench_*)"
go build -o "$WORK/benchproxy" ./pgproxy/internal/benchproxy
"$WORK/benchproxy" -listen "127.0.0.1:$FLPORT" -upstream "$FL_UP" \
	-tables public.pgbench_accounts,public.pgbench_branches,public.pgbench_tellers,public.pgbench_history \
	-install "postgres://postgres@127.0.0.1:$PGPORT_DIRECT/fenced?sslmode=disable" \
	${FL_CPUPROFILE:+-cpuprofile "$FL_CPUPROFILE"} >"$WORK/fl.log" 2>&1 &
PIDS+=($!)

go build -o "$WORK/barerelay" ./pgproxy/internal/barerelay
"$WORK/barerelay" -listen "127.0.0.1:$RELAYPORT" -upstream "$FL_UP" >"$WORK/relay.log" 2>&1 &
PIDS+=($!)

echo "== pgbouncer $(pgbouncer --version | head -1 | awk '{print $2}') (session mode) on 127.0.0.1:$BOUNCEPORT -> $BOUNCE_HOST"
cat >"$WORK/pgbouncer.ini" <<INI
[databases]
postgres = host=$BOUNCE_HOST port=$PGPORT_DIRECT dbname=postgres
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $BOUNCEPORT
unix_socket_dir =
auth_type = trust
auth_file = $WORK/users.txt
pool_mode = session
max_client_conn = 100
default_pool_size = 20
logfile = $WORK/pgbouncer.log
pidfile = $WORK/pgbouncer.pid
INI
echo '"postgres" ""' >"$WORK/users.txt"
[ "$(id -u)" = 0 ] && chown nobody:nogroup "$WORK/pgbouncer.ini" "$WORK/users.txt"
"${RUNAS[@]}" pgbouncer "$WORK/pgbouncer.ini" >/dev/null 2>&1 &
PIDS+=($!)
for port in $FLPORT $BOUNCEPORT $RELAYPORT; do
	for _ in $(seq 100); do "$BIN/pg_isready" -q -h 127.0.0.1 -p "$port" && break; sleep 0.1; done
done

# run NAME PORT ARGS...: prints "tps p50_ms p99_ms"
run() {
	local name=$1 port=$2 db=postgres; shift 2
	[ "$name" = fenceline ] && db=fenced
	rm -f "$WORK"/pgbench_log.*
	local out
	out=$(cd "$WORK" && "$PGBENCH" -h 127.0.0.1 -p "$port" -U postgres -c $CLIENTS -j 2 -T "$DUR" -n -l "$@" "$db" 2>&1) || { echo "$out" >&2; return 1; }
	local tps
	tps=$(echo "$out" | awk '/^tps/ {print $3; exit}')
	local lat
	lat=$(cat "$WORK"/pgbench_log.* | awk '{print $3}' | sort -n | awk '{a[NR]=$1} END {printf "%.3f %.3f", a[int(NR*0.5)]/1000, a[int(NR*0.99)]/1000}')
	echo "$tps $lat"
}

printf '\n%-22s %-12s %10s %9s %9s %12s %12s\n' workload target tps p50_ms p99_ms vs_direct vs_pgbouncer
row() { # row WORKLOAD TARGET TPS P50 P99 DIRECT_TPS BOUNCER_TPS
	printf '%-22s %-12s %10.0f %9s %9s %12s %12s\n' "$1" "$2" "$3" "$4" "$5" \
		"$(awk -v a="$3" -v b="$6" 'BEGIN{printf "%.2f", a/b}')" "$(awk -v a="$3" -v b="$7" 'BEGIN{printf "%.2f", a/b}')"
}
for wl in "select-only simple:-S -M simple" "select-only prepared:-S -M prepared" "tpcb-like simple:-M simple" "tpcb-like prepared:-M prepared"; do
	name=${wl%%:*}; args=${wl#*:}
	read -r dt dp50 dp99 < <(run direct "$PGPORT_DIRECT" $args)
	read -r ft fp50 fp99 < <(run fenceline "$FLPORT" $args)
	read -r bt bp50 bp99 < <(run pgbouncer "$BOUNCEPORT" $args)
	row "$name" direct "$dt" "$dp50" "$dp99" "$dt" "$bt"
	row "" fenceline "$ft" "$fp50" "$fp99" "$dt" "$bt"
	if [ "${name%% *}" = tpcb-like ]; then
		# The same proxy on the unfenced copy: what the storage-side fence costs.
		read -r ut up50 up99 < <(run fl-unfenced "$FLPORT" $args)
		row "" "fl-unfenced" "$ut" "$up50" "$up99" "$dt" "$bt"
	fi
	read -r gt gp50 gp99 < <(run go-relay "$RELAYPORT" $args)
	row "" go-relay "$gt" "$gp50" "$gp99" "$dt" "$bt"
	row "" pgbouncer "$bt" "$bp50" "$bp99" "$dt" "$bt"
done
# Every fenceline tpcb-like write went through the storage-side fence:
"$BIN/psql" -X -At -h 127.0.0.1 -p "$PGPORT_DIRECT" -U postgres fenced -c \
	"SELECT 'fence epochs: ' || string_agg(relname || '=' || fence, ', ' ORDER BY relname) FROM fenceline.epoch"
