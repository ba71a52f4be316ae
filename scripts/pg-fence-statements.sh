#!/usr/bin/env bash
# What the Postgres fence's own statements cost Postgres, with no proxy in
# the way: pgbench sends its tpcb-like transaction straight to Postgres
# (prepared, 8 clients), with and without the statements the fence adds to
# a writable transaction, in the same pipeline (one round trip) as the
# fence sends them. Postgres runs alone on CPU 0 and pgbench on the rest,
# so Postgres's CPU is the limit and tps follows its cost per transaction.
#
#   scripts/pg-fence-statements.sh [SECONDS per run, default 8] [ROUNDS, default 3]
#
# Variants, interleaved round by round:
#   plain      pgbench's tpcb-like transaction, the session read-write (BEGIN and
#              the first UPDATE each in a pipeline, as for the others)
#   fence      as the fence sends it (session read-only by default):
#              SET transaction_read_only = off; SELECT set_config('fenceline.token', …)
#              before BEGIN, SELECT set_config('search_path', …) with the first UPDATE
#   set-local  the same, the token and the path by SET LOCAL (no plan, no row)
#   merged     one SELECT setting both before BEGIN, nothing with the UPDATE
#   rw-only    only the read-write switch before BEGIN
#
# Needs Postgres server binaries (Debian's postgresql-15) and python3.
# Everything listens on 127.0.0.1 (a free port) and is stopped on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${1:-8}
ROUNDS=${2:-3}
BIN=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -1)")
[ "$(nproc)" -ge 2 ] || { echo "needs 2 CPUs or more (Postgres alone on CPU 0)" >&2; exit 2; }
WORK=$(mktemp -d /tmp/fenceline-pg-statements.XXXXXX)
RUNAS=()
if [ "$(id -u)" = 0 ]; then
	chown nobody:nogroup "$WORK"
	RUNAS=(setpriv --reuid=nobody --regid=nogroup --clear-groups)
fi
P=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
cleanup() {
	"${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/data" -m fast -w stop >/dev/null 2>&1 || true
	rm -rf "$WORK"
}
trap cleanup EXIT
"${RUNAS[@]}" "$BIN/initdb" -D "$WORK/data" -U postgres --auth=trust --no-sync -E UTF8 --locale=C >/dev/null
taskset -c 0 "${RUNAS[@]}" "$BIN/pg_ctl" -D "$WORK/data" -l "$WORK/pg.log" -w -o \
	"-p $P -k $WORK -c listen_addresses=127.0.0.1 -c shared_buffers=256MB -c synchronous_commit=off -c autovacuum=off" start >/dev/null
"$BIN/createdb" -h 127.0.0.1 -p "$P" -U postgres b
"$BIN/pgbench" -h 127.0.0.1 -p "$P" -U postgres -i -q -s 10 b >/dev/null 2>&1

# A token as long as the fence's (280 characters).
TOK=$(python3 -c 'import secrets; print(secrets.token_urlsafe(210)[:280])')
HEAD='\set aid random(1, 100000 * :scale)
\set bid random(1, 1 * :scale)
\set tid random(1, 10 * :scale)
\set delta random(-5000, 5000)'
UPD='UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;'
REST='SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
UPDATE pgbench_tellers SET tbalance = tbalance + :delta WHERE tid = :tid;
UPDATE pgbench_branches SET bbalance = bbalance + :delta WHERE bid = :bid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);
END;'
SP="'\"\$user\", public'"
script() { # name, then the lines between HEAD and REST
	local name=$1
	shift
	{ echo "$HEAD"; printf '%s\n' "$@"; echo "$REST"; } >"$WORK/$name.sql"
}
# Every variant sends BEGIN and the first UPDATE each in a pipeline of its
# own, as the fence forwards them, so only the added statements differ.
script plain '\startpipeline' 'BEGIN;' '\endpipeline' '\startpipeline' "$UPD" '\endpipeline'
script fence '\startpipeline' 'SET transaction_read_only = off;' "SELECT pg_catalog.set_config('fenceline.token', '$TOK', true);" 'BEGIN;' '\endpipeline' \
	'\startpipeline' "SELECT pg_catalog.set_config('search_path', $SP, true);" "$UPD" '\endpipeline'
script set-local '\startpipeline' 'SET transaction_read_only = off;' "SET LOCAL fenceline.token = '$TOK';" 'BEGIN;' '\endpipeline' \
	'\startpipeline' 'SET LOCAL search_path = "$user", public;' "$UPD" '\endpipeline'
script merged '\startpipeline' 'SET transaction_read_only = off;' \
	"SELECT pg_catalog.set_config('fenceline.token', '$TOK', true), pg_catalog.set_config('search_path', $SP, true);" 'BEGIN;' '\endpipeline' \
	'\startpipeline' "$UPD" '\endpipeline'
script rw-only '\startpipeline' 'SET transaction_read_only = off;' 'BEGIN;' '\endpipeline' '\startpipeline' "$UPD" '\endpipeline'
chmod 0644 "$WORK"/*.sql

VARIANTS=(plain fence set-local merged rw-only)
declare -A TPS
for r in $(seq "$ROUNDS"); do
	for v in "${VARIANTS[@]}"; do
		ro=""
		[ "$v" = plain ] || ro="-c default_transaction_read_only=on" # as the fence's server connections
		out=$(PGOPTIONS="$ro" taskset -c "1-$(($(nproc) - 1))" "$BIN/pgbench" -h 127.0.0.1 -p "$P" -U postgres -c 8 -j 2 -T "$DUR" -n -M prepared -f "$WORK/$v.sql" b 2>&1) ||
			{ echo "$out" >&2; exit 1; }
		t=$(sed -nE 's/^tps = ([0-9.]+) .*/\1/p' <<<"$out")
		[ -n "$t" ] || { echo "$v: no tps in pgbench's output:" >&2; echo "$out" >&2; exit 1; }
		TPS[$v]="${TPS[$v]:-} $t"
		echo "round $r $v tps=$t"
	done
done
echo "== median tps, and its ratio to plain"
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2)}'; }
base=$(median <<<"${TPS[plain]}")
for v in "${VARIANTS[@]}"; do
	m=$(median <<<"${TPS[$v]}")
	printf 'RESULT variant=%s tps=%.0f ratio=%.3f runs=%s\n' "$v" "$m" "$(python3 -c "print($m/$base)")" "$(echo ${TPS[$v]} | tr ' ' ',')"
done
