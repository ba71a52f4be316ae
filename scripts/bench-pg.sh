#!/usr/bin/env bash
# Side-by-side pgbench: direct Postgres vs through the fenceline Postgres
# fence vs through PgBouncer (session mode), 8 clients, in one run on one
# server: select-only (-S) with the simple protocol, select-only with
# -M prepared, and tpcb-like (writes, fenced by the storage-side trigger).
# The fenceline row's tables carry the trigger "fenceline pg install" picks
# by default: the C one of pgproxy/cfence, built here when the server's
# headers are installed, else plpgsql (the header line says which). For
# tpcb-like, the fl-plpgsql row is fenceline with the plpgsql trigger (what
# managed Postgres, which loads no C, gets), and the fl-unfenced row the
# same proxy on an unfenced copy of the tables: what the trigger costs. The
# go-relay row is
# pgproxy/internal/barerelay, io.Copy both ways and nothing else: what a
# relay written in Go costs here before it parses a single message (through
# net.Conn: fenceline's sessions use raw reads and writes, rawio_linux.go).
# The go-loop row is the same relay as one event loop on one thread
# (barerelay -mode loop: level-triggered epoll, one read per readiness,
# raw calls), PgBouncer's shape written in Go; the go-coro row that loop
# resuming each direction, written as code that blocks, as a coroutine
# (-mode coro): what a fence built on such a loop, keeping its session
# code, would start from.
#
# Needs: Postgres server binaries (/usr/lib/postgresql/*/bin), pgbench,
# pgbouncer (Debian: apt-get install postgresql pgbouncer), Go; for the
# C trigger gcc and the server headers (postgresql-server-dev-NN).
# Usage: scripts/bench-pg.sh [SECONDS per run, default 15] [SCALE, default 10]
# ROUNDS=N (default 3) runs every target N times, interleaved, and reports
# the median tps (ratios are of medians); p50/p99 are over all rounds.
# CPU columns: proxy_us is the proxy process's CPU per transaction,
# pg_us is every Postgres process's (backends, and the background ones).
# They come from /proc and say where the time goes; tps says how much.
# LATENCY=1 measures added latency instead: for 1, 4 and 8 clients
# (LAT_CLIENTS), a simple select, a prepared select and a single-row
# update (prepared; fenced through fenceline: the C trigger checks its
# token), direct, through fenceline and through PgBouncer (and fl-base),
# interleaved, with the go-loop and go-coro relays beside them (their
# update is not fenced: they reach the unfenced tables, as direct does);
# prints each target's p50 and p99 per transaction and what it adds to
# direct's (add_p50, add_p99, in ms).
# FL_CPUPROFILE=FILE writes a CPU profile of the fenceline proxy over the
# whole run (go tool pprof FILE).
# PG_PERF=DIR (split placement) records Postgres's CPU, alone on CPU 0,
# with perf during each run of each target: DIR/WORKLOAD.TARGET.N.data
# (perf report -i FILE --no-children --sort symbol): what Postgres does
# with its CPU behind each proxy, side by side; and counts CPU 0's context
# switches (column pg_cs: per transaction).
# WORKLOADS=PATTERN runs only the workloads whose name matches the shell
# pattern (WORKLOADS='tpcb-like*').
# FL_BASELINE=REV adds target fl-base: the same fence built from git
# revision REV (git archive of it, with REV's own C trigger built here), on
# a copy of the tables of its own, in the same rounds: what the commits
# since REV changed, side by side.
#
# pgbench always reaches its target over TCP (127.0.0.1). Both proxies reach
# Postgres over its Unix socket, as a single-machine deployment would (and as
# PgBouncer usually does); UPSTREAM=tcp makes both use 127.0.0.1 instead.
#
# PLACEMENT=split (the default on 2 CPUs or more): Postgres on CPU 0;
# pgbench, the proxies and PgBouncer on the others, as when the agent and
# its sidecar run in a pod of their own and Postgres on its own server,
# which is where the sidecar stands. PLACEMENT=shared: every process may run
# on every CPU, so on a small machine each microsecond a proxy spends is
# taken from Postgres. The same placement holds for every target, direct
# included.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-15}
SCALE=${2:-10}
CLIENTS=${CLIENTS:-8}
# The newest installed server (a client-only version has a bin directory too).
BIN=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")
PGBENCH=${PGBENCH:-$(command -v pgbench || echo "$BIN/pgbench")}
command -v pgbouncer >/dev/null || { echo "pgbouncer not installed (apt-get install pgbouncer)"; exit 1; }

