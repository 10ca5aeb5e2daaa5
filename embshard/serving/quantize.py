"""Table weights in the types the serving lookup reads: fp32, fp16, and row-wise quantized int8 / int4.

Quantized rows use FBGEMM's fused row-wise layout (`FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`): per row the
packed codes (int8: one byte per element; int4: two elements per byte) followed by the row's fp16 scale and fp16
bias (4 bytes), so `value = code * scale + bias`. This is the layout FBGEMM's inference TBE
(`IntNBitTableBatchedEmbeddingBagsCodegen`) stores, after moving the 4 bytes in front of the codes itself
(`assign_embedding_weights` with the codes and the scale/bias apart). Quantization is per row, so a table is
quantized a block of rows at a time with the same result as all at once.
"""

from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch

DTYPES = ("fp32", "fp16", "int8", "int4")
"""The table types of a serving artifact, widest first."""
BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}
SCALE_BIAS_BYTES = 4
"""fp16 scale and fp16 bias at the end of each quantized row."""


def is_quantized(dtype: str) -> bool:
    return dtype in ("int8", "int4")


def row_bytes(dim: int, dtype: str) -> int:
    """Bytes of one stored row of `dim` elements (quantized: codes, then scale and bias)."""
    if is_quantized(dtype):
        return -(-dim * BITS[dtype] // 8) + SCALE_BIAS_BYTES
    return dim * BITS[dtype] // 8


def quantize(weight_RD: torch.Tensor, dtype: str) -> torch.Tensor:
    """Rows of fp32 weights `[R, D]` in `dtype`: fp32 / fp16 `[R, D]`, int8 / int4 `[R, row_bytes]` uint8 in
    FBGEMM's fused row-wise layout."""
    w = weight_RD.detach().to(torch.float32).contiguous()
    if dtype == "fp32":
        return w
    if dtype == "fp16":
        return w.to(torch.float16)
    if is_quantized(dtype):
        return torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(w, BITS[dtype])
    raise ValueError(f"table type {dtype!r} is not one of {DTYPES}")


def dequantize(stored: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 `[R, D]` of what `quantize` returned: FBGEMM's reference dequantization for int8 / int4."""
    if is_quantized(dtype):
        return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(stored.contiguous(), BITS[dtype])
    return stored.to(torch.float32)


def split_rows(stored: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes, scale/bias) as `IntNBitTableBatchedEmbeddingBagsCodegen.assign_embedding_weights` takes them:
    uint8 views of the stored rows; scale/bias None for fp32 / fp16."""
    if is_quantized(dtype):
        return stored[:, :-SCALE_BIAS_BYTES], stored[:, -SCALE_BIAS_BYTES:]
    return stored.contiguous().view(torch.uint8), None
