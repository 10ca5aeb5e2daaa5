"""ShardedEmbeddingBagCollection: embedding-bag tables sharded over ranks by a ShardingPlan.

forward(kjt) for the rank's local batch:
  0. counts       (all schemes) gather_batch_counts: every rank's ids per feature (and bad-id count), one
                                all-gather and the step's one host sync; ids (per scheme) laid out with them (a
                                pipeline passes counts gathered on the host instead: `host_counts`, no sync)
  1. input dist   (per scheme)  start_input_dist -> handle; handle.wait() -> ids for this rank's shards
  2. lookup       (per scheme)  TBE kernels pool the rows for the global batch
  3. output dist  (per scheme)  start_output_dist -> handle; handle.wait() -> [B_local, width] blocks (views)
  4. mean pooling               divide mean-pooled features by their bag lengths
  5. regroup                    permute_multi_embedding of the blocks -> one dense tensor per output group
Backward runs the exchanges in reverse and the TBE applies the fused optimizer to the touched rows.

For training pipelines (embshard/training/pipeline.py): `prefetch(kjt)` runs steps 0-1 of a coming batch early (and loads
its rows into UVM caches); `lookup_ahead(kjt)` runs the whole forward of a coming batch early. A later
`forward(kjt)` with the same kjt object picks either up. The state methods (`local_shards`, `full_weights`,
`optimizer_step`, ...) are in embshard/collection/shard_state.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from embshard.collection.bounds import check_ids, count_bad_ids
from embshard.collection.regroup import Regroup
from embshard.collection.regroup_kernel import KernelRegroup
from embshard.collection.shard_state import ShardState
from embshard.collection.step_state import StepState
from embshard.lookup.stats import format_cache_stats
from embshard.runtime import comm
from embshard.runtime.comm import world_and_rank
from embshard.runtime.ops import cached_tensor
from embshard.sharding import build_schemes
from embshard.sharding.base import ShardingContext, key_feature
from embshard.sharding.exchange import (
    BatchCounts,
    IdsOutOfRange,
    LocalBatch,
    LookupInput,
    counts_row,
    exchange_counts,
    gather_batch_counts,
)
from embshard.spec import tables as spec_tables
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import BoundsCheck, LookupOptions, UnusedFeatures
from embshard.spec.plan import ShardingPlan
from embshard.spec.raw_ids import check_raw_plan
from embshard.spec.tables import ConfigError, Pooling, TableConfig, feature_columns, feature_order, validate_tables


@dataclass(eq=False)
class PrefetchHandle:
    """A coming batch, already sent to the ranks that look it up and (UVM-caching, with
    LookupOptions.prefetch_pipeline) loaded into the caches. `ebc(kjt)` with the same kjt object uses it (or pass it
    explicitly: `ebc(kjt, prefetched=handle)`), once."""

    kjt: Any
    """The batch it was made for (checked by identity)."""
    lengths_FB: torch.Tensor
    """`[F, B]` bag lengths after the bounds check (mean pooling divides by these)."""
    feature_index: dict[str, int]
    """Feature -> row of lengths_FB."""
    inputs: list[LookupInput]
    """Each scheme's received ids."""
    stream: Any = None
    """The CUDA stream the prefetch ran on, or None (the current stream)."""
    used: bool = False
    """Set once forward consumed it."""


