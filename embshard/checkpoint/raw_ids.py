"""Checkpoints of raw-id tables (`TableConfig(ids="raw")`, embshard/rawids): the id -> row maps ride with the rows.

Saved per raw-id table, besides `weight` and the optimizer state, three logical tensors `[rows]` int64 named
`{collection}/{table}/ids` (the id each row holds), `id_last` (the map's clock at its last use; -1: the row holds
no id) and `id_count` (its uses); each rank writes its blocks' rows. Beside them, what makes a resume exact
(`IdMap.exact_state`): `id_slot` and `id_order` `[rows]` (each row's index slot within its block's slots and its
position in the block's LRU order; -1: none), `id_clock` `[blocks]` (the map's clock) and, for tables with
admit_min_count > 1, `id_sketch` `[depth, sum of the blocks' sketch widths]` and `id_sketch_adds` `[blocks]` (the
admission counts). The manifest entry of the table adds `ids: raw`, `row_blocks` ([row offset, rows] of every
block) and `map_state` (the keys of the exact state saved). Every block's zero row (its last) is zeroed before a
save, so it holds zeros in the checkpoint and its exports (training is unchanged: each lookup zeroes it first).

Load, per raw-id table:
- the same row blocks (any ranks): every id stays in its row; the maps' rows are read straight into place with the
  weights and state, then each map rebuilds its index and LRU order (`IdMap.rebuild`) as saved: slots, order,
  clock and admission counts come back, so the run goes on bit for bit as it would have (a checkpoint without
  them: the index is rebuilt in row order, the LRU order by last use, the clock past the last use). A map that
  holds an id twice, or whose saved slots or order do not fit its rows, is a ConfigError naming the table.
- other row blocks (N -> M ranks, table-wise <-> row-wise): rows move. Every rank holding a block of the table
  reads the saved table in row chunks (ids, uses, weights, state) and keeps the (id, row) pairs its blocks own by
  the routing rule (embshard/rawids: the block holding `route_rows(id, rows)`), writing them with their weights
  and state into the block's first rows; the block's other rows are re-initialised (weights as `init_rows`, state
  zero). A block that owns more ids than it can hold (rows - 1) keeps the ones its policy ranks highest (lru: the
  most recently used; lfu: the most used) and the rest are dropped (a warning counts them). Reads the whole
  table on each such rank, a chunk at a time (host memory: one chunk plus the kept rows of the rank's blocks).
Export (`embshard checkpoint export`) writes `OUT/<table>.ids.safetensors` beside the table's weights: `ids`,
`id_last`, `id_count` `[rows]` int64; row r holds id ids[r] where id_last[r] >= 0.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from embshard.checkpoint.files import NewFile
from embshard.checkpoint.pieces import Piece
from embshard.checkpoint.reading import read_pieces
from embshard.lookup.shards import INIT_BLOCK_ELEMENTS, init_rows
from embshard.rawids.hashing import owner_blocks
from embshard.rawids.state import sketch_width
from embshard.spec.plan import MemoryTier
from embshard.spec.tables import ConfigError, DataType, Eviction

MAP_KEYS = ("ids", "id_last", "id_count")
EXACT_KEYS = ("id_slot", "id_order", "id_clock")
"""Saved too (checkpoints since they exist): per row its index slot and LRU position, per block the map's clock."""
SKETCH_KEYS = ("id_sketch", "id_sketch_adds")
"""Saved for tables with admit_min_count > 1: their blocks' admission sketch."""


def _blocks(ebc: Any, table: str) -> list[list[int]]:
    return sorted([s.row_offset, s.num_rows] for s in ebc.plan[table].shards)


def exact_keys(table: Any) -> list[str]:
    """The keys of a raw-id table's map state beyond MAP_KEYS that make a resume exact (`IdMap.exact_state`)."""
    return list(EXACT_KEYS) + (list(SKETCH_KEYS) if table.admit_min_count > 1 else [])


