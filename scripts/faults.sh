#!/usr/bin/env bash
# Runs the long form of the single-bus half of the fault harness
# (test/faults, TestSingleBusKillRestartRevoke): each round the bus
# (`fenceline bus serve`) is killed with -9 and restarted on the same port
# and store, every agent's lease is revoked right after, and the claims are
# granted to new agents at once, while the revoked agents go on writing.
# The agents: file and Postgres writes of a `fenceline run` agent and of a
# `fenceline agent` beside `fenceline sidecar`, and git pushes through a
# run's git fence. Every landed write, every acknowledged grant, revoke and
# release, and the audit stream are recorded and checked: no overlapping
# grants, no write landed more than 1 s after its lease's revoke (or the
# next grant of its claim), fences unique and rising, the audit complete
# (each acknowledged operation exactly once).
#
# Prints per round what was revoked (how long after the restart) and
# granted, and incidents (a revoke try that hung, an agent that could not
# start), then the counts: grants, revokes, faults, incidents, writes per
# boundary, the latest write after its revoke per boundary (negative: all
# landed before it returned), audit events by type, and every violation.
#
#   scripts/faults.sh [-n ROUNDS] [-r RUNS]
#
# ROUNDS (default $FENCELINE_FAULTS_ROUNDS or 20) faults per run; RUNS
# (default 1) runs one after another. Exits non-zero if any run failed. The
# CI form is the same test with 2 rounds:
#   go test -tags integration -run TestSingleBusKillRestartRevoke ./test/faults
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
case $rounds$runs in *[!0-9]*) echo "-n and -r take whole numbers" >&2; exit 2 ;; esac

root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Build first, so no compile runs beside a fault.
(cd "$root" && go test -tags integration -c -o "$work/faults.test" ./test/faults)

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
  grep -E 'round [0-9]+, right after|incident:' "$work/out.txt" | sed 's/^ *[a-z_]*_test.go:[0-9]*: /  /' || true
  echo "== counts ($status)"
  # The report line, and the violations indented under it.
  awk '/faults: grants=/ {p = 1; sub(/^.*faults: /, ""); gsub(/ /, "\n    "); print "  " $0; next}
       p && /^          / {sub(/^ +/, ""); print "    violation: " $0; next}
       {p = 0}' "$work/out.txt"
  if [ "$status" = FAIL ]; then
    cp "$work/out.txt" "$root/faults-run-$run.log"
    echo "  full log in faults-run-$run.log"
    grep -E -- '--- FAIL|^\s+[a-z_]+_test.go:[0-9]+: (no-|fences|audit|want)|panic' "$work/out.txt" | head -40 || true
  fi
done
exit $failed
