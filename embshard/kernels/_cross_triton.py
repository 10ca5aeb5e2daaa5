"""The Triton kernels of one cross layer's running sum (embshard.kernels.cross), elementwise over `[B, width]`:

    forward     out = x + x0 * y           (x, out fp32; x0, y the layer's compute dtype, e.g. bf16)
                out_lo = out in x0's dtype (the next layer's matrix product reads it: no separate cast)
                FIRST: x is x0 itself (the first layer: no fp32 copy of x0 is made or read)
                HI false: out is not stored (the last layer: only out_lo is read after it)
    backward    g = g_out + g_lo           (either may be absent)
                g_x = g (fp32), g_x0 = g * y, g_y = g * x0 (each in its input's dtype)
                FIRST: g_x0 = g * (1 + y), which holds g_x (x is x0): one output, no add after

Each is one pass over the tensors, in blocks of BLOCK elements, the arithmetic in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from embshard.kernels._common_triton import block_range


@triton.jit
def _cross_forward(
    X, X0, Y, OUT, OUT_LO, n, BLOCK: tl.constexpr, FIRST: tl.constexpr, HI: tl.constexpr, LO: tl.constexpr
):
    offs, mask = block_range(n, BLOCK)
    x0 = tl.load(X0 + offs, mask=mask).to(tl.float32)
    y = tl.load(Y + offs, mask=mask).to(tl.float32)
    if FIRST:
        out = x0 + x0 * y
    else:
        out = tl.load(X + offs, mask=mask) + x0 * y
    if HI:
        tl.store(OUT + offs, out, mask=mask)
    if LO:
        tl.store(OUT_LO + offs, out.to(OUT_LO.dtype.element_ty), mask=mask)


@triton.jit
def _cross_backward(
    G,
    G_LO,
    X0,
    Y,
    GX,
    GX0,
    GY,
    n,
    BLOCK: tl.constexpr,
    HAS_G: tl.constexpr,
    HAS_LO: tl.constexpr,
    FIRST: tl.constexpr,
):
    offs, mask = block_range(n, BLOCK)
    g = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_G:
        g += tl.load(G + offs, mask=mask)
    if HAS_LO:
        g += tl.load(G_LO + offs, mask=mask).to(tl.float32)
    x0 = tl.load(X0 + offs, mask=mask).to(tl.float32)
    y = tl.load(Y + offs, mask=mask).to(tl.float32)
    if FIRST:
        tl.store(GX0 + offs, (g + g * y).to(GX0.dtype.element_ty), mask=mask)
    else:
        tl.store(GX + offs, g, mask=mask)
        tl.store(GX0 + offs, (g * y).to(GX0.dtype.element_ty), mask=mask)
    tl.store(GY + offs, (g * x0).to(GY.dtype.element_ty), mask=mask)
