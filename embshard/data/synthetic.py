"""Synthetic click data at any scale, for benchmarks and smoke tests.

- ids: Zipf-skewed, P(k-th most popular row) ~ 1 / k^s (continuous inverse-CDF approximation; s = 0 is uniform);
  with `scramble` the popularity ranks are spread over the table by k -> (k * A) mod rows (A coprime to rows;
  uniform ids need no scramble).
- bag lengths: mean = the feature's pooling factor p (data.synthetic.pooling, else its table's ids_per_bag):
  1 + Poisson(p - 1) for p >= 1, else 0 or 1 with P(1) = p; or, with bag_lengths fixed, round(p) ids in every bag.
- per-id weights for weighted tables: uniform in [0.5, 1.5).
- dense features: standard normal.
- labels: Bernoulli(sigmoid(2 z)), z a fixed hidden function of the dense features and of the first id of each
  bag (a hash of the id), so a model that learns shows a falling loss.
- with `affinity` (retrieval): the item feature's id depends on the user feature's id (`affinity_items`): with
  probability `strength` the k-th most popular item (Zipf) of the user's group, else the usual draw; labels 1.
Batch t of rank r is drawn from its own seeded stream (seed, r, t): any step can be regenerated, every rank sees
different samples, and evaluation batches come from a separate fixed stream. Each batch is drawn with a few
vectorised numpy calls per feature; with `workers` > 0, worker processes draw the training batches (worker k of n:
steps start + k, start + k + n, ...; torch's DataLoader hands them out in step order), written into reused
shared-memory slots (data/slots.py: no fresh pages per batch) and pinned for an asynchronous copy when CUDA is
available.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from embshard.config.data import AffinityConfig, SyntheticConfig
from embshard.data.common import Batch
from embshard.data.slots import Slots, SlotWriter, fresh_shared_arrays, load, take_arrays
from embshard.data.stream import local_arrays
from embshard.spec.tables import ConfigError, TableConfig

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_EVAL_STREAM = 1 << 40


def zipf_ranks(rng: np.random.Generator, n: int, rows: int, exponent: float) -> np.ndarray:
    """n popularity ranks in [0, rows), P(rank k) ~ 1 / (k + 1)^exponent."""
    if exponent == 0:
        return rng.integers(0, rows, n, dtype=np.int64)
    return zipf_of_uniform(rng.random(n), rows, exponent)


def zipf_of_uniform(u: np.ndarray, rows: int, exponent: float) -> np.ndarray:
    """The popularity ranks in [0, rows) of uniform draws `u` in [0, 1) (the inverse CDF of zipf_ranks)."""
    if exponent == 0:
        return np.minimum((u * rows).astype(np.int64), rows - 1)
    if abs(exponent - 1.0) < 1e-9:
        k = np.exp(u * math.log(rows + 1.0))
    else:
        a = 1.0 - exponent
        k = (((rows + 1.0) ** a - 1.0) * u + 1.0) ** (1.0 / a)
    return np.clip(np.floor(k).astype(np.int64) - 1, 0, rows - 1)


def scramble_multiplier(rows: int) -> int | None:
    """A multiplier coprime to `rows` for the bijection k -> k * A mod rows (None above 2^31 rows: no scramble)."""
    if rows >= 1 << 31:
        return None
    a = 2654435761 % rows
    while math.gcd(a, rows) != 1:
        a += 1
    return a


def id_scores(ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed pseudo-random score in [-1, 1) per id (hash of id and salt)."""
    with np.errstate(over="ignore"):
        h = (ids.astype(np.uint64) + np.uint64(salt * 7919 + 1)) * _GOLDEN
    return (h >> np.uint64(40)).astype(np.float64) / float(1 << 23) - 1.0


