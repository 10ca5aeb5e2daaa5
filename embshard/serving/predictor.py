"""`load(DIR) -> Predictor`: a serving artifact (artifact.py) ready to score batches on the CPU or a CUDA GPU.

    predictor = embshard.serving.load("runs/serve", device="cpu")
    scores_B = predictor(batch)            # probabilities [B]; predictor.logits(batch): before the sigmoid

The tables go into one FBGEMM inference TBE (`IntNBitTableBatchedEmbeddingBagsCodegen`: fp32, fp16, int8 and int4
rows, on the CPU in fbgemm-gpu-cpu and on CUDA), every table's rows as exported (codes and fp16 scale/bias), or,
with `shard_over=[devices]`, one TBE per device of this process, tables whole or split by rows (lookup.py);
it sums each bag's rows (weighted tables: times their per-id weights), mean-pooled features are divided by their
bag's length here, as in training (an empty bag gives zeros). Ids outside their table follow the artifact's
bounds policy (the training run's `lookup.bounds_check`, or `bounds_check=` here): error names the feature and
id; drop removes them from their bags (collection/bounds.py). The dense part is rebuilt from its registered model
kind and the config in model.json, and its weights loaded from safetensors: nothing in the artifact is executed,
and no optimizer, sharding, training or export code is imported (the package root `embshard` imports the
torch-free planner's `simple_plan`; nothing of it runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from embshard.collection.bounds import check_ids, count_bad_ids
from embshard.data.common import Batch
from embshard.serving import artifact
from embshard.serving.graphed import MAX_BATCH, GraphedScorer
from embshard.serving.lookup import TableLookup
from embshard.serving.model import SPARSE_INPUT, build_dense, model_config
from embshard.serving.quantize import DTYPES, row_bytes
from embshard.spec.options import BoundsCheck
from embshard.spec.tables import ConfigError, Pooling

RUNNABLE = {"cpu": set(DTYPES), "cuda": set(DTYPES)}
"""Table types FBGEMM's inference TBE runs, per device type."""
DENSE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""Types the dense part (and the pooled embeddings it takes) may run in."""
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
"""torch.compile modes of the dense part (the modes that make CUDA graphs of their own are not: the scoring call
is captured whole)."""


class Predictor(nn.Module):
    """A loaded serving artifact: `predictor(batch)` -> scores `[B]` (see the module docstring)."""

    def __init__(
        self,
        folder: str | Path,
        device: str | torch.device = "cpu",
        bounds_check: str | None = None,
        shard_over: Sequence[str | torch.device] | None = None,
        row_wise_gib: float | None = None,
        cuda_graphs: bool | None = None,
        max_graph_batch: int = MAX_BATCH,
        dense_dtype: str = "fp32",
        compile_dense: str | None = None,
    ) -> None:
        super().__init__()
        folder = Path(folder)
        if bounds_check not in (None, "error", "drop"):
            raise ConfigError(f"bounds_check={bounds_check!r}: give 'error' or 'drop' (or None: the artifact's)")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {str(self.device)!r}: CUDA is not available here; load with device='cpu'")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in RUNNABLE:
            raise ConfigError(f"device {str(self.device)!r}: serving runs on cpu or cuda")
        if cuda_graphs and self.device.type != "cuda":
            raise ConfigError(f"cuda_graphs=True: CUDA graphs need a CUDA device, not {str(self.device)!r}; leave "
                              "cuda_graphs unset (on for CUDA, off otherwise)")  # fmt: skip
        if dense_dtype not in DENSE_DTYPES:
            raise ConfigError(f"dense_dtype={dense_dtype!r}: give one of {', '.join(DENSE_DTYPES)}")
        self.dense_dtype = DENSE_DTYPES[dense_dtype]
        if compile_dense is not None and compile_dense not in COMPILE_MODES:
            raise ConfigError(f"compile_dense={compile_dense!r}: give one of {', '.join(COMPILE_MODES)} (or None)")
        self.compile_dense = compile_dense
        if max_graph_batch < 1:
            raise ConfigError(f"max_graph_batch={max_graph_batch}: give the largest batch to score through a graph")
        man = artifact.read_manifest(folder)
        info = artifact.read_json(folder, man, artifact.MODEL)
        where = f"serving artifact {str(folder)!r}: {artifact.MODEL}"
        try:
            self.cfg = model_config(info.get("model"), where)
            kind, self.num_dense = info["kind"], int(info["num_dense"])
            entries = {e["name"]: e for e in info["tables"]}
            mode = BoundsCheck(bounds_check or info.get("bounds_check", "error"))
        except (KeyError, TypeError, ValueError) as e:
            raise artifact.ArtifactDamaged(folder, artifact.MODEL, f"it lacks what export writes ({e!r})") from None
        if kind not in SPARSE_INPUT or kind != self.cfg.kind:
            raise artifact.ArtifactDamaged(folder, artifact.MODEL, f"model kind {kind!r} is not one that is served")
        self.info, self.bounds_check, self.kind = info, mode, kind
        self.tables = list(self.cfg.tables)
        self.features = [f for t in self.tables for f in t.feature_names]
        self.table_of = {f: t for t in self.tables for f in t.feature_names}
        self.widths = [self.table_of[f].embedding_dim for f in self.features]
        self.dropped: dict[str, int] = {}
        rows, types = {}, {}
        for t in self.tables:
            e = entries.get(t.name)
            if e is None or e.get("file") != artifact.table_file(t.name):
                raise artifact.ArtifactDamaged(folder, artifact.MODEL, f"table {t.name!r} has no (or another) file")
            dtype = e.get("dtype")
            if dtype not in DTYPES:
                raise artifact.ArtifactDamaged(folder, e["file"], f"table type {dtype!r} is not one of {DTYPES}")
            if dtype not in RUNNABLE[self.device.type]:
                raise ConfigError(f"table {t.name!r} is {dtype}, which FBGEMM's inference lookup does not run on "
                                  f"{self.device.type}: export it again with another --dtype")  # fmt: skip
            stored = artifact.read_tensors(folder, man, e["file"]).get("rows")
            width = row_bytes(t.embedding_dim, dtype)
            if (
                stored is None
                or stored.dim() != 2
                or stored.shape[0] != t.num_embeddings
                or (stored.shape[1] * stored.element_size() != width)
            ):
                found = None if stored is None else list(stored.shape)
                raise artifact.ArtifactDamaged(
                    folder, e["file"], f"tensor 'rows' of shape {found}, expected [{t.num_embeddings}, {width} bytes "
                    f"a row] for table {t.name!r} ({t.num_embeddings} x {t.embedding_dim} {dtype})"
                )  # fmt: skip
            rows[t.name], types[t.name] = stored, dtype
        devices = [torch.device(d) for d in shard_over] if shard_over else [self.device]
        for d in devices:
            if d.type != self.device.type or (d.type == "cuda" and (d.index or 0) >= torch.cuda.device_count()):
                raise ConfigError(f"shard_over {[str(x) for x in devices]}: every device must be a {self.device.type} "
                                  "device of this machine (the output device's kind)")  # fmt: skip
        limit = float("inf") if row_wise_gib is None else row_wise_gib * (1 << 30)
        self.lookup = TableLookup(self.tables, rows, types, devices, self.device, limit, self.dense_dtype)
        self.mean = [self.table_of[f].pooling is Pooling.MEAN for f in self.features]
        self._mean_F = torch.tensor(self.mean, device=self.device)
        self._feature_of_col = torch.tensor(
            [f for f, w in enumerate(self.widths) for _ in range(w)], device=self.device
        )
        self.dense = self._dense(folder, man)
        if compile_dense is not None:  # compiled at the first call of each shape (a graph's warm-up on CUDA)
            self.dense = torch.compile(self.dense, mode=compile_dense)
        self.graphs: GraphedScorer | None = None
        self.eager_reason: str | None = None
        if self.device.type != "cuda":
            self.eager_reason = f"{self.device.type} device (CUDA graphs are for CUDA)"
        elif cuda_graphs is False:
            self.eager_reason = "cuda_graphs=False"
        elif not self.lookup.direct:
            self.eager_reason = "tables over several devices (shard_over)"
        else:
            weighted = self.lookup.weighted_F is not None
            self.graphs = GraphedScorer(self.padded_logits, len(self.features), self.num_dense, weighted, self.device,
                                        max_graph_batch)  # fmt: skip

    def describe(self) -> str:
        """Where and how a call scores: the device, the tables' types, and the CUDA graphs or why not."""
        types: dict[str, int] = {}
        for e in self.info["tables"]:
            types[e["dtype"]] = types.get(e["dtype"], 0) + 1
        tables = ", ".join(f"{n} {t}" for t, n in types.items())
        how = f"eager ({self.eager_reason})" if self.graphs is None else self.graphs.describe()
        if self.graphs is not None and self.graphs.last_fallback:
            how += f"; the last call ran eagerly: {self.graphs.last_fallback}"
        dense = str(self.dense_dtype).removeprefix("torch.")
        if self.compile_dense:
            dense += f" (torch.compile {self.compile_dense})"
        return (f"{self.kind} on {self.device}: {len(self.tables)} tables ({tables}) in one TBE per device, dense "
                f"part in {dense}; {how}")  # fmt: skip

    def _dense(self, folder: Path, man: dict) -> nn.Module:
        # made on its device: every tensor the module keeps (DLRM's pair indices too) is there
        with torch.device(self.device) if self.device.type == "cuda" else nullcontext():
            module = build_dense(self.kind, self.cfg, self.num_dense)
        state = artifact.read_tensors(folder, man, artifact.DENSE)
        expected = module.state_dict()
        wrong = [k for k, v in expected.items() if k not in state or state[k].shape != v.shape]
        extra = sorted(set(state) - set(expected))
        if wrong or extra:
            k = (wrong or extra)[0]
            got = list(state[k].shape) if k in state else "none"
            want = list(expected[k].shape) if k in expected else "none"
            raise artifact.ArtifactDamaged(folder, artifact.DENSE, f"tensor {k!r}: shape {got}, the model needs {want}")
        module.load_state_dict(state)
        return module.to(self.device, self.dense_dtype).eval()

    def _parts(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """(lengths `[F, B]`, ids, per-id weights, B) of the batch's features in the model's order, where the batch
        has them; the features and the dense width checked."""
        kjt = batch.sparse
        keys = list(kjt.keys())
        missing = [f for f in self.features if f not in keys]
        if missing:
            raise ConfigError(f"the batch lacks the features {missing} (it has {keys}); the model reads "
                              f"{self.features}")  # fmt: skip
        if keys != self.features:
            kjt = kjt.permute([keys.index(f) for f in self.features])
        B = int(kjt.stride())
        if batch.dense.dim() != 2 or batch.dense.shape != (B, self.num_dense):
            raise ConfigError(f"dense features of shape {list(batch.dense.shape)}: the model takes [{B}, "
                              f"{self.num_dense}] (batch size, dense features)")  # fmt: skip
        return kjt.lengths().view(len(self.features), B), kjt.values(), kjt.weights_or_none(), B

    def _ids(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """(lengths `[F, B]`, ids, per-id weights, B) of the batch's features in the model's order on the device,
        every id in its table (the bounds policy applied)."""
        lengths_FB, values, w, B = self._parts(batch)
        lengths_FB, values = lengths_FB.to(self.device), values.to(self.device)
        w = None if w is None else w.to(self.device)
        if values.device.type != "cpu" or int(count_bad_ids(lengths_FB, values, self.features, self.table_of)) > 0:
            lengths_FB, values, w = check_ids(lengths_FB, values, w, self.features, self.table_of, self.bounds_check,
                                              self.dropped)  # fmt: skip
        return lengths_FB, values, w, B

    @torch.inference_mode()
    def pooled(self, batch: Batch) -> torch.Tensor:
        """The pooled embeddings of every feature side by side `[B, sum of widths]` (table order), in the dense
        part's type (fp32 unless `dense_dtype`)."""
        lengths_FB, values, w, B = self._ids(batch)
        return self._mean_pooled(lengths_FB, self.lookup(lengths_FB, values, w))

    def _mean_pooled(self, lengths_FB: torch.Tensor, pooled_BS: torch.Tensor) -> torch.Tensor:
        """Mean-pooled features' sums divided by their bag's length (an empty bag stays zeros); no host sync."""
        if not any(self.mean):
            return pooled_BS
        scale_FB = torch.where(lengths_FB > 0, 1.0 / lengths_FB.clamp(min=1), 0.0).to(torch.float32)
        scale_FB = torch.where(self._mean_F[:, None], scale_FB, torch.ones_like(scale_FB))
        return pooled_BS * scale_FB.t().index_select(1, self._feature_of_col).to(pooled_BS.dtype)

    def padded_logits(
        self, lengths_FB: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None, dense_BN: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The scoring of a batch on the device, with no host sync (what a CUDA graph captures; graphed.py):
        (logits `[B]`, `[1]` count of the ids outside their tables: they read row 0 here, and the caller scores
        such a batch again eagerly under the bounds policy). One device only; `values` and `weights` may run past
        the last bag (never read)."""
        values, bad_1 = self.lookup.safe_ids(lengths_FB, values)
        pooled_BS = self._mean_pooled(lengths_FB, self.lookup(lengths_FB, values, weights))
        logits_B = self.dense(dense_BN.to(self.dense_dtype), SPARSE_INPUT[self.kind](pooled_BS, self.cfg))
        return logits_B.reshape(-1).float(), bad_1

    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor:
        """One logit per sample `[B]`."""
        return self._score(batch, torch.clone, None)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Scores `[B]`: the probability of a positive label, sigmoid of the logit."""
        return self._score(batch, torch.sigmoid, torch.sigmoid)

    @torch.inference_mode()
    def _score(self, batch: Batch, finish: Callable, after: Callable | None) -> torch.Tensor:
        """`finish(logits)` through the batch's CUDA graph, else `after(logits)` (None: the logits) eagerly."""
        if self.graphs is not None:
            out = self._graphed(batch, finish)
            if out is not None:
                return out
        sparse = SPARSE_INPUT[self.kind](self.pooled(batch), self.cfg)
        logits_B = self.dense(batch.dense.to(self.device, self.dense_dtype), sparse).reshape(-1).float()
        return logits_B if after is None else after(logits_B)

    def _graphed(self, batch: Batch, finish: Callable) -> torch.Tensor | None:
        """The batch scored through its CUDA graph, or None (then the eager path scores it): a batch the graphs
        do not take (`describe()` says why), or one with ids outside their tables (the eager path applies the
        bounds policy). Ids on the host are checked there before the copy; ids on the GPU by the graph, whose
        count is read once after it ran."""
        lengths_FB, values, w, B = self._parts(batch)
        on_host = values.device.type == "cpu"
        if on_host and values.numel() and int(count_bad_ids(lengths_FB, values, self.features, self.table_of)):
            return None
        out = self.graphs.run(lengths_FB, values, w, batch.dense, finish, count_bad=not on_host and values.numel() > 0)
        if out is None or out[1]:
            return None
        return out[0]


def load(
    folder: str | Path,
    device: str | torch.device = "cpu",
    bounds_check: str | None = None,
    shard_over: Sequence[str | torch.device] | None = None,
    row_wise_gib: float | None = None,
    cuda_graphs: bool | None = None,
    max_graph_batch: int = MAX_BATCH,
    dense_dtype: str = "fp32",
    compile_dense: str | None = None,
) -> Predictor:
    """The Predictor of the serving artifact `folder` (every file checked first; see the module docstring).
    `shard_over`: devices of this process to spread the tables over (tables whole, least-loaded device first;
    tables over `row_wise_gib` GiB split by rows over all of them; serving/lookup.py); output on `device`.
    `cuda_graphs`: score through CUDA graphs per bucket of batch size (graphed.py; None: on for one CUDA device);
    `max_graph_batch`: the largest batch scored through a graph (bigger ones run eagerly). `dense_dtype`: fp32,
    fp16 or bf16 for the dense part and the pooled embeddings (on a GPU the TBE's output type too); scores fp32.
    `compile_dense`: a torch.compile mode for the dense part (COMPILE_MODES), or None: eager."""
    return Predictor(folder, device, bounds_check, shard_over, row_wise_gib, cuda_graphs, max_graph_batch,
                     dense_dtype, compile_dense)  # fmt: skip
