#!/usr/bin/env bash
# Runs the long form of the cluster fault harness (test/faults, the test
# TestClusterAuditThroughFaults): a 3-node cluster of real fenceline
# processes plus a lease service process, under lease traffic, with every
# round pausing (SIGSTOP) the lease log's and the audit stream's leaders and
# killing (SIGKILL) the service process and a node, then restarting them.
# At the end every acknowledged grant, release, revoke, refusal and every
# reclaim must be in the audit stream exactly once, fences unique and
# rising, and no two overlapping leases active at once. Prints the counts.
#
#   scripts/faults-cluster.sh [-r ROUNDS] [-n RUNS] [-s SEED]
#
#   -r  fault rounds per run (default 5; env FENCELINE_FAULTS_CLUSTER_ROUNDS)
#   -n  runs, each on a fresh cluster (default 1)
#   -s  seed of the load's choices (default: a new one per run)
#
# Every process listens on 127.0.0.1 and is killed by the test when it ends.
set -euo pipefail

rounds=${FENCELINE_FAULTS_CLUSTER_ROUNDS:-5}
runs=1
seed=
while getopts "r:n:s:" opt; do
  case $opt in
    r) rounds=$OPTARG ;;
    n) runs=$OPTARG ;;
    s) seed=$OPTARG ;;
    *) echo "usage: $0 [-r ROUNDS] [-n RUNS] [-s SEED]" >&2; exit 2 ;;
  esac
done
case $rounds$runs in *[!0-9]*) echo "-r and -n take whole numbers" >&2; exit 2 ;; esac

root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Build once: the test binary, and the fenceline binary every run uses.
(cd "$root" && go build -o "$work/fenceline" ./cmd/fenceline && go test -c -o "$work/faults.test" ./test/faults)

# Each run may take about a minute to start plus about half a minute a round.
timeout=$(( 120 + 90 * rounds ))s
pass=0 fail=0
for run in $(seq 1 "$runs"); do
  log=$work/run-$run.log
  echo "run $run of $runs: $rounds rounds"
  if (cd "$root/test/faults" && FENCELINE_FAULTS_BIN="$work/fenceline" FENCELINE_FAULTS_CLUSTER_ROUNDS="$rounds" \
      FENCELINE_FAULTS_SEED="$seed" "$work/faults.test" -test.run '^TestClusterAuditThroughFaults$' -test.v \
      -test.count=1 -test.timeout "$timeout") >"$log" 2>&1; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    cp "$log" "$root/faults-cluster-run-$run.log"
    echo "  FAILED: full log in faults-cluster-run-$run.log"
  fi
  # The counts: acknowledged operations, faults injected, audit events.
  grep -E 'seed|ready after|of load under faults|chain of|audit incomplete|duplicates|replay|chain:|FAIL|--- ' "$log" | sed 's/^ *//; s/^/  /'
done
echo "cluster fault runs: $pass passed, $fail failed ($rounds rounds each)"
[ "$fail" -eq 0 ]
