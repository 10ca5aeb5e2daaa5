"""Ragged batches padded to a capacity per feature, so that a captured CUDA graph's sizes fit every batch
(embshard/step_graph.py: the whole training step; embshard/emb_graph.py: the sharded collection's step alone).

A padded batch keeps every bag's ids and gives each feature filler ids up to its capacity, spread evenly over its
bags (the first `pad % B` bags one more), on the first FILLER_ROWS rows of the feature's table (again and again,
so that no bag is long and no row hot). Every id carries a weight: the batch's own for weighted tables, 1 for the
others, 0 for the fillers, and every lookup pools with the weights (`ops.every_id_weighted`). A filler adds
nothing to its bag and gets a zero gradient, which leaves its row as it is under sgd, adagrad and row-wise adagrad
without weight decay (`refusal` lists what else it rules out). Every rank pads to the same capacity, so the counts
of a padded batch are the capacity on every rank, and the exchanges sized from them fit.
"""

from __future__ import annotations

import numpy as np
import torch

from embshard.ops import complete_cumsum, small_to_device
from embshard.optim import OptimizerKind
from embshard.sharding.exchange import BatchCounts
from embshard.tables import Pooling, feature_columns

FILLER_ROWS = 1024
"""A feature's filler ids cycle over this many rows of its table (fewer if the table is smaller)."""


def capacity(ids_F: np.ndarray | int) -> np.ndarray:
    """Padded ids per feature for a run of ragged batches whose largest counts are `ids_F`: 10% above, rounded up
    to a multiple of 64 ids, in integers (3,200 ids give 3,520: through floats, 3,200 x 1.1 rounds above 3,520)."""
    return (np.asarray(ids_F, dtype=np.int64) * 11 + 639) // 640 * 64


def refusal(ebc) -> str | None:
    """Why batches of the sharded collection `ebc` cannot be padded with filler ids of weight 0, or None if they
    can: a mean-pooled feature divides by its bag lengths (which fillers change), and adam or weight decay change
    rows whose gradient is zero."""
    mean = [f for f in ebc.features if ebc._table_of[f].pooling is Pooling.MEAN]
    if mean:
        return f"mean-pooled features {mean[:3]} divide by their bag lengths, which the filler ids change"
    opt = ebc.optimizer
    if opt.kind is OptimizerKind.ADAM or opt.weight_decay:
        return (
            f"the sparse optimizer ({opt.kind.value}, weight decay {opt.weight_decay:g}) changes rows with a zero "
            "gradient"
        )
    return None


class BatchPadder:
    """Pads the KJTs of one sharded collection (`ebc`) to a capacity per feature (canonical columns,
    `feature_columns`); the filler ids of a capacity are made once."""

    def __init__(self, ebc) -> None:
        self.ebc = ebc
        cols = feature_columns(ebc.tables)
        self._column = {f: cols[f] for f in ebc.features}
        self._fill: tuple | None = None  # (key, filler ids, zero weights, weighted features)

    def pad(self, kjt, counts: BatchCounts, cap_C: np.ndarray):
        """(`kjt` padded to the capacity `cap_C` (ids per canonical column; at least this rank's counts), the counts
        of such a batch on every rank). Device work only: the host knows every size."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        keys, B = list(kjt.keys()), kjt.stride()
        F = len(keys)
        cols = [self._column[k] for k in keys]
        have = [int(counts.ids[self.ebc.rank, c]) for c in cols]
        cap = [int(cap_C[c]) for c in cols]
        if any(c < n for c, n in zip(cap, have)):
            over = [(k, n, c) for k, n, c in zip(keys, have, cap) if c < n][:3]
            raise ValueError(f"BatchPadder.pad: features (name, ids, capacity) {over} hold more ids than the capacity")
        values, weights = kjt.values(), kjt.weights_or_none()
        dev, N = values.device, sum(have)
        filler_ids, filler_w, weighted_F = self._fillers(keys, cap, values.dtype, dev)
        lengths_FB = kjt.lengths().view(F, B)
        sizes = small_to_device([c - n for c, n in zip(cap, have)] + have, dev)  # one copy: padding, own ids
        pad_F1, have_F = sizes[:F].view(F, 1), sizes[F:]
        bags_1B = torch.arange(B, device=dev).view(1, B)
        extra_FB = pad_F1 // max(B, 1) + (bags_1B < pad_F1 % max(B, 1)).to(torch.int64)  # pad // B, +1 in the first
        new_lengths = (lengths_FB.to(torch.int64) + extra_FB).reshape(-1)
        old_lengths = lengths_FB.reshape(-1).to(torch.int64)
        bag_of = torch.repeat_interleave(torch.arange(F * B, device=dev), old_lengths, output_size=N)
        shift = complete_cumsum(new_lengths)[:-1] - complete_cumsum(old_lengths)[:-1]  # per bag: where its ids move
        where = torch.arange(N, device=dev) + shift[bag_of]
        if weights is None:
            own_w = torch.ones(N, dtype=torch.float32, device=dev)
        else:  # a table without weights pools with 1
            own_w = torch.where(torch.repeat_interleave(weighted_F, have_F, output_size=N), weights.float(), 1.0)
        values_out = filler_ids.clone().index_copy_(0, where, values)
        weights_out = filler_w.clone().index_copy_(0, where, own_w)
        lengths_out = new_lengths.to(kjt.lengths().dtype)
        padded = KeyedJaggedTensor(keys=keys, values=values_out, lengths=lengths_out, weights=weights_out, stride=B)
        W = len(counts.batch_sizes)
        return padded, BatchCounts(list(counts.batch_sizes), np.tile(np.asarray(cap_C), (W, 1)), [])

    def _fillers(self, keys: list[str], cap: list[int], dtype: torch.dtype, device: torch.device):
        """The padded batch's values and weights before its own ids are put in: per feature, `cap` filler ids on
        rows 0, 1, ..., up to FILLER_ROWS rows of its table (again and again), each of weight 0; and per feature
        whether its table has weights. Made once per capacity."""
        key = (tuple(keys), tuple(cap), dtype)
        if self._fill is None or self._fill[0] != key:
            tables = [self.ebc._table_of[k] for k in keys]
            rows = [min(t.num_embeddings, FILLER_ROWS) for t in tables]
            ids = np.concatenate([np.arange(c, dtype=np.int64) % r for c, r in zip(cap, rows)] or [np.zeros(0)])
            ids_t = torch.from_numpy(ids.astype(np.int64)).to(device=device, dtype=dtype)
            weighted_F = torch.tensor([t.weighted for t in tables], device=device)
            self._fill = (key, ids_t, torch.zeros(ids_t.numel(), dtype=torch.float32, device=device), weighted_F)
        return self._fill[1:]
