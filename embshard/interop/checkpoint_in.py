"""A TorchRec DistributedModelParallel checkpoint into an embshard model on any plan and world size.

    load_torchrec_checkpoint(path, model, module_path="model")     # a DCP folder (every rank reads its rows)
    load_torchrec_state_dict(model, dmp.state_dict(), dmp.fused_optimizer.state_dict())  # in memory (collective)

`path` is what the TorchRec job saved with
`dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=path)`
(`model_key` / `optim_key` name other top-level keys; None: at the top). `model` is a RecModel from
`rec_model_from_torchrec` (tables and dense part; `module_path`: where the TorchRec model given to it sits in the
module DMP wrapped, '' for the module itself, 'model' for a DLRMTrain) or a ShardedEmbeddingBagCollection
(`module_path`: the path of TorchRec's EmbeddingBagCollection) or a ShardedEmbeddingCollection (sequence tables;
`module_path`: the path of TorchRec's EmbeddingCollection, whose tables DMP holds as `embeddings.T.weight`). The
in-memory form takes the state dicts of every
rank (ShardedTensors: their local shards; torch.load of per-rank torch.save files gives them back) or unsharded
ones; it gathers every rank's shards on every rank, so it is for models that fit one host's memory: use DCP for
large ones.

Every rank reads what its shards need (DCP's resharding reads, embshard.checkpoint.reading), after the ranks have
agreed that the checkpoint fits the model (every table's shape, the optimizer state's, the TorchRec job's world
size: an error raises on every rank). Optimizer state:
per-element state (Adagrad, Adam's moments) is read like the weights; row-wise Adagrad's per-row state is read per
row, except that a column-wise TorchRec table keeps one state per column block (`[rows * blocks]`, block-major):
embshard takes their width-weighted mean where it keeps one state per row (exact column-wise and other sharding
types) and the overlap-weighted mean (a copy, for the same blocks) where it keeps one per block. Returned notes say
what was not in the checkpoint (data-parallel tables' optimizer state, which TorchRec keeps outside the fused
optimizer; Adam's step count) and so starts from zero.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from embshard.checkpoint.layout import PER_BLOCK, Piece, row_state_layout
from embshard.interop.checkpoint_world import world_evidence
from embshard.interop.common import (
    BAGS,
    SEQUENCES,
    default_world_size,
    flatten,
    join,
    state_key,
    state_scale,
    weight_key,
)
from embshard.spec.optim import OptimizerKind
from embshard.spec.plan import ShardingType
from embshard.spec.tables import ConfigError


class _DCPSource:
    """A DCP checkpoint folder: its index (read without running code) and reads of pieces (no collective). A
    TorchRec checkpoint has no embshard COMMIT record: its chunks are read unverified."""

    def __init__(self, path: str | os.PathLike) -> None:
        from embshard.checkpoint.reading import VerifyingReader

        self.path = path
        self.reader = VerifyingReader(path, None)
        self.metadata = self.reader.read_metadata()
        self.meta = self.metadata.state_dict_metadata

    def world_size(self, given: int | None) -> int:
        """The saving TorchRec job's world size: read from the index (checkpoint_world), `given` checked against
        it, or ConfigError when neither says it."""
        ev = world_evidence(self.metadata)
        where = f"TorchRec checkpoint {str(self.path)!r}"
        if given is not None:
            if given < max(ev.lower, 1) or (ev.exact is not None and given != ev.exact):
                shown = f"{ev.exact} ranks (the row blocks of {ev.spanning!r})" if ev.exact else f">= {ev.lower} ranks"
                raise ConfigError(
                    f"{where}: torchrec_world_size={given} does not fit the checkpoint, saved by {shown}: pass the "
                    "world size of the TorchRec job that saved it"
                )
            return int(given)
        if ev.exact is None:
            wrote = f"; ranks 0..{ev.lower - 1} wrote to it" if ev.lower else ""
            raise ConfigError(
                f"{where} does not say the world size of the TorchRec job that saved it (no table sharded row-wise "
                f"over every rank{wrote}): pass torchrec_world_size=W, that job's number of ranks (TorchRec's "
                "optimizer state is scaled by it), or gradient_division=False if TorchRec ran without gradient "
                "division"
            )
        return ev.exact

    def chunks(self, key: str) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]] | None:
        md = self.meta.get(key)
        if md is None or not hasattr(md, "chunks"):
            return None
        return tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]

    def read(self, pieces: list[Piece], plain: dict[str, torch.Tensor]) -> None:
        from embshard.checkpoint.reading import read_pieces

        missing = [k for k in plain if k not in self.meta]
        if missing:
            raise ConfigError(
                f"TorchRec checkpoint {str(self.path)!r} has no {missing[:3]} (of {len(missing)} dense tensors): check "
                "module_path and model_key, and that the model is the one saved"
            )
        read_pieces(self.path, pieces, plain, source=self.reader)


class _MemorySource:
    """State dicts in memory: every rank's ShardedTensor shards, gathered on every rank (collective)."""

    def __init__(self, tree: Mapping[str, Any]) -> None:
        local: dict[str, tuple] = {}  # key -> (size, [(offsets, tensor)]); a rank lacks what it holds no shard of
        for key, v in flatten(tree).items():
            if hasattr(v, "local_shards"):  # ShardedTensor
                _check_placements(key, v)
                parts = [(tuple(s.metadata.shard_offsets), s.tensor.detach().cpu()) for s in v.local_shards()]
                local[key] = (tuple(v.size()), parts)
            elif type(v) is torch.Tensor:
                local[key] = (tuple(v.shape), [((0,) * v.dim(), v.detach().cpu())])
            elif isinstance(v, torch.Tensor):
                raise ConfigError(
                    f"state dict entry {key!r} is a {type(v).__name__}: save it with DCP and use "
                    "load_torchrec_checkpoint"
                )
        gathered = [local]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, local)
        self.sizes: dict[str, tuple[int, ...]] = {}
        self.parts: dict[str, list] = {}
        for rank_parts in gathered:
            for key, (size, items) in rank_parts.items():
                self.sizes[key] = size
                have = self.parts.setdefault(key, [])
                have += [(o, t) for o, t in items if all(o != p for p, _ in have) and t.numel() > 0]

    def chunks(self, key: str):
        if key not in self.sizes:
            return None
        return self.sizes[key], [(o, tuple(t.shape)) for o, t in self.parts.get(key, [])]

    def read(self, pieces: list[Piece], plain: dict[str, torch.Tensor]) -> None:
        for p in pieces:
            _fill(p.tensor, p.offsets, self.parts[p.key])
        for key, t in plain.items():
            if key not in self.sizes:
                raise ConfigError(f"the TorchRec state dict has no {key!r}: it was saved from another model")
            _fill(t, (0,) * t.dim(), self.parts[key])


