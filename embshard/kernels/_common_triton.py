"""Triton helpers shared by the kernels of several modules (inlined into each kernel that calls them)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_range(n, BLOCK: tl.constexpr):
    """This program's block of a 1-D range of `n` elements (64-bit indices) and which of them lie inside it."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return i, i < n
