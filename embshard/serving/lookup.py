"""The tables' lookup of a Predictor: one FBGEMM inference TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`) per
device, over one or several devices of one process.

On one device every table is whole in one TBE. Over several (tables that do not fit one GPU), `place` puts each
table whole on the least-loaded device by bytes, largest first (table-wise), and splits the tables over
`row_wise_bytes` into one block of rows per device (row-wise). A row-wise table's ids go to the device of their
block (shifted to its first row), each device pools its part of every bag, and the partial sums are added on the
output device: the regroup of training (one `[B, D]` block per feature, in table order). Mean pooling is applied by
the caller on the full bags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from embshard.serving.quantize import split_rows
from embshard.spec.tables import TableConfig


@dataclass(frozen=True)
class Block:
    """Rows r0..r1 of a table, on `device`."""

    table: str
    r0: int
    r1: int
    device: int


def place(tables: Sequence[TableConfig], nbytes: dict[str, int], devices: int, row_wise_bytes: float) -> list[Block]:
    """Blocks of every table over `devices` devices (see the module docstring)."""
    if devices == 1:
        return [Block(t.name, 0, t.num_embeddings, 0) for t in tables]
    load = [0.0] * devices
    blocks = []
    for t in sorted(tables, key=lambda t: -nbytes[t.name]):
        if nbytes[t.name] > row_wise_bytes and t.num_embeddings >= devices:
            step = -(-t.num_embeddings // devices)
            for d in range(devices):
                r0, r1 = d * step, min(t.num_embeddings, (d + 1) * step)
                if r0 < r1:
                    blocks.append(Block(t.name, r0, r1, d))
                    load[d] += nbytes[t.name] * (r1 - r0) / t.num_embeddings
        else:
            d = min(range(devices), key=lambda i: load[i])
            blocks.append(Block(t.name, 0, t.num_embeddings, d))
            load[d] += nbytes[t.name]
    return blocks


class TableLookup:
    """`lookup(lengths_FB, values, weights) -> pooled [B, sum of widths]` on `out_device` in `out_dtype` (fp32, fp16
    or bf16: on a GPU the TBE's own output type; on the CPU fp32, then cast) (see the module docstring).
    `rows`: each table's stored rows (quantize.py), `types`: each table's type; `devices`: where the TBEs go."""

    def __init__(
        self,
        tables: Sequence[TableConfig],
        rows: dict[str, torch.Tensor],
        types: dict[str, str],
        devices: Sequence[torch.device],
        out_device: torch.device,
        row_wise_bytes: float = float("inf"),
        out_dtype: torch.dtype = torch.float32,
    ) -> None:
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

        sparse = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "int8": SparseType.INT8, "int4": SparseType.INT4}
        self.out_device, self.devices, self.out_dtype = out_device, list(devices), out_dtype
        tbe_out = {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16, torch.bfloat16: SparseType.BF16}
        self.features = [f for t in tables for f in t.feature_names]
        self.widths = [t.embedding_dim for t in tables for _ in t.feature_names]
        self.starts = [sum(self.widths[:i]) for i in range(len(self.widths))]
        self.feature_rows = [t.num_embeddings for t in tables for _ in t.feature_names]
        by_name = {t.name: t for t in tables}
        nbytes = {n: r.numel() * r.element_size() for n, r in rows.items()}
        self.blocks = place(tables, nbytes, len(self.devices), row_wise_bytes)
        self.tbes: list[torch.nn.Module | None] = []
        self.slots: list[list[tuple[int, int, int, bool]]] = []  # per device: (feature, r0, r1, weighted)
        for d, device in enumerate(self.devices):
            mine = [b for b in self.blocks if b.device == d]
            if not mine:
                self.tbes.append(None)
                self.slots.append([])
                continue
            loc = EmbeddingLocation.DEVICE if device.type == "cuda" else EmbeddingLocation.HOST
            specs, ftm, slots, weights = [], [], [], []
            for i, b in enumerate(mine):
                t = by_name[b.table]
                specs.append((f"{b.table}:{b.r0}", b.r1 - b.r0, t.embedding_dim, sparse[types[b.table]], loc))
                weights.append(split_rows(rows[b.table][b.r0 : b.r1], types[b.table]))
                for f in t.feature_names:
                    ftm.append(i)
                    slots.append((self.features.index(f), b.r0, b.r1, t.weighted))
            tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
                specs, feature_table_map=ftm, pooling_mode=PoolingMode.SUM, device=device,
                output_dtype=tbe_out[out_dtype] if device.type == "cuda" else SparseType.FP32,
                bounds_check_mode=BoundsCheckMode.NONE,
            )  # fmt: skip
            tbe.initialize_weights()
            tbe.assign_embedding_weights([(w.to(device), None if s is None else s.to(device)) for w, s in weights])
            self.tbes.append(tbe)
            self.slots.append(slots)

        # one device, every table whole, features in order: the batch's ids go to the TBE as they are
        self.direct = len(self.devices) == 1 and [s[0] for s in self.slots[0]] == list(range(len(self.features)))
        weighted_F = [s[3] for s in self.slots[0]] if self.direct else []
        # one entry more than the features: ids past the last bag (a padded batch's buffer) fall on it
        self.weighted_F = (
            torch.tensor([*weighted_F, False], dtype=torch.bool, device=self.devices[0]) if any(weighted_F) else None
        )
        big = torch.iinfo(torch.int64).max
        self._rows_F = torch.tensor([*self.feature_rows, big], dtype=torch.int64, device=self.devices[0])

    def __call__(self, lengths_FB: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        if self.direct:
            return self._direct(lengths_FB, values, weights)
        F, B = lengths_FB.shape
        ids_F = lengths_FB.sum(1)
        seg = torch.zeros(F + 1, dtype=torch.int64, device=values.device)
        torch.cumsum(ids_F, 0, out=seg[1:])
        seg_h = seg.tolist()
        out = torch.zeros(B, sum(self.widths), device=self.out_device)
        for tbe, slots, device in zip(self.tbes, self.slots, self.devices):
            if tbe is None:
                continue
            lengths, ids, wts = [], [], []
            any_weighted = any(s[3] for s in slots)
            for f, r0, r1, weighted in slots:
                v = values[seg_h[f] : seg_h[f + 1]]
                w = weights[seg_h[f] : seg_h[f + 1]] if weighted and weights is not None else None
                n_B = lengths_FB[f]
                if r1 - r0 < self.feature_rows[f]:  # a row block: this device's ids of every bag
                    keep = (v >= r0) & (v < r1)
                    bag = torch.repeat_interleave(torch.arange(B, device=v.device), n_B, output_size=v.numel())
                    n_B = torch.bincount(bag[keep], minlength=B)
                    v, w = v[keep] - r0, None if w is None else w[keep]
                lengths.append(n_B.to(torch.int64))
                ids.append(v)
                if any_weighted:
                    wts.append(w.to(torch.float32) if w is not None else torch.ones(v.numel(), device=v.device))
            lengths_all = torch.cat(lengths)
            offsets = torch.zeros(lengths_all.numel() + 1, dtype=torch.int64, device=device)
            torch.cumsum(lengths_all.to(device), 0, out=offsets[1:])
            per_id = torch.cat(wts).to(device) if any_weighted else None
            pooled = tbe(torch.cat(ids).to(device, torch.int64), offsets, per_id).view(B, -1).to(self.out_device)
            at = 0
            for f, _, _, _ in slots:  # row blocks add up; whole tables are written once
                D = self.widths[f]
                out[:, self.starts[f] : self.starts[f] + D] += pooled[:, at : at + D].float()
                at += D
        return out.to(self.out_dtype)

    def _direct(self, lengths_FB: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """The one-TBE lookup, with no host sync. `values` (and `weights`) may run past the last bag's end (a padded
        batch's buffers): those ids are not read."""
        device = self.devices[0]
        B = lengths_FB.shape[1]
        lengths = lengths_FB.flatten().to(device, torch.int64)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        per_id = None
        if self.weighted_F is not None:  # weighted features take their weights, the others 1
            ones = torch.ones(values.numel(), dtype=torch.float32, device=device)
            if weights is not None:
                mask = self.weighted_F.index_select(0, self._feature_of_ids(lengths_FB, values.numel()))
                per_id = torch.where(mask, weights.to(device, torch.float32), ones)
            else:
                per_id = ones
        out = self.tbes[0](values.to(device, torch.int64), offsets, per_id)
        return out.view(B, -1).to(self.out_device, self.out_dtype)

    def _feature_of_ids(self, lengths_FB: torch.Tensor, n: int) -> torch.Tensor:
        """The feature of each of `n` ids laid out feature-major (F for those past the last bag); no host sync."""
        ends_F = lengths_FB.to(self.devices[0]).sum(1, dtype=torch.int64).cumsum(0)
        return torch.searchsorted(ends_F, torch.arange(n, device=self.devices[0]), right=True)

    def safe_ids(self, lengths_FB: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the ids with those outside their feature's table replaced by row 0, so that no lookup reads past a
        table; `[1]` count of those, ids past the last bag not counted); no host sync. One device only
        (`direct`)."""
        feature = self._feature_of_ids(lengths_FB, values.numel())
        v = values.to(self.devices[0], torch.int64)
        bad = ((v < 0) & (feature < len(self.features))) | (v >= self._rows_F.index_select(0, feature))
        return v.masked_fill(bad, 0), bad.sum(dtype=torch.int64).reshape(1)
