"""What a checkpoint holds of a sharded embedding collection, and which pieces of it each rank writes and reads.

Every table is saved as logical tensors of the whole table, named `{collection}/{table}/{name}`:

    weight     [rows, dim]   the table's weights (its storage dtype: fp32, or fp16 for fp16 tables in FBGEMM)
    m          [rows, dim]   adagrad's sum of squares; adam's first moment
               [rows]        rowwise_adagrad's per-row state, when the table has one per row (every type but
                             column-wise with per-block state)
    m_blocks   [rows, n]     rowwise_adagrad's per-block state of a column-wise table whose blocks keep their own
                             (column_wise_exact=False, or uvm_caching blocks): column j = block j (manifest: blocks)
    v          [rows, dim]   adam's second moment
    ids, id_last, id_count [rows]  raw-id tables: each row's id and its map's use record (raw_ids.py, whose pieces
                             and manifest entries save.py and load.py add to these)

A rank writes the pieces it owns (`save_pieces`): its row/column blocks; a data-parallel table once, from rank 0's
replica; the per-row state of an exact column-wise table once, from its first column block (every block holds
the same copy). Each piece is cut into row chunks of at most `chunk_bytes` (`pieces.split_rows`), the unit that is
copied to the host, written and later read: a rank never holds more of a table than its own shards plus one
chunk. A rank reads (`load_targets`) what its shards of the NEW plan need: every piece of every logical tensor
that overlaps its blocks, straight into its live tensors; rowwise_adagrad state saved per block and needed per
row, or per other blocks, is computed from the saved blocks (`Conversion`, docs/checkpoints.md):

    per-row state of row r = sum_b (width_b / dim) * m_b[r]      (exact: it is what the unsharded table keeps)
    per-block state of block c = sum_b (overlap(b, c) / width_c) * m_b[r]     (the same block: a copy)
    per-block state from per-row state = the per-row value (approximate: the blocks' states then diverge)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from embshard.checkpoint.pieces import Piece
from embshard.sharding.column_wise import shares_row_state
from embshard.spec.optim import OptimizerKind
from embshard.spec.plan import Shard, ShardingType, TablePlan

PER_ROW = "per_row"
PER_BLOCK = "per_block"


@dataclass(frozen=True)
class Conversion:
    """rowwise_adagrad state that the target needs in another layout than the saved one: rows
    `[row_offset, row_offset + len(target))` of the saved per-block tensor `key` (`[rows, n]`), combined with
    `weights_n` into `target`."""

    key: str
    size: tuple[int, int]
    row_offset: int
    weights_n: torch.Tensor
    """float64 `[n]` weights of the saved blocks."""
    target: torch.Tensor
    """The live `[rows]` state to fill."""


def row_state_layout(tp: TablePlan, optimizer: Any, options: Any) -> str | None:
    """How a table keeps rowwise_adagrad state under plan `tp`: PER_ROW, PER_BLOCK, or None (other optimizers)."""
    if optimizer.kind is not OptimizerKind.ROWWISE_ADAGRAD:
        return None
    if tp.sharding_type is ShardingType.COLUMN_WISE and not shares_row_state(optimizer, options, tp.tier):
        return PER_BLOCK
    return PER_ROW


def column_blocks(tp: TablePlan) -> list[tuple[int, int]]:
    """(first column, width) of each column block of a column-wise table, in column order; one block otherwise."""
    return sorted({(s.col_offset, s.num_cols) for s in tp.shards})


def table_entries(ebc: Any) -> dict[str, dict]:
    """Per table of the collection: what the manifest records of it (shape, types, plan, state layout)."""
    out = {}
    for t in ebc.tables:
        tp = ebc.plan[t.name]
        layout = row_state_layout(tp, ebc.optimizer, ebc.options)
        out[t.name] = {
            "rows": t.num_embeddings,
            "dim": t.embedding_dim,
            "data_type": t.data_type.value,
            "sharding_type": tp.sharding_type.value,
            "tier": tp.tier.value,
            "ranks": sorted(set(tp.ranks)),
            "row_state": layout,
            "blocks": [list(b) for b in column_blocks(tp)] if layout == PER_BLOCK else None,
        }
    return out


def _local(ebc: Any) -> list[tuple[str, Shard, torch.Tensor, dict[str, torch.Tensor]]]:
    """(table, Shard, live weights, live optimizer state) of every shard of this rank."""
    states = ebc.local_optimizer_states()
    return [(n, s, w, st) for (n, s, w), (_, _, st) in zip(ebc.local_shards(), states)]


def save_pieces(ebc: Any, prefix: str) -> list[Piece]:
    """The pieces (live views, not chunked) this rank writes of collection `ebc`, saved as `prefix`."""
    configs = {t.name: t for t in ebc.tables}
    out: list[Piece] = []
    if getattr(ebc, "replica_index", 0) != 0:
        return out  # 2D: the sharding groups hold replicas of one layout; group 0's is saved
    for name, sh, w, state in _local(ebc):
        tp, cfg = ebc.plan[name], configs[name]
        R, D = cfg.num_embeddings, cfg.embedding_dim
        if tp.sharding_type is ShardingType.DATA_PARALLEL and ebc.rank != 0:
            continue  # replicas are identical: rank 0's is saved
        base = f"{prefix}/{name}"
        out.append(Piece(f"{base}/weight", (R, D), (sh.row_offset, sh.col_offset), w))
        layout = row_state_layout(tp, ebc.optimizer, ebc.options)
        for k, s in state.items():
            if s.dim() == 2:
                out.append(Piece(f"{base}/{k}", (R, D), (sh.row_offset, sh.col_offset), s))
            elif layout == PER_BLOCK:
                blocks = column_blocks(tp)
                j = blocks.index((sh.col_offset, sh.num_cols))
                out.append(Piece(f"{base}/{k}_blocks", (R, len(blocks)), (0, j), s.view(-1, 1)))
            elif tp.sharding_type is ShardingType.COLUMN_WISE:
                if sh.col_offset == 0:  # every block holds the same per-row state: the first block saves it
                    out.append(Piece(f"{base}/{k}", (R,), (0,), s))
            else:
                out.append(Piece(f"{base}/{k}", (R,), (sh.row_offset,), s))
    return out


def load_targets(ebc: Any, prefix: str, saved: dict[str, dict]) -> tuple[list[Piece], list[Conversion]]:
    """What this rank reads into collection `ebc` from a checkpoint whose tables (manifest entries) are `saved`:
    pieces read straight into its live tensors, and the rowwise_adagrad states computed from per-block ones."""
    configs = {t.name: t for t in ebc.tables}
    pieces: list[Piece] = []
    conversions: list[Conversion] = []
    for name, sh, w, state in _local(ebc):
        tp, cfg = ebc.plan[name], configs[name]
        R, D = cfg.num_embeddings, cfg.embedding_dim
        base = f"{prefix}/{name}"
        pieces.append(Piece(f"{base}/weight", (R, D), (sh.row_offset, sh.col_offset), w))
        layout = row_state_layout(tp, ebc.optimizer, ebc.options)
        entry = saved[name]
        for k, s in state.items():
            if s.dim() == 2:
                pieces.append(Piece(f"{base}/{k}", (R, D), (sh.row_offset, sh.col_offset), s))
                continue
            column_wise = tp.sharding_type is ShardingType.COLUMN_WISE
            r0 = 0 if column_wise else sh.row_offset  # a column block holds every row
            if entry["row_state"] == PER_ROW:  # straight; into per-block state: the per-row value
                pieces.append(Piece(f"{base}/{k}", (R,), (r0,), s))
                continue
            blocks = [tuple(b) for b in entry["blocks"]]
            key, size = f"{base}/{k}_blocks", (R, len(blocks))
            if layout == PER_BLOCK and (sh.col_offset, sh.num_cols) in blocks:  # the same block: a copy
                pieces.append(Piece(key, size, (0, blocks.index((sh.col_offset, sh.num_cols))), s.view(-1, 1)))
                continue
            if layout == PER_BLOCK:  # another block: mean of the saved blocks over its columns
                c0, c1 = sh.col_offset, sh.col_offset + sh.num_cols
                overlap = [max(0, min(c1, b0 + bw) - max(c0, b0)) for b0, bw in blocks]
                weights = torch.tensor(overlap, dtype=torch.float64) / sh.num_cols
            else:  # per row: width-weighted mean of the blocks
                weights = torch.tensor([bw for _, bw in blocks], dtype=torch.float64) / D
            conversions.append(Conversion(key, size, r0, weights, s))
    return pieces, conversions


def check_tables(ebc: Any, prefix: str, saved: dict[str, dict] | None, where: str) -> None:
    """Raise ValueError unless every table of `ebc` is in the checkpoint's collection `prefix` with its shape."""
    if saved is None:
        raise ValueError(f"{where} has no collection {prefix!r}: it was saved from another kind of model")
    for t in ebc.tables:
        entry = saved.get(t.name)
        if entry is None:
            raise ValueError(
                f"{where} has no table {t.name!r} in collection {prefix!r} (it has {sorted(saved)}): the model's "
                "tables must be the checkpoint's"
            )
        if (entry["rows"], entry["dim"]) != (t.num_embeddings, t.embedding_dim):
            raise ValueError(
                f"{where}: table {t.name!r} is {entry['rows']} x {entry['dim']} there but {t.num_embeddings} x "
                f"{t.embedding_dim} in this model: tables keep their shape across a resume"
            )
