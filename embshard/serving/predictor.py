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

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from embshard.collection.bounds import check_ids, count_bad_ids
from embshard.data.common import Batch
from embshard.serving import artifact
from embshard.serving.lookup import TableLookup
from embshard.serving.model import SPARSE_INPUT, build_dense, model_config
from embshard.serving.quantize import DTYPES, row_bytes
from embshard.spec.options import BoundsCheck
from embshard.spec.tables import ConfigError, Pooling

RUNNABLE = {"cpu": set(DTYPES), "cuda": set(DTYPES)}
"""Table types FBGEMM's inference TBE runs, per device type."""


class Predictor(nn.Module):
    """A loaded serving artifact: `predictor(batch)` -> scores `[B]` (see the module docstring)."""

    def __init__(
        self,
        folder: str | Path,
        device: str | torch.device = "cpu",
        bounds_check: str | None = None,
        shard_over: Sequence[str | torch.device] | None = None,
        row_wise_gib: float | None = None,
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
        self.lookup = TableLookup(self.tables, rows, types, devices, self.device, limit)
        self.mean = [self.table_of[f].pooling is Pooling.MEAN for f in self.features]
        self._mean_F = torch.tensor(self.mean, device=self.device)
        self._width_F = torch.tensor(self.widths, device=self.device)
        self.dense = self._dense(folder, man)

    def _dense(self, folder: Path, man: dict) -> nn.Module:
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
        return module.to(self.device).eval()

    def _ids(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """(lengths `[F, B]`, ids, per-id weights) of the batch's features in the model's order, checked."""
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
        lengths_FB = kjt.lengths().view(len(self.features), B).to(self.device)
        values = kjt.values().to(self.device)
        w = kjt.weights_or_none()
        w = None if w is None else w.to(self.device)
        if values.device.type != "cpu" or int(count_bad_ids(lengths_FB, values, self.features, self.table_of)) > 0:
            lengths_FB, values, w = check_ids(lengths_FB, values, w, self.features, self.table_of, self.bounds_check,
                                              self.dropped)  # fmt: skip
        return lengths_FB, values, w, B

    @torch.inference_mode()
    def pooled(self, batch: Batch) -> torch.Tensor:
        """The pooled embeddings of every feature side by side `[B, sum of widths]` (table order), fp32."""
        lengths_FB, values, w, B = self._ids(batch)
        pooled_BS = self.lookup(lengths_FB, values, w)
        if any(self.mean):
            scale_FB = torch.where(lengths_FB > 0, 1.0 / lengths_FB.clamp(min=1), 0.0).to(torch.float32)
            scale_FB = torch.where(self._mean_F[:, None], scale_FB, torch.ones_like(scale_FB))
            pooled_BS = pooled_BS * scale_FB.t().repeat_interleave(self._width_F, dim=1)
        return pooled_BS

    @torch.inference_mode()
    def logits(self, batch: Batch) -> torch.Tensor:
        """One logit per sample `[B]`."""
        sparse = SPARSE_INPUT[self.kind](self.pooled(batch), self.cfg)
        return self.dense(batch.dense.to(self.device, torch.float32), sparse).reshape(-1)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Scores `[B]`: the probability of a positive label, sigmoid of the logit."""
        return torch.sigmoid(self.logits(batch))


def load(
    folder: str | Path,
    device: str | torch.device = "cpu",
    bounds_check: str | None = None,
    shard_over: Sequence[str | torch.device] | None = None,
    row_wise_gib: float | None = None,
) -> Predictor:
    """The Predictor of the serving artifact `folder` (every file checked first; see the module docstring).
    `shard_over`: devices of this process to spread the tables over (tables whole, least-loaded device first;
    tables over `row_wise_gib` GiB split by rows over all of them; serving/lookup.py); output on `device`."""
    return Predictor(folder, device, bounds_check, shard_over, row_wise_gib)
