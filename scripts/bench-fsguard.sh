#!/usr/bin/env bash
# Runs fsguard's benchmarks: each workload guarded (Landlock + seccomp
# supervisor, real kernel) and unguarded side by side in one run, and prints
# the wall-time ratios (floor: <= 1.3) and the cost of one write-open.
#
#   scripts/bench-fsguard.sh [-n ROUNDS] [-d DIR]
#
# -d puts the working trees on another file system (e.g. /dev/shm to see
# the guard's CPU cost without disk noise); the default is the system temp
# dir. Every workload is bounded (20,000 files, 20,000 opens, a 5,000-file
# checkout) and runs ROUNDS times (default 5).
set -euo pipefail

rounds=5
dir=
while getopts "n:d:" opt; do
  case $opt in
    n) rounds=$OPTARG ;;
    d) dir=$OPTARG ;;
    *) echo "usage: $0 [-n ROUNDS] [-d DIR]" >&2; exit 2 ;;
  esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Build first, so no compile runs beside a measurement.
(cd "$root" && go test -c -o "$work/fsguard.test" ./fsguard)

echo "== fsguard side by side, $rounds rounds, kernel $(uname -r), trees in ${dir:-system temp dir}"
(cd "$root/fsguard" && FSGUARD_BENCH_DIR=$dir "$work/fsguard.test" -test.run '^$' \
  -test.bench 'Benchmark(CreateFiles|WriteOpen|GitCheckout)$' -test.benchtime "${rounds}x") | tee "$work/out.txt"

echo
echo "== summary"
awk '
  /^Benchmark/ {
    name = $1; sub(/-[0-9]+$/, "", name); sub(/^Benchmark/, "", name)
    for (i = 2; i < NF; i++) m[$(i+1)] = $i
    verdict = (name == "WriteOpen") ? "(micro-benchmark: only write-opens, no floor)" : (m["ratio"] <= 1.3 ? "(<= 1.3 ok)" : "(ABOVE 1.3)")
    printf "%-12s guarded %8.3f s  unguarded %8.3f s  ratio %5.2f %s\n", name, m["guarded-s"], m["unguarded-s"], m["ratio"], verdict
    if ("overhead-µs/open" in m) printf "%-12s per write-open: %.2f µs guarded, %.2f µs unguarded, overhead %.2f µs\n", "", m["guarded-µs/open"], m["plain-µs/open"], m["overhead-µs/open"]
    if ("overhead-µs/file" in m) printf "%-12s overhead per created file: %.2f µs\n", "", m["overhead-µs/file"]
    delete m
  }' "$work/out.txt"
