"""Synthetic click data at any scale, for benchmarks and smoke tests.

- ids: Zipf-skewed, P(k-th most popular row) ~ 1 / k^s (continuous inverse-CDF approximation; s = 0 is uniform);
  with `scramble` the popularity ranks are spread over the table by k -> (k * A) mod rows (A coprime to rows).
- bag lengths: mean = the feature's pooling factor p (data.synthetic.pooling, else its table's ids_per_bag):
  1 + Poisson(p - 1) for p >= 1, else 0 or 1 with P(1) = p.
- per-id weights for weighted tables: uniform in [0.5, 1.5).
- dense features: standard normal.
- labels: Bernoulli(sigmoid(2 z)), z a fixed hidden function of the dense features and of each bag's mean id
  score (a hash of the id), so a model that learns shows a falling loss.
- with `affinity` (retrieval): the item feature's id depends on the user feature's id (`affinity_items`): with
  probability `strength` the k-th most popular item (Zipf) of the user's group, else the usual draw; labels 1.
Batch t of rank r is drawn from its own seeded stream (seed, r, t): any step can be regenerated, every rank sees
different samples, and evaluation batches come from a separate fixed stream.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from embshard.config.data import AffinityConfig, SyntheticConfig
from embshard.data.common import Batch
from embshard.tables import ConfigError, TableConfig

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_EVAL_STREAM = 1 << 40


def zipf_ranks(rng: np.random.Generator, n: int, rows: int, exponent: float) -> np.ndarray:
    """n popularity ranks in [0, rows), P(rank k) ~ 1 / (k + 1)^exponent."""
    if exponent == 0:
        return rng.integers(0, rows, n, dtype=np.int64)
    u = rng.random(n)
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

    def __init__(self, cfg: SyntheticConfig, tables: Sequence[TableConfig], batch_size: int, seed: int, rank: int):
        self.cfg, self.tables, self.batch_size, self.seed, self.rank = cfg, list(tables), batch_size, seed, rank
        self.num_dense = cfg.num_dense
        pooling = cfg.pooling or {}
        self.features = [(f, t, pooling.get(f, t.ids_per_bag)) for t in self.tables for f in t.feature_names]
        self.multiplier = {t.name: scramble_multiplier(t.num_embeddings) if cfg.scramble else None for t in tables}
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

    def batch(self, stream: int) -> Batch:
        """The batch of one stream index (training step t uses t; evaluation uses _EVAL_STREAM + i)."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        rng = np.random.default_rng([self.seed, self.rank, stream])
        B = self.batch_size
        dense = rng.standard_normal((B, self.num_dense)).astype(np.float32)
        z = dense @ self.w_dense / math.sqrt(max(self.num_dense, 1)) if self.num_dense else np.zeros(B)
        lengths, values, weights = [], [], []
        weighted = any(t.weighted for t in self.tables)
        for i, (_, t, p) in enumerate(self.features):
            lens = 1 + rng.poisson(p - 1.0, B) if p >= 1 else (rng.random(B) < p).astype(np.int64)
            ids = zipf_ranks(rng, int(lens.sum()), t.num_embeddings, self.cfg.zipf_exponent)
            if self.multiplier[t.name] is not None:
                ids = ids * self.multiplier[t.name] % t.num_embeddings
            score = np.zeros(B)
            np.add.at(score, np.repeat(np.arange(B), lens), id_scores(ids, i))
            z = z + score / np.maximum(lens, 1) / math.sqrt(len(self.features))
            lengths.append(lens)
            values.append(ids)
            if weighted:
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
        kjt = KeyedJaggedTensor(
            keys=[f for f, _, _ in self.features],
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths)).to(torch.int32),
            weights=torch.from_numpy(np.concatenate(weights)).float() if weighted else None,
        )
        return Batch(torch.from_numpy(dense), kjt, torch.from_numpy(labels))

    def train_batches(self, start_step: int = 0) -> Iterator[Batch]:
        """Batches for steps start_step, start_step + 1, ... (endless)."""
        step = start_step
        while True:
            yield self.batch(step)
            step += 1

    def eval_batches(self) -> Iterator[Batch]:
        """The same `eval_batches` held-out batches at every evaluation."""
        for i in range(self.cfg.eval_batches):
            yield self.batch(_EVAL_STREAM + i)
