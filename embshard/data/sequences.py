"""Per-user item sequences, oldest first, for sequential recommenders (model kind hstu): `data.source: sequences`.

A batch holds B users: the item feature is each user's sequence (a jagged bag, oldest item first), every context
feature one id per user, every side feature (a feature of a sequence table, `pooling: none`, other than the item's)
one id per item of the sequence: the item's category, item % (its table's rows); labels are ones and there are
no dense features; `Batch.times` holds each item's time (int64 seconds, in the item feature's order). The model
predicts each item from the items before it; evaluation scores each held-out user's last item from the items
before it.

- synthetic (no path): a Markov chain over Zipf-popular items with planted sequential structure. Item i has a fixed
  successor set of `successors` Zipf-drawn items; a user's first item is a Zipf draw, and each next item is, with
  probability `strength`, a uniform pick from the current item's successors, else a fresh Zipf draw (popularity
  ranks scrambled over the rows as in data/synthetic.py). Lengths are uniform in [min_length, max_length + 1].
  Times: a user's first item at a uniform time within a year after T0; each user has a mean gap of its own,
  log-uniform in [GAP_MIN, GAP_MAX], and its gaps are exponential around it (at least 1 s). With `visit_gap`,
  an item whose gap exceeds it starts a new visit: a fresh Zipf draw, never the chain's successor.
  Every number is a hash of (seed, stream, global user index, position): the global batch of step t is the same
  for any number of ranks (rank r holds users [r B, (r + 1) B) of it), so a run on W ranks with batch B trains on
  exactly the data of a run on one rank with batch W B. Training users are fresh at every step; held-out users come
  from their own streams, and their last item is never trained on. Context features: a hash of the user (no signal).
- file (path): a CSV with a header (the MovieLens layout: user_id, movie_id, timestamp, ...): rows grouped by user
  and ordered by time; items get catalog rows by a vocabulary of the file (most frequent first: row 0, 1, ...);
  context features are the columns of their names (the user's first row's value, hashed into the table's rows
  1..N-1 as data/hashing.py does); the time column gives each item's time (rounded to whole units). A user's last
  max_length + 1 items are kept. Training: each user with 3 or more
  items, without the last one; held out: every user with 2 or more items, the last one predicted. Users are split
  over the ranks by a hash of the user id; every rank yields the same number of training batches per epoch (the
  last may be short or empty), shuffled by (seed, epoch, rank).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from embshard.config.data import SequencesConfig
from embshard.data.common import Batch
from embshard.data.hashing import fmix64, hash_rows, hash_values
from embshard.data.synthetic import scramble_multiplier, zipf_of_uniform
from embshard.spec.tables import ConfigError, TableConfig

_EVAL_STREAM = 1 << 40
T0 = 1_600_000_000  # synthetic times: seconds, the first item of each user in the year after this
GAP_MIN, GAP_MAX = 60.0, 7 * 86_400.0  # synthetic: the range of the users' mean gaps between items (seconds)
_PURPOSES = 8  # independent draws per (user, position)


def uniforms(seed: int, stream: int, users: np.ndarray, position: int, purpose: int) -> np.ndarray:
    """A uniform number in [0, 1) per global user index, a fixed hash of (seed, stream, user, position, purpose)."""
    with np.errstate(over="ignore"):
        key = fmix64(np.full(users.shape, seed * 1_000_003 + stream, dtype=np.uint64))
        key = fmix64(key + users.astype(np.uint64))
        key = fmix64(key + np.uint64(position * _PURPOSES + purpose))
    return (key >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class SequenceSource:
    """Training and held-out batches of per-user sequences for one rank (module docstring)."""

    ids_in_range = True  # every id is a row of its table

    def __init__(
        self,
        cfg: SequencesConfig,
        tables: Sequence[TableConfig],
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
    ) -> None:
        self.cfg, self.batch_size, self.seed, self.rank, self.world = cfg, batch_size, seed, rank, world_size
        self.num_dense = 0
        self.keys = [f for t in tables for f in t.feature_names]
        rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
        if cfg.item_feature not in rows:
            raise ConfigError(
                f"data.sequences.item_feature={cfg.item_feature!r} is no table's feature; features: {self.keys}"
            )
        self.items = rows[cfg.item_feature]
        sequence = {f for t in tables if t.sequence for f in t.feature_names if f != cfg.item_feature}
        self.side = [(f, rows[f]) for f in self.keys if f in sequence]
        """Side features: (feature, categories); each position's id is its item's category, item % categories."""
        self.context = [(f, rows[f]) for f in self.keys if f != cfg.item_feature and f not in sequence]
        for f, n in self.context:
            if n < 2:
                raise ConfigError(f"context feature {f!r}: its table needs >= 2 rows (row 0 is the missing value)")
        if cfg.path is None:
            self.steps_per_epoch = None
            rng = np.random.default_rng([seed, 4242])
            self.multiplier = scramble_multiplier(self.items) if cfg.zipf_exponent > 0 else None
            ranks = zipf_of_uniform(rng.random((self.items, cfg.successors)), self.items, cfg.zipf_exponent)
            self.successors = self._scramble(ranks)
        else:
            self._read(cfg.path)

    # ---- synthetic ------------------------------------------------------------------------------------------
    def _scramble(self, ranks: np.ndarray) -> np.ndarray:
        return ranks * self.multiplier % self.items if self.multiplier is not None else ranks

    def synthetic_sequences(self, stream: int, users: np.ndarray) -> list[np.ndarray]:
        """The item sequences of global users `users` in stream `stream` (a training step, or a held-out batch)."""
        return self.synthetic_histories(stream, users)[0]

    def synthetic_histories(self, stream: int, users: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(item sequences, their times: int64 seconds) of global users `users` in stream `stream`."""
        c, n = self.cfg, users.size
        u = lambda pos, purpose: uniforms(self.seed, stream, users, pos, purpose)  # noqa: E731
        lengths = c.min_length + np.floor(u(0, 4) * (c.max_length + 2 - c.min_length)).astype(np.int64)
        longest = int(lengths.max()) if n else 0
        seq = np.zeros((n, max(longest, 1)), dtype=np.int64)
        times = np.zeros((n, max(longest, 1)), dtype=np.int64)
        seq[:, 0] = self._scramble(zipf_of_uniform(u(0, 0), self.items, c.zipf_exponent))
        # each user's mean gap, log-uniform in [GAP_MIN, GAP_MAX]; gaps exponential around it
        scale = GAP_MIN * (GAP_MAX / GAP_MIN) ** u(0, 6)
        times[:, 0] = T0 + np.floor(u(0, 7) * 86_400 * 365).astype(np.int64)
        for p in range(1, longest):
            gap = np.ceil(-np.log1p(-u(p, 5)) * scale).astype(np.int64)
            times[:, p] = times[:, p - 1] + gap
            pick = np.minimum((u(p, 2) * c.successors).astype(np.int64), c.successors - 1)
            follow = self.successors[seq[:, p - 1], pick]
            jump = self._scramble(zipf_of_uniform(u(p, 3), self.items, c.zipf_exponent))
            chained = u(p, 1) < c.strength
            if c.visit_gap is not None:  # a new visit starts afresh
                chained &= gap <= c.visit_gap
            seq[:, p] = np.where(chained, follow, jump)
        return [seq[i, : lengths[i]] for i in range(n)], [times[i, : lengths[i]] for i in range(n)]

    def _synthetic_batch(self, stream: int) -> Batch:
        B = self.batch_size
        users = np.arange(self.rank * B, (self.rank + 1) * B, dtype=np.int64)
        context = {
            f: 1 + (fmix64((users + stream * 7919 + i * 104729).astype(np.uint64)) % np.uint64(n - 1)).astype(np.int64)
            for i, (f, n) in enumerate(self.context)
        }
        return self._batch(*self.synthetic_histories(stream, users), context)

    # ---- file -----------------------------------------------------------------------------------------------
    def _read(self, path: str) -> None:
        import pyarrow.csv as pacsv

        c = self.cfg
        columns = [c.user_column, c.item_column, c.time_column, *[f for f, _ in self.context]]
        if not os.path.exists(path):
            raise ConfigError(
                f"data.sequences.path={path!r} does not exist: give a CSV with a header (user, item and time columns; "
                "docs/sequence.md shows how to make one of MovieLens-1M's ratings.dat)"
            )
        try:
            table = pacsv.read_csv(path)
        except (OSError, Exception) as e:  # pyarrow raises ArrowInvalid for a malformed file
            raise ConfigError(f"data.sequences.path={path!r} cannot be read as CSV with a header: {e}") from None
        missing = [x for x in columns if x not in table.column_names]
        if missing:
            raise ConfigError(
                f"data.sequences.path={path!r} has no column(s) {missing} (it has {table.column_names}): set "
                "data.sequences.user_column/item_column/time_column, or name the context features after columns"
            )
        user = hash_values(table[c.user_column].combine_chunks())
        item_hash = hash_values(table[c.item_column].combine_chunks())
        time = np.asarray(table[c.time_column].combine_chunks().to_numpy(zero_copy_only=False), dtype=np.float64)
        distinct, inverse, counts = np.unique(item_hash, return_inverse=True, return_counts=True)
        if distinct.size > self.items:
            raise ConfigError(
                f"data.sequences.path={path!r} has {distinct.size} distinct {c.item_column!r} values, more than the "
                f"{self.items} rows of feature {c.item_feature!r}'s table: raise its num_embeddings"
            )
        order = np.lexsort((distinct, -counts))  # most frequent first, ties by hash
        row_of = np.empty(distinct.size, dtype=np.int64)
        row_of[order] = np.arange(distinct.size)
        item = row_of[inverse.reshape(-1)]
        ctx = {f: hash_rows(hash_values(table[f].combine_chunks()), n).astype(np.int64) for f, n in self.context}
        by = np.lexsort((np.arange(user.size), time, user))  # user, then time, then file order
        user, item, time = user[by], item[by], np.rint(time[by]).astype(np.int64)
        ctx = {f: v[by] for f, v in ctx.items()}
        starts = np.flatnonzero(np.r_[True, user[1:] != user[:-1]])
        ends = np.r_[starts[1:], user.size]
        keep = c.max_length + 1
        mine = (fmix64(user[starts]) % np.uint64(self.world)).astype(np.int64)
        per_rank = [[], []]  # train, eval counts per rank (every rank reads the whole file)
        self.train_users, self.eval_users = [], []
        for r in range(self.world):
            at = np.flatnonzero(mine == r)
            train = [
                (item[max(starts[i], ends[i] - keep - 1) : ends[i] - 1], starts[i], max(starts[i], ends[i] - keep - 1))
                for i in at
                if ends[i] - starts[i] >= 3
            ]
            held = [
                (item[max(starts[i], ends[i] - keep) : ends[i]], starts[i], max(starts[i], ends[i] - keep))
                for i in at
                if ends[i] - starts[i] >= 2
            ]
            per_rank[0].append(len(train))
            per_rank[1].append(len(held))
            if r == self.rank:
                self.train_users, self.eval_users = train, held
        self.file_context, self.file_times = ctx, time
        self.steps_per_epoch = max(1, math.ceil(max(per_rank[0]) / self.batch_size))
        self.eval_steps = max(1, math.ceil(max(per_rank[1]) / self.batch_size))
        if sum(per_rank[0]) == 0:
            raise ConfigError(
                f"data.sequences.path={path!r}: no user of its {starts.size} has 3 or more items (a training sequence "
                "without the held-out last item, predicting at least one item): give a file with longer histories"
            )

    def _file_batch(self, users: list[tuple[np.ndarray, int, int]]) -> Batch:
        """users: (items, the user's first row, the first kept row) each, rows of the file sorted by user and time."""
        context = {f: np.array([v[s] for _, s, _ in users], dtype=np.int64) for f, v in self.file_context.items()}
        times = [self.file_times[k : k + seq.size] for seq, _, k in users]
        return self._batch([seq for seq, _, _ in users], times, context)

    # ---- batches --------------------------------------------------------------------------------------------
    def _batch(self, sequences: list[np.ndarray], times: list[np.ndarray], context: dict[str, np.ndarray]) -> Batch:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        B = len(sequences)
        lengths, values = [], []
        side = dict(self.side)
        for f in self.keys:
            if f == self.cfg.item_feature or f in side:
                lengths.append(np.array([s.size for s in sequences], dtype=np.int32))
                items = np.concatenate(sequences) if sequences else np.zeros(0, dtype=np.int64)
                values.append(items % side[f] if f in side else items)
            else:
                lengths.append(np.ones(B, dtype=np.int32))
                values.append(context[f][:B])
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=torch.from_numpy(np.concatenate(values).astype(np.int64)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
            stride=B,
            length_per_key=[int(v.size) for v in values],
        )
        stamps = np.concatenate(times) if times else np.zeros(0, dtype=np.int64)
        return Batch(torch.zeros(B, 0), kjt, torch.ones(B), times=torch.from_numpy(stamps.astype(np.int64)))

    def train_batches(self, start_step: int | dict | None = 0) -> Iterator[Batch]:
        """Batches for steps start_step, start_step + 1, ... (endless; file data: epoch after epoch)."""
        start = int(start_step or 0) if not isinstance(start_step, dict) else int(start_step.get("step", 0))
        for step in itertools.count(start):
            if self.cfg.path is None:
                yield self._synthetic_batch(step)
                continue
            epoch, i = divmod(step, self.steps_per_epoch)
            order = np.random.default_rng([self.seed, epoch, self.rank]).permutation(len(self.train_users))
            picked = order[i * self.batch_size : (i + 1) * self.batch_size]
            yield self._file_batch([self.train_users[j] for j in picked])

    def eval_batches(self) -> Iterator[Batch]:
        """The held-out users (the same at every evaluation): the last item of each is the one predicted."""
        if self.cfg.path is None:
            for i in range(self.cfg.eval_batches):
                yield self._synthetic_batch(_EVAL_STREAM + i)
            return
        B = self.batch_size
        for i in range(0, len(self.eval_users), B):
            yield self._file_batch(self.eval_users[i : i + B])