if [ -z "${PLACEMENT:-}" ]; then
	PLACEMENT=split
	[ "$(nproc)" -ge 2 ] || PLACEMENT=shared
fi
PGCPU=() CLCPU=()
if [ -n "${PG_PERF:-}" ]; then
	[ "$PLACEMENT" = split ] || { echo "PG_PERF needs PLACEMENT=split: it records CPU 0, where Postgres runs alone" >&2; exit 2; }
	command -v perf >/dev/null || { echo "PG_PERF needs perf (apt-get install linux-perf)" >&2; exit 2; }
	mkdir -p "$PG_PERF"
fi
case $PLACEMENT in
shared) ;;
split)
	NCPU=$(nproc)
	[ "$NCPU" -ge 2 ] || { echo "PLACEMENT=split needs 2 CPUs or more; this machine has $NCPU" >&2; exit 2; }
	PGCPU=(taskset -c 0) CLCPU=(taskset -c "1-$((NCPU - 1))") ;;
*) echo "PLACEMENT=$PLACEMENT: want shared or split" >&2; exit 2 ;;
esac

WORK=$(mktemp -d /tmp/fenceline-bench-pg.XXXXXX)
RUNAS=()
if [ "$(id -u)" = 0 ]; then
	chown nobody:nogroup "$WORK"
	RUNAS=(setpriv --reuid=nobody --regid=nogroup --clear-groups)
