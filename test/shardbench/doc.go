// Package shardbench measures handing out a shard of a worktree pool: a
// warm shard (existing and clean: lease acquire in the pool, pool record
// read, readiness check, attempt record) against a fresh "git worktree
// add" of the same repository, side by side, on a repository of 10,000
// files or more (-files). Run it with scripts/bench-shards.sh, which
// prints the ratio and checks the floor: warm <= 1/5 of fresh.
package shardbench
