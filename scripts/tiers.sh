#!/usr/bin/env bash
# The test suite's two tiers (docs/tests.md): the fast tier is the default
# build (go test -race ./...), the integration tier the tests in files with
# //go:build integration.
#
#   scripts/tiers.sh list [TAGS]     every test, fuzz target, benchmark and
#                                    example as "package name", built with TAGS
#   scripts/tiers.sh integration     those only the integration build has
#   scripts/tiers.sh check [REF]     the two tiers together hold every test REF
#                                    held (default: where this branch left main)
#
# Names are read from the test files go list selects for the build, so no
# test binary is compiled.
set -euo pipefail
cd "$(dirname "$0")/.."

list() { # list DIR [TAGS]
  (cd "$1" && go list ${2:+-tags "$2"} -f '{{$d := .Dir}}{{$p := .ImportPath}}{{range .TestGoFiles}}{{$p}} {{$d}}/{{.}}
{{end}}{{range .XTestGoFiles}}{{$p}} {{$d}}/{{.}}
{{end}}' ./...) |
    while read -r pkg file; do
      [ -n "$pkg" ] || continue
      sed -nE 's/^func ((Test|Fuzz|Benchmark|Example)[A-Za-z0-9_]*)\(.*/\1/p' "$file" |
        { grep -vx TestMain || true; } | while read -r name; do echo "${pkg#github.com/fenceline/fenceline} $name"; done
    done | sed 's|^ |.|; s|^/|./|' | sort -u
}

case "${1:-}" in
list) list . "${2:-}" ;;
integration) comm -13 <(list .) <(list . integration) ;;
check)
  ref=${2:-$(git merge-base main HEAD)}
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  git archive "$ref" | tar -x -C "$tmp"
  list "$tmp" >"$tmp/ref.list"
  list . >"$tmp/fast.list"
  list . integration >"$tmp/all.list"
  comm -13 "$tmp/fast.list" "$tmp/all.list" >"$tmp/integration.list"
  echo "$ref: $(wc -l <"$tmp/ref.list") tests, fuzz targets and benchmarks; fast tier $(wc -l <"$tmp/fast.list"), integration tier $(wc -l <"$tmp/integration.list"), together $(wc -l <"$tmp/all.list")"
  # Every name in the integration build but not the fast one lives only
  # behind the tag; the union of the tiers is the integration build.
  lost=$(comm -23 "$tmp/ref.list" "$tmp/all.list")
  if [ -n "$lost" ]; then echo "in $ref but in neither tier:"; echo "$lost"; exit 1; fi
  added=$(comm -13 "$tmp/ref.list" "$tmp/all.list")
  [ -z "$added" ] || { echo "new since $ref:"; echo "$added"; }
  ;;
*) sed -n '2,13p' "$0" >&2; exit 2 ;;
esac
