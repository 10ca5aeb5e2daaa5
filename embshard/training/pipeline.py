"""Training pipelines: one optimizer step per `progress()` call, with the next batches' work overlapped.

Stages of a batch, in the order it meets them (docs/architecture.md, "Training pipeline"):

    host     a background thread takes the batch from the data source (itself fed by worker processes), pins it
             and counts its ids per feature on the host (`ShardedEmbeddingBagCollection.host_counts`)
    agree    one all-gather of every rank's counts row over a CPU (gloo) group: whether each rank still has
             data, the batch sizes and ids per feature, the step (no device sync); started a batch early, so it
             completes in the background and no step waits on a host rendezvous
    copy     host -> device, non-blocking from pinned memory, on a side stream ("data")
    dist     its input dist (`ebc.prefetch`, sized from the host counts), on the data stream; UVM-cache
             prefetch with LookupOptions(prefetch_pipeline=True)
    lookup   the embedding forward (semi_sync: run ahead on the "emb" stream, `ebc.lookup_ahead`)
    train    dense forward, loss, backward (sparse update fused into it), dense optimizer step

Modes (`TrainPipeline(mode=...)`, YAML `training.pipeline`):
- none: host and agree run ahead; copy, the counts all-gather, dist, lookup and train run in sequence on one
  stream, with the step's host sync (the plain loop).
- sparse_dist: while batch i trains, batch i+1 is copied and its input dist runs (issued after batch i's
  forward, before its backward). Losses are those of `none`, bit for bit.
- semi_sync: as sparse_dist, and batch i+1's lookup is issued before batch i's backward (on its own stream on
  CUDA, overlapping batch i's dense work). Staleness: the lookup of batch i+1 reads the tables as they were
  before batch i's sparse update (batch i's backward runs after it); it sees every earlier update. Only rows
  touched by both batches differ from sparse_dist's values; the update of batch i+1 still lands on rows that
  include batch i's update (the fused optimizer applies gradients to the current rows). Dense weights are not
  stale. Refused with UVM-caching tables, with a retrieval catalog and with sequence tables.

With sequence tables (`RecModel.ec`, a ShardedEmbeddingCollection) every exchange of a step runs in its forward:
the sequence collection's and, as in catalog mode, the embedding-bag collection's (the batch counts are gathered
on the device); host, agree and copy still run ahead.

With the model's whole-step graph (`ModelGraphs.whole`, training.cuda_graph with graph_scope step;
embshard/training/step_graph.py) a batch whose agreed counts equal the step before's is trained by one replay: dist,
lookup, train and both updates inside the graph. While the graph is in use the dist stage is not run ahead (a batch
that does not replay runs it just before its forward); host, agree and copy still overlap the replay.

Every rank runs the same collectives in the same order: the agree step is one collective per batch, and when some
rank's data ends first it feeds empty batches (0 samples) until every rank's data has ended; then `progress`
returns None on every rank. `even_batches` does the same for evaluation loops.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from embshard.data.common import Batch
from embshard.models.registry import StepOutput
from embshard.runtime.comm import CollectiveHandle, start_all_gather, start_all_reduce
from embshard.sharding.exchange import BatchCounts, parse_counts
from embshard.spec.options import counts_on_host
from embshard.spec.plan import MemoryTier
from embshard.spec.tables import ConfigError
from embshard.training.model_graphs import ModelGraphs

MODES = ("none", "sparse_dist", "semi_sync")


@dataclass
class TrainStep:
    """What one `progress()` call trained."""

    step: int
    """The step number (1 for the first step after `start_step`)."""
    output: StepOutput
    """The model's output for the batch (loss, scores, labels)."""
    size: int
    """Samples of this rank's batch (0: this rank's data had ended and it fed an empty batch)."""
    position: dict | None
    """The data position after this batch (`Batch.position`), for checkpoints."""