def table_entry(ebc: Any, table: Any) -> dict:
    """What the manifest adds to a table's entry: {'ids': 'raw', 'row_blocks': ..., 'map_state': [keys of the exact
    state]} for raw-id tables, else {}."""
    if not table.raw_ids:
        return {}
    return {"ids": "raw", "row_blocks": _blocks(ebc, table.name), "map_state": exact_keys(table)}


def _map_pieces(ebc: Any, prefix: str) -> list[Piece]:
    """The live map views of every raw-id block of this rank: ids, id_last, id_count."""
    rows = {t.name: t.num_embeddings for t in ebc.tables}
    return [
        Piece(f"{prefix}/{name}/{k}", (rows[name],), (shard.row_offset,), views[k])
        for name, shard, views in ebc.local_id_maps()
        for k in MAP_KEYS
    ]


def _exact_pieces(ebc: Any, prefix: str, name: str, shard: Any, state: dict[str, torch.Tensor]) -> list[Piece]:
    """The pieces of a block's exact map state (`IdMap.exact_state`): per row `[rows]`, per block `[blocks]` (the
    clock, the sketch's adds) and the sketch `[depth, sum of the blocks' widths]`."""
    cfg = next(t for t in ebc.tables if t.name == name)
    blocks = _blocks(ebc, name)
    b = blocks.index([shard.row_offset, shard.num_rows])
    widths = [sketch_width(n - 1) for _, n in blocks]
    base = f"{prefix}/{name}"
    out = []
    for k, v in state.items():
        if k in ("id_slot", "id_order"):
            out.append(Piece(f"{base}/{k}", (cfg.num_embeddings,), (shard.row_offset,), v))
        elif k in ("id_clock", "id_sketch_adds"):
            out.append(Piece(f"{base}/{k}", (len(blocks),), (b,), v))
        else:  # id_sketch
            out.append(Piece(f"{base}/{k}", (v.shape[0], sum(widths)), (0, sum(widths[:b])), v))
    return out


def zero_rows(ebc: Any) -> None:
    """Zero the zero row (the last row) of every raw-id block of this rank, in its weights and optimizer state: the
    row of ids without a row, which gathers their gradients between the lookups that zero it (so it is zero in
    every checkpoint and export; training is unchanged: every lookup zeroes it first)."""
    raw = {t.name for t in ebc.tables if t.raw_ids}
    if any(ebc.plan[name].tier is MemoryTier.UVM_CACHING for name in raw):
        ebc.drop_caches()  # a cached row would be written back over the zeros
    with torch.no_grad():
        for name, _, w in ebc.local_shards():
            if name in raw:
                w[-1] = 0
        for name, _, state in ebc.local_optimizer_states():
            if name in raw:
                for v in state.values():
                    v[-1] = 0


def save_pieces(ebc: Any, prefix: str) -> list[Piece]:
    """The map pieces this rank writes of every raw-id block it holds: ids, id_last, id_count and the exact state.
    Zeroes the blocks' zero rows first (`zero_rows`), so the weights saved beside them hold zeros there."""
    zero_rows(ebc)
    out = _map_pieces(ebc, prefix)
    for name, shard, idmap, i in ebc.id_map_shards():
        out += _exact_pieces(ebc, prefix, name, shard, idmap.exact_state(i))
    return out