def _check_placements(key: str, v: Any) -> None:
    """A ShardedTensor of a job with more ranks than this one: its other ranks' shards are not here."""
    world = default_world_size(None)
    ranks = [m.placement.rank() for m in v.metadata().shards_metadata if m.placement is not None]
    if ranks and max(ranks) >= world:
        raise ConfigError(
            f"state dict entry {key!r} is sharded over ranks up to {max(ranks)}, but this job has {world}: load the "
            f"state dicts in a job of as many ranks (each rank its own), or save them with DCP and use "
            "load_torchrec_checkpoint"
        )


def _fill(target: torch.Tensor, offsets: tuple[int, ...], parts: list) -> None:
    """Copy into `target` (at `offsets` of the logical tensor) every overlapping part (offsets, tensor)."""
    with torch.no_grad():
        for o, t in parts:
            src, dst = t, target
            for dim, (a, n, b, m) in enumerate(zip(o, t.shape, offsets, target.shape)):
                lo, hi = max(a, b), min(a + n, b + m)
                if hi <= lo:
                    break
                src, dst = src.narrow(dim, lo - a, hi - lo), dst.narrow(dim, lo - b, hi - lo)
            else:
                dst.copy_(src.to(dst.dtype))


def _targets(target: Any, module_path: str) -> tuple[Any, str, Any]:
    """(sharded collection, TorchRec path of its EmbeddingBagCollection, TorchRecDense or None) of the target."""
    from embshard.interop.model_in import TorchRecDense

    ebc = getattr(target, "ebc", target)
    dense = target.dense_module() if hasattr(target, "dense_module") else None
    if dense is not None and not isinstance(dense, TorchRecDense):
        raise ConfigError(
            "the model's dense part is not a TorchRec model's: build it with embshard.interop.rec_model_from_torchrec, "
            "or load into its `ebc` alone"
        )
    ebc_path = join(module_path, dense.ebc_path) if dense is not None else module_path
    raw = [t.name for t in ebc.tables if t.raw_ids]
    if raw:  # both ways: TorchRec's rows carry no id -> row map, and an embshard map has no place in TorchRec's
        raise ConfigError(
            f"tables {raw} have ids: raw: their rows mean something only with their id -> row maps, which TorchRec's "
            "EmbeddingBagCollection has no place for; export them with `embshard checkpoint export` (rows and maps), "
            "or move them between TorchRec and embshard as tables with ids: index"
        )
    return ebc, ebc_path, dense