def empty_batch(model) -> Batch:
    """A batch of 0 samples for `model` (RecModel): what a rank whose data has ended feeds while others train."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(model.cfg.features)
    weighted = any(t.weighted for t in model.cfg.tables)
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.zeros(0, dtype=torch.int64),
        lengths=torch.zeros(0, dtype=torch.int32),
        weights=torch.zeros(0) if weighted else None,
        stride=0,
        length_per_key=[0] * len(keys),
    )
    return Batch(torch.zeros(0, model.num_dense), kjt, torch.zeros(0))


def host_group_for(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A CPU (gloo) process group over the ranks of `group` (None: the default group; collective: every rank of
    the job calls it): the group itself if it is gloo already."""
    if not dist.is_initialized() or dist.get_backend(group) == "gloo":
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")


class HostPrefetcher:
    """A background thread that takes batches from an iterator, pins them (CUDA) and computes each one's host
    counts row; up to `depth` prepared batches wait in a queue. `next()` returns (batch, row) or None at the end;
    an exception in the thread is raised there."""

    _END = object()

    def __init__(self, batches: Iterator[Batch], prepare, depth: int) -> None:
        self._it, self._prepare = batches, prepare
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self.wait_s = 0.0  # time the training thread waited for a prepared batch
        self._thread = threading.Thread(target=self._run, name="embshard-host-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> None:
        """Queue `item`, waiting for room until it is queued or the prefetcher is stopped."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                pass

    def _run(self) -> None:
        try:
            for batch in self._it:
                self._put(self._prepare(batch))
                if self._stop.is_set():
                    return
            item = self._END
        except BaseException as e:  # handed to the training thread
            item = e
        self._put(item)

    def next(self):
        t0 = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - t0
        if item is self._END:
            self._queue.put(item)  # stays at the end
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass
class _Agreement:
    """A batch whose agreement is in flight: the host batch, this rank's counts row and the all-gather's handle
    (None on one rank)."""

    batch: Batch
    row: torch.Tensor
    handle: CollectiveHandle | None


@dataclass
class _Item:
    """A batch on its way: the device batch, its counts (None: the forward gathers them) and its data position."""

    batch: Batch
    counts: BatchCounts | None
    position: dict | None
    copied: torch.cuda.Event | None = None  # recorded on the data stream after the copy
    dist_done: bool = False  # its input dist ran ahead (`ebc.prefetch` on the data stream)


class TrainPipeline:
    """Trains `model` (embshard.models.build.RecModel) one step per `progress(batches)` call, overlapping the next
    batches' host work, copy, input dist (and, semi_sync, lookup) with the current step (module docstring).

    Args:
        model: the RecModel (its `ebc`, dense part and loss).
        dense_optimizer: the torch optimizer of `model.dense_parameters()`; the sparse optimizer is fused.
        mode: "none", "sparse_dist" or "semi_sync".
        check_finite: stop every rank before the update if the loss or a pooled embedding is NaN/Inf (one host
            sync per step: runtime.nan_check).
        precision: "fp32", "tf32" (sets torch's TF32 matmul flags, process-wide) or "bf16" (autocast of the
            forward and loss).
        prefetch_batches: batches prepared ahead by the host thread.
        ids_checked: the source guarantees every id is below its table's rows (skip the host-side id check).
        start_step: the last step already trained (resume); the first `progress` trains start_step + 1.
        host_group: the CPU process group of the agree step (default: `host_group_for(model.ebc.group)`, made here,
            collectively).
        graphs: the CUDA graphs of the model's step (embshard/training/model_graphs.py: `build_model` makes them),
            or None: every step runs eagerly.
    """

    def __init__(
        self,
        model,
        dense_optimizer: torch.optim.Optimizer,
        mode: str = "sparse_dist",
        *,
        check_finite: bool = False,
        precision: str = "fp32",
        prefetch_batches: int = 2,
        ids_checked: bool = False,
        start_step: int = 0,
        host_group: dist.ProcessGroup | None = None,
        graphs: ModelGraphs | None = None,
    ) -> None:
        if mode not in MODES:
            raise ConfigError(f"training pipeline mode {mode!r} is unknown: choose one of {list(MODES)}")
        if precision not in ("fp32", "tf32", "bf16"):
            raise ConfigError(f"training precision {precision!r} is unknown: choose fp32, tf32 or bf16")
        self.model, self.optimizer, self.mode = model, dense_optimizer, mode
        self.graphs = graphs if graphs is not None else ModelGraphs(model)  # none captured: every step eager
        self.ebc = model.ebc
        self.device = self.ebc.device
        self.cuda = self.device.type == "cuda"
        self.check_finite, self.prefetch_batches, self.ids_checked = check_finite, prefetch_batches, ids_checked
        self.step = start_step
        self._fetched = start_step  # batches taken from the source so far (the step of the last one)
        # The id exchange runs ahead only where the model hands `ebc` the batch's own kjt (not in catalog mode, nor
        # with sequence tables: their collection's exchanges, and then the embedding-bag one, run in the forward).
        own_kjt = model.catalog is None and getattr(model, "ec", None) is None
        self.dist_ahead = mode != "none" and own_kjt
        self.host_counts = counts_on_host(mode, self.ebc.options.bounds_check, not own_kjt)
        self.host_counts = self.host_counts and getattr(self.ebc, "twod", None) is None  # 2D: counted on the device
        cached = [t.name for t in self.ebc.tables if self.ebc.plan[t.name].tier is MemoryTier.UVM_CACHING]
        if mode == "semi_sync" and (not own_kjt or cached):
            why = (
                f"UVM-caching tables {cached}"
                if own_kjt
                else "a retrieval catalog"
                if model.catalog is not None
                else "sequence tables (looked up in the forward)"
            )
            raise ConfigError(
                f"training.pipeline semi_sync runs a batch's lookup before the previous backward, which {why} cannot "
                "take: use training.pipeline sparse_dist"
            )
        if precision == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.autocast = precision == "bf16"
        agree = None if getattr(self.ebc, "twod", None) is not None else self.ebc.group  # 2D: every rank agrees
        self.host_group = host_group if host_group is not None else host_group_for(agree)
        self.world = dist.get_world_size(self.host_group) if dist.is_initialized() else 1
        self.data_stream = torch.cuda.Stream(self.device) if self.cuda and mode != "none" else None
        self.emb_stream = torch.cuda.Stream(self.device) if self.cuda and mode == "semi_sync" else None
        self._empty = empty_batch(model)
        self._source: Iterator[Batch] | None = None
        self._host: HostPrefetcher | None = None
        self._agreement: _Agreement | None = None  # the next batch's agreement, started while this batch trains
        self._cur: _Item | None = None  # the next batch to train (input dist done; semi_sync: lookup done too)
        self._nxt: _Item | None = None  # semi_sync: the batch after it (input dist done)
        self._ended = False  # every rank's data has ended
        self._training = start_step  # the step being trained
        self.gather_s = 0.0  # host time in the agree all-gathers

    # ---- host side ---------------------------------------------------------------------------------------
    def _prepare(self, batch: Batch) -> tuple[Batch, torch.Tensor | None]:
        """In the host thread: pin the batch (CUDA; a batch already on the device stays there) and count it."""
        if self.cuda and batch.dense.device.type == "cpu" and not batch.dense.is_pinned():
            batch = batch.pin_memory()
        row = self.ebc.host_counts(batch.sparse, check=not self.ids_checked) if self.host_counts else None
        return batch, row

    def _agree_start(self, step: int) -> _Agreement:
        """Take the next batch from the host thread (an empty one once this rank's data has ended) and start the
        ranks' agreement on it: one all-gather of every rank's counts row over the CPU group, not waited for."""
        got = self._host.next()
        present = got is not None
        batch, row = got if present else (self._empty, None)
        if self.host_counts and row is None:
            row = self.ebc.host_counts(batch.sparse, check=False)
        if row is None:
            row = torch.tensor([batch.size, 0, step], dtype=torch.int64)
        else:
            row = row.clone()
            row[2] = step
        row = torch.cat([torch.tensor([int(present)]), row])
        handle = (
            start_all_gather(row, self.host_group, f"step {step} pipeline counts all-gather")
            if self.world > 1
            else None
        )
        return _Agreement(batch, row, handle)

    def _fetch(self) -> _Item | None:
        """The next batch of every rank agreed on, copied to the device; None when every rank's data has ended.

        The agreement (one CPU all-gather of every rank's counts row) of each batch starts when the batch before it
        is fetched, so it completes in the background while that batch trains: a rank a little behind the others
        costs nobody a wait on the host, and the step never waits for a host rendezvous unless a rank falls a whole
        step behind. Every rank starts and waits the same all-gathers in the same order."""
        if self._ended:
            return None
        self._fetched += 1
        step = self._fetched  # the step that will train on this batch
        agreement = self._agreement if self._agreement is not None else self._agree_start(step)
        self._agreement = None
        t0 = time.perf_counter()
        table = agreement.handle.wait(host=True) if agreement.handle is not None else agreement.row.view(1, -1)
        table = table.numpy()
        self.gather_s += time.perf_counter() - t0
        if not table[:, 0].any():
            self._ended = True
            return None
        counts = parse_counts(table[:, 1:])  # raises RanksOutOfStep on every rank if the steps differ
        self._agreement = self._agree_start(step + 1)  # the next batch's, in flight while this one trains
        batch = agreement.batch
        copied = None
        with torch.cuda.stream(self.data_stream) if self.data_stream is not None else nullcontext():
            on_device = batch.to(self.device, non_blocking=self.cuda)
            if self.data_stream is not None:
                copied = torch.cuda.Event()
                copied.record(self.data_stream)
        return _Item(on_device, counts if self.host_counts else None, batch.position, copied)

    def _fetch_and_dist(self) -> _Item | None:
        """`_fetch`, then the batch's input dist (and UVM-cache prefetch) on the data stream."""
        item = self._fetch()
        if item is not None and self.dist_ahead and not self._whole_step_graph():
            self.ebc.prefetch(item.batch.sparse, stream=self.data_stream, counts=item.counts, made_on_stream=True)
            item.dist_done = True
        return item

    def _whole_step_graph(self):
        """The model's whole-step graph (embshard/training/step_graph.py) while it is in use, else None. While it is, the
        input dist is not run ahead: the graph holds it (the steps that do not replay run it just before their
        forward)."""
        graph = self.graphs.whole
        if graph is None or graph.given_up is not None or self.mode == "semi_sync" or self.check_finite:
            return None
        return graph

    def _use(self, item: _Item) -> None:
        """The current stream takes over the batch copied on the data stream."""
        if item.copied is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(item.copied)
            item.batch.record_stream(current)

    # ---- the step ----------------------------------------------------------------------------------------
    def _graph_step(self, item: _Item) -> bool:
        """Whether this step replays the dense step's CUDA graph: only when every rank's batch has the graph's
        size (the agreed counts), so that every rank replays, and all-reduces, together."""
        graph = self.graphs.dense
        if graph is None or self.check_finite:
            return False
        if self.world > 1 and item.counts is None:  # the sizes are not known on the host: never
            return False
        sizes = item.counts.batch_sizes if item.counts is not None else [item.batch.size]
        return len(set(sizes)) == 1 and graph.ready(sizes[0])

    def _forward(self, item: _Item) -> StepOutput:
        whole = self._whole_step_graph()
        if whole is not None and item.counts is not None:
            if whole.ready(item.counts):
                return whole.run(item.batch, item.counts)  # every update done
            whole.prepare(item.counts)  # sizes the graph for the steps to come
        if self.dist_ahead and not item.dist_done:  # the whole-step graph is on but did not replay this step
            self.ebc.prefetch(item.batch.sparse, counts=item.counts)
            item.dist_done = True
        graph = self._graph_step(item)
        ctx = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast else nullcontext()
        with ctx:
            if graph:
                return self.graphs.dense_step(item.batch)  # the dense update done
            return self.model.step(item.batch, check_finite=self.check_finite)

    def _update(self, out: StepOutput) -> None:
        if out.updated:  # a replayed whole-step graph did every update
            return
        if out.dense_updated:  # the dense step's graph updated the dense part; the embeddings' backward is left
            out.loss.backward()
            return
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        self.optimizer.step()

    def _start(self, batches: Iterator[Batch]) -> None:
        if self._source is batches:
            return
        if self._source is not None:
            raise ValueError("TrainPipeline.progress: pass the same batch iterator every call (make a new pipeline)")
        self._source = batches
        self._host = HostPrefetcher(batches, self._prepare, self.prefetch_batches)

    def progress(self, batches: Iterator[Batch]) -> TrainStep | None:
        """Train one step on the next batch of `batches` (the same iterator every call); None, on every rank, once
        every rank's data has ended."""
        self._start(batches)
        if self.mode == "none":
            item = self._fetch()
            if item is None:
                return None
            return self._train(item, None)
        if self._cur is None and not self._ended:  # fill the pipeline
            self.ebc.set_step(self.step + 1)  # the step of the first batch (its prefetch is labelled with it)
            self._cur = self._fetch_and_dist()
            if self.mode == "semi_sync" and self._cur is not None:
                self.ebc.set_step(self._fetched)
                self.ebc.lookup_ahead(self._cur.batch.sparse, stream=self.emb_stream)
                self._nxt = self._fetch_and_dist()
        cur = self._cur
        if cur is None:
            return None
        return self._train(cur, self._advance)

    def _advance(self) -> None:
        """Between the forward and the backward of the current batch: start the next batches' work."""
        if self.mode == "sparse_dist":
            self._cur = self._fetch_and_dist()
            return
        nxt = self._nxt
        if nxt is not None:  # batch i+1: its lookup, before batch i's backward updates the tables
            self.ebc.set_step(self._training + 1)
            self.ebc.lookup_ahead(nxt.batch.sparse, stream=self.emb_stream)
        self._nxt = self._fetch_and_dist()  # batch i+2: copy and input dist
        self._cur = nxt

    def _train(self, item: _Item, advance) -> TrainStep:
        step = self._training = self.step + 1
        self._use(item)
        if self.mode != "semi_sync":
            self.ebc.set_step(step)  # every rank agrees on it (checked), and errors name it
        out = self._forward(item)
        if advance is not None:
            advance()
        self._update(out)
        self.step = step
        return TrainStep(step, _released(out), item.batch.size, item.position)

    @property
    def data_wait_s(self) -> float:
        """Seconds the training thread waited for the host thread (a data path slower than training shows here)."""
        return self._host.wait_s if self._host is not None else 0.0

    def close(self) -> None:
        """Stop the host thread (the data source's workers stop with its iterator), and finish the next batch's
        agreement, which every rank started with its last training batch. Waited for here, its all-gather does not
        outlive the loop: a gloo work still referenced when the interpreter shuts down aborts the process
        ("terminate called without an active exception") when its tensors are freed without the interpreter."""
        if self._host is not None:
            self._host.close()
        agreement, self._agreement = self._agreement, None
        if agreement is not None and agreement.handle is not None:
            agreement.handle.wait(host=True)


def _released(out: StepOutput) -> StepOutput:
    """The step's output without its autograd graph (the backward has run). A caller keeping the output (a
    training loop's last step) would keep the graph's nodes alive, among them the lookups' AccumulateGrad nodes,
    which belong to the stream their step ran on: a CUDA graph captured later on its own stream would then wait on
    that stream (embshard/training/step_graph.py)."""
    if not out.loss.requires_grad and (out.scores is None or not out.scores.requires_grad):
        return out
    detach = lambda t: t.detach() if t is not None else None  # noqa: E731
    hits = {k: detach(v) for k, v in out.hits.items()}
    return replace(out, loss=detach(out.loss), scores=detach(out.scores), labels=detach(out.labels), hits=hits)


def even_batches(
    batches: Iterator[Batch], empty: Batch, group: dist.ProcessGroup | None, device: torch.device | None = None
) -> Iterator[Batch]:
    """`batches` until every rank's have ended, `empty` in place of a batch on ranks whose ended first (one tiny
    all-reduce per batch, on `device` for NCCL groups), so every rank runs the same collectives (evaluation)."""
    it = iter(batches)
    while True:
        batch = next(it, None)
        flag = torch.tensor([0 if batch is None else 1], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            if dist.get_backend(group) != "gloo":
                flag = flag.to(device)
            flag = start_all_reduce(flag, group, "evaluation batch count all-reduce").wait(host=True)
        if not int(flag.sum()):
            return
        yield batch if batch is not None else empty
