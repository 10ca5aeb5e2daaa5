"""The item catalog of a retrieval model: one embedding table whose rows are the items' vectors, row-sharded over
the ranks, scored against the queries by the full softmax, the sampled softmax, or top-k for recall@K.

The catalog is its own ShardedEmbeddingBagCollection of one table with one feature (the item id), apart from
the collection of the query side's tables. Why not a table of that collection: the softmax reads the rank's
whole block every step through `local_rows`, and a table also looked up by the batch's features would be read by
two lookups a step, each applying its own optimizer step (and, sharing a TBE with other tables, the block's
lookup would be as wide as all of them). On its own, each step makes exactly one lookup of the catalog: the
block (full softmax), the sampled and target rows (sampled softmax), or the batch's items (bce, in-batch).

Data flow (full softmax), on rank r holding rows [o_r, o_r + R_r):
  queries [B_r, D], item ids [B_r] --gather--> Q [B, D], T [B]
  local_rows(table) -> E_r [R_r, D] (differentiable, fused optimizer) --sharded_softmax_loss--> loss [B_r]
Sampled softmax: local_rows(table, ids = k_r negatives of this block ++ the targets of T in this block) instead
of the whole block, with the logQ correction of the BlockSampler. Recall@K: sharded_topk over E_r.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from embshard.retrieval.gather import gather_rows, gather_sizes, scatter_sum_rows
from embshard.retrieval.sampler import BlockSampler, negatives_per_rank
from embshard.retrieval.softmax import Candidates, block_targets, sharded_softmax_loss
from embshard.retrieval.topk import recall_hits
from embshard.runtime.comm import world_and_rank
from embshard.runtime.ops import scale_grad
from embshard.spec.optim import FusedOptimizerConfig
from embshard.spec.plan import ShardingPlan
from embshard.spec.tables import ConfigError, Pooling, TableConfig

ROW_BLOCK_TYPES = ("row_wise", "table_wise", "table_row_wise")


class Catalog(nn.Module):
    """The catalog table `table` (one feature: the item id) placed as `plan` says (full-width row blocks).

    Args:
        table, plan: the table and a plan holding it (other tables of the plan are ignored).
        optimizer: the fused optimizer of its rows. device, group, seed: as ShardedEmbeddingBagCollection.
        chunk_mib: memory of one chunk of logits `[B_global, rows]` in the softmax and the top-k (MiB).
        num_negatives: sampled softmax only (None: no sampler): negatives per step over the whole catalog;
        sampler: "unigram" or "uniform"; smoothing: the unigram's pseudo-count.
    """

    def __init__(
        self,
        table: TableConfig,
        plan: ShardingPlan,
        optimizer: FusedOptimizerConfig,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        seed: int | None = 0,
        chunk_mib: float = 256.0,
        num_negatives: int | None = None,
        sampler: str = "unigram",
        smoothing: float = 1.0,
    ) -> None:
        super().__init__()
        from embshard.collection.sharded import ShardedEmbeddingBagCollection

        if len(table.feature_names) != 1:
            raise ConfigError(
                f"catalog table {table.name!r} is looked up by features {list(table.feature_names)}; a catalog has "
                "exactly one feature, the item id (its rows are read whole by the softmax): give other features "
                "their own table"
            )
        tp = plan[table.name]
        if tp.sharding_type.value not in ROW_BLOCK_TYPES:
            raise ConfigError(
                f"catalog table {table.name!r} is planned {tp.sharding_type.value}; the softmax over the catalog needs "
                f"full-width row blocks ({', '.join(ROW_BLOCK_TYPES)}): set "
                f"planner.constraints.{table.name}.sharding_types: [row_wise]"
            )
        sub = replace(plan, tables=(tp,))
        self.table, self.feature = table, table.feature_names[0]
        # every lookup of the catalog is of bags of one id (one row each): a sequence table (pooling none) is one
        bags = replace(table, pooling=Pooling.SUM) if table.pooling is Pooling.NONE else table
        self.ebc = ShardedEmbeddingBagCollection([bags], sub, optimizer, device=device, group=group, seed=seed)
        self.group, self.chunk_mib, self.device = group, chunk_mib, self.ebc.device
        self.world_size, self.rank = world_and_rank(group)
        blocks = {s.rank: (s.row_offset, s.num_rows) for s in tp.shards}
        self.blocks = [blocks.get(r, (table.num_embeddings, 0)) for r in range(self.world_size)]
        self.row_offset, self.num_rows = self.blocks[self.rank]
        self.sampler: BlockSampler | None = None
        if num_negatives is not None:
            try:
                k = negatives_per_rank(num_negatives, [n for _, n in self.blocks])[self.rank]
            except ValueError as e:
                raise ConfigError(f"catalog table {table.name!r}: {e}") from None
            self.sampler = BlockSampler(
                sampler, self.row_offset, self.num_rows, k, smoothing, seed or 0, self.rank, self.device
            )
        self._step = 0

    @property
    def sampler_step(self) -> int:
        """Training steps the sampled softmax has taken: it seeds each step's negatives (checkpoints restore it)."""
        return self._step

    @sampler_step.setter
    def sampler_step(self, step: int) -> None:
        self._step = int(step)

    # ---- the batch's items ----------------------------------------------------------------------------------
    def vectors(self, ids_B: torch.Tensor) -> torch.Tensor:
        """The rows of a batch's item ids `[B, D]` (the sharded lookup: collective, fused optimizer)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        kjt = KeyedJaggedTensor(keys=[self.feature], values=ids_B, lengths=torch.ones_like(ids_B, dtype=torch.int32))
        return self.ebc(kjt).values().float()

    def _gather(self, query_BD: torch.Tensor, target_B: torch.Tensor):
        sizes, T = self._gather_ids(target_B)
        return sizes, gather_rows(query_BD.float(), sizes, self.group), T

    def _gather_ids(self, target_B: torch.Tensor):
        sizes = gather_sizes(target_B.shape[0], target_B.device, self.group)
        T = gather_rows(target_B.to(torch.int64), sizes, self.group)
        bad = (T < 0) | (T >= self.table.num_embeddings)
        if bool(bad.any()):  # every rank sees every target: all raise together
            raise ValueError(
                f"item id {int(T[bad][0])} of feature {self.feature!r} is not a row of catalog table "
                f"{self.table.name!r} ({self.table.num_embeddings} rows): map the ids into [0, num_embeddings) or "
                "enlarge the table"
            )
        return sizes, T

    def block(self) -> torch.Tensor:
        """This rank's block of rows `[R_r, D]` (differentiable: one lookup, one fused optimizer step in the
        backward). Pass it to `full_softmax_loss(rows=)` and `block_vectors` to read the block once a step."""
        return self.ebc.local_rows(self.table.name)[1]

    def block_vectors(self, ids_N: torch.Tensor, block_RD: torch.Tensor) -> torch.Tensor:
        """The rows of item ids `[N]` `[N, D]` read from every rank's `block()` (each rank's ids all-gathered, each
        block contributes the rows it holds, one reduce-scatter sums them; collective). Differentiable into the
        blocks, so a model whose input and output item vectors are the same rows (tied) takes one optimizer step
        a step. Traffic: the global ids and `[N_global, D]` floats per rank (a row-routed lookup sends 1/W of it)."""
        sizes, T = self._gather_ids(ids_N)
        local = T - self.row_offset
        inside = (local >= 0) & (local < self.num_rows)
        if self.num_rows:
            partial = block_RD.float().index_select(0, torch.where(inside, local, 0)) * inside.unsqueeze(1)
        else:
            partial = torch.zeros(T.shape[0], self.table.embedding_dim, device=self.device)
        return scatter_sum_rows(partial, sizes, self.group)

    # ---- losses ---------------------------------------------------------------------------------------------
    def full_softmax_loss(
        self, query_BD: torch.Tensor, target_B: torch.Tensor, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Cross-entropy `[B_r]` of each local query's target item against every item of the catalog. `rows`: this
        step's `block()` (read here if None)."""
        sizes, Q, T = self._gather(query_BD, target_B)
        rows = self.block() if rows is None else rows
        cands = Candidates(rows, rows.shape[0], block_targets(T, self.row_offset, self.num_rows), True)
        return sharded_softmax_loss(Q, cands, sizes, self.group, self.chunk_mib)

    def sampled_softmax_loss(
        self, query_BD: torch.Tensor, target_B: torch.Tensor, row_grad_scale: float = 1.0
    ) -> torch.Tensor:
        """Cross-entropy `[B_r]` of each local query's target against the step's sampled negatives (shared by the
        global batch), logQ-corrected, accidental hits removed. Advances the sampler (one step, then counts T).
        `row_grad_scale`: the looked-up rows' gradient is multiplied by it (their loss's scale, when it differs)."""
        if self.sampler is None:
            raise ValueError("sampled_softmax_loss needs the catalog built with num_negatives (its sampler)")
        sizes, Q, T = self._gather(query_BD, target_B)
        neg = self.sampler.sample(self._step)
        k = neg.numel()
        pos = block_targets(T, self.row_offset, self.num_rows)
        mine = pos >= 0
        t_rows = pos[mine]  # the block's targets, in batch order (a host sync: only rows in use are looked up)
        if self.num_rows:
            _, rows = self.ebc.local_rows(self.table.name, torch.cat([neg, t_rows]))
            rows = scale_grad(rows, row_grad_scale)
        else:
            rows = torch.zeros(0, self.table.embedding_dim, device=self.device, requires_grad=True)
        cands = Candidates(
            rows_RD=rows,
            num_candidates=k,
            target_pos=torch.where(mine, k + torch.cumsum(mine.to(torch.int64), 0) - 1, -1),
            target_is_candidate=False,
            candidate_bias=-self.sampler.log_expected(neg),
            target_bias=-self.sampler.log_expected(pos.clamp(min=0)),
            candidate_ids=neg + self.row_offset,
            targets=T,
        )
        loss = sharded_softmax_loss(Q, cands, sizes, self.group, self.chunk_mib)
        if torch.is_grad_enabled():
            self.sampler.observe(T)
            self._step += 1
        return loss

    # ---- evaluation -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def recall(self, query_BD: torch.Tensor, target_B: torch.Tensor, ks: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """{K: local queries whose target is among the catalog's K best-scored items} (collective)."""
        _, rows = self.ebc.local_rows(self.table.name)
        return recall_hits(query_BD.float(), target_B, rows.float(), self.row_offset, ks, self.group, self.chunk_mib)