def load_targets(ebc: Any, prefix: str, saved: dict[str, dict], pieces: list[Piece], where: str) -> tuple:
    """Adjust the pieces `layout.load_targets` made for collection `ebc`: the raw-id tables whose row blocks are the
    saved ones also read their maps in place; those whose blocks differ are taken out (`reshard` fills them).
    Returns (pieces, names of the tables to reshard)."""
    moved: list[str] = []
    for _, _, idmap, i in ebc.id_map_shards():
        idmap.stage_exact_state(i, None)
    for t in ebc.tables:
        was = saved[t.name].get("ids", "index")
        if was != t.ids.value:
            raise ConfigError(
                f"{where}: table {t.name!r} was saved with ids: {was}, this model's has ids: {t.ids.value}; a "
                "table's rows mean different things then: keep the table's ids setting across a resume"
            )
        if t.raw_ids and saved[t.name]["row_blocks"] != _blocks(ebc, t.name):
            moved.append(t.name)
    if moved:
        pieces = [p for p in pieces if p.key.split("/")[-2] not in moved or not p.key.startswith(f"{prefix}/")]
    pieces += [p for p in _map_pieces(ebc, prefix) if p.key.split("/")[-2] not in moved]
    for name, shard, idmap, i in ebc.id_map_shards():
        keys = set(saved[name].get("map_state", ())) & set(exact_keys(idmap.shards[i].table))
        if name in moved or not keys:  # another layout, or saved without it: the map is rebuilt from its rows
            continue
        state = {k: v for k, v in idmap.exact_state(i).items() if k in keys}
        state.setdefault("id_clock", torch.full((1,), -1, dtype=torch.int64))
        state["id_clock"].fill_(-1)  # stays -1 (not applied) unless the load reads it
        idmap.stage_exact_state(i, state)
        pieces += [p for p in _exact_pieces(ebc, prefix, name, shard, state) if p.key.split("/")[-1] in keys]
    return pieces, moved


def finish_load(
    path: str | os.PathLike, ebc: Any, prefix: str, moved: Sequence[str], chunk_bytes: int, source: Any = None
) -> None:
    """After the pieces were read: reshard the moved tables, then rebuild every map of `ebc`. `source`: the load's
    reader of `path` (its checksummed reads), or None."""
    for name in moved:
        reshard(path, ebc, prefix, name, chunk_bytes, source)
    lost = ebc.rebuild_id_maps()
    if lost:
        warnings.warn(
            f"{prefix}: {lost} loaded ids found no free slot in their map's index and were dropped", stacklevel=3
        )


