#!/usr/bin/env bash
# Shard hand-out benchmark, side by side in one run on the same
# repository: a warm shard (existing and clean: lease acquire in the pool,
# pool record read, readiness check, attempt record) vs a fresh
# `git worktree add`. Prints both, the ratio, and fails unless warm is at
# most 1/5 of fresh.
#
#   scripts/bench-shards.sh [-n RUNS] [-files N]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=10 files=10000
while [ $# -gt 0 ]; do
  case "$1" in
    -n) runs=$2; shift 2 ;;
    -files) files=$2; shift 2 ;;
    *) echo "usage: $0 [-n RUNS] [-files N]" >&2; exit 2 ;;
  esac
done
echo "== shard hand-out, ${files}-file repository, ${runs} runs each (git $(git --version | cut -d' ' -f3))"
out=$(go test -run XXX -bench BenchmarkShardHandOut -benchtime "${runs}x" ./test/shardbench -args -files "$files")
echo "$out" | grep -E '^Benchmark'
warm=$(echo "$out" | awk '/ShardHandOut\/warm/ {print $3}')
fresh=$(echo "$out" | awk '/ShardHandOut\/fresh/ {print $3}')
awk -v w="$warm" -v f="$fresh" 'BEGIN {
  printf "warm shard:          %8.2f ms\n", w / 1e6
  printf "fresh worktree add:  %8.2f ms\n", f / 1e6
  printf "ratio fresh/warm:    %8.1fx (floor: 5x)\n", f / w
  if (w * 5 > f) { print "FAIL: a warm shard must take at most 1/5 of a fresh worktree add"; exit 1 }
}'
