#!/usr/bin/env bash
# Runs the fault harness's long form: the single-bus fault run (kill -9 and
# restart of the bus, a revoke right after each restart, new agents granted
# the same claims at once; file and Postgres writes of a `fenceline run`
# agent and of a `fenceline agent` beside `fenceline sidecar`, and git
# pushes through a run's git fence, recorded and checked) for many rounds, and prints the counts: grants, revokes, faults,
# writes per boundary, the latest write after its revoke per boundary, and
# every violation.
#
#   scripts/faults.sh [-n ROUNDS] [-r RUNS]
#
# ROUNDS (default $FENCELINE_FAULTS_ROUNDS or 20) faults per run; RUNS
# (default 1) runs one after another. Exits non-zero if any run found a
# violation. The CI form is the same test with 2 rounds:
#   go test -run TestSingleBusKillRestartRevoke ./test/faults
set -euo pipefail

rounds=${FENCELINE_FAULTS_ROUNDS:-20}
runs=1
while getopts "n:r:" opt; do
  case $opt in
    n) rounds=$OPTARG ;;
    r) runs=$OPTARG ;;
    *) echo "usage: $0 [-n ROUNDS] [-r RUNS]" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Build first, so no compile runs beside a fault.
(cd "$root" && go test -c -o "$work/faults.test" ./test/faults)

timeout=$((rounds * 40 + 180))s
failed=0
for run in $(seq 1 "$runs"); do
  echo "== single bus: run $run of $runs, $rounds rounds (kill -9, restart, revoke)"
  if (cd "$root/test/faults" && FENCELINE_FAULTS_ROUNDS=$rounds "$work/faults.test" \
      -test.run '^TestSingleBusKillRestartRevoke$' -test.v -test.count=1 -test.timeout "$timeout") >"$work/out.txt" 2>&1; then
    status=ok
  else
    status=FAIL
    failed=1
  fi
  grep -E 'round [0-9]+ [a-z]+:' "$work/out.txt" | sed 's/^ *single_test.go:[0-9]*: /  /' || true
  echo "== counts ($status)"
  # The report line, and the violations indented under it.
  awk '/faults: grants=/ {p = 1; sub(/^.*faults: /, ""); print "  " $0; next}
       p && /^          / {sub(/^ +/, ""); print "    " $0; next}
       {p = 0}' "$work/out.txt"
  if [ "$status" = FAIL ]; then
    grep -E -- '--- FAIL|^\s+single_test.go|panic' "$work/out.txt" | head -40 || true
  fi
done
exit $failed