class ShardedEmbeddingBagCollection(StepState, ShardState, nn.Module):
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
        options: lookup numerics and runtime options (embshard.spec.options.LookupOptions): output dtype, fp16 rounding,
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
        spec_tables.check_pooling_kinds(tables, False, "ShardedEmbeddingBagCollection")
        plan.check(tables)
        check_raw_plan(tables, plan)
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
        ctx = ShardingContext(
            rank, world_size, self.device, group, self.optimizer, self.options, seed, feature_columns(self.tables)
        )
        self.schemes = nn.ModuleList(build_schemes(self.tables, plan, ctx))
        # Each feature's output columns may be split over several keys (column-wise): keys in column order.
        feature_keys: dict[str, list[tuple[int, str]]] = {f: [] for f in self.features}
        for scheme in self.schemes:
            for key in scheme.layout.keys:
                feature, col = key_feature(key)
                feature_keys[feature].append((col, key))
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
        self._block_keys = [keys for s in self.schemes for keys in s.layout.out_keys]
        block_dims = [dims for s in self.schemes for dims in s.layout.out_dims]
        use_kernel = self.options.regroup == "triton" or (self.options.regroup == "auto" and self.device.type == "cuda")
        self.regroup = (KernelRegroup if use_kernel else Regroup)(
            self._block_keys,
            block_dims,
            {n: [k for f in members for k in self._feature_keys[f]] for n, members in regroup_spec.items()},
        )
        # Mean pooling: per output block, which input feature each column belongs to (None if all sums).
        self._mean_features = [f for f in self.features if self._table_of[f].pooling is Pooling.MEAN]
        self._col_feature: list[torch.Tensor | None] = []
        for keys, dims in zip(self._block_keys, block_dims):
            cols: list[int] = []
            for key, d in zip(keys, dims):
                cols += [self.features.index(key_feature(key)[0])] * d
            self._col_feature.append(
                torch.tensor(cols, dtype=torch.int64, device=self.device) if self._mean_features else None
            )
        self._mean_mask = torch.tensor(
            [self._table_of[f].pooling is Pooling.MEAN for f in self.features], dtype=torch.bool, device=self.device
        )
        self._kjt_layout: tuple | None = None
        self._step = 0  # training forwards so far (`step`), written through StepState's methods alone
        self._pending: deque[PrefetchHandle] = deque()  # prefetched batches not consumed yet, in order
        self._ahead: tuple | None = None  # (kjt, output, event): a forward run ahead (lookup_ahead)
        # A list while a caller collects each forward's lookup outputs (before the pooled exchange), else None: the
        # whole-step graph runs its backward in two parts (embshard/training/step_graph.py); kept only while it asks.
        self.lookup_outputs: list[torch.Tensor] | None = None

    # ---- input handling ----------------------------------------------------------------------------------
    def _layout(self, kjt) -> dict[str, int]:
        """Check the KJT's keys against the tables' features (once per key order); its key -> row index."""
        keys = tuple(kjt.keys())
        if self._kjt_layout is None or self._kjt_layout[0] != keys:
            missing = [f for f in self.features if f not in keys]
            extra = [k for k in keys if k not in self._table_of]
            if missing or extra:
                raise ConfigError(
                    f"KeyedJaggedTensor keys do not match the tables' features: missing {missing}, not looked up "
                    f"by any table {extra}; pass exactly the features {self.features} (any order)"
                    + (", or LookupOptions(unused_features='ignore') to leave the others out" if extra else "")
                )
            self._kjt_layout = (keys, {k: i for i, k in enumerate(keys)})
        if kjt.variable_stride_per_key():
            raise ConfigError("variable batch size per feature is not supported: give every feature the same batch")
        dtype = kjt.values().dtype
        if dtype not in (torch.int32, torch.int64):  # before any work: a float id would be truncated silently
            raise ConfigError(
                f"the ids of features {list(keys)} are {dtype}: ids must be integers, torch.int64 or torch.int32 "
                "(raw-id and static tables alike; a float id loses digits and would be truncated): give the "
                "KeyedJaggedTensor integer values"
            )
        return self._kjt_layout[1]

    def _used_only(self, kjt):
        """The KJT without the features no table looks up, under LookupOptions.unused_features 'ignore'."""
        keys = kjt.keys()
        if self.options.unused_features is UnusedFeatures.ERROR or all(k in self._table_of for k in keys):
            return kjt
        return kjt.permute([i for i, k in enumerate(keys) if k in self._table_of])

    def _local_input(self, kjt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, int]]:
        kjt = self._used_only(kjt)
        index = self._layout(kjt)
        lengths_FB = kjt.lengths().view(len(index), kjt.stride())
        values = kjt.values()
        weights = kjt.weights_or_none()
        if values.device != self.device:
            raise ConfigError(f"input is on {values.device} but the module computes on {self.device}: move it")
        return lengths_FB, values, weights, index

    def host_counts(self, kjt, check: bool = True) -> torch.Tensor | None:
        """This rank's row of a step's counts table (`sharding.exchange.counts_row`, step 0), computed from the
        batch where it is (the CPU batch, before its copy to the device: no device sync): batch size, out-of-range
        ids and ids per feature. A pipeline gathers these rows over a CPU process group and passes them to
        `prefetch(..., counts=)`. None in drop mode (the ids sent depend on the drops, made on the device).
        `check=False` skips the out-of-range count (a source that guarantees every id is in range)."""
        if self.options.bounds_check is BoundsCheck.DROP:
            return None
        kjt = self._used_only(kjt)
        index = self._layout(kjt)
        lengths_FB = kjt.lengths().view(len(index), kjt.stride())
        bad = count_bad_ids(lengths_FB, kjt.values(), self._kjt_layout[0], self._table_of) if check else None
        ids_F = lengths_FB.sum(1, dtype=torch.int64).index_select(0, self._canonical_rows(index, lengths_FB.device))
        return counts_row(ids_F, lengths_FB.shape[1], bad, 0)

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

    def _input_dist(
        self, lengths_FB, values, weights, index, check: bool, step: int, counts: BatchCounts | None = None
    ) -> tuple[list, torch.Tensor]:
        """One all-gather of every rank's batch size, ids per feature and out-of-range id count, read with the
        step's one host sync (`gather_batch_counts`), unless `counts` were gathered on the host already; then every
        scheme lays out its ids with known sizes and starts its exchange (row-wise schemes first swap their
        bucketed counts: `exchange_counts`). Returns the inputs and the lengths actually sent (drop mode removes
        ids). In error mode every rank stops together if any rank has bad ids, and the ranks that have them raise
        the error naming feature, table and value."""
        drop = check and self.options.bounds_check is BoundsCheck.DROP
        if drop:
            lengths_FB, values, weights = self._check_ids(lengths_FB, values, weights)
        if counts is None:
            bad = count_bad_ids(lengths_FB, values, self._kjt_layout[0], self._table_of) if check and not drop else None
            ids_F = lengths_FB.sum(1, dtype=torch.int64).index_select(0, self._canonical_rows(index, lengths_FB.device))
            counts = gather_batch_counts(ids_F, lengths_FB.shape[1], bad, self.group, step)
        if counts.bad_ranks:
            if self.rank in counts.bad_ranks:
                self._check_ids(lengths_FB, values, weights)  # raises, naming feature, table and value
            raise IdsOutOfRange(counts.bad_ranks)
        batch = LocalBatch(lengths_FB, values, weights, index, counts)
        parts = [s.local_ids(batch) for s in self.schemes]
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
        input exchange and the id check already ran). Without it, the oldest pending prefetch is used when it was
        made for this kjt object, and a forward run ahead for it (`lookup_ahead`) is returned as it is."""
        if self._ahead is not None and self._ahead[0] is kjt:
            return self._take_ahead()
        if prefetched is None and self._pending and self._pending[0].kjt is kjt:
            prefetched = self._pending[0]
        with comm.scope(f"step {self.step}"):
            if prefetched is not None:
                inputs, lengths_FB, index = self._consume(prefetched, kjt)
            else:
                lengths_FB, values, weights, index = self._local_input(kjt)
                inputs, lengths_FB = self._input_dist(lengths_FB, values, weights, index, check_ids, self.step)
            # Each scheme's pooled exchange starts right after its lookup, and the schemes whose rows stay here
            # (data-parallel) look up last, beside the exchanges in flight; the blocks keep the schemes' order.
            order = sorted(range(len(self.schemes)), key=lambda i: self.schemes[i].local_output)
            handles: list = [None] * len(self.schemes)
            for i in order:
                pooled = self.schemes[i].lookup(inputs[i])
                if self.lookup_outputs is not None:
                    self.lookup_outputs.append(pooled)
                handles[i] = self.schemes[i].start_output_dist(pooled, inputs[i].batch_sizes)
            blocks = [b for h in handles for b in h.wait()]
        if torch.is_grad_enabled():
            self.advance_step()
        if self._mean_features:
            blocks = self._apply_mean(blocks, lengths_FB, index)
        out = self.regroup(blocks)
        if self.groups is not None:
            return out
        from torchrec.sparse.jagged_tensor import KeyedTensor

        return KeyedTensor(keys=self.features, length_per_key=self._feature_dims, values=out["all"], key_dim=1)

    # ---- pipelining: early input dist (and UVM-cache prefetch), early lookup -------------------------------
    @property
    def next_prefetch_step(self) -> int:
        """The step the next `prefetch` labels its batch with: the training forward that will consume it."""
        return self.step + len(self._pending)

    @property
    def pending_prefetches(self) -> int:
        """Prefetched batches (`prefetch`) that no forward has consumed yet."""
        return len(self._pending)

    def drop_prefetches(self, keep: int = 0) -> None:
        """Forget the prefetched batches not consumed yet but the `keep` oldest (a failed capture's, say)."""
        if keep < 0:
            raise ValueError(f"ShardedEmbeddingBagCollection.drop_prefetches(keep={keep}): keep must be >= 0")
        while len(self._pending) > keep:
            self._pending.pop()

    def prefetch(
        self,
        kjt,
        stream: torch.cuda.Stream | None = None,
        counts: BatchCounts | None = None,
        made_on_stream: bool = False,
    ) -> PrefetchHandle:
        """Send a COMING batch's ids to the ranks that look them up (input dist), while the current batch may still
        be waiting for its backward; with LookupOptions(prefetch_pipeline=True) also load its rows into the UVM
        caches. Collective (every rank calls it, same order). The forward of the same kjt object uses it (oldest
        first); the handle may also be passed explicitly: `ebc(kjt, prefetched=handle)`.

        `stream`: a CUDA stream to run on (the forward waits for it and records the tensors it uses on its own
        stream); None: the current stream. `counts`: the step's counts gathered on the host (`host_counts` rows of
        every rank, step `next_prefetch_step`): no device all-gather and no host sync here. `made_on_stream`: the
        kjt was made on `stream` itself (copied there), so the stream need not wait for the caller's work.
        """
        if stream is not None and self.device.type != "cuda":
            raise ConfigError(f"prefetch(stream=...) needs a CUDA module; this one computes on {self.device}")
        caller = torch.cuda.current_stream(self.device) if stream is not None else None
        if stream is not None and not made_on_stream:
            stream.wait_stream(caller)  # the batch's tensors were made on the caller's stream
        step = self.next_prefetch_step  # the step that will consume this batch
        with torch.cuda.stream(stream) if stream is not None else _nullcontext(), comm.scope(f"step {step} prefetch"):
            lengths_FB, values, weights, index = self._local_input(kjt)
            if counts is not None and counts.batch_sizes[self.rank] != lengths_FB.shape[1]:
                raise ValueError(
                    f"prefetch(counts=...): the counts give rank {self.rank} a batch of "
                    f"{counts.batch_sizes[self.rank]} samples but its kjt has {lengths_FB.shape[1]}: gather the "
                    "host_counts of this same batch"
                )
            inputs, lengths_FB = self._input_dist(lengths_FB, values, weights, index, True, step, counts)
            if self.options.prefetch_pipeline:
                for scheme, inp in zip(self.schemes, inputs):
                    scheme.prefetch(inp, caller)
        handle = PrefetchHandle(kjt, lengths_FB, index, inputs, stream)
        self._pending.append(handle)
        return handle

    def _consume(self, handle: PrefetchHandle, kjt) -> tuple[list, torch.Tensor, dict[str, int]]:
        if handle.kjt is not kjt or handle.used:
            raise ValueError(
                "forward(kjt, prefetched=handle): the handle was made by prefetch() for another batch or was already "
                "used; pass the kjt that was prefetched, once"
            )
        handle.used = True
        for i, pending in enumerate(self._pending):
            if pending is handle:
                del self._pending[i]
                break
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

    def lookup_ahead(self, kjt, stream: torch.cuda.Stream | None = None) -> None:
        """Run `forward(kjt)` now, on `stream` (CUDA) or the current stream, and keep its output for the later
        `forward(kjt)` with the same kjt object, which returns it as it is (semi-synchronous pipelines: the lookup
        reads the tables before the sparse update of every batch whose backward has not run yet). Collective."""
        if self._ahead is not None:
            raise ValueError("lookup_ahead: the forward run ahead for an earlier batch has not been used yet")
        with torch.cuda.stream(stream) if stream is not None else _nullcontext():
            out = self.forward(kjt)
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
        self._ahead = (kjt, out, event)

    def _take_ahead(self):
        _, out, event = self._ahead
        self._ahead = None
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in out.values() if isinstance(out, dict) else [out.values()]:
                t.record_stream(current)
        return out

    # ---- UVM-caching: statistics ---------------------------------------------------------------------------
    def cache_stats(self, gather: bool = False) -> dict[str, dict]:
        """UVM-cache statistics per table since the last reset_cache_stats(), for the UVM-caching tables of this
        rank (or, with gather=True, of every rank: collective). Needs LookupOptions(cache_stats=True); {} for
        tables in other tiers. Per table: requested (ids looked up), unique_misses (rows fetched from UVM),
        hit_rate (1 - unique_misses / requested), cached_rows, rows, and for the TBE whose cache the table shares:
        cache_group (its tables), group_cache_slots, group_evictions (LRU only, else None).
        Training loops log it every N steps: `log(format_cache_stats(ebc.cache_stats())); ebc.reset_cache_stats()`.
        """
        stats = {k: v for scheme in self.schemes for k, v in scheme.cache_stats().items()}
        if gather and self.world_size > 1:
            everyone: list = [None] * self.world_size
            dist.all_gather_object(everyone, stats, group=self.group)
            stats = {k: v for rank_stats in everyone for k, v in rank_stats.items()}
        return stats

    def reset_cache_stats(self) -> None:
        """Zero the UVM-cache statistics of this rank's tables."""
        for scheme in self.schemes:
            scheme.reset_cache_stats()

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

    # ---- a rank's own rows, differentiable (retrieval: embshard/retrieval) ------------------------------------
    def local_rows(self, table: str, ids: torch.Tensor | None = None) -> tuple[int, torch.Tensor]:
        """(row_offset, rows `[n, D]`): this rank's block of `table` (rows `row_offset ...`), or the block's rows
        `ids` (local indices, int64), read through the block's own lookup as bags of one id each, so the result is
        differentiable and its gradient is applied by the fused optimizer in the backward, like any lookup's. No
        collective. The table must be split into full-width row blocks (row_wise, table_wise, table_row_wise); a
        rank without a block gets (num_embeddings, an empty `[0, D]` tensor that requires grad). Cost: one lookup
        of n bags; when other tables share the lookup (TBE), the output is as wide as all of them for those n bags.
        Call it at most once per step per table: each call's backward is its own optimizer step."""
        tp = self.plan[table]
        if tp.sharding_type.value not in ("row_wise", "table_wise", "table_row_wise"):
            raise ConfigError(
                f"local_rows({table!r}): the table is {tp.sharding_type.value}; it needs full-width row blocks, one "
                "per rank: plan it row_wise (planner.constraints.<table>.sharding_types: [row_wise])"
            )
        cfg = next(t for t in self.tables if t.name == table)
        for scheme in self.schemes:
            for lk in scheme.lookups:
                for s in lk.shards:
                    if s.table.name != table:
                        continue
                    n = s.shard.num_rows if ids is None else int(ids.numel())
                    F, f0 = len(lk.features), lk.features.index(s.features[0])
                    dev = self.device
                    offsets = torch.cat(
                        [
                            torch.zeros(f0 * n, dtype=torch.int64, device=dev),
                            torch.arange(n + 1, dtype=torch.int64, device=dev),
                            torch.full(((F - f0 - 1) * n,), n, dtype=torch.int64, device=dev),
                        ]
                    )
                    idx = torch.arange(n, device=dev) if ids is None else ids.to(dev, torch.int64)
                    weights = torch.ones(n, device=dev) if lk.weighted else None
                    out = lk(idx, offsets, weights)
                    col0 = sum(lk.dims[:f0])
                    return s.shard.row_offset, out[:, col0 : col0 + cfg.embedding_dim]
        return cfg.num_embeddings, torch.zeros(0, cfg.embedding_dim, device=self.device, requires_grad=True)
