"""Save a training run: every rank writes only its own pieces, in chunks, through DCP; rank 0 writes the
manifest first and the COMMIT marker last (storage.py). `Checkpointer` is the training loop's interface.

Synchronous save (`async_save: false`): DCP copies one chunk at a time from the live tensors to the host and
writes it, so host memory stays within a few chunks; the loop waits for the write.
Asynchronous save (the default): the loop waits only while this rank's pieces are copied into host buffers
(pinned on CUDA, kept for the next save); a background thread writes them, on a gloo process group of its own,
and commits. Host memory: one copy of this rank's pieces. The next save (or `wait()`, `close()`) first waits for
the previous one; an error in the background is raised there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from embshard.checkpoint import integrity, raw_ids, storage
from embshard.checkpoint.layout import save_pieces, table_entries
from embshard.checkpoint.load import DEFAULT_CHUNK_BYTES, Resumed, load_checkpoint
from embshard.checkpoint.pieces import Piece, split_rows
from embshard.checkpoint.state import TrainState, dense_state, host_copy, rng_states
from embshard.runtime import comm
from embshard.runtime.comm import world_and_rank
from embshard.spec.tables import AllRanksError, ConfigError


@dataclass
class SaveStats:
    """Timing and size of one save, on this rank."""

    step: int
    path: str
    blocking_s: float = 0.0
    """Time the caller waited: the copy to host memory (async), or the whole save (sync)."""
    write_s: float = 0.0
    """Time from the start of writing to the commit."""
    bytes: int = 0
    """Bytes of this rank's pieces (tables and their optimizer state)."""
    done: bool = False


def _collect(state: TrainState, position: Any) -> tuple[list[Piece], dict[str, Any], bool, list[str]]:
    """This rank's pieces (live views), the plain state dict (dense part, step counts) to save, whether every
    rank has a data position (else the run resumes by step count), and the row tensors' names on any rank. One
    all-gather of small objects."""
    pieces: list[Piece] = []
    steps = {}
    for prefix, ebc in state.collections.items():
        if hasattr(ebc, "sync_replicas"):
            ebc.sync_replicas()  # periodic 2D: the replicas averaged, so group 0's holds the run's state
        pieces += save_pieces(ebc, prefix) + raw_ids.save_pieces(ebc, prefix)
        steps[prefix] = ebc.optimizer_step
    mine = (steps, position is not None, sorted({p.key for p in state.row_tensors}))
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    plain: dict[str, Any] = {}
    for prefix in steps:  # the ranks' lookups step together; a rank without lookups counts 0
        plain[f"{prefix}/optimizer_step"] = torch.tensor(max(e[0][prefix] for e in everyone), dtype=torch.int64)
    pieces += list(state.row_tensors)
    for name, counter in state.counters.items():
        plain[name] = torch.tensor(int(counter.get()), dtype=torch.int64)
    dense = dense_state(state)
    if dense:
        plain["dense"] = dense
    row_names = sorted({k for e in everyone for k in e[2]})  # a rank holding no rows of them has none
    return pieces, plain, all(e[1] for e in everyone), row_names


def manifest(state: TrainState, step: int, world: int, config: Any, positions: bool, row_names: list[str]) -> dict:
    """The manifest of a checkpoint of `state` at `step`."""
    from dataclasses import asdict

    collections = {}
    for prefix, ebc in state.collections.items():
        tables = table_entries(ebc)
        for t in ebc.tables:  # raw-id tables add their row blocks
            tables[t.name].update(raw_ids.table_entry(ebc, t))
        collections[prefix] = {
            "optimizer": asdict(ebc.optimizer),
            "column_wise_exact": bool(ebc.options.column_wise_exact),
            "plan": ebc.plan.to_dict(),
            "tables": tables,
        }
    opt = state.dense_optimizer
    return {
        "format": storage.FORMAT,
        "version": storage.VERSION,
        "step": step,
        "world_size": world,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "collections": collections,
        "row_tensors": row_names,
        "counters": sorted(state.counters),
        "dense": state.dense is not None,
        "dense_optimizer": type(opt).__name__ if opt is not None else None,
        "data_position": "per_rank" if positions else "step",
        "config": asdict(config) if config is not None else None,
    }