def affinity_items(
    rng: np.random.Generator,
    users: np.ndarray,
    items: np.ndarray,
    rows: int,
    cfg: AffinityConfig,
    zipf_exponent: float,
    multiplier: int | None,
) -> np.ndarray:
    """Each sample's item: with probability cfg.strength, item g + G k of the user's group g = hash(user) mod G
    (k Zipf-ranked within the group's rows / G items, then scrambled by `multiplier`), else its `items` entry."""
    G = cfg.clusters
    with np.errstate(over="ignore"):
        group = (((users.astype(np.uint64) + np.uint64(12345)) * _GOLDEN) >> np.uint64(33)) % np.uint64(G)
    own = group.astype(np.int64) + G * zipf_ranks(rng, users.size, rows // G, zipf_exponent)
    if multiplier is not None:
        own = own * multiplier % rows
    return np.where(rng.random(users.size) < cfg.strength, own, items)


class SyntheticSource:
    """Endless training batches and a fixed set of evaluation batches for one rank."""

    steps_per_epoch = None
    ids_in_range = True  # every id is drawn below its table's rows: a pipeline may skip the host-side id check

    def __init__(
        self,
        cfg: SyntheticConfig,
        tables: Sequence[TableConfig],
        batch_size: int,
        seed: int,
        rank: int,
        workers: int = 0,
        prefetch: int = 4,
        pin_memory: bool = True,
    ):
        self.cfg, self.tables, self.batch_size, self.seed, self.rank = cfg, list(tables), batch_size, seed, rank
        self.workers, self.prefetch = workers, prefetch
        self.pin = pin_memory and torch.cuda.is_available()
        self.num_dense = cfg.num_dense
        pooling = cfg.pooling or {}
        self.features = [(f, t, pooling.get(f, t.ids_per_bag)) for t in self.tables for f in t.feature_names]
        self.keys = [f for f, _, _ in self.features]
        if cfg.bag_lengths == "fixed":
            for f, t, p in self.features:
                if round(p) < 1:
                    raise ConfigError(
                        f"data.synthetic.bag_lengths fixed: feature {f!r} has {p} ids per bag (table {t.name!r}'s "
                        "ids_per_bag or data.synthetic.pooling); fixed bags hold round(p) >= 1 ids: raise it or use "
                        "bag_lengths: poisson"
                    )
        self.weighted = any(t.weighted for t in self.tables)
        scramble = cfg.scramble and cfg.zipf_exponent > 0  # a bijection of uniform ids is uniform: skip it
        self.multiplier = {t.name: scramble_multiplier(t.num_embeddings) if scramble else None for t in tables}
        hidden = np.random.default_rng([seed, 999])
        self.affinity = None
        if cfg.affinity is not None:
            a = cfg.affinity
            at = {f: (i, t, p) for i, (f, t, p) in enumerate(self.features)}
            for f in (a.user_feature, a.item_feature):
                if at[f][2] != 1:
                    raise ConfigError(
                        f"data.synthetic.affinity: feature {f!r} has {at[f][2]} ids per bag; it holds one id per "
                        "sample: set its table's ids_per_bag (or data.synthetic.pooling) to 1"
                    )
            i, t, _ = at[a.item_feature]
            if t.num_embeddings % a.clusters:
                raise ConfigError(
                    f"data.synthetic.affinity.clusters={a.clusters} does not divide table {t.name!r}'s "
                    f"{t.num_embeddings} rows: pick a divisor so every group has the same items"
                )
            self.affinity = (at[a.user_feature][0], i, t)
        self.w_dense = hidden.standard_normal(max(cfg.num_dense, 1))[: cfg.num_dense]

    def _lengths(self, rng: np.random.Generator, p: float) -> np.ndarray:
        B = self.batch_size
        if self.cfg.bag_lengths == "fixed":
            return np.full(B, round(p), dtype=np.int32)
        if p >= 1:
            return (1 + rng.poisson(p - 1.0, B)).astype(np.int32)
        return (rng.random(B) < p).astype(np.int32)

    def draw(self, stream: int, alloc=local_arrays) -> dict:
        """The arrays of the batch of one stream index (training step t uses t; evaluation _EVAL_STREAM + i):
        dense `[B, num_dense]`, labels `[B]`, feature-major lengths `[F * B]` and ids, weights (weighted tables
        only), and the ids per feature (what a KeyedJaggedTensor is built from); written into the arrays `alloc`
        makes (this process's, or a worker's shared-memory slot: data/slots.py)."""
        rng = np.random.default_rng([self.seed, self.rank, stream])
        B, F = self.batch_size, len(self.features)
        dense = rng.standard_normal((B, self.num_dense), dtype=np.float32)
        z = dense @ self.w_dense / math.sqrt(max(self.num_dense, 1)) if self.num_dense else np.zeros(B)
        lengths, values, weights = [], [], []
        for i, (_, t, p) in enumerate(self.features):
            lens = self._lengths(rng, p)
            ids = zipf_ranks(rng, int(lens.sum()), t.num_embeddings, self.cfg.zipf_exponent)
            if self.multiplier[t.name] is not None:
                ids = ids * self.multiplier[t.name] % t.num_embeddings
            starts = np.cumsum(lens) - lens  # each bag's first id; empty bags score 0
            first = (
                np.where(lens > 0, id_scores(ids[np.minimum(starts, max(ids.size - 1, 0))], i), 0.0)
                if ids.size
                else 0.0
            )
            z = z + first / math.sqrt(F)
            lengths.append(lens)
            values.append(ids)
            if self.weighted:
                weights.append(rng.random(ids.size) + 0.5 if t.weighted else np.ones(ids.size))
        labels = (rng.random(B) < 1.0 / (1.0 + np.exp(-2.0 * z))).astype(np.float32)
        if self.affinity is not None:
            u, i, t = self.affinity
            extra = np.random.default_rng([self.seed, self.rank, stream, 1])
            a, rows = self.cfg.affinity, t.num_embeddings
            values[i] = affinity_items(
                extra, values[u], values[i], rows, a, self.cfg.zipf_exponent, self.multiplier[t.name]
            )
            labels = np.ones(B, dtype=np.float32)
        n = sum(int(v.size) for v in values)
        specs = {"dense": (dense.shape, np.float32), "labels": ((B,), np.float32), "lengths": ((F * B,), np.int32)}
        specs["values"] = ((n,), np.int64)
        if self.weighted:
            specs["weights"] = ((n,), np.float32)
        items, out = alloc(specs)
        out["dense"][...] = dense
        out["labels"][...] = labels
        np.concatenate(lengths, out=out["lengths"])
        np.concatenate(values, out=out["values"])
        if self.weighted:
            np.concatenate(weights, out=out["weights"], casting="same_kind")
        return {**items, "length_per_key": [int(v.size) for v in values]}

    def _batch(self, d: dict) -> Batch:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        take_arrays(d)  # from a worker: views of its shared-memory slot (copied out already when pinned)
        t = {k: torch.as_tensor(d.pop(k)) for k in ("dense", "labels", "lengths", "values")}
        weights = torch.as_tensor(d.pop("weights")) if "weights" in d else None
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=t["values"],
            lengths=t["lengths"],
            weights=weights,
            stride=self.batch_size,
            length_per_key=list(d["length_per_key"]),
        )
        return Batch(t["dense"], kjt, t["labels"])

    def batch(self, stream: int) -> Batch:
        """The batch of one stream index (training step t uses t; evaluation uses _EVAL_STREAM + i)."""
        return self._batch(self.draw(stream))

    def train_batches(self, start_step: int | None = 0) -> Iterator[Batch]:
        """Batches for steps start_step, start_step + 1, ... (endless); drawn by `workers` processes if > 0, which
        start at the first batch taken and write into reused shared-memory slots (`slots.load`)."""
        start = int(start_step or 0)
        if self.workers <= 0:
            return (self.batch(step) for step in itertools.count(start))
        return (
            self._batch(d)
            for d in load(lambda slots: _Steps(self, start, slots), self.workers, self.prefetch, self.pin)
        )

    def eval_batches(self) -> Iterator[Batch]:
        """The same `eval_batches` held-out batches at every evaluation."""
        for i in range(self.cfg.eval_batches):
            yield self.batch(_EVAL_STREAM + i)


class _Steps(torch.utils.data.IterableDataset):
    """Worker k of n draws the batches of steps start + k, start + k + n, ... (the DataLoader interleaves the
    workers in order, so the batches arrive in step order)."""

    def __init__(self, source: SyntheticSource, start: int, slots: Slots | None = None) -> None:
        self.source, self.start, self.slots = source, start, slots

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        k, n = (info.id, info.num_workers) if info is not None else (0, 1)
        alloc = SlotWriter(self.slots, k) if self.slots is not None else fresh_shared_arrays
        step = self.start + k
        while True:
            yield self.source.draw(step, alloc)
            step += n
