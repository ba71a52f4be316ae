#!/usr/bin/env bash
# Runs the real agent CLIs (Codex CLI and Claude Code, pinned in
# test/agents/package.json) through issue 21's story against the scripted
# model in test/agents: under "fenceline run" (both), in a pod ("fenceline
# sidecar" + "fenceline agent" wrapping codex exec), and once with
# fenceline's file guard off, which must fail; then each CLI plants code in
# its own state (a SessionStart hook, a notify command) under the README's
# recipe (--private-state: it never reaches the user's next plain run) and
# under the old one (--allow-write ~/.claude: it does), and Claude Code
# plants a hook in its claim's .claude/settings.local.json, which run names
# for review at settle. Prints one line per
# step and agent:
#
#   PASS codex  run       1 in-claim edit lands
#   ...
#
#   scripts/agents-e2e.sh [-run REGEXP]
#
# Installs the CLIs with "npm ci" when test/agents/node_modules lacks them
# (node and npm must be on PATH; .ci/run installs them from Debian). The
# agents run as the user nobody, so run this as root. Each run is bounded
# (4 minutes per agent; the whole go test 15 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."

run='TestCodexUnderRun|TestClaudeUnderRun|TestCodexInPod|TestGuardOffFails|TestClaudeStateStaysPrivate|TestCodexStateStaysPrivate|TestClaudeStateAttackAllowWrite|TestCodexStateAttackAllowWrite|TestClaudeProjectHookNamed'
if [ "${1:-}" = "-run" ] && [ -n "${2:-}" ]; then run=$2; fi

if [ ! -x test/agents/node_modules/.bin/codex ] || [ ! -x test/agents/node_modules/.bin/claude ]; then
  echo "== npm ci (test/agents)"
  (cd test/agents && npm ci --no-audit --no-fund >/dev/null)
fi
echo "== $(test/agents/node_modules/.bin/codex --version 2>/dev/null), claude $(test/agents/node_modules/.bin/claude --version 2>/dev/null)"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
go test -tags integration -count=1 -v -timeout 15m -run "^($run)\$" ./test/agents >"$log" 2>&1 || status=$?
grep -a '^AGENT-E2E ' "$log" | sed 's/^AGENT-E2E //' || true
grep -a -E '^(--- (PASS|FAIL|SKIP)|.*SKIPPING REAL-AGENT TEST)' "$log" || true
if [ "$status" -ne 0 ]; then
  echo "== go test failed ($status); its output:"
  tail -n 200 "$log"
  exit "$status"
fi
echo "== ok (the guard-off run's FAIL lines are expected: they prove the guard held the others)"
