"""Negatives for the sampled softmax, drawn from the row-sharded catalog without any communication.

The proposal is stratified by block: rank r draws k_r of the K negatives from its own block of R_r rows (one, plus
the rest of K in proportion to R_r; fixed for the run), with replacement:
  uniform: each row of the block with probability 1 / R_r
  unigram: row j with probability (c_j + alpha) / M_r, c_j the times j was a training target so far (counted on
           the row's own rank from the gathered targets), alpha the smoothing pseudo-count, M_r the block's total
The expected number of draws of row j is then e_j = k_r q_r(j), and the logQ correction subtracts log(e_j) from
the logit of every candidate and of every target (Jean et al. 2015; TF's sampled_softmax_loss): the softmax over
{target} + negatives with corrected logits is a consistent estimate of the full softmax. Draws come from a
generator seeded by (seed, step, rank), so any step can be replayed. Counts are not checkpointed.
"""

from __future__ import annotations

import math

import torch


def negatives_per_rank(num_negatives: int, block_rows: list[int]) -> list[int]:
    """k_r: one negative for every rank with rows, the rest of `num_negatives` split in proportion to the block
    rows (largest remainders first, ties to the lower rank); a rank without rows gets none. Every block must be
    sampled (a target in a never-sampled block would have an infinite correction): raises ValueError when
    `num_negatives` is smaller than the number of ranks with rows."""
    holders = [r for r, n in enumerate(block_rows) if n]
    if num_negatives < len(holders):
        raise ValueError(
            f"num_negatives={num_negatives} is fewer than the {len(holders)} ranks holding catalog rows: every "
            f"block needs at least one negative a step; use num_negatives >= {len(holders)}"
        )
    rest, total = num_negatives - len(holders), sum(block_rows)
    exact = [rest * n / total for n in block_rows]
    k = [int(math.floor(e)) for e in exact]
    order = sorted(range(len(k)), key=lambda r: (-(exact[r] - k[r]), r))
    for r in order[: rest - sum(k)]:
        k[r] += 1
    return [k[r] + (1 if block_rows[r] else 0) for r in range(len(k))]


class BlockSampler:
    """This rank's negatives: `k` rows of its block `[row_offset, row_offset + num_rows)` per step."""

    def __init__(
        self,
        kind: str,
        row_offset: int,
        num_rows: int,
        k: int,
        smoothing: float,
        seed: int,
        rank: int,
        device: torch.device,
    ) -> None:
        if kind not in ("uniform", "unigram"):
            raise ValueError(f"sampler {kind!r} is unknown: use 'uniform' or 'unigram'")
        self.kind, self.row_offset, self.num_rows, self.k = kind, row_offset, num_rows, k
        self.smoothing, self.seed, self.rank = smoothing, seed, rank
        self.counts = torch.zeros(num_rows, dtype=torch.float64, device=device)
        self._gen = torch.Generator(device=device)

    def log_expected(self, local_ids: torch.Tensor) -> torch.Tensor:
        """log(expected draws per step) of the block's rows `local_ids` (float32); zeros on a rank without rows."""
        if self.num_rows == 0:
            return torch.zeros(local_ids.shape, device=local_ids.device)
        if self.kind == "uniform":
            return torch.full(local_ids.shape, math.log(self.k / self.num_rows), device=local_ids.device)
        mass = self.counts.sum() + self.smoothing * self.num_rows
        return (torch.log(self.counts[local_ids] + self.smoothing) + math.log(self.k) - torch.log(mass)).float()

    def sample(self, step: int) -> torch.Tensor:
        """This step's negatives: `k` local row indices (int64), drawn with replacement."""
        device = self.counts.device
        self._gen.manual_seed((self.seed * 1_000_003 + step) * 4099 + self.rank)
        if self.k == 0 or self.num_rows == 0:
            return torch.zeros(0, dtype=torch.int64, device=device)
        if self.kind == "uniform":
            return torch.randint(0, self.num_rows, (self.k,), generator=self._gen, device=device)
        cdf = torch.cumsum(self.counts + self.smoothing, 0)
        u = torch.rand(self.k, generator=self._gen, device=device, dtype=torch.float64) * cdf[-1]
        return torch.searchsorted(cdf, u, right=True).clamp_(max=self.num_rows - 1)

    def observe(self, targets: torch.Tensor) -> None:
        """Count the global batch's targets that fall in this block (after the step that used the counts)."""
        if self.num_rows == 0:
            return
        local = targets - self.row_offset
        inside = ((local >= 0) & (local < self.num_rows)).to(torch.float64)  # no host sync: a masked add
        self.counts.index_add_(0, local.clamp(0, self.num_rows - 1), inside)
