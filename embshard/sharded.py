"""ShardedEmbeddingBagCollection: embedding-bag tables sharded over ranks by a ShardingPlan.

forward(kjt) for the rank's local batch:
  0. counts       (all schemes) gather_batch_counts: every rank's ids per feature (and bad-id count), one
                                all-gather and the step's one host sync; ids (per scheme) laid out with them
  1. input dist   (per scheme)  start_input_dist -> handle; handle.wait() -> ids for this rank's shards
  2. lookup       (per scheme)  TBE kernels pool the rows for the global batch
  3. output dist  (per scheme)  start_output_dist -> handle; handle.wait() -> [B_local, width] blocks (views)
  4. mean pooling               divide mean-pooled features by their bag lengths
  5. regroup                    permute_multi_embedding of the blocks -> one dense tensor per output group
Backward runs the exchanges in reverse and the TBE applies the fused optimizer to the touched rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext as _nullcontext

import torch
import torch.distributed as dist
from torch import nn

from embshard.bounds import check_ids, count_bad_ids
from embshard.comm import world_and_rank
from embshard.optim import FusedOptimizerConfig
from embshard.plan import ShardingPlan
from embshard.regroup import Regroup
from embshard.sharding import build_schemes
from embshard.sharding.exchange import IdsOutOfRange, cached_tensor, exchange_counts, gather_batch_counts
from embshard.tables import ConfigError, Pooling, TableConfig, feature_order, validate_tables
from embshard.tiers import BoundsCheck, LookupOptions, PrefetchHandle, format_cache_stats


class ShardedEmbeddingBagCollection(nn.Module):
    """Embedding-bag tables sharded by `plan`, trained with a fused sparse optimizer.

    Args:
        tables: the tables (each names the features that look it up).
        plan: where each shard lives; `plan.world_size` must equal the process group's size.
        optimizer: the fused sparse optimizer applied in backward.
        output_groups: {group name: [feature, ...]} (features may repeat across groups); forward then returns
            {group name: tensor}. Without it forward returns a torchrec KeyedTensor of all features.
        device: compute device (default: cuda:current if available, else cpu).
        group: process group (default: the world).
        seed: initial weights are a deterministic function of (seed, table index), whatever the sharding;
            None draws them on the device (fast for huge tables, but not reproducible across shardings).
        options: lookup numerics and runtime options (tiers.LookupOptions): output dtype, fp16 rounding,
            out-of-range ids (error or drop), UVM-cache prefetch and statistics.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        plan: ShardingPlan,
        optimizer: FusedOptimizerConfig | None = None,
        output_groups: Mapping[str, Sequence[str]] | None = None,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        seed: int | None = 0,
        options: LookupOptions | None = None,
    ) -> None:
        super().__init__()
        validate_tables(tables)
        plan.check(tables)
        world_size, rank = world_and_rank(group)
        if plan.world_size != world_size:
            raise ConfigError(
                f"the plan is for world_size={plan.world_size} but the process group has {world_size} ranks: "
                "plan again for this world size"
            )
        self.device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" means the current device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tables = list(tables)
        self.plan = plan
        self.rank, self.world_size, self.group = rank, world_size, group
        self.optimizer = optimizer or FusedOptimizerConfig()
        self.options = options or LookupOptions()
        self._dropped: dict[str, int] = {}
        self.features = feature_order(tables)
        self._table_of = {f: t for t in tables for f in t.feature_names}
        self._feature_dims = [self._table_of[f].embedding_dim for f in self.features]
        self.schemes = nn.ModuleList(
            build_schemes(self.tables, plan, rank, self.optimizer, self.device, group, seed, self.options)
        )
        # Each feature's output columns may be split over several keys (column-wise): keys in column order.
        feature_keys: dict[str, list[tuple[int, str]]] = {f: [] for f in self.features}
        for scheme in self.schemes:
            for key in scheme.keys:
                feature, _, col = key.partition("#c")
                feature_keys[feature].append((int(col or 0), key))
        self._feature_keys = {f: [k for _, k in sorted(v)] for f, v in feature_keys.items()}
        self.groups = dict(output_groups) if output_groups is not None else None
        regroup_spec = self.groups if self.groups is not None else {"all": self.features}
        for name, members in regroup_spec.items():
            unknown = [f for f in members if f not in self._feature_keys]
            if unknown:
                raise ConfigError(
                    f"output group {name!r} names features {unknown} that no table lists; known features: "
                    f"{self.features}"
                )
        # The output dists' blocks, in order: each scheme's `out_keys` (routed schemes: one block per serving rank).
        self._block_keys = [keys for s in self.schemes for keys in s.out_keys]
        self.regroup = Regroup(
            self._block_keys,
            [dims for s in self.schemes for dims in s.out_dims],
            {n: [k for f in members for k in self._feature_keys[f]] for n, members in regroup_spec.items()},
        )
        # Mean pooling: per output block, which input feature each column belongs to (None if all sums).
        self._mean_features = [f for f in self.features if self._table_of[f].pooling is Pooling.MEAN]
        self._col_feature: list[torch.Tensor | None] = []
        for keys, dims in zip(self._block_keys, [d for s in self.schemes for d in s.out_dims]):
            cols: list[int] = []
            for key, d in zip(keys, dims):
                cols += [self.features.index(key.partition("#c")[0])] * d
            self._col_feature.append(
                torch.tensor(cols, dtype=torch.int64, device=self.device) if self._mean_features else None
            )
        self._mean_mask = torch.tensor(
            [self._table_of[f].pooling is Pooling.MEAN for f in self.features], dtype=torch.bool, device=self.device
        )
        self._kjt_layout: tuple | None = None

    # ---- input handling ----------------------------------------------------------------------------------
    def _local_input(self, kjt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, int]]:
        keys = tuple(kjt.keys())
        if self._kjt_layout is None or self._kjt_layout[0] != keys:
            missing = [f for f in self.features if f not in keys]
            extra = [k for k in keys if k not in self._table_of]
            if missing or extra:
                raise ConfigError(
                    f"KeyedJaggedTensor keys do not match the tables' features: missing {missing}, not looked up "
                    f"by any table {extra}; pass exactly the features {self.features} (any order)"
                )
            self._kjt_layout = (keys, {k: i for i, k in enumerate(keys)})
        if kjt.variable_stride_per_key():
            raise ConfigError("variable batch size per feature is not supported: give every feature the same batch")
        B = kjt.stride()
        lengths_FB = kjt.lengths().view(len(keys), B)
        values = kjt.values()
        weights = kjt.weights_or_none()
        if values.device != self.device:
            raise ConfigError(f"input is on {values.device} but the module computes on {self.device}: move it")
        return lengths_FB, values, weights, self._kjt_layout[1]

    def _check_ids(
        self, lengths_FB: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Every id must be a row of its feature's table: raise naming the feature, table and value, or drop the
        bad ids (LookupOptions.bounds_check; see bounds.py)."""
        return check_ids(
            lengths_FB, values, weights, self._kjt_layout[0], self._table_of, self.options.bounds_check, self._dropped
        )

    def _canonical_rows(self, index: dict[str, int], device: torch.device) -> torch.Tensor:
        """The rows of the batch's `[F, B]` lengths (KJT key order, `index`) that give the canonical order."""
        return cached_tensor([index[f] for f in self.features], device)

    def _input_dist(self, lengths_FB, values, weights, index, check: bool) -> tuple[list, torch.Tensor]:
        """One all-gather of every rank's batch size, ids per feature and out-of-range id count, read with the
        step's one host sync (`gather_batch_counts`); then every scheme lays out its ids with known sizes and starts
        its exchange (row-wise schemes first swap their bucketed counts: `exchange_counts`). Returns the inputs and
        the lengths actually sent (drop mode removes ids). In error mode every rank stops together if any rank has
        bad ids, and the ranks that have them raise the error naming feature, table and value."""
        drop = check and self.options.bounds_check is BoundsCheck.DROP
        if drop:
            lengths_FB, values, weights = self._check_ids(lengths_FB, values, weights)
        bad = count_bad_ids(lengths_FB, values, self._kjt_layout[0], self._table_of) if check and not drop else None
        ids_F = lengths_FB.sum(1, dtype=torch.int64).index_select(0, self._canonical_rows(index, lengths_FB.device))
        counts = gather_batch_counts(ids_F, lengths_FB.shape[1], bad, self.group)
        if counts.bad_ranks:
            if self.rank in counts.bad_ranks:
                self._check_ids(lengths_FB, values, weights)  # raises, naming feature, table and value
            raise IdsOutOfRange(counts.bad_ranks)
        parts = [s.local_ids(lengths_FB, values, weights, index, counts) for s in self.schemes]
        pending = [p for p in parts if p.sent is None]
        if pending:
            exchange_counts(pending, self.group, self.world_size)
        handles = [s.start_input_dist(p, counts.batch_sizes) for s, p in zip(self.schemes, parts)]
        return [h.wait() for h in handles], lengths_FB

    def dropped_ids(self) -> dict[str, int]:
        """Out-of-range ids dropped so far from this rank's batches, per feature (bounds_check='drop')."""
        return dict(self._dropped)

    # ---- forward -----------------------------------------------------------------------------------------
    def forward(self, kjt, check_ids: bool = True, prefetched: PrefetchHandle | None = None):
        """Pooled embeddings for the local batch: {group: tensor} if output_groups was given, else a KeyedTensor.

        `prefetched`: the handle `prefetch(kjt)` returned for this same kjt; its ids are used as they are (the
        input exchange and the id check already ran)."""
        if prefetched is not None:
            inputs, lengths_FB, index = self._consume(prefetched, kjt)
        else:
            lengths_FB, values, weights, index = self._local_input(kjt)
            inputs, lengths_FB = self._input_dist(lengths_FB, values, weights, index, check_ids)
        pooled = [s.lookup(inp) for s, inp in zip(self.schemes, inputs)]
        out_handles = [s.start_output_dist(p, inp.batch_sizes) for s, p, inp in zip(self.schemes, pooled, inputs)]
        blocks = [b for h in out_handles for b in h.wait()]
        if self._mean_features:
            blocks = self._apply_mean(blocks, lengths_FB, index)
        out = self.regroup(blocks)
        if self.groups is not None:
            return out
        from torchrec.sparse.jagged_tensor import KeyedTensor

        return KeyedTensor(keys=self.features, length_per_key=self._feature_dims, values=out["all"], key_dim=1)

    # ---- UVM-caching: prefetch and statistics -------------------------------------------------------------
    def prefetch(self, kjt, stream: torch.cuda.Stream | None = None) -> PrefetchHandle:
        """Send the NEXT batch's ids to the ranks that look them up and load its rows into the UVM caches, while
        the current batch may still be waiting for its backward. Collective (every rank calls it, same order).
        Needs LookupOptions(prefetch_pipeline=True). Pass the handle to the next forward: `ebc(kjt, prefetched=h)`.

        `stream`: a CUDA stream to run on (the caller's stream waits for it at that forward); None: the current
        stream. Tiers without a cache only get the input exchange done early.
        """
        if not self.options.prefetch_pipeline:
            raise ConfigError(
                "prefetch() needs the caches built for it (rows in use locked until their backward): construct the "
                "module with options=LookupOptions(prefetch_pipeline=True)"
            )
        if stream is not None and self.device.type != "cuda":
            raise ConfigError(f"prefetch(stream=...) needs a CUDA module; this one computes on {self.device}")
        main = torch.cuda.current_stream(self.device) if stream is not None else None
        if stream is not None:
            stream.wait_stream(main)  # the batch's tensors were made on the caller's stream
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            lengths_FB, values, weights, index = self._local_input(kjt)
            inputs, lengths_FB = self._input_dist(lengths_FB, values, weights, index, check=True)
            for scheme, inp in zip(self.schemes, inputs):
                if hasattr(scheme, "prefetch"):
                    scheme.prefetch(inp, main)
        return PrefetchHandle(kjt, lengths_FB, index, inputs, stream)

    def _consume(self, handle: PrefetchHandle, kjt) -> tuple[list, torch.Tensor, dict[str, int]]:
        if handle.kjt is not kjt or handle.used:
            raise ValueError(
                "forward(kjt, prefetched=handle): the handle was made by prefetch() for another batch or was already "
                "used; pass the kjt that was prefetched, once"
            )
        handle.used = True
        if handle.stream is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(handle.stream)
            tensors = [handle.lengths_FB]
            for inp in handle.inputs:
                tensors += [inp.lengths, inp.values] + ([inp.weights] if inp.weights is not None else [])
                tensors += [t for part in inp.parts or [] for t in part if t is not None]
            for t in tensors:
                t.record_stream(main)  # made on the prefetch stream, used on this one
        return handle.inputs, handle.lengths_FB, handle.feature_index

    def cache_stats(self, gather: bool = False) -> dict[str, dict]:
        """UVM-cache statistics per table since the last reset_cache_stats(), for the UVM-caching tables of this
        rank (or, with gather=True, of every rank: collective). Needs LookupOptions(cache_stats=True); {} for
        tables in other tiers. Per table: requested (ids looked up), unique_misses (rows fetched from UVM),
        hit_rate (1 - unique_misses / requested), cached_rows, rows, and for the TBE whose cache the table shares:
        cache_group (its tables), group_cache_slots, group_evictions (LRU only, else None).
        Training loops log it every N steps: `log(format_cache_stats(ebc.cache_stats())); ebc.reset_cache_stats()`.
        """
        stats: dict[str, dict] = {}
        for scheme in self.schemes:
            for lookup in scheme.lookups:
                stats.update(lookup.cache_stats())
        if gather and self.world_size > 1:
            everyone: list = [None] * self.world_size
            dist.all_gather_object(everyone, stats, group=self.group)
            stats = {k: v for rank_stats in everyone for k, v in rank_stats.items()}
        return stats

    def reset_cache_stats(self) -> None:
        """Zero the UVM-cache statistics of this rank's tables."""
        for scheme in self.schemes:
            for lookup in scheme.lookups:
                lookup.reset_cache_stats()

    def format_cache_stats(self, gather: bool = False) -> str:
        """cache_stats() as one log line per table."""
        return format_cache_stats(self.cache_stats(gather))

    def _apply_mean(
        self, blocks: list[torch.Tensor], lengths_FB: torch.Tensor, index: dict[str, int]
    ) -> list[torch.Tensor]:
        lengths_BF = (
            lengths_FB.index_select(0, self._canonical_rows(index, lengths_FB.device)).t().to(torch.float32)
        )  # canonical feature order
        mask = self._mean_mask
        scale_BF = torch.where(mask, 1.0 / lengths_BF.clamp(min=1.0), torch.ones_like(lengths_BF))
        scale_BF = scale_BF.to(blocks[0].dtype) if blocks else scale_BF
        out = []
        for x, cols in zip(blocks, self._col_feature):
            out.append(x * scale_BF.index_select(1, cols) if x.shape[1] else x)
        return out

    # ---- state -------------------------------------------------------------------------------------------
    def local_shards(self) -> list[tuple[str, object, torch.Tensor]]:
        """(table name, Shard, weights) for every shard on this rank."""
        out = []
        for scheme in self.schemes:
            for lookup in scheme.lookups:
                for s, w in zip(lookup.shards, lookup.shard_weights()):
                    out.append((s.table.name, s.shard, w))
        return out

    def local_optimizer_states(self) -> list[tuple[str, object, dict[str, torch.Tensor]]]:
        """(table name, Shard, {state name: tensor}) for every shard on this rank, in `local_shards()` order. Names
        and shapes as `optim.optimizer_state`: adagrad `m` `[rows, cols]`, rowwise_adagrad `m` `[rows]` (for a
        column-wise shard: the state of its column block), adam `m` and `v` `[rows, cols]`, sgd none."""
        out = []
        for scheme in self.schemes:
            for lookup in scheme.lookups:
                for s, st in zip(lookup.shards, lookup.shard_optimizer_states()):
                    out.append((s.table.name, s.shard, st))
        return out

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every table's full weights, assembled on every rank (collective; for tests, checkpoints, export).
        Replicated tables are taken from their first replica."""
        world, _ = self.world_size, self.rank
        out = {t.name: torch.zeros(t.num_embeddings, t.embedding_dim) for t in self.tables}
        local = self.local_shards()
        gathered: list = [None] * world
        payload = [(name, s, w.detach().float().cpu()) for name, s, w in local]
        if world > 1:
            dist.all_gather_object(gathered, payload, group=self.group)
        else:
            gathered = [payload]
        done: set = set()
        for rank_items in gathered:
            for name, s, w in rank_items:
                key = (name, s.row_offset, s.col_offset)
                if key in done:
                    continue
                done.add(key)
                out[name][s.row_offset : s.row_offset + s.num_rows, s.col_offset : s.col_offset + s.num_cols] = w
        return out
