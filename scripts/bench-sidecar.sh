#!/usr/bin/env bash
# Sidecar footprint: the real fenceline binary as a child process with a
# Postgres fence in front of a real Postgres (internal/pgtest: the machine's
# initdb/postgres, or FENCELINE_TEST_PG): start to ready (/readyz 200),
# resident memory idle, and with 100 concurrent proxied Postgres connections.
#
#   scripts/bench-sidecar.sh [-n RUNS] [-conns N] [-v]
# Floors (issue 7): idle <= 40 MB, 100 connections <= 120 MB, ready <= 300 ms.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
echo "== building"
go build -o "$bin/fenceline" ./cmd/fenceline
go build -o "$bin/sidecarbench" ./test/sidecarbench
echo "== sidecar: start to ready, resident memory (VmRSS/VmHWM from /proc)"
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -n) args+=(-runs "$2"); shift 2 ;;
    -conns) args+=(-conns "$2"); shift 2 ;;
    -v) args+=(-v); shift ;;
    *) echo "usage: $0 [-n RUNS] [-conns N] [-v]" >&2; exit 2 ;;
  esac
done
"$bin/sidecarbench" -fenceline "$bin/fenceline" "${args[@]}"
