"""ShardedEmbeddingCollection: sequence tables (`pooling: none`) sharded over ranks, TorchRec `EmbeddingCollection`
semantics: one row per id, returned per feature as a `JaggedTensor` in the ids' order.

    ec = ShardedEmbeddingCollection(tables, plan, optimizer=None, device=None, group=None, seed=0, options=None,
                                    dedup=False)
    out = ec(kjt)                      # SequenceOutput: {feature: JaggedTensor}, values [n_f, D], the KJT's lengths
    x_BLD = out.padded("history", 50)  # [B, 50, D]: each sample's rows, zeros after its length

`tables` are sequence tables (every one `pooling: none`); `plan` any ShardingPlan of them for the process group's
world size (table_wise, column_wise, row_wise, table_row_wise, data_parallel); `optimizer` the fused sparse
optimizer (sgd, adagrad, rowwise_adagrad, adam), applied in backward; `seed`: initial weights a function of (seed,
table index) whatever the sharding; `dedup`: True, False, or the names of the tables whose ids are exchanged and
looked up once per step (unique per table, column block and destination rank; rows expanded after).
`forward(kjt)`: `kjt` a torchrec `KeyedJaggedTensor` of the rank's local batch with exactly the tables' features
(any order, int ids). A table's `max_length` cuts longer histories to their newest ids (`length_overflow:
truncate`) or refuses them (`error`); the lengths of the output are those kept.

One step (every rank, even with an empty local batch: the exchanges are collectives):
  0. counts       one all-gather of every rank's ids per feature, the step's host sync (`gather_batch_counts`);
                  or `forward(kjt, counts=...)` with every rank's `host_counts` of the CPU batch: no host sync
  1. ids          per scheme, destinations and (dedup) unique ids; row-wise and dedup schemes swap their device
                  counts in one small all-to-all (`exchange_segment_counts`)
  2. input dist   one all-to-all of ids per scheme
  3. lookup       one row per received id (CPU: embedding with sparse gradients; CUDA: FBGEMM TBE, PoolingMode.NONE)
  4. output dist  one all-to-all of rows per scheme, sized from step 1's counts; backward sends the gradients back
  5. assembly     rows back in the ids' order, dedup expanded, column blocks side by side, one JaggedTensor each
`SequenceStepGraph` (sequence_graph.py) runs the whole training step, the loss and backward included, as one CUDA
graph replay on batches padded to a capacity.
As with the pooled collection, every rank's backward must reach every scheme's rows (a loss over all the outputs,
empty ones included): the row exchange's backward is a collective.
Column-wise tables under rowwise_adagrad keep one optimizer state per row of each column block (TorchRec's
behaviour; `column_wise_exact` is off here). The state methods (`local_shards`, `full_weights`, ...) are those of
the pooled collection (shard_state.py), so checkpoints save, load and reshard sequence tables the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from embshard.collection.bounds import check_ids, count_bad_ids
from embshard.collection.sequence_padding import zero_fillers
from embshard.collection.shard_state import ShardState
from embshard.collection.step_state import StepCount
from embshard.runtime import comm
from embshard.runtime.comm import world_and_rank
from embshard.runtime.ops import cached_tensor
from embshard.sharding.base import ShardingContext
from embshard.sharding.exchange import BatchCounts, IdsOutOfRange, counts_row, gather_batch_counts
from embshard.sharding.sequence_replicated import replicated_sequence
from embshard.sharding.sequence_routed import exchange_segment_counts, routed_sequence
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.options import BoundsCheck, LookupOptions
from embshard.spec.plan import ShardingPlan, ShardingType
from embshard.spec.tables import (
    ConfigError,
    LengthOverflow,
    TableConfig,
    check_pooling_kinds,
    feature_columns,
    feature_order,
    validate_tables,
)

log = logging.getLogger(__name__)

# The schemes, in the order every rank builds and runs them: (label, sharding types).
ROUTED = (
    ("sequence table_wise/column_wise", (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE)),
    ("sequence row_wise", (ShardingType.ROW_WISE, ShardingType.TABLE_ROW_WISE)),
)


class BadSequenceBatch(IdsOutOfRange):
    """Some rank's local batch has ids outside their tables or histories over a max_length that refuses them;
    raised on every rank at the same point."""

    def __init__(self, ranks: list[int]) -> None:
        ValueError.__init__(
            self,
            f"ranks {ranks} have ids outside their tables or histories longer than an error-mode max_length in their "
            "local batch (each of those ranks raises an error naming the feature and the fix); every rank stops here "
            "so none waits forever",
        )
        self.ranks = ranks


class SequenceOutput(dict):
    """{feature: JaggedTensor} of one forward, with `padded`."""

    def padded(self, feature: str, max_len: int) -> torch.Tensor:
        """`[B, max_len, D]`: each sample's rows of `feature`, in order, cut at max_len, zeros after its length."""
        jt = self[feature]
        return jt.to_padded_dense(desired_length=max_len, padding_value=0.0)


