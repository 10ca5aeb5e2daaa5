"""Unsharded reference in plain PyTorch: full tables, F.embedding_bag, and the optimizer math written out.

Independent of embshard's distributed code: it shares only the deterministic initialisation (init_rows) so both
start from the same weights.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from embshard.lookup import init_rows
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.tables import Pooling, TableConfig

# The fused optimizers the parity tests train with (a test file adds its own variants after these, in this order).
OPTIMIZERS = {
    "sgd": FusedOptimizerConfig("sgd", lr=0.1),
    "adagrad": FusedOptimizerConfig("adagrad", lr=0.1, eps=1e-6),
    "rowwise_adagrad": FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6),
    "adam": FusedOptimizerConfig("adam", lr=0.05, eps=1e-6),
    "rowwise_adagrad_wd": FusedOptimizerConfig("rowwise_adagrad", lr=0.1, eps=1e-6, weight_decay=0.05),
}


def _init_device() -> str:
    """The device the module under test computes on (EMBSHARD_TEST_DEVICE): the reference draws its initial rows
    there too (init_rows gives the same bits on the CPU and on CUDA; tests/test_init_rows.py checks it)."""
    return os.environ.get("EMBSHARD_TEST_DEVICE", "cpu")


class ReferenceEBC:
    """Plain-PyTorch embedding bags with exact sparse optimizer updates (only touched rows change).

    `column_blocks` {table: [widths]}: row-wise Adagrad keeps one state value per row of each column block (the
    mean of g^2 over the block's columns), as a column-wise sharded table does; default: one block, the full row.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        opt: FusedOptimizerConfig,
        seed: int = 0,
        column_blocks: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        self.tables = list(tables)
        self.opt = opt
        self.column_blocks = {t.name: [t.embedding_dim] for t in tables}
        self.column_blocks.update({k: list(v) for k, v in (column_blocks or {}).items()})
        for name, widths in self.column_blocks.items():
            dim = next(t.embedding_dim for t in tables if t.name == name)
            assert sum(widths) == dim, f"column blocks {widths} of {name} do not add up to {dim}"
        self.weights = {
            t.name: init_rows(t, i, 0, t.num_embeddings, 0, t.embedding_dim, seed, _init_device()).cpu().double()
            for i, t in enumerate(tables)
        }
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.step_count = 0
        for t in tables:
            w = self.weights[t.name]
            self.state[t.name] = {
                "sum": torch.zeros_like(w),
                "row_sum": torch.zeros(w.shape[0], len(self.column_blocks[t.name]), dtype=w.dtype),
                "m": torch.zeros_like(w),
                "v": torch.zeros_like(w),
            }

    def optimizer_state(
        self,
        name: str,
        row_offset: int = 0,
        num_rows: int | None = None,
        col_offset: int = 0,
        num_cols: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Table `name`'s optimizer state for rows [row_offset, +num_rows) x columns [col_offset, +num_cols), named
        as embshard.lookup.updates.optimizer_state: adagrad `m` `[rows, cols]`, rowwise_adagrad `m` `[rows]`, adam `m` and
        `v` `[rows, cols]`, sgd none. Row-wise Adagrad keeps one value per row of each column block: the columns
        must be one block (with one block, the full row, every column range reads the row's one value)."""
        w = self.weights[name]
        rows = slice(row_offset, row_offset + (num_rows if num_rows is not None else w.shape[0] - row_offset))
        cols = slice(col_offset, col_offset + (num_cols if num_cols is not None else w.shape[1] - col_offset))
        st, kind = self.state[name], self.opt.kind
        if kind is OptimizerKind.SGD:
            return {}
        if kind is OptimizerKind.ADAGRAD:
            return {"m": st["sum"][rows, cols]}
        if kind is OptimizerKind.ADAM:
            return {"m": st["m"][rows, cols], "v": st["v"][rows, cols]}
        blocks = self.column_blocks[name]
        if len(blocks) == 1:
            return {"m": st["row_sum"][rows, 0]}
        starts = [sum(blocks[:k]) for k in range(len(blocks))]
        if cols.start not in starts or blocks[starts.index(cols.start)] != cols.stop - cols.start:
            raise ValueError(f"{name}: columns {cols.start}..{cols.stop} are not one of the column blocks {blocks}")
        return {"m": st["row_sum"][rows, starts.index(cols.start)]}

    def forward(self, batch: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]], params=None):
        """batch: feature -> (lengths [B], ids, weights or None). Returns feature -> pooled [B, D] (float64)."""
        params = params or self.weights
        out = {}
        for t in self.tables:
            for f in t.feature_names:
                lengths, ids, w = batch[f]
                if lengths.numel() == 0:  # an empty global batch
                    out[f] = params[t.name][:0] * 0
                    continue
                offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.long().cumsum(0)[:-1]])
                psw = w.double() if (t.weighted and w is not None) else None
                pooled = F.embedding_bag(ids.long(), params[t.name], offsets, mode="sum", per_sample_weights=psw)
                if t.pooling is Pooling.MEAN:
                    pooled = pooled / lengths.clamp(min=1).double().unsqueeze(1)
                out[f] = pooled
        return out

    def step(self, batch, upstream: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Forward, backward of sum(out[f] * upstream[f]), then the sparse update. Returns the outputs."""
        params = {k: v.clone().requires_grad_(True) for k, v in self.weights.items()}
        out = self.forward(batch, params)
        loss = sum((out[f] * upstream[f].double()).sum() for f in upstream)
        loss.backward()
        self.step_count += 1
        for t in self.tables:
            touched = torch.unique(torch.cat([batch[f][1].long() for f in t.feature_names]))
            if touched.numel():
                self._update(t.name, params[t.name].grad, touched)
        return {f: o.detach() for f, o in out.items()}

    def _update(self, name: str, grad: torch.Tensor, rows: torch.Tensor) -> None:
        o, w, st = self.opt, self.weights[name], self.state[name]
        g = grad[rows]
        if o.weight_decay:
            g = g + o.weight_decay * w[rows]
        if o.kind is OptimizerKind.SGD:
            w[rows] -= o.lr * g
        elif o.kind is OptimizerKind.ADAGRAD:
            st["sum"][rows] += g * g
            w[rows] -= o.lr * g / (st["sum"][rows].sqrt() + o.eps)
        elif o.kind is OptimizerKind.ROWWISE_ADAGRAD:
            c0 = 0
            for k, width in enumerate(self.column_blocks[name]):
                gk = g[:, c0 : c0 + width]
                st["row_sum"][rows, k] += (gk * gk).mean(dim=1)
                w[rows, c0 : c0 + width] -= o.lr * gk / (st["row_sum"][rows, k].sqrt().unsqueeze(1) + o.eps)
                c0 += width
        else:
            t = self.step_count
            st["m"][rows] = o.beta1 * st["m"][rows] + (1 - o.beta1) * g
            st["v"][rows] = o.beta2 * st["v"][rows] + (1 - o.beta2) * g * g
            m_hat = st["m"][rows] / (1 - o.beta1**t)
            v_hat = st["v"][rows] / (1 - o.beta2**t)
            w[rows] -= o.lr * m_hat / (v_hat.sqrt() + o.eps)
