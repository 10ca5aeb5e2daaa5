"""The sequence collection's training step as one CUDA graph, for a training loop of its own around
`ShardedEmbeddingCollection`.

An eager step of the sequence collection is a few hundred launches of Python and dispatcher work (the id layout
per scheme, the exchanges, the lookups, the assembly per feature, the loss, their backward with the fused sparse
update); on a GPU the host takes longer to launch them than the GPU to run them. `SequenceStepGraph.step(kjt,
counts)` runs the same step from one replay:

    padded batch   every feature's ids padded to a capacity (collection/sequence_padding.py: filler ids after the
                   last sample's, their rows and gradients zeroed), `headroom` over the most ids seen on any rank,
                   so the exchanges, sized from the counts, have the same sizes in every step
    static inputs  the padded ids and lengths, the batch's own lengths and ids per feature, copied in each step
    graph          the forward, `loss_fn` of its output (a `SequenceOutput` whose values hold each feature's
                   capacity of rows, the fillers' last and zero, and whose lengths are the batch's), the backward
                   with the fused sparse update and the data-parallel tables' all-reduce
    output         the loss (copied out); every update is done

`counts` are every rank's `host_counts` rows of this step, stacked and parsed (`sharding.exchange.parse_counts`;
on one rank, the row of the CPU batch before its copy to the device): the step then has no host sync, and every rank
pads, captures and replays alike. The first step of a capacity runs eagerly on the capture stream (lazy
initialisations happen there), then is captured; later steps replay. A batch over the capacity, or with more
fillers than the capture's window, captures again, at most `max_captures` times.

What it takes (`refusal`): table-wise, column-wise and data-parallel tables on the HBM or UVM tiers (each id's
rank known on the host), no dedup (its unique ids are counted on the device), no max_length (the cut would meet the
fillers: cut histories in the data), and an update rule that leaves a row with a zero gradient as it is (sgd,
adagrad, row-wise adagrad without weight decay). The sparse learning rate is a constant of the captured launches.
`capture=False` runs the padded step eagerly each call (any device: the padding's arithmetic checked against the
eager step where CUDA graphs do not exist).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from embshard.collection import sequence_padding as padding
from embshard.collection.emb_graph import CapturedStep, backward_to_leaves
from embshard.collection.sequence import SequenceOutput
from embshard.runtime.ops import small_to_device
from embshard.sharding.exchange import BatchCounts
from embshard.spec.geometry import capacity
from embshard.spec.graph_rules import padding_refusal, plan_refusal

__all__ = ["SequenceStepGraph", "refusal"]


def refusal(ec) -> str | None:
    """Why `SequenceStepGraph` cannot run the step of the sequence collection `ec`, or None if it can."""
    why = plan_refusal(ec.tables, ec.plan)
    if why is not None:
        return why.reason
    deduped = sorted(name for name, on in ec.dedup.items() if on)
    if deduped:
        return f"tables {deduped[:3]} deduplicate their ids, whose unique count is known on the device alone"
    cut = [t.name for t in ec.tables if t.max_length is not None]
    if cut:
        return f"tables {cut[:3]} have a max_length, whose cut would meet the filler ids: cut histories in the data"
    why = padding_refusal(ec.tables, ec.optimizer)
    return None if why is None else why.reason


class SequenceStepGraph(CapturedStep):
    """The training step of the sequence collection `ec`, with the loss `loss_fn(output)` of its forward's output,
    as one CUDA graph for ragged batches padded to a capacity (module docstring). `capture=False`: the same padded
    step eagerly, each call."""

    eager_hint = "`ec(kjt)`"

    def __init__(
        self,
        ec,
        loss_fn: Callable[[SequenceOutput], torch.Tensor],
        capture: bool = True,
        max_captures: int = 8,
        headroom: float = 0.03,
    ) -> None:
        super().__init__(ec, refusal(ec), capture, max_captures)
        if not 0 <= headroom <= 1:
            raise ValueError(f"SequenceStepGraph(headroom={headroom}): give a fraction in [0, 1], e.g. 0.03")
        self.loss_fn, self.headroom = loss_fn, headroom
        self.features = list(ec.features)
        self._rows_F = [next(t.num_embeddings for t in ec.tables if f in t.feature_names) for f in self.features]
        self.capacity: np.ndarray | None = None  # ids per feature (canonical order), every rank's
        self.starts: np.ndarray | None = None  # first row of each feature's filler window
        self._static: dict | None = None

    @property
    def ec(self):
        """The sequence collection whose step this is."""
        return self.collection

    def step(self, kjt, counts: BatchCounts) -> torch.Tensor:
        """One training step on this rank's batch `kjt` (on the collection's device) with every rank's `counts`
        (module docstring); returns the loss (a tensor of its own), every update done."""
        ec = self.ec
        if counts.bad_ranks:
            ec(kjt, counts=counts)  # raises on every rank, naming the feature and the fix
        ids_WF = np.asarray(counts.ids, dtype=np.int64)
        B = kjt.stride()
        if B < 1:
            raise ValueError("SequenceStepGraph: an empty local batch has no sample to carry the filler ids")
        most, least = ids_WF.max(0), ids_WF.min(0)
        if self.capacity is None or (most > self.capacity).any() or (least < self.starts).any():
            if self.captures >= self.max_captures:
                raise RuntimeError(
                    f"SequenceStepGraph: captured {self.captures} times (max_captures) and batch counts "
                    f"{most.tolist()} (least {least.tolist()}) leave the capacity again: the batches' sizes do not "
                    "settle; raise max_captures or headroom, or run the eager step"
                )
            grown = most if self.capacity is None else np.maximum(self.capacity, most)
            self.capacity = capacity(grown, self.headroom)
            self.starts = padding.window_starts(self.capacity, least)
            self.graph, self._static = None, None
        if self._static is None or self._static["B"] != B:
            self._make_static(kjt, B)
        self._pad_into_static(kjt, ids_WF[ec.rank])
        return self._run()

    # ---- the static batch --------------------------------------------------------------------------------------
    def _make_static(self, kjt, B: int) -> None:
        """The graph's input buffers for the capacity and batch size, and the fillers of each feature."""
        from torchrec import KeyedJaggedTensor

        dev, cap = self.ec.device, [int(c) for c in self.capacity]
        F = len(self.features)
        ldt = kjt.lengths().dtype
        values = torch.zeros(sum(cap), dtype=torch.int64, device=dev)
        pad_FB = torch.zeros(F, B, dtype=ldt, device=dev)
        static = {
            "B": B,
            "values": values,
            "pad_FB": pad_FB,
            "real_FB": torch.zeros(F, B, dtype=ldt, device=dev),
            "n_F": torch.zeros(F, dtype=torch.int64, device=dev),
            "fill": [padding.filler_ids(r, c, dev) for r, c in zip(self._rows_F, cap)],
            "kjt": KeyedJaggedTensor(keys=self.features, values=values, lengths=pad_FB.view(-1), stride=B),
            "counts": BatchCounts(
                batch_sizes=[B] * self.ec.world_size,
                ids=np.tile(np.asarray(cap, dtype=np.int64), (self.ec.world_size, 1)),
                bad_ranks=[],
            ),
        }
        self._static, self.graph = static, None

    def _pad_into_static(self, kjt, n_F: np.ndarray) -> None:
        """This rank's batch padded into the static buffers (device work only: the host knows every size)."""
        s, keys = self._static, list(kjt.keys())
        if sorted(keys) != sorted(self.features):
            self.ec(kjt, counts=None)  # raises naming the missing and extra features
        col = {f: i for i, f in enumerate(self.features)}
        sizes = [int(n_F[col[k]]) for k in keys]
        if sum(sizes) != kjt.values().numel() or kjt.stride() != self._static["B"]:
            raise ValueError(
                f"SequenceStepGraph.step: the counts give this rank {sum(sizes)} ids, its kjt has "
                f"{kjt.values().numel()} ids and {kjt.stride()} samples: pass the counts of this same batch "
                "(every rank's host_counts rows)"
            )
        pieces = kjt.values().split(sizes)
        of_key = dict(zip(keys, pieces))
        cap = self.capacity
        parts = []
        for f, fill in zip(self.features, s["fill"]):
            parts += [of_key[f].long(), fill[: int(cap[col[f]] - n_F[col[f]])]]
        torch.cat(parts, out=s["values"])
        order = [keys.index(f) for f in self.features]
        lengths_FB = kjt.lengths().view(len(keys), -1)
        real = lengths_FB if order == list(range(len(keys))) else lengths_FB[order]
        small = small_to_device([int(x) for x in n_F] + [int(c - n) for c, n in zip(cap, n_F)], self.ec.device)
        F = len(self.features)
        s["real_FB"].copy_(real)
        s["pad_FB"].copy_(real)
        s["pad_FB"][:, -1] += small[F:].to(s["pad_FB"].dtype)
        s["n_F"].copy_(small[:F])

    # ---- the step ----------------------------------------------------------------------------------------------
    def _body(self) -> torch.Tensor:
        from torchrec.sparse.jagged_tensor import JaggedTensor

        s, ec = self._static, self.ec
        starts = [int(x) for x in self.starts]
        dtype = ec.options.output_dtype.torch_dtype
        keeps = padding.keep_masks(s["n_F"], [int(c) for c in self.capacity], starts, dtype)
        out = ec(s["kjt"], counts=s["counts"], fillers=list(zip(starts, keeps)))
        own = SequenceOutput()
        for i, f in enumerate(self.features):
            own[f] = JaggedTensor(values=out[f].values(), lengths=s["real_FB"][i])
        loss = self.loss_fn(own)
        backward_to_leaves(loss)
        return loss.detach()
