"""Softmax cross-entropy over candidates spread across the ranks: the full softmax over a row-sharded item table,
and sampled softmax with logQ correction; never a `[B_global, N_items]` tensor anywhere.

Shapes: W ranks, B_r queries on rank r, B = sum B_r (the global batch), D the vector width, R_r rows on rank r,
c rows per chunk (chosen so that one `[B, c]` chunk of logits takes `chunk_mib`).

Forward, on every rank:
  queries [B_r, D], targets [B_r] --gather_rows--> Q [B, D], T [B]            (all-gathers, embshard.retrieval.gather)
  for each chunk of this rank's candidate rows E_c [c, D]:
      logits = Q E_c^T (+ bias_c; accidental hits -inf)   [B, c]
      lse_r = logaddexp(lse_r, logsumexp_rows(logits))   [B]  partial normaliser over this rank's candidates
  target logit, where this rank holds the target's row:  t_r = Q_i . E[pos_i] (+ target bias), else 0     [B]
  one all-gather of [lse_r; t_r] -> [W, 2, B]:  lse_cand = logsumexp over ranks,  t = sum over ranks
  lse = lse_cand (full softmax: the target is a candidate) or logaddexp(lse_cand, t) (sampled: it is not)
  loss_i = lse_i - t_i  [B]; each rank returns its own queries' losses [B_r]
Backward (the chunks recomputed, logits never kept):
  g [B_r] --all-gather--> g [B]
  per chunk: P = g * exp(logits - lse) (in place, softmax_grad_);  dQ += P E_c;  dE_c = P^T Q
  target term (the target's rank): coef_i = g_i (p_target_i - 1), p_target_i = exp(t_i - lse_i) if the target is
      not a candidate, else 0 (the chunk pass already counted its softmax share); dQ_i += coef_i E[pos_i],
      dE[pos_i] += coef_i Q_i
  dQ [B, D] --gather_rows' backward (all-to-all + sum)--> each rank's [B_r, D]: to the user tower
  dE [R_r, D] --> the rows' lookup (ShardedEmbeddingBagCollection.local_rows) --> its fused optimizer
Collectives per step: forward 2 all-gathers of the batch (+ one of the batch sizes) and 1 of [2, B] floats;
backward 1 all-gather of [B] floats and the reduce-scatter of dQ. Peak extra memory per rank: Q, dQ [B, D], dE
[R_r, D] and one or two chunks [B, c].

Semantics: each query's loss is the cross-entropy of its target against the candidates (mean over the local batch
is the caller's), so with W ranks the item rows receive the gradient of the sum over ranks of each rank's loss,
as every sharded lookup does (the dense towers are averaged by DistributedDataParallel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from embshard.kernels.cross_entropy import logsumexp_rows, softmax_grad_
from embshard.retrieval.gather import gather_rows
from embshard.runtime.comm import start_all_gather, world_and_rank

NEG_INF = float("-inf")


@dataclass
class Candidates:
    """This rank's share of the softmax: the rows it scores and where the global batch's targets are among them."""

    rows_RD: torch.Tensor
    """Rows this rank scores, `[R, D]`, differentiable (its gradient goes to the table's fused optimizer): the
    candidates first, then rows used only as targets (sampled softmax)."""
    num_candidates: int
    """rows_RD[:num_candidates] enter every query's normaliser."""
    target_pos: torch.Tensor
    """`[B]` int64: the row of rows_RD holding query i's target, -1 where another rank holds it."""
    target_is_candidate: bool
    """True (full softmax): each target is among some rank's candidates; False (sampled): it is added to the
    normaliser on its own."""
    candidate_bias: torch.Tensor | None = None
    """`[num_candidates]` added to the candidates' logits (logQ correction), or None."""
    target_bias: torch.Tensor | None = None
    """`[B]` added to the target's logit where target_pos >= 0 (logQ correction), or None."""
    candidate_ids: torch.Tensor | None = None
    """`[num_candidates]` item ids; a candidate equal to query i's target is left out of i's normaliser (accidental
    hit). None: nothing is left out."""
    targets: torch.Tensor | None = None
    """`[B]` the global batch's target ids (needed with candidate_ids)."""


def chunk_rows(batch: int, chunk_mib: float) -> int:
    """Rows of a chunk such that a `[batch, rows]` fp32 chunk of logits takes at most `chunk_mib` MiB (>= 1 row)."""
    return max(1, int(chunk_mib * (1 << 20)) // (4 * max(batch, 1)))


def _chunk_logits(Q: torch.Tensor, rows: torch.Tensor, cands: Candidates, c0: int, c1: int) -> torch.Tensor:
    logits = Q @ rows[c0:c1].t()
    if cands.candidate_bias is not None:
        logits += cands.candidate_bias[c0:c1]
    if cands.candidate_ids is not None:
        logits.masked_fill_(cands.candidate_ids[c0:c1].unsqueeze(0) == cands.targets.unsqueeze(1), NEG_INF)
    return logits


def _target_rows(cands: Candidates) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of queries whose target row is here [B], that row's index, 0 elsewhere [B])."""
    mine = cands.target_pos >= 0
    return mine, cands.target_pos.clamp(min=0)


class _ShardedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, rows, cands, sizes, group, chunk):  # type: ignore[override]
        W, rank = world_and_rank(group)
        B = Q.shape[0]
        lse_part = Q.new_full((B,), NEG_INF)
        for c0 in range(0, cands.num_candidates, chunk):
            logits = _chunk_logits(Q, rows, cands, c0, min(c0 + chunk, cands.num_candidates))
            lse_part = torch.logaddexp(lse_part, logsumexp_rows(logits).to(Q.dtype))
        mine, pos = _target_rows(cands)
        t_part = Q.new_zeros(B)
        if rows.shape[0]:
            t_part = (Q * rows.index_select(0, pos)).sum(1)
            if cands.target_bias is not None:
                t_part = t_part + cands.target_bias
            t_part = torch.where(mine, t_part, 0.0)
        stats = start_all_gather(torch.stack([lse_part, t_part]), group).wait()  # [W, 2, B]
        t_logit = stats[:, 1].sum(0)
        lse = torch.logsumexp(stats[:, 0], dim=0)
        if not cands.target_is_candidate:
            lse = torch.logaddexp(lse, t_logit)
        loss = lse - t_logit
        ctx.save_for_backward(Q, rows, lse, t_logit)
        ctx.cands = replace(cands, rows_RD=None)  # the rows are saved above, with autograd's checks
        ctx.sizes, ctx.group, ctx.chunk = sizes, group, chunk
        off = sum(sizes[:rank])
        return loss[off : off + sizes[rank]]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_local):  # type: ignore[override]
        Q, rows, lse, t_logit = ctx.saved_tensors
        cands, sizes, group, chunk = ctx.cands, ctx.sizes, ctx.group, ctx.chunk
        g = gather_rows(grad_local.contiguous().to(Q.dtype), sizes, group)  # [B]
        dQ = torch.zeros_like(Q)
        dR = torch.zeros_like(rows)
        for c0 in range(0, cands.num_candidates, chunk):
            c1 = min(c0 + chunk, cands.num_candidates)
            P = softmax_grad_(_chunk_logits(Q, rows, cands, c0, c1), lse, g)
            dQ.addmm_(P, rows[c0:c1])
            torch.mm(P.t(), Q, out=dR[c0:c1])
        mine, pos = _target_rows(cands)
        if rows.shape[0]:
            p_target = torch.zeros_like(lse) if cands.target_is_candidate else torch.exp(t_logit - lse)
            coef = torch.where(mine, g * (p_target - 1.0), 0.0)
            dQ += coef.unsqueeze(1) * rows.index_select(0, pos)
            dR.index_add_(0, pos[mine], coef[mine].unsqueeze(1) * Q[mine])
        return dQ, dR, None, None, None, None


def sharded_softmax_loss(
    Q_BD: torch.Tensor,
    cands: Candidates,
    sizes: list[int],
    group: dist.ProcessGroup | None = None,
    chunk_mib: float = 256.0,
) -> torch.Tensor:
    """Per-query cross-entropy `[B_r]` of this rank's queries against the candidates of every rank (module
    docstring). `Q_BD`: the global batch's queries `[B, D]` (gather_rows of the local ones, so that the gradient
    returns to each query's rank); `sizes`: the local batch sizes; collective (every rank calls it, same order).
    Only this rank's losses may be used: each rank's backward gathers the others' gradients."""
    rows = cands.rows_RD
    if rows.dtype != Q_BD.dtype:
        rows = rows.to(Q_BD.dtype)
    return _ShardedSoftmax.apply(Q_BD, rows, cands, sizes, group, chunk_rows(Q_BD.shape[0], chunk_mib))


def block_targets(T: torch.Tensor, row_offset: int, num_rows: int) -> torch.Tensor:
    """`[B]`: each target's row within the block `[row_offset, row_offset + num_rows)`, -1 outside it."""
    local = T - row_offset
    return torch.where((local >= 0) & (local < num_rows), local, -1)
