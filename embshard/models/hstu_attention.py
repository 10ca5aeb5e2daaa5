"""The HSTU layer and its two attention layouts (model kind hstu, embshard/models/sequential.py).

One HSTU layer, on the rows of a batch of histories (`[..., D]`: jagged `[N, D]` or padded `[B, L, D]`):

    U, V, Q, K = split(SiLU(Linear(LayerNorm(X))))                    H heads of D / H each
    A[i, j] = SiLU(Q_i . K_j / sqrt(D / H) + rab_pos[i - j] + rab_time[bucket(t_i - t_j)]) / (i + 1)   for j <= i
    X = X + Linear(LayerNorm(sum_j A[i, j] V_j) * U)

rab_pos is a learned bias per head and distance (clamped to the longest history); rab_time (`time_bias`, as in
HSTU, "Actions Speak Louder than Words") a learned bias per head and log-bucketed time gap: bucket(g) =
floor(ln(max(|g|, 1)) / 0.301), at most TIME_BUCKETS - 1. t_i is the time of the action query i predicts (the
request time; the last position, which predicts nothing, takes its own item's time) and t_j the time of key j.

The attention is pointwise (no softmax), so torch's flex_attention and nested-tensor SDPA (softmax kernels) do
not compute it; the two layouts here are plain torch (autograd, CPU and GPU):

- `PaddedAttention`: the batch padded to its longest history, `[B, H, L, L]` scores, padding masked: work
  B * Lmax^2 (the reference).
- `JaggedAttention`: each history padded only to a multiple of a tile of T positions; the causal (query tile, key
  tile) pairs inside each history are enumerated once per batch (index tensors), their Q/K/V tiles gathered into
  `[P, H, T, D/H]`, multiplied in one batched matmul into `[P, H, T, T]` scores, biased, masked and multiplied by
  the V tiles, and summed back into the query tiles (index_add): work sum_i ceil(L_i / T)^2 T^2 / 2, about
  sum_i L_i^2 / 2. Its index tensors are built from the lengths on the host (one host sync per batch) and are
  shared by every layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from embshard.runtime.ops import host_to_device

TIME_BUCKETS = 128
"""Buckets of the time bias: gaps of up to e^(0.301 * 127) seconds (about 3.6e16) get their own bucket."""


def time_buckets(gap: torch.Tensor) -> torch.Tensor:
    """The bucket of each time gap (int64 seconds): floor(ln(max(|gap|, 1)) / 0.301), at most TIME_BUCKETS - 1
    (int32: an index of half the memory of int64; the per-pair buckets are the time bias's largest tensor)."""
    g = gap.abs().clamp(min=1).to(torch.float64)
    return (torch.log(g) / 0.301).floor().clamp(max=TIME_BUCKETS - 1).to(torch.int32)


def query_times(times_N: torch.Tensor, last_N: torch.Tensor) -> torch.Tensor:
    """Each position's query time `[N]`: the time of the next item of its history (the item it predicts); at a
    history's last position (`last_N`), its own item's time."""
    nxt = torch.cat([times_N[1:], times_N[-1:]]) if times_N.numel() else times_N
    return torch.where(last_N, times_N, nxt)


def host_positions(lengths: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(user `[N]`, position within its history `[N]`) of every item, built from the lengths on the host (int64
    `[B]`, no host sync) and sent to `device`."""
    n = lengths.to(torch.int64)
    N = int(n.sum())
    user_N = torch.repeat_interleave(torch.arange(n.shape[0]), n, output_size=N)
    pos_N = torch.arange(N) - (torch.cumsum(n, 0) - n)[user_N]
    return host_to_device(user_N, device), host_to_device(pos_N, device)


class HSTULayer(nn.Module):
    """One HSTU layer (module docstring): the projections here, the attention by a per-batch layout."""

    def __init__(self, width: int, heads: int, max_length: int, time_bias: bool = False) -> None:
        super().__init__()
        self.heads, self.max_length = heads, max_length
        self.norm = nn.LayerNorm(width)
        self.uvqk = nn.Linear(width, 4 * width)
        self.attn_norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, width)
        self.rel_bias = nn.Parameter(torch.zeros(heads, max_length))
        self.time_bias = nn.Parameter(torch.zeros(heads, TIME_BUCKETS)) if time_bias else None

    def forward(self, x: torch.Tensor, attention: PaddedAttention | JaggedAttention) -> torch.Tensor:
        """`x`: `[N, D]` for a JaggedAttention, `[B, L, D]` for a PaddedAttention (the layout of this batch)."""
        D, H = x.shape[-1], self.heads
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).split(D, dim=-1)
        heads = [t.reshape(*t.shape[:-1], H, D // H) for t in (q, k, v)]
        y = attention(*heads, self.rel_bias, self.time_bias)
        return x + self.out(self.attn_norm(y.reshape(x.shape)) * u)


class PaddedAttention:
    """The attention of a batch padded to its longest history `L` (the reference layout): q, k, v `[B, L, H, Dh]`."""

    def __init__(self, lengths_B: torch.Tensor, L: int, qtimes_BL: torch.Tensor | None, times_BL: torch.Tensor | None):
        device = lengths_B.device
        ij = torch.arange(L, device=device)
        allowed = (ij.view(1, 1, -1) <= ij.view(1, -1, 1)) & (ij.view(1, 1, -1) < lengths_B.view(-1, 1, 1))
        self.weight_BLL = allowed.float() / (ij.view(1, -1, 1) + 1).float()
        self.distance_LL = ij.unsqueeze(1) - ij.unsqueeze(0)
        self.bucket_BLL = None
        if times_BL is not None:
            self.bucket_BLL = time_buckets(qtimes_BL.unsqueeze(2) - times_BL.unsqueeze(1))

    def __call__(self, q, k, v, rel_bias_HM: torch.Tensor, time_bias_HK: torch.Tensor | None) -> torch.Tensor:
        B, L, H, Dh = q.shape
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, Dh]
        distance = self.distance_LL.clamp(0, rel_bias_HM.shape[1] - 1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(Dh) + rel_bias_HM[:, distance].unsqueeze(0)
        if time_bias_HK is not None:
            scores = scores + time_bias_HK[:, self.bucket_BLL].transpose(0, 1)
        attn = F.silu(scores) * self.weight_BLL.to(scores.dtype).unsqueeze(1)
        return (attn @ v).transpose(1, 2)  # [B, L, H, Dh]


class JaggedAttention:
    """The attention of jagged histories by causal tile pairs (module docstring): q, k, v `[N, H, Dh]`.

    Args:
        lengths: the histories' lengths on the host (int64 `[B]`); tile: positions per tile (T).
        device: where the index tensors go. qtimes_N, times_N: the query and key times (time bias), or None.
    """

    def __init__(
        self,
        lengths: torch.Tensor,
        tile: int,
        device: torch.device,
        qtimes_N: torch.Tensor | None = None,
        times_N: torch.Tensor | None = None,
    ) -> None:
        n = lengths.to(torch.int64).cpu()
        T = self.tile = tile
        N = self.num_items = int(n.sum())
        tiles_B = (n + T - 1) // T
        Nt = self.num_tiles = int(tiles_B.sum())
        seq_t = torch.repeat_interleave(torch.arange(n.shape[0]), tiles_B)
        first_B = torch.cumsum(tiles_B, 0) - tiles_B
        start_B = torch.cumsum(n, 0) - n
        qi_t = torch.arange(Nt) - first_B[seq_t]  # each tile's place in its history
        pos_tT = qi_t.unsqueeze(1) * T + torch.arange(T)  # each slot's position in its history
        valid_tT = pos_tT < n[seq_t].unsqueeze(1)
        rows_tT = torch.where(valid_tT, start_B[seq_t].unsqueeze(1) + pos_tT, N)  # N: the zero row
        pairs_t = qi_t + 1  # a query tile attends to its history's tiles 0..qi
        P = int(pairs_t.sum())
        pair_q = torch.repeat_interleave(torch.arange(Nt), pairs_t, output_size=P)
        pair_k = first_B[seq_t[pair_q]] + torch.arange(P) - (torch.cumsum(pairs_t, 0) - pairs_t)[pair_q]
        delta_P = qi_t[pair_q] - qi_t[pair_k]
        user_N = torch.repeat_interleave(torch.arange(n.shape[0]), n, output_size=N)
        pos_N = torch.arange(N) - start_B[user_N]
        slot_N = first_B[user_N] * T + pos_N
        self.pair_q, self.delta_P = host_to_device(pair_q, device), host_to_device(delta_P, device)
        self.rows_q, self.rows_k = (
            host_to_device(rows_tT[pair_q], device),
            host_to_device(rows_tT[pair_k], device),
        )  # [P, T]
        self.slot_N = host_to_device(slot_N, device)
        qpos_PT, kpos_PT = host_to_device(pos_tT[pair_q], device), host_to_device(pos_tT[pair_k], device)
        kvalid_PT = self.rows_k < N
        allowed = (
            (kpos_PT.unsqueeze(1) <= qpos_PT.unsqueeze(2)) & kvalid_PT.unsqueeze(1) & (self.rows_q < N).unsqueeze(2)
        )
        self.weight_PTT = allowed.float() / (qpos_PT.unsqueeze(2) + 1).float()
        a = torch.arange(T, device=device)
        deltas = torch.arange(int(tiles_B.max()) if n.numel() else 1, device=device)
        self.distance_dTT = deltas.view(-1, 1, 1) * T + a.view(1, -1, 1) - a.view(1, 1, -1)  # by tile distance
        self.bucket_PTT = None
        if times_N is not None:
            zero = times_N.new_zeros(1)
            tq, tk = torch.cat([qtimes_N, zero])[self.rows_q], torch.cat([times_N, zero])[self.rows_k]
            self.bucket_PTT = time_buckets(tq.unsqueeze(2) - tk.unsqueeze(1))

    def __call__(self, q, k, v, rel_bias_HM: torch.Tensor, time_bias_HK: torch.Tensor | None) -> torch.Tensor:
        N, H, Dh = q.shape
        T = self.tile
        zero = q.new_zeros(1, H, Dh)
        qP, kP, vP = (
            torch.cat([t, zero])[rows].permute(0, 2, 1, 3)  # [P, H, T, Dh]
            for t, rows in ((q, self.rows_q), (k, self.rows_k), (v, self.rows_k))
        )
        bias_HdTT = rel_bias_HM[:, self.distance_dTT.clamp(0, rel_bias_HM.shape[1] - 1)]
        scores = qP @ kP.transpose(-1, -2) / math.sqrt(Dh) + bias_HdTT[:, self.delta_P].transpose(0, 1)
        if time_bias_HK is not None:
            scores = scores + time_bias_HK[:, self.bucket_PTT].transpose(0, 1)
        attn = F.silu(scores) * self.weight_PTT.to(scores.dtype).unsqueeze(1)
        out_P = attn @ vP  # [P, H, T, Dh]
        tiles = out_P.new_zeros(self.num_tiles, H, T, Dh).index_add(0, self.pair_q, out_P)
        return tiles.transpose(1, 2).reshape(self.num_tiles * T, H, Dh).index_select(0, self.slot_N)
