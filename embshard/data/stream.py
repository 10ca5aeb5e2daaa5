"""Streams of batches over one rank's pieces: shuffle windows, batch assembly, exact cursors, worker processes.

Training (endless). A rank's pieces are dealt to N streams (N = data.workers, at least 1, at most the number of
pieces); each stream is read by one worker process (or by the training process when workers is 0):

    epoch e: pieces in a seeded order (seed, rank, e) -> stream j takes pieces j, j+N, j+2N, ...
          -> windows: consecutive pieces of at least shuffle_rows rows -> rows of a window permuted (seed, rank,
             e, j, window) -> the stream's rows: window after window, epoch after epoch
          -> batches: consecutive batch_size rows (a batch may span two windows or two epochs)
    the rank's batches: stream 0's first, stream 1's first, ..., stream 0's second, ...  (round robin)

A stream's cursor (epoch, window, offset) is where its next batch starts; a window is re-read and re-permuted
from its pieces, so the cursor alone restores the stream exactly. The rank's position is the number of batches
consumed and every stream's cursor (a small dict, `Batch.position`). Without skipped bad rows the cursor of any
step is also computed from row counts alone (`cursor_after`). Evaluation: stream j reads a contiguous part of the
rank's held-out rows (a whole number of batches), in order; the last batch of the last part may be short.

Batches leave a worker as numpy arrays in the layout of a KeyedJaggedTensor (feature-major lengths and ids);
a fixed-length feature (all bags of a window the same size, e.g. one-hot or MLPerf multi-hot) is gathered as
one 2-D take, a jagged one through its offsets.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from embshard.data.chunk import Chunk, ReadSpec, same_size
from embshard.data.decode import Reader
from embshard.data.layout import Layout, Piece
from embshard.spec.tables import ConfigError

Cursor = tuple[int, int, int]  # (epoch, window, offset) of a stream's next row


@dataclass(frozen=True)
class StreamPlan:
    """What every stream of one rank and split reads (plain data, sent to the worker processes)."""

    spec: ReadSpec
    layout: Layout
    vocab: dict | None
    pieces: tuple[Piece, ...]  # training: the rank's pieces; evaluation: unused (see parts)
    parts: tuple[tuple[int, int], ...]  # evaluation: per stream, its rows [lo, hi) of the split
    batch_size: int
    streams: int
    shuffle: bool
    shuffle_rows: int
    seed: int
    rank: int

    def windows(self, stream: int, epoch: int) -> list[list[Piece]]:
        """The training windows of one stream in one epoch."""
        order = np.arange(len(self.pieces))
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.rank, epoch, 0x5EED]).permutation(len(self.pieces))
        out: list[list[Piece]] = []
        cur: list[Piece] = []
        rows = 0
        for i in order[stream :: self.streams]:
            cur.append(self.pieces[int(i)])
            rows += self.pieces[int(i)].rows
            if rows >= self.shuffle_rows:
                out.append(cur)
                cur, rows = [], 0
        if cur:
            out.append(cur)
        return out

    def window_order(self, stream: int, epoch: int, window: int, n: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, self.rank, epoch, stream, window]).permutation(n)

    def cursor_after(self, stream: int, rows: int) -> Cursor:
        """The cursor after `rows` rows of a training stream, from row counts alone (no bad rows skipped)."""
        epoch = 0
        while True:
            sizes = [sum(p.rows for p in w) for w in self.windows(stream, epoch)]
            total = sum(sizes)
            if rows < total:
                w = int(np.searchsorted(np.cumsum(sizes), rows, side="right"))
                return epoch, w, rows - sum(sizes[:w])
            rows -= total
            epoch += 1
            if rows == 0:
                return epoch, 0, 0


STACK_MAX = 4  # fixed bags up to this size are stacked row-major (larger bags are already contiguous runs)


class Part:
    """One piece's rows (a Chunk) with per-feature bag offsets and fixed bag sizes, ready for gathers."""

    def __init__(self, chunk: Chunk) -> None:
        self.chunk = chunk
        self.offsets: list[np.ndarray | None] = []
        self.fixed: list[int | None] = []
        for f, lens in enumerate(chunk.lengths):
            fixed = chunk.fixed[f] if chunk.fixed else None
            if fixed is None:  # not known from the decoding: look
                first = int(lens[0]) if len(lens) else 0
                fixed = first if first > 0 and (lens == first).all() else None
            fixed = fixed or None  # bags of size 0: the jagged path
            self.fixed.append(fixed)
            if fixed is None:
                off = np.zeros(len(lens) + 1, dtype=np.int64)
                np.cumsum(lens, out=off[1:])
                self.offsets.append(off)
            else:
                self.offsets.append(None)
        # the small fixed-size features of an unweighted chunk, side by side in one row-major matrix of their ids'
        # type (int32 ids of a file stay 32-bit: half the bytes to stack and gather): a batch's random rows are then
        # gathered as whole rows (one or two cache lines for 26 one-hot ids, instead of 26)
        self.matrix: np.ndarray | None = None
        self.column: list[int | None] = [None] * len(self.fixed)
        small = [f for f, k in enumerate(self.fixed) if k is not None and k <= STACK_MAX]
        stacked = small if chunk.weights is None else []
        if len(stacked) >= 2:
            n = len(chunk)
            dtype = np.result_type(*(chunk.values[f].dtype for f in stacked))
            self.matrix = np.empty((n, sum(self.fixed[f] for f in stacked)), dtype=dtype)
            at = 0
            for f in stacked:
                k = self.fixed[f]
                self.matrix[:, at : at + k] = chunk.values[f].reshape(n, k)
                self.column[f] = at
                chunk.values[f] = None  # the matrix holds them now
                at += k
        self.signature = (tuple(self.fixed), tuple(self.column))  # what the gathers depend on (_plan)

    def __len__(self) -> int:
        return len(self.chunk)

    def take(self, idx: np.ndarray) -> Chunk:
        """The given rows as a new Chunk (a batch's rows carried over to the next window): gathered as a batch is."""
        nf, weighted = len(self.fixed), self.chunk.weights is not None
        b = assemble([(self, idx)], nf, weighted)
        cuts = np.cumsum(b["length_per_key"])[:-1]
        weights = np.split(b["weights"], cuts) if weighted else None
        lengths = list(b["lengths"].reshape(nf, len(idx)))
        return Chunk(b["labels"], b["dense"], lengths, np.split(b["values"], cuts), weights, list(self.fixed))

    def positions(self, f: int, idx: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Positions in the feature's ids of the bags of rows idx, concatenated."""
        k = self.fixed[f]
        if k is not None:
            return (idx[:, None] * k + np.arange(k)).ravel()
        starts = self.offsets[f][idx]
        ends = np.cumsum(lens)
        return np.repeat(starts - (ends - lens), lens) + np.arange(int(ends[-1]) if len(ends) else 0)


class Window:
    """A window's pieces, read but not concatenated: the window's rows are numbered piece after piece."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts = parts
        self.starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def select(self, idx: np.ndarray) -> list[tuple[Part, np.ndarray]]:
        """Window rows idx as (part, its rows) pairs, grouped by part (so a batch's rows come in part order)."""
        if len(self.parts) == 1:
            return [(self.parts[0], idx)]
        pid = (np.searchsorted(self.starts, idx, side="right") - 1).astype(np.int16)
        order = np.argsort(pid, kind="stable")
        cuts = np.searchsorted(pid[order], np.arange(len(self.parts) + 1))
        out = []
        for j, part in enumerate(self.parts):
            rows = idx[order[cuts[j] : cuts[j + 1]]] - self.starts[j]
            if len(rows):
                out.append((part, rows))
        return out


def local_arrays(specs: dict[str, tuple[tuple[int, ...], type]]) -> tuple[dict, dict[str, np.ndarray]]:
    """New arrays {key: (shape, dtype)} in this process: (items for the batch dict, the same arrays to fill).
    Worker processes write into shared-memory slots instead (data/slots.py)."""
    arrays = {k: np.empty(shape, dtype=dt) for k, (shape, dt) in specs.items()}
    return arrays, arrays


@functools.lru_cache(maxsize=256)
def _plan(signatures: tuple) -> tuple[tuple[int | None, ...], dict[int, int]]:
    """For parts of these signatures (Part.signature): per feature the bag size common to every part (None: jagged
    somewhere, or sizes differ), and the runs {first feature: count >= 2} of one-id features that every part holds in
    consecutive columns of its matrix (copied together, transposed)."""
    nf = len(signatures[0][0]) if signatures else 0
    same = tuple(same_size([fixed[f] for fixed, _ in signatures]) if signatures else None for f in range(nf))
    runs, f = {}, 0
    while f < nf:
        run = 0
        while f + run < nf and all(
            fixed[f + run] == 1 and column[f + run] is not None and column[f + run] == column[f] + run
            for fixed, column in signatures
        ):
            run += 1
        if run > 1:
            runs[f] = run
        f += max(run, 1)
    return same, runs


def assemble(parts: list[tuple[Part, np.ndarray]], nf: int, weighted: bool, alloc=local_arrays) -> dict:
    """One batch from rows of several parts, in the layout of a KeyedJaggedTensor (ids int64); `alloc` makes the
    output arrays (local_arrays, or a worker's shared-memory slot).

    Per part: one gather of whole rows of its stacked matrix (small fixed bags), then per feature a copy of its
    columns into the feature's block (a run of one-id features stacked side by side: one transposing copy); a larger
    fixed bag is one 2-D gather of its [rows, k] ids, a jagged bag a gather through its offsets. Ids of a narrower
    type are widened as they are copied."""
    B = sum(len(idx) for _, idx in parts)
    nd = parts[0][0].chunk.dense.shape[1] if parts else 0
    same, runs = _plan(tuple(p.signature for p, _ in parts))
    none = [None] * len(parts)
    lens_fp: list[list[np.ndarray | None]] = []  # per feature and part: bag lengths, None when fixed
    per_key = []
    for f in range(nf):
        if parts and same[f] is not None:
            lens_fp.append(none)
            per_key.append(same[f] * B)
            continue
        row, total = [], 0
        for p, idx in parts:
            k = p.fixed[f]
            if k is not None:
                row.append(None)
                total += k * len(idx)
            else:
                lens = p.chunk.lengths[f].take(idx, mode="clip")
                row.append(lens)
                total += int(lens.sum())
        lens_fp.append(row)
        per_key.append(total)
    n_ids = sum(per_key)
    specs = {"labels": ((B,), np.float32), "dense": ((B, nd), np.float32), "lengths": ((nf * B,), np.int32)}
    specs["values"] = ((n_ids,), np.int64)
    if weighted:
        specs["weights"] = ((n_ids,), np.float32)
    batch, out = alloc(specs)
    batch.update(size=B, length_per_key=per_key)
    batch.setdefault("weights", None)
    labels, dense, lengths, values = out["labels"], out["dense"], out["lengths"], out["values"]
    weights = out.get("weights")
    at = 0
    for p, idx in parts:
        np.take(p.chunk.labels, idx, out=labels[at : at + len(idx)], mode="clip")
        np.take(p.chunk.dense, idx, axis=0, out=dense[at : at + len(idx)], mode="clip")
        at += len(idx)
    if parts and all(k is not None for k in same):  # every bag of the batch has its feature's fixed size
        lengths.reshape(nf, B)[:] = np.array(same, dtype=np.int32)[:, None]
    else:
        at = 0
        for f in range(nf):
            for (p, idx), lens in zip(parts, lens_fp[f]):
                lengths[at : at + len(idx)] = p.fixed[f] if lens is None else lens
                at += len(idx)
    rows = [None if p.matrix is None else np.take(p.matrix, idx, axis=0, mode="clip") for p, idx in parts]
    at, f = 0, 0
    while f < nf:
        run = runs.get(f)
        if run:  # features f .. f+run-1 are one id a row, side by side in every part's matrix
            block = values[at : at + run * B].reshape(run, B)
            col = 0
            for (p, idx), gathered in zip(parts, rows):
                c = p.column[f]
                block[:, col : col + len(idx)] = gathered[:, c : c + run].T
                col += len(idx)
            at += run * B
            f += run
            continue
        for (p, idx), gathered, lens in zip(parts, rows, lens_fp[f]):
            k, src = p.fixed[f], p.chunk.values[f]
            if p.column[f] is not None:
                n = k * len(idx)
                values[at : at + n].reshape(-1, k)[:] = gathered[:, p.column[f] : p.column[f] + k]
            elif k is not None:
                n = k * len(idx)
                out = values[at : at + n].reshape(-1, k)
                if src.dtype == np.int64:
                    np.take(src.reshape(-1, k), idx, axis=0, out=out, mode="clip")
                else:  # narrower ids (an int32 file): gather, then widen
                    out[:] = np.take(src.reshape(-1, k), idx, axis=0, mode="clip")
                if weighted:
                    out = weights[at : at + n].reshape(-1, k)
                    np.take(p.chunk.weights[f].reshape(-1, k), idx, axis=0, out=out, mode="clip")
            else:
                pos = p.positions(f, idx, lens)
                n = len(pos)
                if src.dtype == np.int64:
                    np.take(src, pos, out=values[at : at + n], mode="clip")
                else:
                    values[at : at + n] = np.take(src, pos, mode="clip")
                if weighted:
                    np.take(p.chunk.weights[f], pos, out=weights[at : at + n], mode="clip")
            at += n
        f += 1
    return batch


class _Skips:
    """Bad rows skipped since the last batch: {file: [count, first message]}."""

    def __init__(self) -> None:
        self.pending: dict[str, list] = {}

    def add(self, path: str, count: int, message: str | None) -> None:
        if count:
            entry = self.pending.setdefault(path, [0, message])
            entry[0] += count

    def take(self) -> dict[str, list]:
        out, self.pending = self.pending, {}
        return out


def _read_window(reader: Reader, pieces: list[Piece], skips: _Skips) -> Window:
    parts = []
    for p in pieces:
        chunk, skipped, message = reader.read(p)
        skips.add(reader.layout.files[p.group.file], skipped, message)
        if len(chunk):
            parts.append(Part(chunk))
    return Window(parts)


class _Batcher:
    """Cuts a sequence of windows (each read in some row order) into batches of batch_size rows; rows of a batch
    begun in one window and finished in the next are carried over as a small copy."""

    def __init__(self, plan: StreamPlan, alloc) -> None:
        self.B, self.nf, self.weighted = plan.batch_size, len(plan.spec.features), plan.spec.weighted
        self.alloc = alloc
        self.carry: Part | None = None

    def batches(self, win: Window, order: np.ndarray, at: int) -> Iterator[tuple[dict, int]]:
        """(batch, rows of `order` used so far) for every batch completed inside this window."""
        while at < len(order):
            have = len(self.carry) if self.carry is not None else 0
            idx = order[at : at + self.B - have]
            at += len(idx)
            if have + len(idx) < self.B:  # the window ends inside this batch: carry its rows on
                self._carry([(p, i) for p, i in win.select(idx)])
                return
            parts = win.select(idx)
            if self.carry is not None:
                parts = [(self.carry, np.arange(have)), *parts]
            self.carry = None
            yield assemble(parts, self.nf, self.weighted, self.alloc), at

    def _carry(self, parts: list[tuple[Part, np.ndarray]]) -> None:
        # A carry carried on again is read through `take` like any part: Part moved its one-hot ids into a matrix.
        chunks = [self.carry.take(np.arange(len(self.carry)))] if self.carry is not None else []
        chunks += [p.take(i) for p, i in parts]
        self.carry = Part(Chunk.concat(chunks)) if chunks else None

    def rest(self) -> dict | None:
        """The carried rows as a last, short batch (evaluation), or None."""
        if self.carry is None or not len(self.carry):
            return None
        batch = assemble([(self.carry, np.arange(len(self.carry)))], self.nf, self.weighted, self.alloc)
        self.carry = None
        return batch


def train_stream(plan: StreamPlan, stream: int, cursor: Cursor, alloc=local_arrays) -> Iterator[dict]:
    """Stream `stream`'s training batches from `cursor` on (endless); each carries its cursor after it."""
    reader = Reader(plan.spec, plan.layout, plan.vocab)
    batcher = _Batcher(plan, alloc)
    skips = _Skips()
    epoch, w, offset = cursor
    empty_epochs = 0
    while True:
        windows = plan.windows(stream, epoch)
        rows_this_epoch = 0
        while w < len(windows):
            win = _read_window(reader, windows[w], skips)
            rows_this_epoch += len(win)
            for batch, at in batcher.batches(win, plan.window_order(stream, epoch, w, len(win)), offset):
                if at < len(win):
                    after = (epoch, w, at)
                elif w + 1 < len(windows):
                    after = (epoch, w + 1, 0)
                else:
                    after = (epoch + 1, 0, 0)
                batch.update(stream=stream, cursor=after, skipped=skips.take())
                yield batch
            w, offset = w + 1, 0
        empty_epochs = empty_epochs + 1 if rows_this_epoch == 0 else 0
        if empty_epochs >= 2:
            raise ConfigError(
                f"{plan.spec.where}: rank {plan.rank}'s stream {stream} read two epochs without one good row: every "
                "row of its pieces was skipped as bad; fix the data or lower data.workers"
            )
        epoch, w = epoch + 1, 0


def eval_stream(plan: StreamPlan, stream: int, alloc=local_arrays) -> Iterator[dict]:
    """Stream `stream`'s held-out batches: its rows in order, then empty batches if bad rows were skipped, so
    that every rank yields the same number of batches."""
    reader = Reader(plan.spec, plan.layout, plan.vocab)
    batcher = _Batcher(plan, alloc)
    lo, hi = plan.parts[stream]
    expected = -(-(hi - lo) // plan.batch_size)
    skips = _Skips()
    sent = 0
    for piece in plan.layout.pieces(lo, hi):
        win = _read_window(reader, [piece], skips)
        for batch, _ in batcher.batches(win, np.arange(len(win)), 0):
            batch.update(stream=stream, cursor=None, skipped=skips.take())
            sent += 1
            yield batch
    while sent < expected:
        batch = batcher.rest()
        if batch is None:
            empty = Part(_empty_chunk(len(plan.spec.features), len(plan.spec.dense), plan.spec.weighted))
            batch = assemble([(empty, np.arange(0))], len(plan.spec.features), plan.spec.weighted, alloc)
        batch.update(stream=stream, cursor=None, skipped=skips.take())
        sent += 1
        yield batch


def _empty_chunk(nf: int, nd: int, weighted: bool) -> Chunk:
    return Chunk(
        np.zeros(0, np.float32),
        np.zeros((0, nd), np.float32),
        [np.zeros(0, np.int32) for _ in range(nf)],
        [np.zeros(0, np.int64) for _ in range(nf)],
        [np.zeros(0, np.float32) for _ in range(nf)] if weighted else None,
    )
