"""Top-k over the whole row-sharded catalog, and recall@K, without a `[B, N_items]` tensor.

  queries [B_r, D] --gather_rows--> Q [B, D]
  this rank: for each chunk E_c [c, D] of its block: scores Q E_c^T [B, c] -> top-k of (running top-k, chunk)
             -> best scores [B, k] and their global item ids [B, k]
  one all-gather of each -> [W, B, k] -> top-k of the W k candidates -> the catalog's top-k per query [B, k]
  recall@K: a rank's queries whose target is among their first K (K <= k), counted per K
Ties between equal scores may be broken differently from a dense torch.topk over the full score matrix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from embshard.retrieval.gather import gather_rows, gather_sizes
from embshard.retrieval.softmax import chunk_rows
from embshard.runtime.comm import start_all_gather, world_and_rank


@torch.no_grad()
def sharded_topk(
    Q_BD: torch.Tensor,
    rows_RD: torch.Tensor,
    row_offset: int,
    k: int,
    group: dist.ProcessGroup | None = None,
    chunk_mib: float = 256.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, k], global ids [B, k]) of the k best rows over every rank's block for each query of `Q_BD` (the
    same on every rank); ids are -1 (score -inf) where the catalog has fewer than k rows. Collective."""
    B = Q_BD.shape[0]
    best = Q_BD.new_full((B, k), float("-inf"))
    best_ids = torch.full((B, k), -1, dtype=torch.int64, device=Q_BD.device)
    step = chunk_rows(B, chunk_mib)
    rows_RD = rows_RD.to(Q_BD.dtype)
    for c0 in range(0, rows_RD.shape[0], step):
        scores = Q_BD @ rows_RD[c0 : c0 + step].t()
        ids = torch.arange(c0, c0 + scores.shape[1], device=Q_BD.device) + row_offset
        merged = torch.cat([best, scores], 1)
        best, at = merged.topk(k, dim=1)
        best_ids = torch.cat([best_ids, ids.expand(B, -1)], 1).gather(1, at)
    W, _ = world_and_rank(group)
    if W == 1:
        return best, best_ids
    h_scores, h_ids = start_all_gather(best, group), start_all_gather(best_ids, group)
    all_scores = h_scores.wait().permute(1, 0, 2).reshape(B, W * k)
    all_ids = h_ids.wait().permute(1, 0, 2).reshape(B, W * k)
    top, at = all_scores.topk(k, dim=1)
    return top, all_ids.gather(1, at)


@torch.no_grad()
def recall_hits(
    query_BD: torch.Tensor,
    target_B: torch.Tensor,
    rows_RD: torch.Tensor,
    row_offset: int,
    ks: tuple[int, ...],
    group: dist.ProcessGroup | None = None,
    chunk_mib: float = 256.0,
) -> dict[int, torch.Tensor]:
    """{K: number of this rank's queries whose target is among the K best-scored items of the whole catalog}
    (0-d int64 tensors; recall@K = hits / queries). Collective."""
    sizes = gather_sizes(query_BD.shape[0], query_BD.device, group)
    Q = gather_rows(query_BD.detach(), sizes, group)
    _, ids = sharded_topk(Q, rows_RD, row_offset, max(ks), group, chunk_mib)
    _, rank = world_and_rank(group)
    off = sum(sizes[:rank])
    mine = ids[off : off + sizes[rank]]
    return {K: (mine[:, :K] == target_B.unsqueeze(1)).any(1).sum() for K in ks}