def _row_state_reads(ebc: Any, name: str, sh: Any, s: torch.Tensor, skey: str, blocks: list, size: tuple) -> list:
    """The reads that fill row-wise Adagrad state `s` of shard `sh` from TorchRec's `[rows * blocks]` state `skey`
    (column blocks `blocks`): [(weight, piece)], the state being the weighted sum of the pieces' tensors."""
    R, D = next((t.num_embeddings, t.embedding_dim) for t in ebc.tables if t.name == name)
    n = size[0] // R
    if size != (R * n,) or n != len(blocks):
        raise ConfigError(
            f"table {name!r}: TorchRec's {skey!r} is {size}, not [rows x column blocks] = {(R * len(blocks),)}"
        )
    r0 = 0 if ebc.plan[name].sharding_type is ShardingType.COLUMN_WISE else sh.row_offset
    if row_state_layout(ebc.plan[name], ebc.optimizer, ebc.options) == PER_BLOCK:  # mean over this block's columns
        c0, c1 = sh.col_offset, sh.col_offset + sh.num_cols
        weights = [max(0, min(c1, b0 + bw) - max(c0, b0)) / sh.num_cols for b0, bw in blocks]
    else:  # per row: mean over the row's columns
        weights = [bw / D for _, bw in blocks]
    if sorted(weights) == [0.0] * (n - 1) + [1.0]:  # one block: read straight into the state
        return [(1.0, Piece(skey, (R * n,), (weights.index(1.0) * R + r0,), s))]
    return [(wt, Piece(skey, (R * n,), (b * R + r0,), torch.empty(s.shape[0]))) for b, wt in enumerate(weights) if wt]


def _attr(ebc: Any) -> str:
    """Where TorchRec keeps the collection's tables: `embeddings` for sequence tables (a ShardedEmbeddingCollection,
    TorchRec's EmbeddingCollection), else `embedding_bags`."""
    from embshard.collection.sequence import ShardedEmbeddingCollection

    return SEQUENCES if isinstance(ebc, ShardedEmbeddingCollection) else BAGS


def _agree(ebc: Any, error: str | None) -> None:
    """Every rank of the collection raises if any rank found an error (one all-gather of the ranks' errors): a
    mismatch seen only where a table's shards are raises on every rank, before any rank returns."""
    if ebc.world_size > 1 and dist.is_available() and dist.is_initialized():
        errors: list[str | None] = [None] * ebc.world_size
        dist.all_gather_object(errors, error, group=ebc.group)
        found = [(r, e) for r, e in enumerate(errors) if e]
        if found:
            rank, first = found[0]
            raise ConfigError(first if rank == ebc.rank else f"rank {rank}: {first}")
    elif error:
        raise ConfigError(error)


def _check_tables(source: Any, ebc: Any, ebc_path: str, model_key: str | None) -> None:
    """Every table of the collection (not only this rank's) is in the checkpoint with the model's shape."""
    for t in ebc.tables:
        R, D = t.num_embeddings, t.embedding_dim
        key = weight_key(ebc_path, t.name, model_key, _attr(ebc))
        found = source.chunks(key)
        if found is None or found[0] != (R, D):
            got = f"{found[0][0]} rows x {found[0][1]} columns" if found and len(found[0]) == 2 else found and found[0]
            raise ConfigError(
                f"table {t.name!r}: the TorchRec checkpoint has no {key!r} of {R} rows x {D} columns (found: {got}): "
                "check module_path / model_key and that the model's tables are the checkpoint's"
            )


def _load(
    source: Any,
    target: Any,
    module_path: str,
    model_key: str | None,
    optim_key: str | None,
    scale_ws: Callable[[], int],
) -> list[str]:
    """Load `source` into `target`. Every check runs before any read, and the ranks agree on its outcome
    (`_agree`). `scale_ws()`: the TorchRec job's world size, asked only if the checkpoint has optimizer state to
    convert."""
    ebc, ebc_path, dense = _targets(target, module_path)
    error = None
    try:
        _check_tables(source, ebc, ebc_path, model_key)
        kinds = [k for k in ("m", "v") if ebc.optimizer.kind is not OptimizerKind.SGD]
        attr = _attr(ebc)
        has_state = any(
            source.chunks(state_key(ebc_path, t.name, k, optim_key, attr)) for t in ebc.tables for k in kinds
        )
        ws = scale_ws() if has_state else 1
        pieces, states, notes = _plan_reads(source, ebc, ebc_path, model_key, optim_key, ws)
    except ConfigError as e:
        error = str(e)
    _agree(ebc, error)
    ebc.drop_caches()  # UVM-caching: written back and emptied BEFORE the weights are written
    plain: dict[str, torch.Tensor] = {}
    if dense is not None:
        plain = {join(model_key or "", module_path, k): v for k, v in dense.model.state_dict().items()}
    source.read(pieces, plain)
    with torch.no_grad():
        for s, factor, reads in states:
            if reads[0][1].tensor is s:  # read in place
                s.mul_(factor)
            else:
                value = sum(wt * p.tensor.double() for wt, p in reads) * factor
                s.copy_(value.to(device=s.device, dtype=s.dtype))
    if ebc.optimizer.kind is OptimizerKind.ADAM:
        notes.add("Adam's step count is not read from TorchRec's checkpoint: set ebc.optimizer_step to resume it")
    return sorted(notes)


