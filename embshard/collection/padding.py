"""Ragged batches padded to a capacity per feature, so that a captured CUDA graph's sizes fit every batch
(embshard/training/step_graph.py: the whole training step; embshard/collection/emb_graph.py: the sharded collection's step alone).

A padded batch keeps every bag's ids and gives each feature filler ids up to its capacity, spread evenly over its
bags (the first `pad % B` bags one more), on the first FILLER_ROWS rows of the feature's table (again and again,
so that no bag is long and no row hot). Every id carries a weight: the batch's own for weighted tables, 1 for the
others, 0 for the fillers, and every lookup that meets fillers pools with the weights (`ebc.weighing_every_id`).
A lookup that reads its ids through the bags' offsets alone, whatever the length of the values (the data-parallel
tables on the small-table kernels: a scheme's `pads_free`), needs no fillers: its features keep their bags and
follow the padded features (the padded KJT lists them last, so every buffer a lookup reads starts at the same place
in every step), and the ids their capacity leaves unused sit at the batch's end, in no bag (most of a step's ids,
where many small tables are data-parallel: no filler lookups, no weights, less to copy). A filler adds
nothing to its bag and gets a zero gradient, which leaves its row as it is under sgd, adagrad and row-wise adagrad
without weight decay (`refusal` lists what else it rules out). Every rank pads to the same capacity, so the counts
of a padded batch are the capacity on every rank, and the exchanges sized from them fit.
"""

from __future__ import annotations

import numpy as np
import torch

from embshard.runtime.ops import cached_tensor, complete_cumsum, small_to_device
from embshard.sharding.exchange import BatchCounts
from embshard.spec.graph_rules import padding_refusal
from embshard.spec.tables import feature_columns

FILLER_ROWS = 1024
"""A feature's filler ids cycle over this many rows of its table (fewer if the table is smaller)."""


def refusal(ebc) -> str | None:
    """Why batches of the sharded collection `ebc` cannot be padded with filler ids of weight 0, or None if they
    can: a mean-pooled feature divides by its bag lengths (which fillers change), and adam or weight decay change
    rows whose gradient is zero (the rules: embshard.spec.graph_rules.padding_refusal)."""
    why = padding_refusal(ebc.tables, ebc.optimizer)
    return None if why is None else why.reason


