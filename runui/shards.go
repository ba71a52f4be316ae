package runui

import (
	"context"
	"errors"
	"fmt"

	"github.com/fenceline/fenceline/shard"
)

// ShardsView is the shard part of the UI: the pools with their shards, and
// the latest attempts of each pool's repo.
type ShardsView struct {
	Pools    []*shard.Pool    `json:"pools"`
	Attempts []*shard.Attempt `json:"attempts"`
}

// maxAttempts bounds the attempts shown per repo (the latest ones).
const maxAttempts = 200

// StoreSource lists shards and attempts from a shard store.
func StoreSource(st *shard.Store) ShardSource {
	return func(ctx context.Context, repo string) (any, error) {
		var pools []*shard.Pool
		if repo != "" {
			p, err := st.Pool(ctx, repo)
			switch {
			case errors.Is(err, shard.ErrNoPool):
			case err != nil:
				return nil, err
			default:
				pools = []*shard.Pool{p}
			}
		} else {
			var err error
			if pools, err = st.Pools(ctx); err != nil {
				return nil, err
			}
		}
		v := &ShardsView{Pools: pools, Attempts: []*shard.Attempt{}}
		if v.Pools == nil {
			v.Pools = []*shard.Pool{}
		}
		for _, p := range pools {
			as, err := st.Attempts(ctx, p.Repo)
			if err != nil && !errors.Is(err, shard.ErrNoPool) {
				return nil, fmt.Errorf("attempts of %s: %w", p.Repo, err)
			}
			if len(as) > maxAttempts {
				as = as[len(as)-maxAttempts:]
			}
			v.Attempts = append(v.Attempts, as...)
		}
		return v, nil
	}
}
