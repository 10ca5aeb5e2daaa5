"""Retrieval over a row-sharded item catalog: the full softmax and the sampled softmax (logQ-corrected) without a
`[B_global, N_items]` tensor, all-gathered in-batch negatives, and recall@K by sharded top-k. docs/retrieval.md."""

from embshard.retrieval.catalog import Catalog
from embshard.retrieval.gather import gather_rows, gather_sizes
from embshard.retrieval.sampler import BlockSampler, negatives_per_rank
from embshard.retrieval.softmax import Candidates, block_targets, sharded_softmax_loss
from embshard.retrieval.topk import recall_hits, sharded_topk

__all__ = [
    "BlockSampler",
    "Candidates",
    "Catalog",
    "block_targets",
    "gather_rows",
    "gather_sizes",
    "negatives_per_rank",
    "recall_hits",
    "sharded_softmax_loss",
    "sharded_topk",
]
