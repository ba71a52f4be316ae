#!/usr/bin/env bash
# Runs the long form of the cluster half of the fault harness (test/faults,
# TestClusterAuditThroughFaults): a 3-node cluster of real fenceline
# processes plus a lease service process, under lease traffic (acquire,
# renew, release, abandon, operator revokes) and with guarded agents
# (`fenceline run` on the cluster: file and Postgres writes, git pushes).
# Every round pauses (SIGSTOP 3 s, SIGCONT) the lease log's and the audit
# stream's leaders, kills (SIGKILL) the service process and the log's
# leader, then restarts them, then pauses the node the run agent's holder
# is connected to and then cuts that node off from the others (unless
# FENCELINE_FAULTS_PAUSE_HOLDER=0); right after each of these faults
# (during the last two) every
# agent's lease is revoked and its claim granted to a new agent at once,
# the revoked agent left writing. At the end: no two overlapping grants
# valid at once, no write landed more than 1 s after its lease's revoke (or
# the next grant of its claim), fences unique and rising, every
# acknowledged grant, release, revoke, refusal and the end of every
# abandoned lease in the audit exactly once, the audit's replay and chain
# sound.
#
# Prints per round the faults and what was revoked (how long after the
# fault) and granted, the incidents (a revoke try that hung 8 s and was
# tried again, an agent that could not start during a fault), then the
# counts: acknowledged operations of the load, revokes right after faults,
# grants, revokes, faults, incidents, writes per boundary, the latest write after its
# revoke per boundary (negative: all landed before it returned), audit
# events by type, and every violation.
#
#   scripts/faults-cluster.sh [-r ROUNDS] [-n RUNS] [-s SEED]
#
#   -r  fault rounds per run (default 5; env FENCELINE_FAULTS_CLUSTER_ROUNDS)
#   -n  runs, each on a fresh cluster (default 1)
#   -s  seed of the load's choices (default: a new one per run)
#
# Every process listens on 127.0.0.1 and is killed by the test when it ends.
# The CI form is the same test with 1 round:
#   go test -tags integration -run TestClusterAuditThroughFaults ./test/faults
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
(cd "$root" && go build -o "$work/fenceline" ./cmd/fenceline && go test -tags integration -c -o "$work/faults.test" ./test/faults)

# Each run may take about a minute to start plus up to two minutes a round.
timeout=$(( 180 + 150 * rounds ))s
pass=0 fail=0
for run in $(seq 1 "$runs"); do
  log=$work/run-$run.log
  echo "== cluster: run $run of $runs, $rounds rounds"
  if (cd "$root/test/faults" && FENCELINE_FAULTS_BIN="$work/fenceline" FENCELINE_FAULTS_CLUSTER_ROUNDS="$rounds" \
      FENCELINE_FAULTS_PAUSE_HOLDER="${FENCELINE_FAULTS_PAUSE_HOLDER-1}" \
      FENCELINE_FAULTS_SEED="$seed" "$work/faults.test" -test.run '^TestClusterAuditThroughFaults$' -test.v \
      -test.count=1 -test.timeout "$timeout") >"$log" 2>&1; then
    status=ok
    pass=$((pass + 1))
  else
    status=FAIL
    fail=$((fail + 1))
    cp "$log" "$root/faults-cluster-run-$run.log"
  fi
  # The faults and the revokes after them, the load's counts, the chains.
  grep -E 'seed|ready after|round [0-9]+|incident:|of load under faults|chain of' "$log" | sed 's/^ *[a-z_]*_test.go:[0-9]*: /  /' || true
  echo "== counts ($status)"
  awk '/faults: grants=/ {p = 1; sub(/^.*faults: /, ""); gsub(/ /, "\n    "); print "  " $0; next}
       p && /^          / {sub(/^ +/, ""); print "    violation: " $0; next}
       {p = 0}' "$log"
  if [ "$status" = FAIL ]; then
    echo "  FAILED: full log in faults-cluster-run-$run.log"
    grep -E -- '--- FAIL|^\s+[a-z_]+_test.go:[0-9]+: (no-|fences|audit|want|read)|panic' "$log" | head -40 || true
  fi
done
echo "cluster fault runs: $pass passed, $fail failed ($rounds rounds each)"
[ "$fail" -eq 0 ]
