"""`HostLookup`: the CPU lookup for what FBGEMM's CPU TBE cannot do (Adam, weight decay); same contract as
`TBELookup` (tbe.py)."""

from __future__ import annotations

import torch
from torch import nn

from embshard.lookup.base import NoCache, ShardLookup
from embshard.lookup.settings import tbe_settings
from embshard.lookup.shards import init_rows
from embshard.lookup.updates import optimizer_state, sparse_update
from embshard.spec.tables import DataType


class HostLookup(NoCache, ShardLookup):
    """CPU lookup for what FBGEMM's CPU TBE cannot do: Adam (not implemented there) and weight decay (silently
    ignored there, seen with fbgemm-gpu-cpu 1.8.0). Plain embedding_bag with sparse gradients; the optimizer is
    applied to the touched rows as soon as each shard's gradient is ready (fused into backward). fp16 tables keep
    fp16 values in fp32 storage (torch cannot add sparse fp16 gradients on the CPU): initial and updated values
    are rounded to the nearest fp16 value (no stochastic rounding here), so the numerics are those of fp16."""

    def _build(self, device: torch.device, seed: int | None) -> None:
        if device.type != "cpu":
            raise ValueError("HostLookup computes on the CPU only")
        tbe_settings(self.shards, self.options, device.type)  # the same checks as a TBE
        self.weights = nn.ParameterList()
        self._state: list[dict[str, torch.Tensor]] = []
        self._step = [0] * len(self.shards)
        for i, s in enumerate(self.shards):
            sh = s.shard
            w = init_rows(s.table, s.table_index, sh.row_offset, sh.num_rows, sh.col_offset, sh.num_cols, seed)
            p = nn.Parameter(w.half().float() if s.table.data_type is DataType.FP16 else w)
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            self.weights.append(p)
            self._state.append(optimizer_state(self.optimizer, w))
        self._fp16 = [s.table.data_type is DataType.FP16 for s in self.shards]
        self._feature_shard = [i for i, s in enumerate(self.shards) for _ in s.features]

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            grad = p.grad.coalesce()
            p.grad = None
            self._step[i] += 1
            with torch.no_grad():
                sparse_update(
                    self.optimizer,
                    p.data,
                    self._state[i],
                    grad.indices()[0],
                    grad.values(),
                    self._step[i],
                    self._fp16[i],
                )

        return hook

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]`, same contract as TBELookup."""
        F = len(self.features)
        B = (offsets.numel() - 1) // F
        outs = []
        for f in range(F):
            lo, hi = f * B, (f + 1) * B
            start = offsets[lo]
            off = offsets[lo : hi + 1] - start
            end = offsets[hi]
            idx = indices[start:end].long()
            w = self.weights[self._feature_shard[f]]
            psw = weights[start:end] if (weights is not None and (self.weighted or self.every_id_weighted)) else None
            outs.append(
                nn.functional.embedding_bag(
                    idx,
                    w,
                    off[:-1].long(),
                    mode="sum",
                    sparse=True,
                    per_sample_weights=psw,
                    include_last_offset=False,
                )
                if B
                else w.new_zeros(0, w.shape[1])
            )
        out = torch.cat(outs, dim=1) if outs else indices.new_zeros(B, 0, dtype=torch.float32)
        return out.to(self.options.output_dtype.torch_dtype)

    def shard_weights(self) -> list[torch.Tensor]:
        """The weights of each shard, in shard order."""
        return [p.data for p in self.weights]

    def shard_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """The optimizer state of each shard (the tensors themselves), named as `optim.optimizer_state`."""
        return list(self._state)

    @property
    def optimizer_step(self) -> int:
        """Steps the optimizer has taken (Adam's bias-correction count)."""
        return max(self._step) if self._step else 0

    @optimizer_step.setter
    def optimizer_step(self, step: int) -> None:
        self._step = [step] * len(self._step)