def reshard(path: str | os.PathLike, ebc: Any, prefix: str, name: str, chunk_bytes: int, source: Any = None) -> None:
    """Fill this rank's blocks of raw-id table `name` from a checkpoint saved under other row blocks."""
    cfg = next(t for t in ebc.tables if t.name == name)
    index = next(i for i, t in enumerate(ebc.tables) if t.name == name)
    R, D = cfg.num_embeddings, cfg.embedding_dim
    blocks = sorted(ebc.plan[name].shards, key=lambda s: s.row_offset)
    bs = blocks[0].num_rows
    weights = {s.row_offset: w for n, s, w in ebc.local_shards() if n == name}
    states = {s.row_offset: st for n, s, st in ebc.local_optimizer_states() if n == name}
    maps = {s.row_offset: st for n, s, st in ebc.local_id_maps() if n == name}
    if not maps:
        return
    seed = ebc.id_map_seed(name)
    w_dtype = next(iter(weights.values())).dtype
    state_shapes = {k: tuple(v.shape[1:]) for k, v in next(iter(states.values())).items()}
    row_bytes = D * 4 + 3 * 8 + sum(4 * (D if s else 1) for s in state_shapes.values())
    step = max(1, chunk_bytes // row_bytes)
    base = f"{prefix}/{name}"
    kept: dict[int, list[dict[str, torch.Tensor]]] = {off: [] for off in maps}
    for r0 in range(0, R, step):
        n = min(step, R - r0)
        bufs = {k: torch.empty(n, dtype=torch.int64) for k in MAP_KEYS}
        bufs["weight"] = torch.empty(n, D, dtype=w_dtype)
        bufs.update({f"state/{k}": torch.empty(n, *s, dtype=torch.float32) for k, s in state_shapes.items()})
        pieces = [Piece(f"{base}/{k}", (R,), (r0,), bufs[k]) for k in MAP_KEYS]
        pieces.append(Piece(f"{base}/weight", (R, D), (r0, 0), bufs["weight"]))
        pieces += [Piece(f"{base}/{k}", (R, *s), (r0,) + (0,) * len(s), bufs[f"state/{k}"]) for k, s in state_shapes.items()]  # fmt: skip
        read_pieces(path, pieces, source=source)
        owner = owner_blocks(bufs["ids"], R, bs)
        for b, s in enumerate(blocks):
            if s.row_offset in maps:
                mine = (bufs["id_last"] >= 0) & (owner == b)
                kept[s.row_offset].append({k: v[mine] for k, v in bufs.items()})
    dropped = 0
    for off, parts in kept.items():
        got = {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}
        shard = next(s for s in blocks if s.row_offset == off)
        capacity = shard.num_rows - 1
        n = int(got["ids"].numel()) if got else 0
        if n > capacity:  # keep what the policy ranks highest
            score = got["id_count"] if cfg.eviction is Eviction.LFU else got["id_last"]
            order = torch.sort(score, descending=True, stable=True).indices[:capacity]
            dropped += n - capacity
            got = {k: v[order] for k, v in got.items()}
            n = capacity
        _write_block(cfg, index, shard, weights[off], states[off], maps[off], got, n, seed)
    if dropped:
        warnings.warn(
            f"{base}: {dropped} ids of the checkpoint did not fit the row blocks they belong to under this plan "
            "(each block keeps the ids its eviction policy ranks highest); give the table more rows to keep them",
            stacklevel=4,
        )


def _write_block(cfg, index, shard, w, state, views, got, n, seed) -> None:
    """Write the n kept (id, row) pairs into the block's first rows; re-initialise the rest."""
    dev = w.device
    step = max(1, INIT_BLOCK_ELEMENTS // shard.num_cols)
    with torch.no_grad():
        for r0 in range(0, shard.num_rows, step):  # in passes, as the lookups draw their rows: bounded memory
            k = min(step, shard.num_rows - r0)
            init = init_rows(cfg, index, shard.row_offset + r0, k, shard.col_offset, shard.num_cols, seed, dev)
            if cfg.data_type is DataType.FP16:  # fp16 values in any storage, as IdMap.reset writes them
                init = init.half()
            w.data[r0 : r0 + k] = init.to(w.dtype)
        w.data[-1] = 0.0  # the zero row
        for v in state.values():
            v.data.zero_()
        views["ids"].zero_()
        views["id_last"].fill_(-1)
        views["id_count"].zero_()
        if n:
            w.data[:n] = got["weight"].to(dev, w.dtype)
            for k, v in state.items():
                v.data[:n] = got[f"state/{k}"].to(dev, v.dtype).reshape(v[:n].shape)
            for k in MAP_KEYS:
                views[k][:n] = got[k].to(dev)


# ---- export --------------------------------------------------------------------------------------------------
def export_map(
    path: Path, out: Path, prefix: str, name: str, rows: int, chunk_bytes: int, meta: dict, source: Any = None
) -> str:
    """Stream raw-id table `name`'s map into OUT/<name>.ids.safetensors (`ids`, `id_last`, `id_count`; written
    to a new temporary file first, renamed when complete, following no link: files.NewFile); returns the real
    path written."""
    nbytes = rows * 8
    header: dict[str, Any] = {"__metadata__": meta}
    for i, k in enumerate(MAP_KEYS):
        header[k] = {"dtype": "I64", "shape": [rows], "data_offsets": [i * nbytes, (i + 1) * nbytes]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    step = max(1, chunk_bytes // 8)
    new = NewFile(out, f"{name}.ids.safetensors", f"the id map of table {name!r}")
    with new as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for k in MAP_KEYS:
            buf = torch.zeros(min(step, rows), dtype=torch.int64)
            for r0 in range(0, rows, step):
                part = buf[: min(step, rows - r0)]
                read_pieces(path, [Piece(f"{prefix}/{name}/{k}", (rows,), (r0,), part)], source=source)
                f.write(part.numpy().tobytes())
    return new.path