class Checkpointer:
    """Saves a run every so often and resumes it (collective: every rank builds it and calls `save` and `resume`
    together).

        ckpt = Checkpointer(state, folder, keep_last=3, async_save=True)
        start, position = ckpt.resume(resume_from)       # (0, None) when there is nothing to resume
        for step in range(start + 1, total + 1):
            batch = next(batches); ...train on it...
            ckpt.save(step, batch.position)              # when due; position: the data position AFTER this batch
        ckpt.close()                                     # waits for the last write

    Contract for the training loop: `save(step, position)` is called after step `step`'s update, with the data
    position of the last batch TRAINED on (a loop that fetches batches ahead passes the trained batch's
    position, not the prefetched one's); resuming continues with the batch after it.
    """

    def __init__(
        self,
        state: TrainState,
        folder: str | None,
        keep_last: int = 3,
        async_save: bool = True,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        io_threads: int = 2,
        config: Any = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.state, self.folder = state, Path(folder) if folder else None
        self.keep_last, self.async_save = keep_last, async_save
        self.chunk_bytes, self.io_threads = chunk_bytes, io_threads
        self.config, self.log = config, log or (lambda _s: None)
        self.world, self.rank = world_and_rank()
        self._group: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.history: list[SaveStats] = []
        self.resumed: Resumed | None = None
        """What the last `resume` loaded."""

    # ---- resume ------------------------------------------------------------------------------------------
    def resume(self, resume_from: str | None) -> tuple[int, Any]:
        """Load `resume_from` (a checkpoint folder, or 'latest': the newest complete one in the folder) into
        the state; returns (step, data position) to continue from, or (0, None) when there is nothing to load.
        Collective: every rank loads the same checkpoint (rank 0 picks it), and the ranks agree on the outcome.
        A damaged checkpoint (a file not what its save recorded) is refused when named, skipped for the next older
        intact one under 'latest' (with a message naming the file); an error is raised on every rank
        (AllRanksError)."""
        if not resume_from:
            return 0, None
        if resume_from != "latest":
            resumed = self._load_everywhere(resume_from)
        else:
            found = [str(p) for _, p, ok in storage.checkpoints(self.folder) if ok] if self.folder is not None else []
            if dist.is_initialized() and self.world > 1:
                box = [found]
                dist.broadcast_object_list(box, src=0)
                found = box[0]
            skipped: list[str] = []
            for path in reversed(found):
                try:
                    resumed = self._load_everywhere(path, skip_damaged=True)
                    break
                except integrity.CheckpointDamaged as e:
                    skipped.append(f"{path}: {e.brief}")
                    self.log(f"checkpoint.resume_from=latest: {path} is damaged ({e.brief}); trying the one before it")
            else:
                if skipped:
                    raise AllRanksError(
                        f"checkpoint.resume_from=latest: every checkpoint in {str(self.folder)!r} is damaged: "
                        + "; ".join(skipped)
                        + ". Fix: restore the files from a copy, or start afresh (checkpoint.resume_from=null, or "
                        "another checkpoint.dir: a save in this folder removes the damaged checkpoints)"
                    )
                self.log(f"checkpoint.resume_from=latest: no complete checkpoint in {str(self.folder)!r}; step 0")
                return 0, None
        path, self.resumed = resumed.path, resumed
        self.log(f"resumed from {path} at step {resumed.step}")
        if not resumed.verified:
            self.log(f"note: {path} was saved without checksums (by an older embshard): its data could not be verified")
        later = [s for s, _, _ in storage.checkpoints(self.folder)] if self.folder is not None else []
        later = [s for s in later if s > resumed.step]
        if later:
            self.log(f"{self.folder} holds checkpoints of later steps {later}: the first save of this run removes them")
        return resumed.step, resumed.position

    def _load_everywhere(self, path: str, skip_damaged: bool = False) -> Resumed:
        """load_checkpoint on every rank, then agree: if any rank failed, every rank raises its error (the lowest
        failing rank's): a CheckpointDamaged when `skip_damaged` and it was damage, else AllRanksError. A rank's
        unexpected exception is re-raised there as it was (the others raise AllRanksError naming it)."""
        resumed: Resumed | None = None
        mine: tuple[str, str, Any] | None = None
        error: BaseException | None = None
        try:
            resumed = load_checkpoint(path, self.state, self.chunk_bytes)
        except integrity.CheckpointDamaged as e:
            error, mine = e, ("damaged", str(e), (e.folder, e.file, e.expected, e.found))
        except ConfigError as e:
            error, mine = e, ("config", str(e), None)
        except Exception as e:
            error, mine = e, ("error", f"{type(e).__name__}: {e}", None)
        outcomes = [mine]
        if dist.is_initialized() and self.world > 1:
            outcomes = [None] * self.world
            dist.all_gather_object(outcomes, mine)
        failed = [(r, o) for r, o in enumerate(outcomes) if o is not None]
        if not failed:
            assert resumed is not None
            return resumed
        if mine is not None and mine[0] == "error":
            raise error  # type: ignore[misc]  # a bug: its traceback, on the rank where it happened
        rank, (kind, message, damage) = failed[0]
        if kind == "damaged" and skip_damaged:
            raise integrity.CheckpointDamaged(*damage)
        if kind == "error":
            message = f"failed while loading checkpoint {path!r}: {message}"
        raise AllRanksError(f"rank {rank}: {message}" if self.world > 1 else message) from None

    # ---- save --------------------------------------------------------------------------------------------
    def save(self, step: int, position: Any = None) -> SaveStats:
        """Checkpoint the state after training step `step`; `position`: the data position after the last trained
        batch (None: resume by step count). Collective. Returns this save's statistics (filled in as it ends)."""
        if self.folder is None:
            raise ValueError("Checkpointer.save needs a folder (checkpoint.dir)")
        t0 = time.perf_counter()
        self.wait()
        if self._group is None and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # its own group: the writer thread's collectives
        pieces, plain, positions, row_names = _collect(self.state, position)
        record = {"position": position if positions else None, "rng": rng_states()}
        plain[f"rank/{self.rank}"] = storage.to_json(record)
        chunks = [c for p in pieces for c in split_rows(p, self.chunk_bytes)]
        path = storage.step_dir(self.folder, step)
        stats = SaveStats(step, str(path), bytes=sum(c.nbytes for c in chunks))
        info = manifest(self.state, step, self.world, self.config, positions, row_names)
        self.history.append(stats)
        if self.async_save:
            chunks = self._snapshot(chunks)
            plain = host_copy(plain)
            stats.blocking_s = time.perf_counter() - t0
            self.log(f"checkpoint step {step}: {stats.bytes / 2**20:.1f} MiB copied in {stats.blocking_s:.2f} s, written "
                     "in the background")  # fmt: skip
            self._thread = threading.Thread(
                target=self._run, args=(path, chunks, plain, info, stats), name=f"checkpoint-{step}", daemon=True
            )
            self._thread.start()
        else:
            self._write(path, chunks, plain, info, stats)
            stats.blocking_s = time.perf_counter() - t0
        return stats

    def _snapshot(self, chunks: list[Piece]) -> list[Piece]:
        """Copies of the chunks in host memory (pinned buffers on CUDA, reused from the last save)."""
        out, cuda = [], False
        for c in chunks:
            key = (c.key, c.offsets)
            buf = self._buffers.get(key)
            src = c.tensor.detach()
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                self._buffers[key] = buf
            buf.copy_(src, non_blocking=src.is_cuda)
            cuda = cuda or src.is_cuda
            out.append(Piece(c.key, c.size, c.offsets, buf))
        live = {(c.key, c.offsets) for c in chunks}
        self._buffers = {k: v for k, v in self._buffers.items() if k in live}
        if cuda:
            torch.cuda.synchronize()
        return out

    def _run(self, path: Path, chunks: list[Piece], plain: dict, info: dict, stats: SaveStats) -> None:
        try:
            self._write(path, chunks, plain, info, stats)
        except BaseException as e:  # raised in the caller's thread by the next wait()
            self._error = e

    def _write(self, path: Path, chunks: list[Piece], plain: dict, info: dict, stats: SaveStats) -> None:
        t0 = time.perf_counter()
        manifest_record = storage.prepare(path, info) if self.rank == 0 else None
        if self._group is not None:
            comm.barrier(self._group)  # the folder is ready before any rank writes into it
        writer = storage.writer(path, self.io_threads)
        dcp.save(
            plain,
            storage_writer=writer,
            planner=storage.PieceSavePlanner(chunks),
            process_group=self._group,
            no_dist=self._group is None,
        )
        sums = [writer.fs.sums]  # this rank's files' CRC-32, computed as they were written
        if self._group is not None:
            everyone: list | None = [None] * dist.get_world_size(self._group) if self.rank == 0 else None
            dist.gather_object(sums[0], everyone, dst=0, group=self._group)
            sums = everyone or []
        stats.write_s = time.perf_counter() - t0
        if self.rank == 0:
            files = {storage.MANIFEST: manifest_record, **integrity.files_record(sums)}
            info = {"step": stats.step, "bytes": self._total_bytes(path), "write_s": round(stats.write_s, 3)}
            storage.commit(path, info, files)
            storage.prune(self.folder, self.keep_last, stats.step)
        stats.done = True

    @staticmethod
    def _total_bytes(path: Path) -> int:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())

    def wait(self) -> None:
        """Wait until the pending save (if any) is committed; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint save failed: {error}") from error

    def close(self) -> None:
        """Wait for the pending save and release the writer's process group."""
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
