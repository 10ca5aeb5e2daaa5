"""`TBELookup`: one FBGEMM TBE (SplitTableBatchedEmbeddingBagsCodegen) over a group of compatible shards, the
sparse optimizer fused into its backward.

Input: the ids of the lookup's keys for the (global) batch, as indices + offsets in feature-major order. Output:
pooled sums `[B, sum of key widths]`, keys in the lookup's order. Pooling is always a sum here; mean pooling is
applied after the output exchange, where every bag's full length is known (row-wise shards see only part).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from embshard.lookup.base import ShardLookup
from embshard.lookup.fbgemm_fixes import array_cache_state
from embshard.lookup.settings import tbe_settings
from embshard.lookup.shards import init_rows
from embshard.lookup.stats import summarize_cache_stats
from embshard.lookup.uvm_fill import HostFirstTouch, concurrent_managed_access, uvm_first_touch
from embshard.runtime.ops import cached_tensor
from embshard.spec.optim import OptimizerKind
from embshard.spec.options import OutputDtype
from embshard.spec.tables import ConfigError

INIT_BLOCK_BYTES = 64 << 20  # a TBE's weights are initialised in row blocks of about this size (temporary buffer)


class TBELookup(ShardLookup):
    """One FBGEMM TBE over a group of compatible shards, optimizer fused into its backward."""

    pooling_mode = "SUM"  # FBGEMM PoolingMode member: SUM (bags, this class) or NONE (a row per id: lookup/sequence.py)

    def _build(self, device: torch.device, seed: int | None) -> None:
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        optimizer, shards = self.optimizer, self.shards
        self.settings = tbe_settings(shards, self.options, device.type)
        if device.type == "cuda" and optimizer.weight_decay and optimizer.kind is not OptimizerKind.ROWWISE_ADAGRAD:
            raise ConfigError(
                f"optimizer {optimizer.kind.value} with weight_decay={optimizer.weight_decay}: FBGEMM's fused GPU kernel "
                "ignores weight decay for this optimizer (seen with fbgemm-gpu 1.6 and 1.8); use rowwise_adagrad, or "
                "weight_decay: 0"
            )
        if device.type == "cuda" and optimizer.kind is OptimizerKind.ADAM and self.settings.weights_precision == "fp16":
            raise ConfigError(
                f"tables {[s.table.name for s in shards]}: fp16 weights with adam fail inside FBGEMM's GPU kernel "
                "(seen with fbgemm-gpu 1.6.0: 'row_counter_dev' Half vs Float); use data_type fp32 for these tables, "
                "or sgd/adagrad/rowwise_adagrad"
            )
        uvm = self.settings.location in ("MANAGED", "MANAGED_CACHING") and concurrent_managed_access(device)
        with uvm_first_touch() if uvm else nullcontext() as touch:  # uvm_fill.py: host threads populate UVM
            with array_cache_state() if self.settings.caching else nullcontext():  # fbgemm_fixes.py
                kwargs = self.settings.fbgemm_kwargs()
                if self.pooling_mode != "SUM":
                    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

                    kwargs["pooling_mode"] = PoolingMode[self.pooling_mode]
                self.tbe = SplitTableBatchedEmbeddingBagsCodegen(device=device, **kwargs, **optimizer.fbgemm_kwargs())
            self._init_weights(seed, touch)
        self._cast = OutputDtype(self.settings.cast_output_to).torch_dtype if self.settings.cast_output_to else None
        if self.settings.cache_stats:
            requested_F = torch.zeros(len(self.features), dtype=torch.int64, device=device)
            self.register_buffer("_requested_F", requested_F, persistent=False)
            self._occupied_base = 0

    @torch.no_grad()
    def _init_weights(self, seed: int | None, touch: HostFirstTouch | None) -> None:
        """Every shard's initial rows (`init_rows`), drawn where the weights live, in row blocks of about
        INIT_BLOCK_BYTES (UVM: each block written from the GPU once host threads have populated its pages)."""
        for w, s in zip(self.tbe.split_embedding_weights(), self.shards):
            sh = s.shard
            block = max(1, INIT_BLOCK_BYTES // (4 * sh.num_cols))
            for r0 in range(0, sh.num_rows, block):
                n = min(block, sh.num_rows - r0)
                init = init_rows(
                    s.table, s.table_index, sh.row_offset + r0, n, sh.col_offset, sh.num_cols, seed, w.device
                )
                if touch is not None:
                    touch.wait(w[r0 : r0 + n])
                w[r0 : r0 + n].copy_(init.to(w.dtype))

    def forward(
        self, indices: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pooled sums `[B, sum(dims)]` for ids laid out feature-major (offsets of length F*B+1)."""
        offsets = offsets.long()
        if self.settings.cache_stats:
            F = len(self.features)
            bounds = offsets[torch.arange(F + 1, device=offsets.device) * ((offsets.numel() - 1) // F)]
            self._requested_F += bounds[1:] - bounds[:-1]
        weighted = self.weighted or self.every_id_weighted  # a padded batch weighs every id
        psw = weights if weighted else None
        # FBGEMM's backward forms the weights' gradient unless told no feature needs it: all zero, it only writes
        # zeros (the weights of a batch are data; a padded batch's weigh every id of these tables)
        grad_flags = None
        if psw is not None and not psw.requires_grad:
            grad_flags = cached_tensor([0] * len(self.features), psw.device, torch.int32)
        out = self.tbe(indices.long(), offsets, per_sample_weights=psw, feature_requires_grad=grad_flags)
        return out.to(self._cast) if self._cast is not None else out

    def prefetch(
        self, indices: torch.Tensor, offsets: torch.Tensor, forward_stream: torch.cuda.Stream | None = None
    ) -> None:
        """Load the rows of a coming batch into the UVM cache (no-op without a cache). The next forward must get
        the same ids."""
        if self.settings.caching:
            self.tbe.prefetch(indices.long(), offsets.long(), forward_stream=forward_stream)

    def shard_weights(self) -> list[torch.Tensor]:
        """The weights of each shard (views, in shard order). UVM-caching: the cache is written back first; it keeps
        its rows (FBGEMM's flush does not empty it), so call `drop_cache()` BEFORE writing into these tensors: a
        flush after the write would put the cached old rows back over the new values."""
        if self.settings.caching:
            self.tbe.flush()
        return list(self.tbe.split_embedding_weights())

    def shard_optimizer_states(self) -> list[dict[str, torch.Tensor]]:
        """The fused optimizer's state of each shard (views, in shard order), named as `optim.optimizer_state`:
        'm' (adagrad: `[rows, D]`; rowwise_adagrad: `[rows]`; adam: first moment `[rows, D]`), 'v' (adam: second
        moment); {} for sgd. UVM-caching: call `shard_weights()` first if the weights are needed too."""
        names = {
            OptimizerKind.SGD: (),
            OptimizerKind.ADAGRAD: ("m",),
            OptimizerKind.ROWWISE_ADAGRAD: ("m",),
            OptimizerKind.ADAM: ("m", "v"),
        }[self.optimizer.kind]
        if not names:
            return [{} for _ in self.shards]
        return [dict(zip(names, states)) for states in self.tbe.split_optimizer_states()]

    @property
    def optimizer_step(self) -> int:
        """Steps the fused optimizer has taken (Adam's bias-correction count; FBGEMM's `iter`)."""
        return int(self.tbe.iter.item()) if self.optimizer.kind is OptimizerKind.ADAM else 0

    @optimizer_step.setter
    def optimizer_step(self, step: int) -> None:
        if self.optimizer.kind is OptimizerKind.ADAM:
            self.tbe.iter.fill_(step)
            if hasattr(self.tbe, "iter_cpu"):  # FBGEMM counts on this host copy once it is non-zero
                self.tbe.iter_cpu.fill_(step)

    def drop_cache(self) -> None:
        """Write every cached row back and empty the cache; later lookups reload rows from UVM. Call it before
        writing into the weights (loading a checkpoint): with the cache empty, nothing can overwrite them."""
        if self.settings.caching:
            self.tbe.flush()
            self.tbe.reset_cache_states()

    # ---- UVM-cache statistics ----------------------------------------------------------------------------
    def _cached_rows(self) -> list[int]:
        state = self.tbe.lxu_cache_state.flatten()
        state = state[(state >= 0) & (state < int(sum(self.settings.rows)))]
        bounds = torch.tensor(self.settings.rows, device=state.device).cumsum(0)
        table = torch.bucketize(state, bounds, right=True)
        return torch.bincount(table, minlength=len(self.settings.rows)).tolist()

    def cache_stats(self) -> dict[str, dict]:
        """Per-table cache statistics since the last reset (lookup.stats.summarize_cache_stats); {} without stats."""
        if not self.settings.cache_stats:
            return {}
        return summarize_cache_stats(
            self.settings,
            self._requested_F.tolist(),
            self.tbe.get_table_wise_cache_miss().tolist(),
            self.tbe.get_uvm_cache_stats().tolist(),
            self._cached_rows(),
            self._occupied_base,
            int(self.tbe.lxu_cache_state.numel()),
        )

    def reset_cache_stats(self) -> None:
        """Start counting afresh."""
        if self.settings.cache_stats:
            self._requested_F.zero_()
            self.tbe.get_table_wise_cache_miss().zero_()
            self.tbe.reset_uvm_cache_stats()
            self._occupied_base = sum(self._cached_rows())