fi
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PGPORT_DIRECT=$(freeport); FLPORT=$(freeport); FLPPORT=$(freeport); BOUNCEPORT=$(freeport); RELAYPORT=$(freeport); LOOPPORT=$(freeport); COROPORT=$(freeport); FLBPORT=$(freeport)
PIDS=()
cleanup() {
	local rc=$?
	if [ "$rc" != 0 ]; then
		for f in fl.log flp.log flb.log relay.log loop.log coro.log pgbouncer.log pg.log; do
			[ -s "$WORK/$f" ] && { echo "--- $f (last lines)"; tail -5 "$WORK/$f"; } >&2
		done
	fi
	for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${PIDS[@]}"; do while kill -0 "$p" 2>/dev/null; do sleep 0.1; done; done
	"${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/data" -m fast -w stop >/dev/null 2>&1 || true
	rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 143' INT TERM

echo "== postgres $("$BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$PGPORT_DIRECT (scale $SCALE, $CLIENTS clients, ${DUR}s per run, placement $PLACEMENT${PGCPU[*]:+: postgres ${PGCPU[*]}, the rest ${CLCPU[*]}})"
"${RUNAS[@]}" "$BIN/initdb" -D "$WORK/data" -U postgres --auth=trust --no-sync -E UTF8 --locale=C >/dev/null
"${PGCPU[@]}" "${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/data" -l "$WORK/pg.log" -w -o \
	"-p $PGPORT_DIRECT -k $WORK -c listen_addresses=127.0.0.1 -c max_connections=100 -c shared_buffers=256MB -c synchronous_commit=off -c autovacuum=off" start >/dev/null
# Direct and PgBouncer use database "postgres"; fenceline uses "fenced", an
# identical copy whose tables carry the storage-side fence (a direct write
# there fails without a token), and fl-plpgsql "fencedp", fenced by the
# plpgsql trigger.
INC=$("$BIN/pg_config" --includedir-server 2>/dev/null || true)
DBS="postgres fenced fencedp"
[ -n "${FL_BASELINE:-}" ] && DBS="$DBS fencedb"
CLIB= # none built: auto tries the server's $libdir
if [ ! -f "$INC/postgres.h" ]; then
	echo "== no C trigger: it needs the server headers (postgresql-server-dev-$(basename "$(dirname "$BIN")"))"
elif ! command -v gcc >/dev/null; then
	echo "== no C trigger: it needs gcc"
else
	# shellcheck disable=SC2046 # pg_config prints flags to split
	CLIB=$WORK/fenceline_fence_gate.so
	gcc $("$BIN/pg_config" --cflags --cflags_sl --cppflags) -shared -I "$INC" -o "$CLIB" pgproxy/cfence/fenceline_fence_gate.c
	chmod 0755 "$CLIB"
fi
for db in $DBS; do
	[ "$db" = postgres ] || "$BIN/createdb" -h 127.0.0.1 -p "$PGPORT_DIRECT" -U postgres "$db"
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
FENCED=public.pgbench_accounts,public.pgbench_branches,public.pgbench_tellers,public.pgbench_history
# The default trigger choice (auto), with the library built above if any.
"${CLCPU[@]}" "$WORK/benchproxy" -listen "127.0.0.1:$FLPORT" -upstream "$FL_UP" -tables "$FENCED" \
	-install "postgres://postgres@127.0.0.1:$PGPORT_DIRECT/fenced?sslmode=disable" -trigger auto \
	${CLIB:+-c-library "$CLIB"} ${FL_CPUPROFILE:+-cpuprofile "$FL_CPUPROFILE"} >"$WORK/fl.log" 2>&1 &
FL_PID=$!
PIDS+=($FL_PID)
echo "== fl-plpgsql: fenceline fence, plpgsql trigger, on 127.0.0.1:$FLPPORT -> $FL_UP"
"${CLCPU[@]}" "$WORK/benchproxy" -listen "127.0.0.1:$FLPPORT" -upstream "$FL_UP" -tables "$FENCED" \
	-install "postgres://postgres@127.0.0.1:$PGPORT_DIRECT/fencedp?sslmode=disable" -trigger plpgsql >"$WORK/flp.log" 2>&1 &
FLP_PID=$!
PIDS+=($FLP_PID)

FLB_PID=
if [ -n "${FL_BASELINE:-}" ]; then
	mkdir "$WORK/base"
	git archive "$FL_BASELINE" | tar -x -C "$WORK/base"
	(cd "$WORK/base" && go build -o "$WORK/benchproxy-base" ./pgproxy/internal/benchproxy)
	# Its own C trigger too, at a path of its own (a backend keeps the
	# libraries it loaded by path).
	CLIBB=
	if [ -n "$CLIB" ]; then
		mkdir -m 0755 "$WORK/base-lib"
		CLIBB=$WORK/base-lib/fenceline_fence_gate.so
		# shellcheck disable=SC2046 # pg_config prints flags to split
		gcc $("$BIN/pg_config" --cflags --cflags_sl --cppflags) -shared -I "$INC" -o "$CLIBB" "$WORK/base/pgproxy/cfence/fenceline_fence_gate.c"
		chmod 0755 "$CLIBB"
	fi
	echo "== fl-base: the fence as of $(git log -1 --format='%h %cd' --date=short "$FL_BASELINE"), its trigger too, on 127.0.0.1:$FLBPORT -> $FL_UP"
	"${CLCPU[@]}" "$WORK/benchproxy-base" -listen "127.0.0.1:$FLBPORT" -upstream "$FL_UP" -tables "$FENCED" \
		-install "postgres://postgres@127.0.0.1:$PGPORT_DIRECT/fencedb?sslmode=disable" -trigger auto \
		${CLIBB:+-c-library "$CLIBB"} >"$WORK/flb.log" 2>&1 &
	FLB_PID=$!
	PIDS+=($FLB_PID)
fi

go build -o "$WORK/barerelay" ./pgproxy/internal/barerelay
go build -o "$WORK/wakecost" ./pgproxy/internal/wakecost
"${CLCPU[@]}" "$WORK/barerelay" -listen "127.0.0.1:$RELAYPORT" -upstream "$FL_UP" >"$WORK/relay.log" 2>&1 &
RELAY_PID=$!
PIDS+=($RELAY_PID)
"${CLCPU[@]}" "$WORK/barerelay" -mode loop -listen "127.0.0.1:$LOOPPORT" -upstream "$FL_UP" >"$WORK/loop.log" 2>&1 &
LOOP_PID=$!
PIDS+=($LOOP_PID)
"${CLCPU[@]}" "$WORK/barerelay" -mode coro -listen "127.0.0.1:$COROPORT" -upstream "$FL_UP" >"$WORK/coro.log" 2>&1 &
CORO_PID=$!
PIDS+=($CORO_PID)

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
admin_users = postgres
max_client_conn = 100
default_pool_size = 20
logfile = $WORK/pgbouncer.log
pidfile = $WORK/pgbouncer.pid
INI
echo '"postgres" ""' >"$WORK/users.txt"
[ "$(id -u)" = 0 ] && chown nobody:nogroup "$WORK/pgbouncer.ini" "$WORK/users.txt"
"${CLCPU[@]}" "${RUNAS[@]}" pgbouncer "$WORK/pgbouncer.ini" >/dev/null 2>&1 &
PIDS+=($!)
for port in $FLPORT $FLPPORT $BOUNCEPORT $RELAYPORT $LOOPPORT $COROPORT ${FLB_PID:+$FLBPORT}; do
	for _ in $(seq 100); do "$BIN/pg_isready" -q -h 127.0.0.1 -p "$port" && break; sleep 0.1; done
done
echo "== fenceline's tables carry the $(awk '/^trigger / {print $2}' "$WORK/fl.log") trigger$(sed -n 's/^not the C trigger: /; not C: /p' "$WORK/fl.log")"

# Postgres's CPU so far: the postmaster's own and its reaped children's,
# plus every live child's (clock ticks).
PM=$(head -1 "$WORK/data/postmaster.pid")
pgticks() {
	local t c
	t=$(awk '{print $14+$15+$16+$17}' "/proc/$PM/stat")
	for c in $(pgrep -P "$PM"); do
		t=$((t + $(awk '{print $14+$15}' "/proc/$c/stat" 2>/dev/null || echo 0)))
	done
	echo "$t"
}
pidticks() { [ "$1" = 0 ] && echo 0 || awk '{print $14+$15}' "/proc/$1/stat"; }
# settle: wait (bounded) until no client backend is left and no child is a
# zombie (exited, not yet reaped: its CPU is in neither count), so a run's
# backends are all in the postmaster's count.
settle() {
	for _ in $(seq 50); do
		[ "$(pgrep -c -P "$PM" -f '^postgres: postgres (postgres|fenced|fencedp|fencedb) ' || true)" = 0 ] &&
			[ "$(ps -o stat= --ppid "$PM" | grep -c '^Z' || true)" = 0 ] && return
		sleep 0.1
	done
	echo "warning: client backends still alive 5 s after a run; its pg_us is not exact" >&2
}

# vacuum DB: what pgbench does before a run unless told not to (-n: it
# would do it through the proxy), as the superuser straight to Postgres with
# the fence's triggers off. Autovacuum is off: its workers would land their
# CPU, and their competition for it, on whichever run they meet.
vacuum() {
	"$BIN/psql" -X -q -h 127.0.0.1 -p "$PGPORT_DIRECT" -U postgres "$1" -c "VACUUM pgbench_branches, pgbench_tellers" \
		-c "SET session_replication_role = replica" -c "TRUNCATE pgbench_history" >/dev/null
}

# run KEY PORT PID ARGS...: one pgbench run; prints "tps transactions
# proxy_ticks pg_ticks" and appends per-transaction latencies to $WORK/lat.KEY.
run() {
	local key=$1 port=$2 pid=$3 db=postgres; shift 3
	case $key in *.fenceline) db=fenced ;; *.fl-plpgsql) db=fencedp ;; *.fl-base) db=fencedb ;; esac
	rm -f "$WORK"/pgbench_log.*
	vacuum "$db"
	settle
	local p0 g0 p1 g1 out
	p0=$(pidticks "$pid"); g0=$(pgticks)
	local perf=
	if [ -n "${PG_PERF:-}" ]; then
		local n=1
		while [ -e "$PG_PERF/$key.$n.data" ]; do n=$((n + 1)); done
		perf record -q -g -C 0 -o "$PG_PERF/$key.$n.data" -- sleep "$DUR" >/dev/null 2>&1 &
		perf=$!
		perf stat -x, -e context-switches -C 0 -o "$PG_PERF/$key.$n.stat" -- sleep "$DUR" >/dev/null 2>&1 &
		perf="$perf $!"
	fi
	out=$(cd "$WORK" && "${CLCPU[@]}" "$PGBENCH" -h 127.0.0.1 -p "$port" -U postgres -c $CLIENTS -j "$(( CLIENTS < 2 ? 1 : 2 ))" -T "$DUR" -n -l "$@" "$db" 2>&1) || { echo "$out" >&2; return 1; }
	# shellcheck disable=SC2086 # two pids
	[ -z "$perf" ] || wait $perf
	if [ "$pid" = "$BOUNCER_PID" ]; then
		# PgBouncer keeps its server connections: drop them so their
		# backends exit and their CPU is counted now.
		"$BIN/psql" -X -q -h 127.0.0.1 -p "$BOUNCEPORT" -U postgres pgbouncer -c "KILL postgres" -c "RESUME postgres" >/dev/null
	fi
	settle
	p1=$(pidticks "$pid"); g1=$(pgticks)
	cat "$WORK"/pgbench_log.* | awk '{print $3}' >>"$WORK/lat.$key"
	local tps tx
	tps=$(echo "$out" | awk '/^tps/ {print $3; exit}')
	tx=$(echo "$out" | awk '/actually processed/ {split($NF, a, "/"); print a[1]}')
	if [ -z "$tps" ] || [ -z "$tx" ]; then echo "pgbench printed no tps or transaction count:" >&2; echo "$out" >&2; return 1; fi
	local cs=0
	[ -z "$perf" ] || cs=$(awk -F, '$3 == "context-switches" {print $1}' "$PG_PERF/$key.$n.stat")
	echo "$tps $tx $((p1 - p0)) $((g1 - g0)) ${cs:-0}"
}

