"""From a training checkpoint to serving (docs/serving.md).

- export.py: `export_serving(checkpoint, out, dtype)`: the self-contained artifact (quantized tables, dense
  weights, model description, manifest with SHA-256 of every file), read straight from the sharded checkpoint
- choose.py: `--dtype auto`: a table type per table under a memory budget (the planner's byte pricing)
- quantize.py: fp32 / fp16 / FBGEMM's row-wise int8 and int4 rows
- artifact.py: the artifact's files, written whole, read back checked, never executed
- model.py: what serving needs of a model kind
- predictor.py: `load(DIR) -> Predictor`; `predictor(batch) -> scores` on FBGEMM's inference TBE
- lookup.py: the tables' TBEs, on one device or spread over several of one process (table-wise, row-wise)
- graphed.py: a scoring call on one CUDA device as a CUDA graph per bucket of batch size and id count (padded)
- http.py: `embshard serve`: JSON over HTTP with micro-batching
- batch_scoring.py: `embshard predict`: a data source's batches scored into a Parquet file
"""

from __future__ import annotations

from typing import Any

__all__ = ["Predictor", "export_serving", "load"]


def __getattr__(name: str) -> Any:
    # lazy: `load` imports neither the export side (checkpoint reading, planner pricing) nor the other way round
    if name in ("Predictor", "load"):
        from embshard.serving import predictor

        return getattr(predictor, name)
    if name == "export_serving":
        from embshard.serving.export import export_serving

        return export_serving
    raise AttributeError(f"module 'embshard.serving' has no attribute {name!r}")
