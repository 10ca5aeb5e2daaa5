"""Load a checkpoint into a training run of any world size and plan: every rank, on its own (no collective),
reads the rows its shards need (layout.load_targets) straight into its live tensors with DCP's resharding reads,
one saved chunk at a time; then the dense part, Adam's step counts, and (same world size only) its data position
and random number generator states. UVM caches are written back and emptied before the weights are written.
Raw-id tables' maps are read with their rows, or resharded when their row blocks changed (raw_ids.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from embshard.checkpoint import raw_ids
from embshard.checkpoint.layout import Conversion, check_tables, load_targets
from embshard.checkpoint.pieces import Piece, split_rows
from embshard.checkpoint.reading import VerifyingReader, read_pieces, reader
from embshard.checkpoint.state import TrainState, dense_state, set_dense_state, set_rng_states
from embshard.checkpoint.storage import read_manifest
from embshard.runtime.comm import world_and_rank
from embshard.spec.tables import ConfigError

DEFAULT_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Resumed:
    """What a load restored."""

    path: str
    """The checkpoint folder."""
    step: int
    """The training step it was saved after."""
    position: Any
    """This rank's data position after that step (the last trained batch's `Batch.position`), when the world size
    is the saved one and the source gave positions; else the step count."""
    saved_world_size: int
    """The world size it was saved under."""
    verified: bool = True
    """Whether what was read was checked against checksums (False: saved before embshard recorded them)."""


def _convert(path: str | os.PathLike, conversions: list[Conversion], chunk_bytes: int, source: VerifyingReader) -> None:
    """Fill rowwise_adagrad states from saved per-block states, in rounds of about `chunk_bytes` read."""
    jobs: list[tuple[Conversion, int, torch.Tensor]] = []
    for c in conversions:
        n_blocks = c.size[1]
        rows = max(1, chunk_bytes // (4 * n_blocks))
        for r0 in range(0, c.target.shape[0], rows):
            jobs.append((c, r0, torch.empty(min(rows, c.target.shape[0] - r0), n_blocks)))
    start = 0
    while start < len(jobs):
        end, size = start, 0
        while end < len(jobs) and (end == start or size + jobs[end][2].numel() * 4 <= chunk_bytes):
            size += jobs[end][2].numel() * 4
            end += 1
        batch = jobs[start:end]
        read_pieces(path, [Piece(c.key, c.size, (c.row_offset + r0, 0), buf) for c, r0, buf in batch], source=source)
        with torch.no_grad():
            for c, r0, buf in batch:
                value = (buf.double() @ c.weights_n).to(c.target.dtype)
                c.target[r0 : r0 + buf.shape[0]].copy_(value.to(c.target.device))
        start = end


def load_checkpoint(
    path: str | os.PathLike,
    state: TrainState,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    restore_rng: bool = True,
    verify: bool = True,
) -> Resumed:
    """Load the committed checkpoint `path` into this rank's `state` (any world size, plan, sharding type or
    tier). Not a collective: every rank reads what it needs on its own. Raises ConfigError naming what does not
    match (tables, shapes, optimizer) and the fix; CheckpointDamaged (a ConfigError) when a file it reads is not
    what the save recorded, UnsafeCheckpoint when a file asks to run code. After such an error the state is
    partly loaded: load another checkpoint into it (Checkpointer.resume does) or rebuild it. `verify=False` skips
    the checksums (bench/checkpoint_bench.py measures their cost with it)."""
    manifest = read_manifest(path)
    where = f"checkpoint {str(path)!r}"
    world, rank = world_and_rank()
    pieces: list[Piece] = []
    conversions: list[Conversion] = []
    moved: dict[str, list[str]] = {}  # raw-id tables whose rows move under this plan (raw_ids.py)
    plain: dict[str, Any] = {}
    saved_collections = manifest["collections"]
    for prefix, ebc in state.collections.items():
        ebc.drop_caches()  # UVM-caching: written back and emptied BEFORE the weights are written (sharded.py)
        saved = saved_collections.get(prefix)
        try:
            check_tables(ebc, prefix, saved["tables"] if saved else None, where)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        kind = saved["optimizer"]["kind"]
        if kind != ebc.optimizer.kind.value:
            raise ConfigError(
                f"{where}: collection {prefix!r} was trained with the {kind} optimizer, this run uses "
                f"{ebc.optimizer.kind.value}: its state does not carry over; resume with sparse_optimizer.kind: {kind}"
            )
        p, c = load_targets(ebc, prefix, saved["tables"])
        p, moved[prefix] = raw_ids.load_targets(ebc, prefix, saved["tables"], p, where)
        pieces += p
        conversions += c
        plain[f"{prefix}/optimizer_step"] = torch.zeros((), dtype=torch.int64)
    saved_rows = set(manifest.get("row_tensors", []))
    for piece in state.row_tensors:
        if piece.key not in saved_rows:
            raise ConfigError(f"{where} has no {piece.key!r}: it was saved from a model without it")
        pieces.append(piece)
    for name in state.counters:
        if name not in manifest.get("counters", []):
            raise ConfigError(f"{where} has no {name!r}: it was saved from a model without it")
        plain[name] = torch.zeros((), dtype=torch.int64)
    if state.dense is not None:
        if not manifest.get("dense"):
            raise ConfigError(f"{where} holds no dense model")
        plain["dense"] = dense_state(state)
        if state.dense_optimizer is not None and not manifest.get("dense_optimizer"):
            raise ConfigError(f"{where} holds no dense optimizer")
    same_world = manifest["world_size"] == world
    if same_world:
        plain[f"rank/{rank}"] = ""
    chunks = [c for p in pieces for c in split_rows(p, chunk_bytes)]
    source = reader(path, verify)
    loaded = read_pieces(path, chunks, plain, source)
    if conversions:
        _convert(path, conversions, chunk_bytes, source)
    for prefix, ebc in state.collections.items():
        raw_ids.finish_load(path, ebc, prefix, moved[prefix], chunk_bytes, source)
    if state.dense is not None:
        set_dense_state(state, loaded["dense"])
    for prefix, ebc in state.collections.items():
        ebc.optimizer_step = int(loaded[f"{prefix}/optimizer_step"])
    for name, counter in state.counters.items():
        counter.set(int(loaded[name]))
    position: Any = manifest["step"]
    if same_world:
        record = json.loads(loaded[f"rank/{rank}"])
        if record.get("position") is not None:
            position = record["position"]
        if restore_rng:
            set_rng_states(record["rng"])
    return Resumed(str(path), int(manifest["step"]), position, int(manifest["world_size"]), source.record is not None)
