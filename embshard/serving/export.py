"""`export_serving`: a sharded training checkpoint -> a self-contained serving artifact (artifact.py).

Reads the checkpoint directly in this process (checkpoint/'s checked readers: every chunk compared with the
save's CRC-32, from any world size and plan), a block of rows at a time: each table's rows are quantized block by
block (quantize.py; row-wise, so the same as all at once) and streamed into its file, so no table is held whole.
The dense part's state dict is read from the checkpoint's `dense.model.*` tensors and saved as safetensors; the
model is rebuilt at load from its registered kind and the config in model.json (torch.export's ExportedProgram
is not used: `torch.export.load` unpickles parts of the archive, which may run code from the file).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from embshard.checkpoint.files import NewFile
from embshard.checkpoint.pieces import Piece
from embshard.checkpoint.reading import read_pieces, reader
from embshard.checkpoint.storage import read_manifest
from embshard.serving import artifact
from embshard.serving.model import SUPPORTED_KINDS, model_config, num_dense_of
from embshard.serving.quantize import DTYPES, quantize, row_bytes
from embshard.spec.tables import ConfigError

CHUNK_BYTES = 64 << 20


def _training_config(man: dict, path: Path, config_file: str | None) -> dict:
    """The training config (as plain data): the checkpoint's own, or the YAML file `config_file`."""
    if config_file is not None:
        from embshard.checkpoint.storage import to_json
        from embshard.config import load_config

        return json.loads(to_json(load_config(config_file)))
    cfg = man.get("config")
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"checkpoint {str(path)!r} holds no training config (saved without one): give the run's YAML with --config"
        )
    return cfg


def _dense_state(path: Path, source: Any) -> dict[str, torch.Tensor]:
    """The dense model's tensors `dense.model.*` of the checkpoint, read whole (they are small)."""
    md = source.read_metadata()
    prefix = "dense.model."
    plain: dict[str, torch.Tensor] = {}
    for key, m in sorted(md.state_dict_metadata.items()):  # one order, whatever the saving ranks wrote
        if key.startswith(prefix) and hasattr(m, "chunks"):
            plain[key[len(prefix) :]] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if not plain:
        raise ConfigError(f"checkpoint {str(path)!r} holds no dense model (dense.model.*): nothing to serve")
    loaded = read_pieces(path, [], {"dense": {"model": plain}}, source=source)
    return {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in loaded["dense"]["model"].items()}


def export_serving(
    checkpoint: Path,
    out: Path,
    dtype: str = "fp16",
    device: str = "cpu",
    memory_gib: float | None = None,
    config_file: str | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    say: Callable[[str], None] = print,
) -> dict:
    """Write the serving artifact of `checkpoint` into `out`; returns model.json's content. `dtype`: one of
    DTYPES for every table, or 'auto' (choose.py, under `memory_gib`)."""
    if dtype not in (*DTYPES, "auto"):
        raise ConfigError(f"--dtype {dtype!r}: give one of {', '.join(DTYPES)} or auto")
    if dtype == "auto" and memory_gib is None:
        raise ConfigError("--dtype auto needs --memory-gib N: the tables' memory budget on the serving device (GiB)")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: give cpu or cuda")
    man = read_manifest(checkpoint)
    train_cfg = _training_config(man, checkpoint, config_file)
    mcfg = model_config(train_cfg.get("model"), f"checkpoint {str(checkpoint)!r}: its training config")
    if mcfg.kind not in SUPPORTED_KINDS:
        raise ConfigError(
            f"model.kind {mcfg.kind!r}: serving export supports {', '.join(SUPPORTED_KINDS)} (one score per sample "
            "from dense features and pooled embeddings)"
        )
    saved = man["collections"].get("ebc", {}).get("tables", {})
    for t in mcfg.tables:
        entry = saved.get(t.name)
        if entry is None or (entry["rows"], entry["dim"]) != (t.num_embeddings, t.embedding_dim):
            found = "none" if entry is None else f"{entry['rows']} x {entry['dim']}"
            raise ConfigError(
                f"table {t.name!r}: the config says {t.num_embeddings} x {t.embedding_dim}, the checkpoint holds "
                f"{found}: give the run's own config"
            )
        if t.raw_ids:
            raise ConfigError(f"table {t.name!r} has raw ids (ids: raw): serving export reads index tables only")
    if dtype == "auto":
        from embshard.serving.choose import choose_dtypes

        choices = choose_dtypes(mcfg.tables, memory_gib * (1 << 30))
        for c in choices:
            say(f"dtype auto: {c.table}: {c.dtype} ({c.why})")
        types = {c.table: c.dtype for c in choices}
    else:
        types = {t.name: dtype for t in mcfg.tables}
    for t in mcfg.tables:
        if types[t.name] == "int4" and t.embedding_dim % 2:
            raise ConfigError(f"table {t.name!r}: int4 packs two elements a byte; its embedding_dim "
                              f"{t.embedding_dim} is odd: give another --dtype")  # fmt: skip
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r}: cannot make the folder ({e})") from None
    source = reader(checkpoint)
    files: dict[str, dict] = {}
    tables = []
    for t in mcfg.tables:
        name = artifact.table_file(t.name)
        files[name] = _export_table(checkpoint, out, source, t, types[t.name], name, chunk_bytes)
        tables.append({"name": t.name, "rows": t.num_embeddings, "dim": t.embedding_dim, "dtype": types[t.name],
                       "file": name, "bytes": files[name]["bytes"]})  # fmt: skip
        say(f"table {t.name}: {t.num_embeddings} x {t.embedding_dim} {types[t.name]} -> {name}")
    dense = _dense_state(checkpoint, source)
    files[artifact.DENSE] = artifact.write_tensors(out, artifact.DENSE, dense, "the dense model")
    lookup = train_cfg.get("lookup") or {}
    model = {
        "kind": mcfg.kind,
        "model": train_cfg["model"],
        "num_dense": num_dense_of(mcfg.kind, dense),
        "features": [f for t in mcfg.tables for f in t.feature_names],
        "tables": tables,
        "bounds_check": lookup.get("bounds_check", "error"),
        "device": device,
        "data": train_cfg.get("data"),
        "source": {"checkpoint": str(checkpoint), "step": man["step"], "world_size": man["world_size"]},
    }
    files[artifact.MODEL] = artifact.write_json(out, artifact.MODEL, model, "the model description")
    artifact.write_manifest(out, files, {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return model


def _export_table(path: Path, out: Path, source: Any, t: Any, dtype: str, name: str, chunk_bytes: int) -> dict:
    """Stream table `t`'s rows from the checkpoint into `out/name` in `dtype`; the file's manifest record."""
    R, D = t.num_embeddings, t.embedding_dim
    key = f"ebc/{t.name}/weight"
    stored = quantize(torch.zeros(1, D), dtype)
    st_dtype, width = stored.dtype, stored.shape[1]
    assert width * stored.element_size() == row_bytes(D, dtype)
    header = artifact.safetensors_header({"rows": (st_dtype, (R, width))}, {"table": t.name, "dtype": dtype})
    rows = max(1, chunk_bytes // (D * 4))
    buf = torch.zeros(min(rows, R), D)  # read as fp32 whatever the table's stored type
    with NewFile(out, name, f"table {t.name!r}") as f:
        h = artifact.HashingFile(f)
        h.write(header)
        for r0 in range(0, R, rows):
            part = buf[: min(rows, R - r0)]
            read_pieces(path, [Piece(key, (R, D), (r0, 0), part)], source=source)
            h.write(quantize(part, dtype).contiguous().view(torch.uint8).numpy().tobytes())
    return h.record()
