"""Sharded checkpoints of a training run (docs/checkpoints.md).

Save: every rank writes only its own shards of every table, with the fused optimizer's state, in chunks, as a
torch.distributed.checkpoint (DCP) checkpoint; rank 0 adds the dense model and optimizer (replicated, written
once), Adam's step counts, per rank the data position and RNG states, and a manifest (plan, tables, config);
a COMMIT marker written last makes it visible. Asynchronous by default: the step loop waits only for the copy
to host memory. Load: under any world size, plan, sharding type or tier, every rank reads only the rows its
shards need. COMMIT records every file's size and CRC-32 (computed as it is written); every chunk read is checked
against them; nothing read from a checkpoint can run code, and no name in it reaches outside its folder.

- pieces.py: `Piece`, a block of a logical tensor (the unit written, read and checked); `split_rows`
- layout.py: the logical tensors of a collection; the pieces a rank writes and reads; state-layout mapping
- raw_ids.py: raw-id tables' id -> row maps (their pieces, resharding, export)
- storage.py: the folder layout (manifest, COMMIT, latest, pruning) and the DCP save planner over pieces
- reading.py: `read_pieces`: the checked reader and load planner (chunks cover what is read, as declared)
- state.py: what else a run saves (dense part, RNG states); `TrainState`
- save.py: `Checkpointer` (save: sync or async, keep the last K; resume)
- load.py: `load_checkpoint`
- integrity.py: the checksums: written with the files, checked as they are read, `verify_folder`
- unpickle.py: DCP's index and non-tensor items read with allow-lists (no code from a checkpoint runs)
- files.py: a checkpoint's files read and written without trusting them (plain names, regular files only, sizes
  and caps, no link followed)
- embshard/tools/checkpoint.py: `embshard checkpoint inspect DIR [--verify]` and `embshard checkpoint export DIR
  --out OUT`
"""

from __future__ import annotations

from typing import Any

from embshard.checkpoint.load import Resumed, load_checkpoint
from embshard.checkpoint.save import Checkpointer, SaveStats
from embshard.checkpoint.state import TrainState
from embshard.checkpoint.storage import latest, read_manifest, step_dir

__all__ = [
    "Checkpointer",
    "Resumed",
    "SaveStats",
    "TrainState",
    "checkpointer",
    "latest",
    "load_checkpoint",
    "read_manifest",
    "step_dir",
]


def checkpointer(cfg: Any, model: Any, dense_optimizer: Any, config: Any = None, log: Any = None) -> Checkpointer:
    """The Checkpointer of a RecModel and its dense optimizer, set up from the `checkpoint:` config section."""
    return Checkpointer(
        TrainState.of_model(model, dense_optimizer),
        cfg.dir,
        keep_last=cfg.keep_last,
        async_save=cfg.async_save,
        chunk_bytes=int(cfg.chunk_mib * (1 << 20)),
        io_threads=cfg.io_threads,
        config=config,
        log=log,
    )
