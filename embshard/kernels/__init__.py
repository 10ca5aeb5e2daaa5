"""Fused GPU kernels (Triton) with torch fallbacks of the same semantics: the softmax cross-entropy."""

from embshard.kernels.cross_entropy import LaunchConfig, fused_cross_entropy, logsumexp_rows, softmax_grad_

__all__ = ["LaunchConfig", "fused_cross_entropy", "logsumexp_rows", "softmax_grad_"]