class BatchPadder:
    """Pads the KJTs of one sharded collection (`ebc`) to a capacity per feature (canonical columns,
    `feature_columns`). Features whose every lookup reads its ids through the bags' offsets alone (a scheme with
    `pads_free`: the data-parallel tables on the small-table kernels) get no fillers: their bags stay as they are,
    they follow the padded features, and the ids their capacity leaves unused sit at the end of the batch's values,
    in no bag. The filler ids of a capacity are made once."""

    def __init__(self, ebc) -> None:
        self.ebc = ebc
        cols = feature_columns(ebc.tables)
        self._column = {f: cols[f] for f in ebc.features}
        # the free features in their scheme's order: its lookup reads them as one run, without a permute
        self._free_order = [f for s in ebc.schemes if getattr(s, "pads_free", False) for f in s.layout.keys]
        self._free = set(self._free_order)
        self._fill: dict = {}  # (keys, capacities, dtype, device) of a run of padded features -> filler ids

    def pad(self, kjt, counts: BatchCounts, cap_C: np.ndarray, out: tuple | None = None):
        """(`kjt` padded to the capacity `cap_C` (ids per canonical column; at least this rank's counts), the counts
        of such a batch on every rank). Device work only: the host knows every size.

        The padded KJT lists the padded features first (each holding its capacity: every one at the same place in
        every step), then the free ones (their own ids, from a fixed place), then the free features' unused
        capacity (in no bag): a lookup sees the same buffers, at the same addresses, in every step. `out`: the
        (values, weights, lengths) tensors to write the padded batch into (a padded batch of the same capacity and
        keys: a captured graph's static inputs), instead of new ones."""
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        keys, B = list(kjt.keys()), kjt.stride()
        cols = [self._column[k] for k in keys]
        have = [int(counts.ids[self.ebc.rank, c]) for c in cols]
        cap = [int(cap_C[c]) for c in cols]
        if any(c < n for c, n in zip(cap, have)):
            over = [(k, n, c) for k, n, c in zip(keys, have, cap) if c < n][:3]
            raise ValueError(f"BatchPadder.pad: features (name, ids, capacity) {over} hold more ids than the capacity")
        values, weights, lengths = kjt.values(), kjt.weights_or_none(), kjt.lengths()
        dev = values.device
        if out is None:
            values_out = torch.empty(sum(cap), dtype=values.dtype, device=dev)
            weights_out = torch.empty(sum(cap), dtype=torch.float32, device=dev)
            lengths_out = torch.empty(lengths.numel(), dtype=lengths.dtype, device=dev)
        else:
            values_out, weights_out, lengths_out = out
            if values_out.numel() != sum(cap) or lengths_out.numel() != lengths.numel():
                raise ValueError(
                    f"BatchPadder.pad: out holds {values_out.numel()} ids and {lengths_out.numel()} bags, the padded "
                    f"batch {sum(cap)} and {lengths.numel()}: pass buffers of a batch of this capacity"
                )
        free = [k in self._free for k in keys]
        where_in = {k: i for i, k in enumerate(keys)}
        order = [i for i in range(len(keys)) if not free[i]] + [where_in[f] for f in self._free_order if f in where_in]
        old = np.concatenate([[0], np.cumsum(have)]).astype(np.int64)  # where each feature's ids are now
        at_ids: dict[int, int] = {}  # and where they go: a padded feature holds its capacity, a free one its ids
        at = 0
        for i in order:
            at_ids[i] = at
            at += have[i] if free[i] else cap[i]
        for r0, f0, f1 in _runs(order, free):
            is_free = free[f0]
            o0, o1, n0 = int(old[f0]), int(old[f1]), at_ids[f0]
            n1 = n0 + (o1 - o0 if is_free else sum(cap[f0:f1]))
            bags = slice(r0 * B, (r0 + f1 - f0) * B)
            if is_free:  # no fillers: the ids, their weights (where a table has them) and their bags as they are
                values_out[n0:n1].copy_(values[o0:o1])
                if any(self.ebc._table_of[k].weighted for k in keys[f0:f1]):
                    self._own_weights(keys[f0:f1], have[f0:f1], weights, o0, o1, weights_out[n0:n1])
                lengths_out[bags].copy_(lengths[f0 * B : f1 * B])
                continue
            self._pad_run(keys[f0:f1], have[f0:f1], cap[f0:f1], B, lengths[f0 * B : f1 * B], values[o0:o1],
                          weights, (o0, o1), (values_out[n0:n1], weights_out[n0:n1], lengths_out[bags]))  # fmt: skip
        if at < values_out.numel():  # the free features' unused capacity: in no bag, read by no lookup
            values_out[at:].zero_()
        keys_out = [keys[i] for i in order]
        padded = KeyedJaggedTensor(keys=keys_out, values=values_out, lengths=lengths_out, weights=weights_out, stride=B)
        W = len(counts.batch_sizes)
        return padded, BatchCounts(list(counts.batch_sizes), np.tile(np.asarray(cap_C), (W, 1)), [])

    def _own_weights(self, keys, have, weights, o0: int, o1: int, out: torch.Tensor) -> None:
        """The weights the ids `o0:o1` of features `keys` pool with, into `out`: the batch's for weighted tables,
        1 for the others."""
        flags = [self.ebc._table_of[k].weighted for k in keys]
        if weights is None or not any(flags):
            out.fill_(1.0)
        elif all(flags):
            out.copy_(weights[o0:o1])
        else:
            weighted = cached_tensor(flags, out.device, torch.bool)  # made once: no host-to-device copy a step
            per_id = torch.repeat_interleave(weighted, small_to_device(have, out.device), output_size=o1 - o0)
            out.copy_(torch.where(per_id, weights[o0:o1].float(), 1.0))

    def _pad_run(self, keys, have, cap, B: int, lengths, values, weights, span, out) -> None:
        """Pad consecutive features `keys` (their `lengths` `[F*B]`, `values`, the batch's `weights` over `span`)
        into `out` (values, weights, lengths): each feature to its capacity, its fillers spread over its bags."""
        values_out, weights_out, lengths_out = out
        F, dev, N = len(keys), values.device, sum(have)
        filler_ids = self._fillers(keys, cap, values.dtype, dev)
        lengths_FB = lengths.view(F, B)
        sizes = small_to_device([c - n for c, n in zip(cap, have)], dev)  # one copy: the padding per feature
        pad_F1 = sizes.view(F, 1)
        bags_1B = torch.arange(B, device=dev).view(1, B)
        extra_FB = pad_F1 // max(B, 1) + (bags_1B < pad_F1 % max(B, 1)).to(torch.int64)  # pad // B, +1 in the first
        new_lengths = (lengths_FB.to(torch.int64) + extra_FB).reshape(-1)
        old_lengths = lengths_FB.reshape(-1).to(torch.int64)
        bag_of = torch.repeat_interleave(torch.arange(F * B, device=dev), old_lengths, output_size=N)
        shift = complete_cumsum(new_lengths)[:-1] - complete_cumsum(old_lengths)[:-1]  # per bag: where its ids move
        where = torch.arange(N, device=dev) + shift[bag_of]
        own_w = torch.empty(N, dtype=torch.float32, device=dev)
        self._own_weights(keys, have, weights, span[0], span[1], own_w)
        values_out.copy_(filler_ids).index_copy_(0, where, values)
        weights_out.zero_().index_copy_(0, where, own_w)
        lengths_out.copy_(new_lengths)

    def _fillers(self, keys: list[str], cap: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A run of padded features' values before their own ids are put in: per feature, `cap` filler ids on rows
        0, 1, ..., up to FILLER_ROWS rows of its table (again and again). Made once per capacity."""
        key = (tuple(keys), tuple(cap), dtype, str(device))
        if key not in self._fill:
            if len(self._fill) > 16:  # capacities of the past
                self._fill.clear()
            rows = [min(self.ebc._table_of[k].num_embeddings, FILLER_ROWS) for k in keys]
            ids = np.concatenate([np.arange(c, dtype=np.int64) % r for c, r in zip(cap, rows)] or [np.zeros(0)])
            self._fill[key] = torch.from_numpy(ids.astype(np.int64)).to(device=device, dtype=dtype)
        return self._fill[key]


def _runs(order: list[int], free: list[bool]) -> list[tuple[int, int, int]]:
    """The output `order` (input feature indices) cut into runs of one kind whose input features are consecutive:
    (first output row, first input feature, end input feature)."""
    out: list[list[int]] = []
    for r, i in enumerate(order):
        if out and free[i] == free[out[-1][1]] and i == out[-1][2]:
            out[-1][2] = i + 1
        else:
            out.append([r, i, i + 1])
    return [(r, f0, f1) for r, f0, f1 in out]