def _plan_reads(
    source: Any, ebc: Any, ebc_path: str, model_key: str | None, optim_key: str | None, ws: int
) -> tuple[list[Piece], list[tuple[torch.Tensor, float, list]], set[str]]:
    """The reads of this rank's shards and their state: (pieces, [(state, factor to embshard's scale, [(weight,
    piece)])], notes)."""
    configs = {t.name: t for t in ebc.tables}
    pieces: list[Piece] = []
    states: list[tuple[torch.Tensor, float, list]] = []
    notes: set[str] = set()
    for (name, sh, w), (_, _, state) in zip(ebc.local_shards(), ebc.local_optimizer_states()):
        R, D = configs[name].num_embeddings, configs[name].embedding_dim
        key = weight_key(ebc_path, name, model_key, _attr(ebc))
        found = source.chunks(key)
        pieces.append(Piece(key, (R, D), (sh.row_offset, sh.col_offset), w))
        blocks = sorted({(o[1], s[1]) for o, s in found[1] if s[0] > 0 and s[1] > 0})
        for k, s in state.items():
            skey = state_key(ebc_path, name, k, optim_key, _attr(ebc))
            saved = source.chunks(skey)
            if saved is None:
                notes.add(f"table {name!r}: the checkpoint has no {skey!r}: its {k} state starts from zero")
                continue
            if s.dim() == 2:
                if saved[0] != (R, D):
                    raise ConfigError(f"table {name!r}: TorchRec's {skey!r} is {saved[0]}, not the table's {(R, D)}")
                reads = [(1.0, Piece(skey, (R, D), (sh.row_offset, sh.col_offset), s))]
            else:
                reads = _row_state_reads(ebc, name, sh, s, skey, blocks, saved[0])
            pieces += [p for _, p in reads]
            states.append((s, state_scale(ebc.optimizer.kind.value, k, ws), reads))
    return pieces, states, notes


def load_torchrec_checkpoint(
    path: str | os.PathLike,
    target: Any,
    module_path: str = "",
    *,
    model_key: str | None = "model",
    optim_key: str | None = "optim",
    torchrec_world_size: int | None = None,
    gradient_division: bool = True,
) -> list[str]:
    """Load TorchRec's DCP checkpoint `path` into `target` (module docstring): tables, optimizer state, and the
    dense part of a RecModel. Every rank of the collection calls it: the ranks agree on the checks (one small
    all-gather) before any reads, so a mismatch (e.g. a table with other rows than the checkpoint's) raises on
    every rank; the reads need no collective. The optimizer state is converted to embshard's gradient scale
    (embshard.interop.common.GRADIENT_DIVISION) for the world size of the TorchRec job that saved it: read from
    the checkpoint (a table sharded row-wise over every rank; embshard.interop.checkpoint_world), else
    `torchrec_world_size` is required (and, when given, checked against the checkpoint); `gradient_division=False`:
    TorchRec ran with it off, no conversion. Returns notes on the state not found in the checkpoint (it starts
    from zero)."""
    source = _DCPSource(path)
    ws = (lambda: source.world_size(torchrec_world_size)) if gradient_division else (lambda: 1)
    return _load(source, target, module_path, model_key, optim_key, ws)


def load_torchrec_state_dict(
    target: Any,
    state_dict: Mapping[str, Any],
    optim_state_dict: Mapping[str, Any] | None = None,
    module_path: str = "",
    gradient_division: bool = True,
) -> list[str]:
    """Load a TorchRec DMP `state_dict()` (and `fused_optimizer.state_dict()`) of every rank into `target`
    (module docstring). A collective: every rank calls it with its own state dicts, so the TorchRec job's world
    size is this job's (for the optimizer state's conversion, as in `load_torchrec_checkpoint`)."""
    tree = {"model": state_dict, "optim": optim_state_dict or {}}
    ws = default_world_size(None) if gradient_division else 1
    return _load(_MemorySource(tree), target, module_path, "model", "optim", lambda: ws)
