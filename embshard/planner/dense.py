"""The dense part of a training step at scale: its compute and its gradient all-reduce, priced beside the embedding
step (search.py) so that predictions at many GPUs can be read as samples per second.

  compute       flops_per_sample * B / (peak FLOP/s of the GPU model at the precision * DENSE_EFFICIENCY),
                flops_per_sample = 6 * multiply-adds of one sample's forward (forward 2, backward 4)
  all-reduce    the dense gradient, S = parameters * grad_bytes, as NCCL runs it over hosts of L GPUs with one
                NIC each (`ring_allreduce_s`): a ring inside each host over NVLink, 2 (L-1)/L * S / intra_host_bw,
                and, between the H hosts, one ring per local rank on its own NIC carrying S/L of the gradient,
                2 (H-1)/H * (S/L) / inter_host_bw; one collective latency for each level used.

The same ring prices 2D sharding's replica synchronization (twod.py), whose replicas sit one per host.
Assumptions: the dense step does not overlap the embedding step (the prediction is their sum: an upper bound
where the runtime overlaps them), and DENSE_EFFICIENCY is an assumed share of the GPU's peak, not a measured one
(docs/planner.md, "Predictions at scale").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embshard.planner.topology import Topology
from embshard.spec.tables import ConfigError

PEAK_FLOPS = {
    ("h100", "bf16"): 989e12,
    ("h100", "fp32"): 494e12,  # TF32 tensor cores
    ("h200", "bf16"): 989e12,  # the same GH100 chip
    ("h200", "fp32"): 494e12,
    ("a100", "bf16"): 312e12,
    ("a100", "fp32"): 156e12,
}
"""Dense tensor-core peak (FLOP/s, no sparsity) per GPU model and precision (vendor data sheets)."""
DENSE_EFFICIENCY = 0.40
"""Share of the peak the dense forward and backward reach at 8192 samples per GPU (an assumption: MLPs of 512-1024
units and DCNv2's rank-512 cross layers are small GEMMs)."""


@dataclass(frozen=True)
class DenseSpec:
    """The dense model's work per sample and size (from the training config: tools/plan.py)."""

    flops_per_sample: float
    """Forward + backward floating-point operations of one sample."""
    parameters: int
    """Dense parameters (the all-reduced gradient's elements)."""
    precision: str = "fp32"
    """'fp32' (TF32 tensor cores) or 'bf16' (autocast)."""
    grad_bytes: int = 4
    """Bytes per all-reduced gradient element (DDP's fp32 buckets: 4)."""

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"dense model: precision={self.precision!r} is invalid: choose fp32 or bf16")
        if self.flops_per_sample < 0 or self.parameters < 0:
            raise ConfigError(f"dense model: {self} has a negative size")


def mlp(widths: Sequence[int]) -> tuple[int, int]:
    """(multiply-adds per sample, parameters) of a stack of linear layers with these widths, input first."""
    macs = sum(a * b for a, b in zip(widths[:-1], widths[1:]))
    return macs, macs + sum(widths[1:])


def dlrm_dense(
    num_dense: int,
    embedding_dim: int,
    num_features: int,
    bottom: Sequence[int],
    top: Sequence[int],
    cross_layers: int = 0,
    low_rank: int = 0,
    precision: str = "fp32",
) -> DenseSpec:
    """DLRM's dense part: bottom MLP num_dense -> bottom -> embedding_dim, then either DCNv2's low-rank cross layers
    over the (num_features + 1) * embedding_dim concatenation followed by the top MLP (cross_layers > 0), or the
    pairwise dot interaction (its n(n-1)/2 products) and the top MLP; the top MLP ends in one logit."""
    b_macs, b_par = mlp([num_dense, *bottom, embedding_dim])
    n = num_features + 1
    if cross_layers:
        width = n * embedding_dim
        rank = low_rank or width
        x_macs = cross_layers * 2 * width * rank
        x_par = cross_layers * (2 * width * rank + width)
        top_in = width
    else:
        x_macs, x_par = n * n * embedding_dim // 2, 0
        top_in = embedding_dim + n * (n - 1) // 2
    t_macs, t_par = mlp([top_in, *top, 1])
    return DenseSpec(6.0 * (b_macs + x_macs + t_macs), b_par + x_par + t_par, precision)


def dense_compute_s(spec: DenseSpec, topo: Topology, batch_size: int) -> float:
    """Seconds of the dense forward and backward for `batch_size` samples on one GPU of `topo` (0 on CPUs: not
    priced)."""
    if not topo.is_gpu:
        return 0.0
    key = (str(topo.device_name).lower(), spec.precision)
    peak = PEAK_FLOPS.get(key, PEAK_FLOPS[("h100", spec.precision)])
    return spec.flops_per_sample * batch_size / (peak * DENSE_EFFICIENCY)


def ring_allreduce_s(nbytes: float, ranks: int, per_host: int, topo: Topology) -> float:
    """Seconds of an all-reduce of `nbytes` over `ranks` ranks, `per_host` of them on each host (module docstring:
    a ring inside each host, then one ring per local rank between the hosts)."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    p = max(1, min(per_host, ranks))
    hosts = ranks // p
    t = 0.0
    if p > 1:
        t += 2 * (p - 1) / p * nbytes / topo.intra_host_bw + topo.collective_latency_s
    if hosts > 1:
        t += 2 * (hosts - 1) / hosts * (nbytes / p) / topo.inter_host_bw + topo.inter_collective_latency_s
    return t


def dense_allreduce_s(spec: DenseSpec, topo: Topology) -> float:
    """Seconds of the dense gradient's all-reduce over every rank of `topo`."""
    return ring_allreduce_s(spec.parameters * spec.grad_bytes, topo.world_size, topo.local_world_size, topo)