class ShardedEmbeddingCollection(StepCount, ShardState, nn.Module):
    """Sequence tables sharded by `plan`, trained with a fused sparse optimizer (the module docstring has the
    arguments and the step)."""

    def __init__(
        self,
        tables: Sequence[TableConfig],
        plan: ShardingPlan,
        optimizer: FusedOptimizerConfig | None = None,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
        seed: int | None = 0,
        options: LookupOptions | None = None,
        dedup: bool | Collection[str] = False,
    ) -> None:
        super().__init__()
        tables = validate_tables(tables)
        check_pooling_kinds(tables, True, "ShardedEmbeddingCollection")
        raw = [t.name for t in tables if t.raw_ids]
        if raw:
            raise ConfigError(f"tables {raw} have ids: raw; sequence tables take index ids: set ids: index")
        plan.check(tables)
        world_size, rank = world_and_rank(group)
        if plan.world_size != world_size:
            raise ConfigError(
                f"the plan is for world_size={plan.world_size} but the process group has {world_size} ranks: "
                "plan again for this world size"
            )
        names = {t.name for t in tables}
        if isinstance(dedup, bool):
            dedup_of = dict.fromkeys(names, dedup)
        else:
            unknown = sorted(set(dedup) - names)
            if unknown or isinstance(dedup, str):
                raise ConfigError(
                    f"dedup={dedup!r} names tables {unknown or [dedup]} that are not sequence tables of this "
                    f"collection ({sorted(names)}): give True, False or a list of table names"
                )
            dedup_of = {n: n in set(dedup) for n in names}
        self.device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tables = list(tables)
        self.plan = plan
        self.rank, self.world_size, self.group = rank, world_size, group
        self.optimizer = optimizer or FusedOptimizerConfig()
        # Column blocks keep their own row-wise state (checkpoints read it so).
        self.options = replace(options or LookupOptions(), column_wise_exact=False)
        if self.options.bounds_check is not BoundsCheck.ERROR:
            raise ConfigError(
                f"LookupOptions.bounds_check={self.options.bounds_check.value!r}: sequence tables refuse "
                "out-of-range ids (a dropped id would shift the history); use bounds_check: error"
            )
        self.features = feature_order(tables)
        self._table_of = {f: t for t in tables for f in t.feature_names}
        self._columns = feature_columns(tables)
        self.dedup = dedup_of
        """Whether each table's ids are deduplicated before the exchange (table name -> bool)."""
        for t in tables:
            if t.max_length is not None:
                how = (
                    f"cut to the newest {t.max_length} ids"
                    if t.length_overflow is LengthOverflow.TRUNCATE
                    else "refused with an error"
                )
                log.info("sequence table %r: histories longer than %d ids are %s", t.name, t.max_length, how)
        ctx = ShardingContext(rank, world_size, self.device, group, self.optimizer, self.options, seed, self._columns)
        schemes = [routed_sequence(tables, plan, ctx, types, dedup_of, label) for label, types in ROUTED]
        schemes.append(replicated_sequence(tables, plan, ctx, dedup_of))
        self.schemes = nn.ModuleList([s for s in schemes if s is not None])
        self._step = 0

    # ---- input --------------------------------------------------------------------------------------------
    def _local_input(self, kjt, on_device: bool = True) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """(keys, `[F, B]` lengths, ids) of the KJT, checked (`on_device`: on the module's device)."""
        keys = list(kjt.keys())
        missing = [f for f in self.features if f not in keys]
        extra = [k for k in keys if k not in self._table_of]
        if missing or extra:
            raise ConfigError(
                f"KeyedJaggedTensor keys do not match the sequence tables' features: missing {missing}, not looked "
                f"up by any table {extra}; pass exactly the features {self.features} (any order)"
            )
        if kjt.variable_stride_per_key():
            raise ConfigError("variable batch size per feature is not supported: give every feature the same batch")
        values = kjt.values()
        if values.dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"the ids of features {keys} are {values.dtype}: ids must be torch.int64 or torch.int32")
        if on_device and values.device != self.device:
            raise ConfigError(f"input is on {values.device} but the module computes on {self.device}: move it")
        return keys, kjt.lengths().view(len(keys), kjt.stride()).long(), values

    def _kept_lengths(
        self, keys: list[str], lengths_FB: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Each table's max_length on the `[F, B]` lengths, where they are (no host sync): (kept lengths, `[F, 1]`
        limits (None: no table has one), `[1]` count of histories over a limit whose table says length_overflow:
        error (None: no such table))."""
        limits = [self._table_of[k].max_length for k in keys]
        if all(m is None for m in limits):
            return lengths_FB, None, None
        big = torch.iinfo(torch.int64).max
        limit_F1 = cached_tensor([m if m is not None else big for m in limits], lengths_FB.device).unsqueeze(1)
        over = None
        strict = [self._table_of[k].length_overflow is LengthOverflow.ERROR for k in keys]
        if any(strict):
            strict_F1 = cached_tensor([int(x) for x in strict], lengths_FB.device).unsqueeze(1)
            over = ((lengths_FB > limit_F1) * strict_F1).sum().reshape(1)
        return torch.minimum(lengths_FB, limit_F1), limit_F1, over

    def _cut(
        self, keys: list[str], lengths_FB: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Each table's max_length, on the device (no host sync): (kept `[F, B]` lengths, which ids are kept (None:
        all), `[1]` count of histories over a limit whose table says length_overflow: error (None: no such table)).
        A longer history keeps its newest (last) max_length ids."""
        kept_FB, limit_F1, over = self._kept_lengths(keys, lengths_FB)
        if limit_F1 is None:
            return lengths_FB, None, None
        flat = lengths_FB.reshape(-1)
        n = values.numel()
        starts = torch.cumsum(flat, 0) - flat  # each bag's first id
        pos = torch.arange(n, device=values.device) - torch.repeat_interleave(starts, flat, output_size=n)
        keep = pos >= torch.repeat_interleave(flat - kept_FB.reshape(-1), flat, output_size=n)
        return kept_FB, keep, over

    def host_counts(self, kjt) -> torch.Tensor:
        """This rank's row of the step's counts table (`sharding.exchange.counts_row`, step 0), computed where the
        batch is: a CPU batch, before its copy to the device, costs no device sync (a batch on the device costs
        one). It counts each feature's ids after its table's max_length, and the out-of-range ids and over-long
        histories that the forward refuses. `parse_counts` of every rank's row, stacked (gathered over a CPU
        process group on several ranks), gives the `counts` of `forward(kjt, counts=)` and of
        `SequenceStepGraph.step`: the step then has no host sync."""
        keys, lengths_FB, values = self._local_input(kjt, on_device=False)
        kept_FB, _, over = self._kept_lengths(keys, lengths_FB)
        return counts_row(*self._ids_and_bad(keys, lengths_FB, values, kept_FB, over), 0)

    def _ids_and_bad(
        self, keys: list[str], lengths_FB: torch.Tensor, values: torch.Tensor, kept_FB: torch.Tensor, over
    ) -> tuple[torch.Tensor, int, torch.Tensor]:
        """(kept ids per feature in the canonical order, batch size, `[1]` count of out-of-range ids and over-long
        histories that the forward refuses), where the batch is: a counts row's parts."""
        ids_F = kept_FB.sum(1).index_select(0, cached_tensor([keys.index(f) for f in self.features], kept_FB.device))
        bad = count_bad_ids(lengths_FB, values, keys, self._table_of)
        return ids_F, lengths_FB.shape[1], bad + over if over is not None else bad

    def _raise_bad_batch(self, keys, lengths_FB, values, ranks: list[int]) -> None:
        """Raise on every rank: the ranks with bad batches name the feature, sample or id, and the fix."""
        if self.rank in ranks:
            for f, k in enumerate(keys):
                t = self._table_of[k]
                if t.max_length is not None and t.length_overflow is LengthOverflow.ERROR:
                    over = (lengths_FB[f] > t.max_length).nonzero()
                    if over.numel():
                        b = int(over[0])
                        raise ValueError(
                            f"feature {k!r}: sample {b} has {int(lengths_FB[f, b])} ids, more than table "
                            f"{t.name!r}'s max_length={t.max_length} (length_overflow: error); shorten the history, "
                            "raise max_length, or set length_overflow: truncate"
                        )
            check_ids(lengths_FB, values, None, keys, self._table_of, BoundsCheck.ERROR, {})  # raises
        raise BadSequenceBatch(ranks)

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(
        self,
        kjt,
        counts: BatchCounts | None = None,
        fillers: Sequence[tuple[int, torch.Tensor]] | None = None,
    ) -> SequenceOutput:
        """{feature: JaggedTensor} of the local batch (the module docstring has the steps). `counts`: the step's
        counts gathered on the host (`host_counts`): no host sync. `fillers` (the padded step's,
        collection/sequence_padding.py): per feature of the KJT, in its key order, (first row, keep mask) of the
        rows whose fillers are zeroed in the output and in its gradient."""
        from torchrec.sparse.jagged_tensor import JaggedTensor

        with comm.scope(f"sequence step {self._step}"):
            keys, lengths_FB, values = self._local_input(kjt)
            kept_FB, keep, over = self._cut(keys, lengths_FB, values)
            if counts is None:
                ids_F, batch, bad = self._ids_and_bad(keys, lengths_FB, values, kept_FB, over)
                counts = gather_batch_counts(ids_F, batch, bad, self.group, self._step)
            elif len(counts.batch_sizes) != self.world_size or counts.batch_sizes[self.rank] != lengths_FB.shape[1]:
                raise ValueError(
                    f"forward(counts=...): the counts give {len(counts.batch_sizes)} ranks, rank {self.rank} a batch "
                    f"of {counts.batch_sizes[self.rank] if self.rank < len(counts.batch_sizes) else None} samples, "
                    f"but the group has {self.world_size} ranks and this kjt {lengths_FB.shape[1]} samples: gather "
                    "every rank's host_counts of this same batch"
                )
            if counts.bad_ranks:  # every rank stops here together
                self._raise_bad_batch(keys, lengths_FB, values, counts.bad_ranks)
            mine = counts.ids[self.rank]
            if keep is not None:  # the kept ids: their count is known now, so no host sync
                values = values[keep.nonzero_static(size=int(mine.sum())).squeeze(1)]
            lengths_FB = kept_FB
            sizes = [int(mine[self._columns[k]]) for k in keys]
            by_feature = dict(zip(keys, values.split(sizes)))
            parts = [s.local_ids(by_feature, counts) for s in self.schemes]
            pending = [p for s, p in zip(self.schemes, parts) if not s.on_host]
            if pending:
                exchange_segment_counts(pending, self.group, self.world_size)
            handles = [s.start_input_dist(p) for s, p in zip(self.schemes, parts)]
            received = [h.wait() for h in handles]
            handles = [s.start_output_dist(p, s.lookup(p, r)) for s, p, r in zip(self.schemes, parts, received)]
            pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
            for s, p, h in zip(self.schemes, parts, handles):
                for f, blocks in s.feature_rows(p, h.wait()).items():
                    pieces.setdefault(f, []).extend(blocks)
        if torch.is_grad_enabled():
            self._step += 1
        rows = []
        for f in keys:
            blocks = [x for _, x in sorted(pieces[f], key=lambda cx: cx[0])]
            rows.append(blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1))
        if fillers is not None:
            rows = zero_fillers(rows, fillers)
        out = SequenceOutput()
        for i, f in enumerate(keys):
            out[f] = JaggedTensor(values=rows[i], lengths=lengths_FB[i])
        return out
