"""Regroup of pooled blocks into the model's feature groups by one Triton column-gather launch each way.

Same constructor and call contract as `embshard.collection.regroup.Regroup` (which it extends): blocks `[B, sum of the
block's key widths]` in, `{group: [B, sum of the group's key widths]}` out, keys may repeat across groups, keys
used by no group get an exactly-zero gradient.

Data flow. Built once per (device, dtype), host -> device: for every output column its source (block, column),
and for every input column the list of output (group, column) that copied it (K = the most any column has; empty
slots and unused columns point at a zero source). Per call: the tensors' addresses and row strides go to the
kernel as arguments (up to 8 tensors each side; more: a small int64 table copied to the device), then
  forward   one `_gather_cols` launch: tiles of `[BLOCK_B, BLOCK_W]` output columns, each column loaded from its
            block (pure copy);
  backward  one launch over the input columns: each sums its K sources in fp32 (K = 1: pure copy, unused
            columns copy zeros), written once: no atomics, no memset, deterministic.
Bytes moved: each way, B x (input + output widths) x element size (+ K - 1 extra reads of duplicated columns).

`impl`: "triton" (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1), "torch" (index_select on the
concatenated blocks: the CPU path), "fbgemm" (the parent's permute_multi_embedding), "auto" (triton on CUDA,
torch on the CPU unless TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch

from embshard.collection.regroup import Regroup

VECTOR_BYTES = 16  # widest vector load the kernel asks for


class KernelRegroup(Regroup):
    """Regroup with a Triton kernel forward and backward (torch fallback on the CPU)."""

    def __init__(
        self,
        keys: Sequence[Sequence[str]],
        dims: Sequence[Sequence[int]],
        groups: Mapping[str, Sequence[str]],
        impl: str = "auto",
        block_b: int = 32,
        block_w_bytes: int = 512,
        num_warps: int = 4,
    ) -> None:
        super().__init__(keys, dims, groups)
        if impl not in ("auto", "triton", "torch", "fbgemm"):
            raise ValueError(f"KernelRegroup impl={impl!r} is unknown: choose auto, triton, torch or fbgemm")
        self.impl = impl
        self.block_b, self.block_w_bytes, self.num_warps = block_b, block_w_bytes, num_warps
        where: dict[str, tuple[int, int]] = {}
        self._widths = []
        for i, (k_list, d_list) in enumerate(zip(self._keys, self._dims)):
            pos = 0
            for k, d in zip(k_list, d_list):
                where[k] = (i, pos)
                pos += d
            self._widths.append(pos)
        width = {k: d for k_list, d_list in zip(self._keys, self._dims) for k, d in zip(k_list, d_list)}
        # forward: per output column (group, column) <- (block, column)
        fwd = []  # (dst_ref, dst_col, src_ref, src_col)
        uses: list[list[list[tuple[int, int]]]] = [[[] for _ in range(w)] for w in self._widths]
        for g, members in enumerate(self._groups):
            col = 0
            for k in members:
                i, pos = where[k]
                for c in range(width[k]):
                    fwd.append((g, col + c, i, pos + c))
                    uses[i][pos + c].append((g, col + c))
                col += width[k]
        self._fwd = fwd
        self._uses = uses
        self._k = max([1] + [len(u) for cols in uses for u in cols])
        all_dims = [d for d_list in self._dims for d in d_list]
        self._vec_bits = _pow2_gcd(all_dims)
        self._meta: dict[tuple[str, torch.dtype], tuple] = {}

    def _triton(self, device: torch.device) -> bool:
        if self.impl == "auto":
            return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        return self.impl == "triton"

    def forward(self, blocks: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """`blocks[i]` is `[B, sum(dims[i])]`; returns {group name: `[B, group width]`}."""
        if len(blocks) != len(self._keys):
            raise ValueError(f"KernelRegroup: {len(blocks)} blocks given, {len(self._keys)} expected")
        device = blocks[0].device
        if self.impl == "fbgemm":
            return super().forward(blocks)
        if not self._triton(device):
            return self._torch_forward(blocks)
        if len({b.dtype for b in blocks}) != 1:
            raise ValueError(f"KernelRegroup: blocks of different dtypes {[b.dtype for b in blocks]}; cast them first")
        blocks = [b if b.stride(-1) == 1 else b.contiguous() for b in blocks]
        if torch.is_grad_enabled() and any(b.requires_grad for b in blocks):
            outs = _RegroupFn.apply(self, *blocks)
        else:
            outs = self._run(blocks, forward=True)
        return dict(zip(self.names, outs))

    # ---- torch path -------------------------------------------------------------------------------------------
    def _torch_forward(self, blocks: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        key = (str(blocks[0].device), torch.int64)
        if key not in self._meta:
            starts = [0]
            for w in self._widths:
                starts.append(starts[-1] + w)
            cols: list[list[int]] = [[] for _ in self._groups]
            for g, _gc, i, c in self._fwd:
                cols[g].append(starts[i] + c)
            self._meta[key] = tuple(torch.tensor(c, dtype=torch.int64, device=blocks[0].device) for c in cols)
        x = torch.cat(list(blocks), dim=1)  # every block takes part: unused columns get zero gradients
        return {n: x.index_select(1, idx) for n, idx in zip(self.names, self._meta[key])}

    # ---- triton path ------------------------------------------------------------------------------------------
    def _metadata(self, device: torch.device, dtype: torch.dtype) -> tuple:
        from embshard.kernels._regroup_triton import pack

        key = (str(device), dtype)
        if key not in self._meta:
            vmax = VECTOR_BYTES // torch.empty(0, dtype=dtype).element_size()
            n_groups = len(self._groups)
            g, gc, i, c = zip(*self._fwd) if self._fwd else ((), (), (), ())
            fwd = (pack(i, c), pack(g, gc))
            k = self._k
            src: list[list[int]] = [[] for _ in range(k)]
            dst_ref, dst_col = [], []
            for blk, cols in enumerate(self._uses):
                for col, u in enumerate(cols):
                    dst_ref.append(blk)
                    dst_col.append(col)
                    slots = u + [(n_groups, col % vmax)] * (k - len(u))  # the zero source
                    for s, (r, sc) in enumerate(slots):
                        src[s].append((r, sc))
            bwd_src = [m for slot in src for m in pack([r for r, _ in slot], [sc for _, sc in slot])]
            as_tensor = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
            self._meta[key] = (
                (as_tensor(fwd[0]), as_tensor(fwd[1])),
                (as_tensor(bwd_src), as_tensor(pack(dst_ref, dst_col))),
                torch.zeros(vmax, dtype=dtype, device=device),
            )
        return self._meta[key]

    def _run(self, srcs: Sequence[torch.Tensor], forward: bool, batch: int | None = None) -> list[torch.Tensor]:
        """Forward: srcs = blocks -> group outputs. Backward: srcs = group gradients -> block gradients."""
        from embshard.kernels._regroup_triton import launch

        ref = srcs[0]
        device, dtype = ref.device, ref.dtype
        B = ref.shape[0] if batch is None else batch
        fwd_meta, bwd_meta, zero = self._metadata(device, dtype)
        widths = self.out_dims if forward else self._widths
        dsts = [torch.empty(B, w, dtype=dtype, device=device) for w in widths]
        if not forward:
            srcs = [*srcs, zero]
        if B == 0 or not dsts:
            return dsts
        esize = ref.element_size()
        vec = min(1 << self._vec_bits, VECTOR_BYTES // esize)
        for t in [*srcs, *dsts]:
            if t.numel() == 0 or t is zero:  # empty blocks are never read or written; the zero source is aligned
                continue
            while vec > 1 and (t.data_ptr() % (vec * esize) or t.stride(0) % vec):
                vec //= 2
        src_meta, dst_meta = fwd_meta if forward else bwd_meta
        launch(
            [(t, 0 if t is zero else t.stride(0)) for t in srcs], [(t, t.stride(0)) for t in dsts],
            src_meta, dst_meta, B, 1 if forward else self._k, vec, self.block_b, self.block_w_bytes, self.num_warps,
        )  # fmt: skip
        return dsts


class _RegroupFn(torch.autograd.Function):
    """The regroup kernel with its backward kernel (no saved tensors: the backward needs only the batch size)."""

    @staticmethod
    def forward(ctx, rg: KernelRegroup, *blocks: torch.Tensor):  # type: ignore[override]
        ctx.rg, ctx.B = rg, blocks[0].shape[0]
        return tuple(rg._run(blocks, forward=True))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        grads = tuple(g if g.stride(-1) == 1 else g.contiguous() for g in grads)
        return (None, *ctx.rg._run(grads, forward=False, batch=ctx.B))


def _pow2_gcd(values: Sequence[int]) -> int:
    """log2 of the largest power of two dividing every value (capped at 4: 16 elements)."""
    bits = 4
    for v in values:
        while bits and v % (1 << bits):
            bits -= 1
    return bits
