"""Generative sequential recommender (model kind `hstu`): causal HSTU layers over each user's item sequence predict
the next item at every position, trained with the softmax over the whole row-sharded item catalog.

HSTU (Zhai et al. 2024, "Actions Speak Louder than Words") rather than SASRec: its pointwise attention (SiLU of
the scores, divided by the number of attended items, no softmax) with a learned relative position bias is the
architecture that scales with data in that work, and it costs the same code as SASRec here (one projection to
U, V, Q, K, one gated output). Per layer (embshard/models/hstu_attention.py has the layer and its attention):

    U, V, Q, K = split(SiLU(Linear(LayerNorm(X))))                    [N, D] each, H heads of D / H
    A[i, j] = SiLU(Q_i . K_j / sqrt(D / H) + rab_pos[i - j] + rab_time[bucket(t_i - t_j)]) / (i + 1), j <= i
    X = X + Linear(LayerNorm(A V) * U)

The input of position i is item i's catalog row (input and output item vectors are tied, as in SASRec) plus a
projection of the user's pooled context features; the output of position i, LayerNorm-ed and divided by the
temperature, scores the catalog for item i + 1: `Catalog.full_softmax_loss` (fused cross-entropy, never a
`[positions, items]` tensor) or `sampled_softmax_loss`.

The histories stay jagged (`[N, D]`, users' items one after another) through the projections; the attention is
pointwise, not a softmax, so torch's flex_attention and nested-tensor SDPA (softmax kernels) do not compute it,
and `sequential.attention` picks one of two plain-torch layouts: jagged (causal pairs of tiles inside each history,
work ~ sum of squared lengths) or padded (to the batch's longest history: the reference). The time bias
(`sequential.time_bias`, HSTU's rab_time) buckets the log of the gap between the time of the item a position
predicts (the request time) and each key's time: the batch's `times`, each item's time from the sequences source.

The history's item vectors come from one adapter, `history_vectors`: with the full softmax, from this step's
catalog block (`Catalog.block_vectors`: the same rows the softmax reads, one optimizer step a step); with the
sampled softmax, from the catalog's own lookup of the ids (`Catalog.vectors`, a second lookup: its own optimizer
step). Side features (`sequential.side_features`: e.g. each history item's category or the action taken on it, one
id per position) are rows of sequence tables looked up by the model's sharded sequence collection
(`RecModel.sequences`, a ShardedEmbeddingCollection: any sharding type), added to the item vectors position by
position before the HSTU layers; their rows are trained by that collection's fused optimizer.

Loss scaling: rank r's loss is (its positions' summed cross-entropy) * W / (positions of the global batch), so
the mean over ranks (what DistributedDataParallel's average of the dense gradients and the printed loss see) is the
mean over every position of the global batch, as on one process with the whole batch. The embedding rows (catalog,
context bags, side features) receive the sum over ranks of their gradients, so each rank's rows enter the step
through `scale_grad(rows, 1 / W)`: every row's gradient is that of one process with the whole batch, and so are
the optimizer states (Adagrad's sums of squares, Adam's moments) a checkpoint saves. A run resumed on another
number of ranks then continues the run that never stopped, to round-off (with the full softmax; the sampled
softmax draws each rank's negatives from its own block, so its negatives depend on the number of ranks).

Evaluation (each user's last item, predicted from the items before it): HR@K (the item is among the catalog's K
best-scored items, by sharded top-k) and NDCG@K (1 / log2(2 + its place)), beside the popularity baseline (the K
items most often a training target so far: counts of each catalog row, kept by the rank holding the row and saved
in checkpoints with the rows).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from embshard.config.model import ModelConfig
from embshard.data.common import Batch
from embshard.models.hstu_attention import (
    HSTULayer,
    JaggedAttention,
    PaddedAttention,
    host_positions,
    query_times,
)
from embshard.models.registry import ModelKind, StepOutput, feature_widths, register
from embshard.retrieval.catalog import Catalog
from embshard.retrieval.gather import gather_rows, gather_sizes
from embshard.retrieval.topk import sharded_topk
from embshard.runtime.comm import start_all_reduce, world_and_rank
from embshard.runtime.ops import host_to_device, scale_grad


class HSTUDense(nn.Module):
    """The dense part: the context projection, the HSTU layers and the final LayerNorm. Input: the jagged
    history's item vectors `[N, D]` (users' items one after another), the users' lengths `[B]`, their pooled
    context `[B, C]` and, with the time bias, each item's time `[N]` (int64 seconds); output: one query `[N, D]`
    per position (position i scores item i + 1). `attention`: jagged (tiles of `tile` positions; a batch whose
    longest history fits in one tile is laid out padded, the same work without the tiles' gathers) or padded
    (hstu_attention.py); both compute the same function."""

    def __init__(
        self,
        width: int,
        context_width: int,
        layers: int,
        heads: int,
        max_length: int,
        attention: str = "jagged",
        tile: int = 64,
        time_bias: bool = False,
    ) -> None:
        super().__init__()
        if attention not in ("jagged", "padded"):
            raise ValueError(f"attention={attention!r}: give jagged or padded")
        self.max_length, self.attention, self.tile, self.use_time = max_length, attention, tile, time_bias
        self.context = nn.Linear(context_width, width)
        self.layers = nn.ModuleList(HSTULayer(width, heads, max_length + 1, time_bias) for _ in range(layers))
        self.final = nn.LayerNorm(width)

    def forward(
        self,
        items_ND: torch.Tensor,
        lengths_B: torch.Tensor,
        context_BC: torch.Tensor,
        times_N: torch.Tensor | None = None,
        lengths_host: np.ndarray | None = None,
    ) -> torch.Tensor:
        """`lengths_host`: `lengths_B` on the host when the caller has it (else read here: one host sync)."""
        device = items_ND.device
        n = lengths_B.cpu() if lengths_host is None else torch.from_numpy(np.asarray(lengths_host))  # one host sync
        L = int(n.max()) if n.numel() else 1
        if L > self.max_length + 1:  # max_length items of history and the item they predict
            raise ValueError(
                f"a sequence of {L} items is longer than sequential.max_length + 1 = {self.max_length + 1}: keep "
                "each user's last max_length + 1 items (data.sequences.max_length) or raise the model's max_length"
            )
        if self.use_time and times_N is None:
            raise ValueError("this model has the time bias (sequential.time_bias: true) but the batch has no times")
        user_N, pos_N = host_positions(n, device)
        qtimes_N = None
        if self.use_time:
            times_N = times_N.to(torch.int64)
            qtimes_N = query_times(times_N, pos_N == lengths_B.to(torch.int64).index_select(0, user_N) - 1)
        else:
            times_N = None
        context_ND = self.context(context_BC).index_select(0, user_N)
        if self.attention == "jagged" and L > self.tile:  # else one tile holds every history: the padded layout
            attention = JaggedAttention(n, self.tile, device, qtimes_N, times_N)
            x = items_ND + context_ND
            for layer in self.layers:
                x = layer(x, attention)
            return self.final(x)
        B, L = n.shape[0], max(L, 1)
        pad = lambda t: t.new_zeros(B, L, *t.shape[1:]).index_put((user_N, pos_N), t)  # noqa: E731
        padded = PaddedAttention(
            lengths_B, L, pad(qtimes_N) if self.use_time else None, pad(times_N) if self.use_time else None
        )
        x = pad(items_ND + context_ND)
        for layer in self.layers:
            x = layer(x, padded)
        return self.final(x)[user_N, pos_N]


class SequenceCatalog(Catalog):
    """The item catalog, counting how often each of this rank's rows was a training target (over the global batch)
    for the popularity baseline: row state that checkpoints save and reshard like the rows."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.target_counts = torch.zeros(self.num_rows, dtype=torch.float64, device=self.device)

    def observe(self, targets_N: torch.Tensor, sizes: list[int]) -> None:
        """Count the global batch's targets (each rank's `targets_N`, `sizes` of them: collective) in this block."""
        T = gather_rows(targets_N.to(torch.int64), sizes, self.group) - self.row_offset
        if self.num_rows:  # no boolean indexing: no host sync
            inside = (T >= 0) & (T < self.num_rows)
            self.target_counts.index_add_(0, torch.where(inside, T, 0), inside.to(torch.float64))

    @torch.no_grad()
    def popular(self, k: int) -> torch.Tensor:
        """The k items most often a training target so far (collective: one all-reduce)."""
        counts = torch.zeros(self.table.num_embeddings, dtype=torch.float64, device=self.device)
        counts[self.row_offset : self.row_offset + self.num_rows] = self.target_counts
        counts = start_all_reduce(counts, self.group).wait()
        return counts.topk(min(k, counts.shape[0])).indices


def sequential_groups(cfg: ModelConfig) -> dict[str, list[str]]:
    """The embedding-bag collection serves the context features (the item catalog has a collection of its own)."""
    return {"context": list(cfg.sequential.context_features)}


def sequential_dense(cfg: ModelConfig, num_dense: int) -> HSTUDense:
    sq, width = cfg.sequential, feature_widths(cfg)
    return HSTUDense(
        width[sq.item_feature],
        sum(width[f] for f in sq.context_features),
        sq.num_layers,
        sq.num_heads,
        sq.max_length,
        attention=sq.attention,
        tile=sq.attention_tile,
        time_bias=sq.time_bias,
    )


def sequential_catalog(cfg: ModelConfig, plan, sparse_optimizer, device: torch.device, seed: int) -> SequenceCatalog:
    sq = cfg.sequential
    table = next(t for t in cfg.tables if sq.item_feature in t.feature_names)
    extra = {}
    if sq.sampled_softmax is not None:
        s = sq.sampled_softmax
        extra = {"sampler": s.sampler, "num_negatives": s.num_negatives, "smoothing": s.smoothing}
    return SequenceCatalog(table, plan, sparse_optimizer, device, seed=seed, chunk_mib=sq.chunk_mib, **extra)


def history_vectors(catalog: Catalog, ids_N: torch.Tensor, block: torch.Tensor | None) -> torch.Tensor:
    """The history's item vectors `[N, D]`: from this step's catalog block when there is one (tied, one optimizer
    step), else the catalog's lookup of the ids (module docstring)."""
    if block is not None:
        return catalog.block_vectors(ids_N, block)
    return catalog.vectors(ids_N)


def sequential_step(model, batch: Batch) -> StepOutput:
    """Training: the softmax loss of every position's next item (module docstring's scaling). Evaluation: each
    user's last item from the items before it: the full-softmax loss, HR@K and NDCG@K, and the popularity
    baseline's."""
    sq, catalog = model.cfg.sequential, model.catalog
    kjt = batch.sparse
    keys = list(kjt.keys())
    seq = kjt[sq.item_feature]
    ids_N, lengths_B = seq.values().to(torch.int64), seq.lengths()
    times_N = batch.times if sq.time_bias else None
    if sq.time_bias and times_N is None and ids_N.numel() == 0:  # an empty batch (this rank's data has ended)
        times_N = ids_N
    if sq.time_bias and times_N is None:
        raise ValueError(
            "model.sequential.time_bias is on but the batch has no times: use data.source sequences (its file's "
            "data.sequences.time_column, or the synthetic histories) or set model.sequential.time_bias: false"
        )
    world, _ = world_and_rank(catalog.group)
    row_scale = 1.0 / world if model.training else 1.0  # every row's gradient: one process's (module docstring)
    context_BC = scale_grad(model.ebc(kjt.permute([keys.index(f) for f in sq.context_features]))["context"], row_scale)
    full = not model.training or sq.loss == "full_softmax"
    block = scale_grad(catalog.block(), row_scale) if full else None
    items_ND = history_vectors(catalog, ids_N, block)
    if block is None:
        items_ND = scale_grad(items_ND, row_scale)
    side = model.sequences(kjt)  # collective (every rank, every step): the side features' rows
    for f in sq.side_features:
        rows_ND = scale_grad(side[f].values(), row_scale)
        if rows_ND.shape[0] != items_ND.shape[0]:
            raise ValueError(
                f"side feature {f!r} has {rows_ND.shape[0]} ids in this batch but {sq.item_feature!r} has "
                f"{items_ND.shape[0]}: a side feature needs one id per history item, in the items' order"
            )
        items_ND = items_ND + rows_ND.to(items_ND.dtype)
    n_host = lengths_B.cpu()  # the step's one host sync: the lengths lay out the attention and pick the positions
    user, pos = host_positions(n_host, torch.device("cpu"))
    before = pos - (n_host.to(torch.int64)[user] - 1)  # 0 at a history's last item, -1 before it, ...
    pick = lambda mask: host_to_device(torch.nonzero(mask).squeeze(1), ids_N.device)  # noqa: E731
    # a numpy array: DistributedDataParallel moves tensor arguments to the device (a host sync to read them back)
    query_ND = model.dense(items_ND, lengths_B, context_BC.float(), times_N, n_host.numpy())
    if model.training:
        q = query_ND.index_select(0, pick(before < 0)) / sq.temperature  # every position but the last predicts
        targets = ids_N.index_select(0, pick(pos > 0))
        sizes = gather_sizes(targets.shape[0], targets.device, catalog.group)
        if sq.loss == "full_softmax":
            losses = catalog.full_softmax_loss(q, targets, rows=block)
        else:
            losses = catalog.sampled_softmax_loss(q, targets, row_grad_scale=row_scale)
        catalog.observe(targets, sizes)
        return StepOutput(losses.sum() * world / max(sum(sizes), 1), None, None)
    # the query of position n - 2 predicts item n - 1 (causal: the held-out item is not seen)
    q = query_ND.index_select(0, pick(before == -1)) / sq.temperature
    targets = ids_N.index_select(0, pick((before == 0) & (pos > 0)))
    loss = catalog.full_softmax_loss(q, targets, rows=block)
    metrics = ranking_metrics(catalog, q, targets, block, sq.metrics_at)
    return StepOutput(loss.mean() if loss.numel() else loss.sum(), None, None, metrics=metrics)


@torch.no_grad()
def ranking_metrics(
    catalog: SequenceCatalog, query_BD: torch.Tensor, target_B: torch.Tensor, block: torch.Tensor, ks: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """{hr@K, ndcg@K, pop_hr@K, pop_ndcg@K: sums over the local queries} (collective: top-k over every block)."""
    K = max(ks)
    sizes = gather_sizes(query_BD.shape[0], query_BD.device, catalog.group)
    Q = gather_rows(query_BD.detach().float(), sizes, catalog.group)
    _, ids = sharded_topk(Q, block.detach(), catalog.row_offset, K, catalog.group, catalog.chunk_mib)
    _, rank = world_and_rank(catalog.group)
    off = sum(sizes[:rank])
    model_BK = ids[off : off + sizes[rank]]
    popular_BK = catalog.popular(K).unsqueeze(0).expand(target_B.shape[0], -1)
    out = {}
    for name, top in (("", model_BK), ("pop_", popular_BK)):
        for k in ks:
            match = top[:, :k] == target_B.unsqueeze(1)  # at most one place matches
            places = torch.arange(match.shape[1], device=match.device, dtype=torch.float64)
            gain = 1.0 / torch.log2(places + 2.0)
            out[f"{name}hr@{k}"] = match.any(1).sum().double()
            out[f"{name}ndcg@{k}"] = (match.double() * gain).sum()
    return out


register("hstu", ModelKind(sequential_dense, sequential_step, sequential_groups, sequential_catalog))
