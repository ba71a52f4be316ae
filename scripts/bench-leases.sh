#!/usr/bin/env bash
# Runs fenceline's lease bus benchmark side by side with the yardsticks in
# ../shared/anchor-bench — raw JetStream KV compare-and-swap (the store's
# own limit) and etcd's concurrency.Mutex (Debian's etcd-server) — in one
# run on this machine, then prints the ratios the floors are stated in.
#
#   scripts/bench-leases.sh [-d 10s] [-c 32]
#
# etcd: $ETCD, else `etcd` on PATH, else /usr/bin/etcd or /usr/local/bin/etcd.
# On Debian: apt-get install -y etcd-server (etcd 3.4, /usr/bin/etcd; the
# package's own service is not needed, this script starts etcd itself).
#
# Everything listens on 127.0.0.1 (free ports), every phase is bounded by -d,
# and the etcd server it starts is stopped by its process id on exit.
set -euo pipefail

dur=10s
clients=32
while getopts "d:c:" opt; do
  case $opt in
    d) dur=$OPTARG ;;
    c) clients=$OPTARG ;;
    *) echo "usage: $0 [-d DURATION] [-c CLIENTS]" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
# shared/ sits beside the main checkout (../shared) or beside a worktree's
# parent (../../shared).
shared=${FENCELINE_SHARED:-$root/../shared}
[ -n "${FENCELINE_SHARED:-}" ] || [ -d "$shared/anchor-bench" ] || shared=$root/../../shared
anchors=$shared/anchor-bench
[ -d "$anchors/nats" ] || { echo "no anchor benchmarks at $anchors (set FENCELINE_SHARED to the shared/ folder)" >&2; exit 1; }

work=$(mktemp -d)
etcd_pid=
cleanup() {
  if [ -n "$etcd_pid" ]; then kill "$etcd_pid" 2>/dev/null || true; wait "$etcd_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
results=$work/results.txt

etcd_bin=${ETCD:-$(command -v etcd || true)}
for p in /usr/bin/etcd /usr/local/bin/etcd; do
  [ -n "$etcd_bin" ] || { [ -x "$p" ] && etcd_bin=$p; }
done

# Build everything first, so no compile runs beside a measurement.
(cd "$root" && go build -o "$work/leasebench" ./test/leasebench && go build -o "$work/fleetbench" ./test/fleetbench)
# The anchors are their own modules; build them outside the read-only copy of shared/.
cp -r "$anchors/nats" "$work/natsanchor"
(cd "$work/natsanchor" && go build -o "$work/natsbench" .)

# The disk's fsync latency here drifts over minutes, so each fenceline phase
# runs right next to the yardstick phase it is compared with.
echo "== 1 client: fenceline (embedded single node, SyncAlways), then raw JetStream KV CAS, $dur each"
"$work/leasebench" -d "$dur" -c "$clients" -dir "$work" -phases single | tee -a "$results"
"$work/natsbench" -d "$dur" -w "$clients" -dir "$work" -label raw -phases A | tee -a "$results"

echo "== $clients clients: fenceline, then raw JetStream KV CAS on $clients keys, $dur each"
"$work/leasebench" -d "$dur" -c "$clients" -dir "$work" -phases disjoint,contended,active | tee -a "$results"
"$work/natsbench" -d "$dur" -w "$clients" -dir "$work" -label raw -phases C | tee -a "$results"

if [ -n "$etcd_bin" ]; then
  echo "== etcd concurrency.Mutex (anchor-bench/etcd, $("$etcd_bin" --version | head -1)), $dur per mode"
  read -r client_port peer_port <<<"$("$work/fleetbench" ports 2)"
  "$etcd_bin" --name bench --data-dir "$work/etcd" \
    --listen-client-urls "http://127.0.0.1:$client_port" --advertise-client-urls "http://127.0.0.1:$client_port" \
    --listen-peer-urls "http://127.0.0.1:$peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$peer_port" \
    --initial-cluster "bench=http://127.0.0.1:$peer_port" >"$work/etcd.log" 2>&1 &
  etcd_pid=$!
  for _ in $(seq 100); do
    curl -sf "http://127.0.0.1:$client_port/health" >/dev/null 2>&1 && break
    sleep 0.1
  done
  cp -r "$anchors/etcd" "$work/etcdanchor"
  (cd "$work/etcdanchor" && go build -o "$work/etcdbench" .)
  # The yardstick reports its own lock errors (etcd under load) and exits
  # non-zero for them; keep its numbers and go on.
  for args in "-c 1 -label etcd1" "-c $clients -label etcddisjoint" "-c $clients -shared -label etcdshared"; do
    # shellcheck disable=SC2086
    "$work/etcdbench" -endpoints "http://127.0.0.1:$client_port" -d "$dur" $args | tee -a "$results" || echo "(etcd yardstick $args exited non-zero)"
  done
else
  echo "== etcd not found (\$ETCD, PATH, /usr/bin/etcd, /usr/local/bin/etcd): etcd columns left empty."
  echo "   Install it: apt-get install -y etcd-server (Debian), or set ETCD=/path/to/etcd."
fi

echo
echo "== side by side (cycles/s = acquire+release or lock+unlock pairs per second)"
awk '
function val(line, key,   n, i, kv) {
  n = split(line, kv, " ")
  for (i = 1; i <= n; i++) if (index(kv[i], key "=") == 1) return substr(kv[i], length(key) + 2)
  return ""
}
/^RESULT system=fenceline/ { fl[val($0, "phase")] = val($0, "cycles_per_s"); hand = (val($0, "phase") == "contended") ? val($0, "handoff_p50") : hand }
/^RESULT label=raw phase=A/ { rawA = val($0, "cas_pairs_per_s") }
/^RESULT label=raw phase=C/ { rawC = val($0, "cas_pairs_per_s") }
/^RESULT label=etcd1 /      { e1 = val($0, "cycles_per_s") }
/^RESULT label=etcddisjoint/ { ed = val($0, "cycles_per_s") }
/^RESULT label=etcdshared/  { es = val($0, "cycles_per_s"); eshand = val($0, "lock_p50") }
/^RATIO/ { ratio = $0 }
function r(a, b) { return (a != "" && b != "" && b + 0 > 0) ? sprintf("%.2fx", a / b) : "n/a" }
END {
  printf "%-28s %12s %12s %12s %14s %14s\n", "phase", "fenceline", "raw CAS", "etcd", "vs raw CAS", "vs etcd"
  printf "%-28s %12s %12s %12s %14s %14s\n", "1 client", fl["single"], rawA, e1, r(fl["single"], rawA), r(fl["single"], e1)
  printf "%-28s %12s %12s %12s %14s %14s\n", "32 clients, disjoint", fl["disjoint"], rawC, ed, r(fl["disjoint"], rawC), r(fl["disjoint"], ed)
  printf "%-28s %12s %12s %12s %14s %14s\n", "32 clients, one scope", fl["contended"], "-", es, "-", r(fl["contended"], es)
  printf "contended handoff p50: fenceline %s, etcd lock p50 %s\n", hand, eshand
  print ratio
  print "floors: >= 1000 cycles/s at 32 clients; >= 0.50x raw CAS pairs at 1 client; acquire p50 at 1,000 active <= 2x at 10"
}' "$results"