TICK=$(getconf CLK_TCK)
median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
ROUNDS=${ROUNDS:-3}
BOUNCER_PID=$(cat "$WORK/pgbouncer.pid")
echo "== $("${CLCPU[@]}" "$WORK/wakecost")"
if [ "${LATENCY:-}" = 1 ]; then
	cat >"$WORK/update-one.sql" <<'SQL'
\set aid random(1, 100000 * :scale)
\set delta random(-5000, 5000)
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
SQL
	[ "$(id -u)" = 0 ] && chown nobody:nogroup "$WORK/update-one.sql"
	echo "== latency: $ROUNDS rounds of ${DUR}s per target, workload and client count, interleaved"
	printf '\n%-7s %-22s %-10s %9s %8s %8s %8s %8s %9s\n' clients workload target tps p50_ms p99_ms add_p50 add_p99 proxy_us
	for CLIENTS in ${LAT_CLIENTS:-1 4 8}; do
		for wl in "select simple:-S -M simple" "select prepared:-S -M prepared" "update-one prepared:-f $WORK/update-one.sql -s $SCALE -M prepared"; do
			name=${wl%%:*}; args=${wl#*:}; w=c$CLIENTS.${name// /_}
			targets="direct:$PGPORT_DIRECT:0 fenceline:$FLPORT:$FL_PID${FLB_PID:+ fl-base:$FLBPORT:$FLB_PID} go-loop:$LOOPPORT:$LOOP_PID go-coro:$COROPORT:$CORO_PID pgbouncer:$BOUNCEPORT:$BOUNCER_PID"
			for t in $targets; do rm -f "$WORK/lat.$w.${t%%:*}" "$WORK/res.$w.${t%%:*}"; done
			for _ in $(seq "$ROUNDS"); do
				for t in $targets; do
					IFS=: read -r tn tp tpid <<<"$t"
					# shellcheck disable=SC2086 # args are pgbench's, split
					run "$w.$tn" "$tp" "$tpid" $args >>"$WORK/res.$w.$tn"
				done
			done
			read -r d50 d99 < <(sort -n "$WORK/lat.$w.direct" | awk '{a[NR]=$1} END {printf "%.3f %.3f\n", a[int(NR*0.5)]/1000, a[int(NR*0.99)]/1000}')
			first=$name
			for t in $targets; do
				tn=${t%%:*}
				tps=$(awk '{print $1}' "$WORK/res.$w.$tn" | median)
				read -r p50 p99 < <(sort -n "$WORK/lat.$w.$tn" | awk '{a[NR]=$1} END {printf "%.3f %.3f\n", a[int(NR*0.5)]/1000, a[int(NR*0.99)]/1000}')
				pus=$(awk -v tick="$TICK" '{tx+=$2; p+=$3} END {printf "%.1f", p*1e6/tick/tx}' "$WORK/res.$w.$tn")
				[ "$tn" = direct ] && pus=-
				printf '%-7s %-22s %-10s %9.0f %8s %8s %8s %8s %9s\n' "$CLIENTS" "$first" "$tn" "$tps" "$p50" "$p99" \
					"$(awk -v a="$p50" -v b="$d50" 'BEGIN{printf "%+.3f", a-b}')" "$(awk -v a="$p99" -v b="$d99" 'BEGIN{printf "%+.3f", a-b}')" "$pus"
				first=
			done
		done
	done
	exit 0
fi
echo "== $ROUNDS rounds of ${DUR}s per target and workload, interleaved"
printf '\n%-22s %-12s %9s %10s %12s %8s %8s %9s %7s%s\n' workload target tps vs_direct vs_pgbouncer p50_ms p99_ms proxy_us pg_us "${PG_PERF:+   pg_cs}"
for wl in "select-only simple:-S -M simple" "select-only prepared:-S -M prepared" "tpcb-like simple:-M simple" "tpcb-like prepared:-M prepared"; do
	name=${wl%%:*}; args=${wl#*:}; w=${name// /_}
	# shellcheck disable=SC2254 # WORKLOADS is a pattern
	case $name in ${WORKLOADS:-*}) ;; *) continue ;; esac
	# target:port:pid; fl-unfenced is the same proxy on the unfenced copy
	# of the tables: beside fenceline, what the storage-side fence costs.
	targets="direct:$PGPORT_DIRECT:0 fenceline:$FLPORT:$FL_PID${FLB_PID:+ fl-base:$FLBPORT:$FLB_PID}"
	if [ "${name%% *}" = tpcb-like ]; then
		targets="$targets fl-plpgsql:$FLPPORT:$FLP_PID fl-unfenced:$FLPORT:$FL_PID"
	fi
	targets="$targets go-relay:$RELAYPORT:$RELAY_PID go-loop:$LOOPPORT:$LOOP_PID go-coro:$COROPORT:$CORO_PID pgbouncer:$BOUNCEPORT:$BOUNCER_PID"
	for t in $targets; do rm -f "$WORK/lat.$w.${t%%:*}" "$WORK/res.$w.${t%%:*}"; done
	for _ in $(seq "$ROUNDS"); do
		for t in $targets; do
			IFS=: read -r tn tp tpid <<<"$t"
			run "$w.$tn" "$tp" "$tpid" $args >>"$WORK/res.$w.$tn"
		done
	done
	dt=$(awk '{print $1}' "$WORK/res.$w.direct" | median)
	bt=$(awk '{print $1}' "$WORK/res.$w.pgbouncer" | median)
	first=$name
	for t in $targets; do
		tn=${t%%:*}
		tps=$(awk '{print $1}' "$WORK/res.$w.$tn" | median)
		read -r p50 p99 < <(sort -n "$WORK/lat.$w.$tn" | awk '{a[NR]=$1} END {printf "%.3f %.3f\n", a[int(NR*0.5)]/1000, a[int(NR*0.99)]/1000}')
		read -r pus gus cs < <(awk -v tick="$TICK" '{tx+=$2; p+=$3; g+=$4; c+=$5} END {printf "%.1f %.1f %.1f\n", p*1e6/tick/tx, g*1e6/tick/tx, c/tx}' "$WORK/res.$w.$tn")
		[ "$tn" = direct ] && pus=-
		printf '%-22s %-12s %9.0f %10s %12s %8s %8s %9s %7s%s\n' "$first" "$tn" "$tps" \
			"$(awk -v a="$tps" -v b="$dt" 'BEGIN{printf "%.2f", a/b}')" "$(awk -v a="$tps" -v b="$bt" 'BEGIN{printf "%.2f", a/b}')" \
			"$p50" "$p99" "$pus" "$gus" "${PG_PERF:+$(printf ' %7s' "$cs")}"
		first=
	done
done
# Every fenceline tpcb-like write went through the storage-side fence:
for db in $DBS; do
	[ "$db" = postgres ] && continue
	"$BIN/psql" -X -At -h 127.0.0.1 -p "$PGPORT_DIRECT" -U postgres "$db" -c \
		"SELECT 'fence epochs ($db): ' || string_agg(relname || '=' || fence, ', ' ORDER BY relname) FROM fenceline.epoch"
done
