#!/usr/bin/env bash
# Git fence benchmarks, side by side in one run against the same git
# http-backend: a large history pushed directly and through a fenceline
# sidecar process (alternating), the sidecar's peak RSS during a 200 MB
# push, and the in-process go benchmark of small pushes.
#
#   scripts/bench-git.sh [-n RUNS] [-files N] [-big-mb MB]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=5 files=5000 big=200
while [ $# -gt 0 ]; do
  case "$1" in
    -n) runs=$2; shift 2 ;;
    -files) files=$2; shift 2 ;;
    -big-mb) big=$2; shift 2 ;;
    *) echo "usage: $0 [-n RUNS] [-files N] [-big-mb MB]" >&2; exit 2 ;;
  esac
done
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
echo "== building"
go build -o "$bin/fenceline" ./cmd/fenceline
go build -o "$bin/gitbench" ./test/gitbench
echo "== large push: direct vs through the sidecar (git $(git --version | cut -d' ' -f3))"
"$bin/gitbench" -fenceline "$bin/fenceline" -runs "$runs" -files "$files" -big-mb "$big"
echo
echo "== go test -bench (100 files changed per push, 2,000-file tree)"
go test -run XXX -bench BenchmarkPush -benchtime 30x ./gitproxy | grep -E '^Benchmark'
