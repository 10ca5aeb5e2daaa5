"""`embshard checkpoint inspect DIR [--verify]` and `embshard checkpoint export DIR --out OUT`.

inspect: the checkpoint's step, world size, optimizers, and per table its plan (sharding, tier, ranks), shape,
type and bytes of its weights and optimizer state (from the manifest and DCP's index; no data is read). With
--verify it also reads every file and compares its size and CRC-32 with what the save recorded (exit status 1 and
one line per damaged file if any differs).
export: every table's full weights, one safetensors file per table (`OUT/<table>.safetensors`, tensor 'weight'
`[rows, dim]`), streamed in row chunks (no table is held whole in memory), with `OUT/tables.json` listing them;
every chunk is checked against the save's checksums as it is read, and a damaged one stops the export (the table's
file is not left behind); a raw-id table's id -> row map goes beside it (`OUT/<table>.ids.safetensors`:
checkpoint/raw_ids.py). DIR is a checkpoint folder (step_<N>), or a folder of them (its latest complete one).
Nothing here runs code from the checkpoint (unpickle.py) or reaches outside DIR and OUT with its names: every
table and collection is a plain file name (storage.read_manifest), every output is written to a new temporary file
in OUT and renamed, following no link already there (files.NewFile); the paths printed are the real ones, and
every name printed is escaped (files.escape). A table whose declared shape is not what its chunks hold is refused
before anything is allocated.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

import torch

from embshard.checkpoint import raw_ids
from embshard.checkpoint.files import CheckpointDamaged, NewFile, escape
from embshard.checkpoint.integrity import regular_size, verify_folder
from embshard.checkpoint.pieces import Piece
from embshard.checkpoint.reading import read_pieces, reader
from embshard.checkpoint.storage import checksums, latest, read_commit, read_manifest
from embshard.spec.tables import ConfigError

_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def resolve(path: str) -> Path:
    """A checkpoint folder: `path` itself, or the latest complete checkpoint in it."""
    p = Path(path)
    if (p / "manifest.json").is_file() or (p / "COMMIT").is_file():
        return p
    found = latest(p)
    if found is None:
        raise ConfigError(f"{path!r} is neither a checkpoint folder nor a folder holding a complete one")
    return found


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def tensor_index(path: Path, md: Any = None) -> dict[str, tuple[tuple[int, ...], torch.dtype, int, int]]:
    """Per logical tensor of the checkpoint: (shape, dtype, chunks, bytes stored), from DCP's index (`md`: read
    already)."""
    md = md if md is not None else reader(path).read_metadata()
    stored: dict[str, int] = {}
    for index, info in md.storage_data.items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(info.length)
    out = {}
    for key, m in md.state_dict_metadata.items():
        if hasattr(m, "chunks"):
            out[key] = (tuple(m.size), m.properties.dtype, len(m.chunks), stored.get(key, 0))
    return out


def _check_declared(path: Path, md: Any, key: str, shape: tuple[int, ...]) -> None:
    """Raise CheckpointDamaged unless DCP's index `md` holds `key` with the manifest's `shape`, in chunk files that
    hold at least its bytes: no absurd declared size is allocated or written."""
    m = md.state_dict_metadata.get(key)
    if m is None or not hasattr(m, "chunks"):
        raise CheckpointDamaged(path, ".metadata", f"the tensor {key!r} that manifest.json lists", "none")
    if tuple(m.size) != shape:
        raise CheckpointDamaged(path, ".metadata", f"{key!r} of shape {list(shape)} (manifest.json)", f"{list(m.size)}")
    need = torch.Size(shape).numel() * torch.empty((), dtype=m.properties.dtype).element_size()
    files = {info.relative_path for index, info in md.storage_data.items() if index.fqn == key}
    disk = sum(max(0, regular_size(path / name)) for name in files)
    if disk < need:
        raise CheckpointDamaged(path, ".metadata", f"chunk files of {key!r} holding its {need} bytes", f"{disk} bytes")


def inspect(path: Path) -> str:
    """The text `embshard checkpoint inspect` prints."""
    man, commit = read_manifest(path), read_commit(path)
    try:
        return _describe(path, man, commit)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ConfigError(
            f"checkpoint {str(path)!r}: its manifest or COMMIT lacks what a save writes ({type(e).__name__}: "
            f"{escape(str(e))[:200]}): it is damaged"
        ) from None


def _describe(path: Path, man: dict, commit: dict) -> str:
    index = tensor_index(path)
    lines = [
        f"checkpoint {path}: step {man['step']}, saved by {man['world_size']} ranks at {man['time']}, "
        f"{_size(commit['bytes'])} on disk (write {commit.get('write_s', '?')} s)",
        f"dense model: {'yes' if man['dense'] else 'no'}; dense optimizer: {man['dense_optimizer']}; "
        f"data position: {man['data_position']}",
        f"checksums: CRC-32 of {len(commit['files'])} files, checked when read (--verify: read every file now)"
        if commit.get("files") is not None
        else "checksums: none (saved by an older embshard): the data cannot be verified",
    ]
    for prefix, col in man["collections"].items():
        opt = col["optimizer"]
        lines.append(
            f"collection {prefix}: {len(col['tables'])} tables; sparse optimizer {opt['kind']} (lr {opt['lr']}, "
            f"eps {opt['eps']}, weight_decay {opt['weight_decay']}); column_wise_exact {col['column_wise_exact']}"
        )
        rows = [("table", "rows x dim", "type", "sharding", "tier", "ranks", "weight", "optimizer state")]
        for name, t in col["tables"].items():
            base = f"{prefix}/{name}/"
            w = index.get(base + "weight")
            states = []
            for key, (shape, _, _, nbytes) in index.items():
                if key.startswith(base) and key != base + "weight":
                    states.append(f"{key[len(base) :]} {list(shape)} {_size(nbytes)}")
            ranks = ",".join(map(str, t["ranks"])) if len(t["ranks"]) < 5 else f"{t['ranks'][0]}-{t['ranks'][-1]}"
            rows.append(
                (
                    name,
                    f"{t['rows']} x {t['dim']}",
                    str(w[1]).replace("torch.", "") if w else "?",
                    t["sharding_type"],
                    t["tier"],
                    ranks,
                    _size(w[3]) if w else "?",
                    ", ".join(states) or "-",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines += ["  " + "  ".join(c.ljust(n) for c, n in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    for key in man.get("row_tensors", []):
        shape, dtype, _, nbytes = index[key]
        lines.append(f"row tensor {key}: {list(shape)} {str(dtype).replace('torch.', '')} {_size(nbytes)}")
    return "\n".join(lines)


def _safetensors_header(shape: tuple[int, int], dtype: torch.dtype, meta: dict[str, str]) -> bytes:
    nbytes = shape[0] * shape[1] * torch.empty((), dtype=dtype).element_size()
    header = {
        "__metadata__": meta,
        "weight": {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape), "data_offsets": [0, nbytes]},
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def export(path: Path, out: Path, dtype: str | None, tables: list[str] | None, chunk_mib: float) -> list[dict]:
    """Stream every table's full weights into OUT/<table>.safetensors; returns what was written (with the real
    paths: 'path', 'ids_path')."""
    man = read_manifest(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r}: cannot make the folder ({e})") from None
    chunk_bytes = int(chunk_mib * (1 << 20))
    written = []
    available = {name: (prefix, t) for prefix, col in man["collections"].items() for name, t in col["tables"].items()}
    wanted = tables or list(available)
    unknown = [t for t in wanted if t not in available]
    if unknown:
        raise ConfigError(f"--tables names {unknown}, which the checkpoint does not hold; it has {sorted(available)}")
    source = reader(path)  # one index read; every chunk checked against the save's checksums once
    md = source.read_metadata()
    for name in wanted:
        prefix, t = available[name]
        R, D = t["rows"], t["dim"]
        target = _DTYPES.get(dtype or t.get("data_type"))
        if target is None:
            raise ConfigError(f"checkpoint {str(path)!r}: table {name!r} has data_type {t.get('data_type')!r} in its "
                              f"manifest, not one of {sorted(_DTYPES)}: it is damaged (or give --dtype)")  # fmt: skip
        key = f"{prefix}/{name}/weight"
        _check_declared(path, md, key, (R, D))
        rows = max(1, chunk_bytes // (D * 4))
        meta = {"table": name, "collection": prefix, "step": str(man["step"]), "source": str(path)}
        new = NewFile(out, f"{name}.safetensors", f"the weights of table {name!r}")
        with new as f:
            f.write(_safetensors_header((R, D), target, meta))
            buf = torch.zeros(min(rows, R), D)
            for r0 in range(0, R, rows):
                part = buf[: min(rows, R - r0)]
                read_pieces(path, [Piece(key, (R, D), (r0, 0), part)], source=source)
                f.write(part.to(target).contiguous().view(torch.uint8).numpy().tobytes())
        written.append({"table": name, "file": os.path.basename(new.path), "rows": R, "dim": D,
                        "dtype": str(target).split(".")[-1], "path": new.path})  # fmt: skip
        if t.get("ids") == "raw":  # the id -> row map beside the weights
            for k in raw_ids.MAP_KEYS:
                _check_declared(path, md, f"{prefix}/{name}/{k}", (R,))
            ids_path = raw_ids.export_map(path, out, prefix, name, R, chunk_bytes, meta, source)
            written[-1].update(ids_file=os.path.basename(ids_path), ids_path=ids_path)
    listing = [{k: v for k, v in w.items() if k not in ("path", "ids_path")} for w in written]
    new = NewFile(out, "tables.json", "the list of exported tables")
    with new as f:
        f.write(json.dumps({"step": man["step"], "tables": listing}, indent=1).encode())
    return written


def _say(text: str, err: bool = False) -> None:
    """Print `text` with every non-printable character escaped (no terminal escapes from a checkpoint's names)."""
    print(escape(text), file=sys.stderr if err else sys.stdout)


def verify(path: Path, threads: int) -> bool:
    """`inspect --verify`: read every file of the checkpoint, print what was found; whether it is intact."""
    v = verify_folder(path, checksums(path), threads)
    for problem in v.problems:
        _say(f"damaged: {path}/{problem}")
    if not v.checksums:
        _say(f"not verified: {path} was saved without checksums (by an older embshard); only its structure was "
              f"checked{': damaged' if v.problems else ''}")  # fmt: skip
    elif v.problems:
        _say(f"{path} failed verification: {len(v.problems)} of its {v.files} files are not what the save recorded "
              "or cannot be read safely. Fix: resume from an earlier checkpoint (checkpoint.resume_from=latest skips "
              "damaged ones), or restore the files from a copy")  # fmt: skip
    else:
        _say(f"verified: {v.files} files, {_size(v.bytes)} match the save's CRC-32 "
              f"({v.seconds:.2f} s, {v.gb_per_s:.2f} GB/s)")  # fmt: skip
    return not v.problems


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="embshard checkpoint", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print a checkpoint's step, plan, tables, shapes, bytes and optimizer")
    p.add_argument("dir", help="checkpoint folder (step_<N>), or a folder of them (the latest complete one)")
    p.add_argument("--verify", action="store_true", help="read every file and check its size and CRC-32")
    p.add_argument("--threads", type=int, default=8, help="files read at once by --verify")
    p = sub.add_parser("export", help="write every table's full weights as one safetensors file per table")
    p.add_argument("dir", help="checkpoint folder (step_<N>), or a folder of them (the latest complete one)")
    p.add_argument("--out", default=None, help="output folder (default runs/tables/step_<N>)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="weight type (default: the table's)")
    p.add_argument("--tables", default=None, help="comma-separated tables (default: all)")
    p.add_argument("--chunk-mib", type=float, default=64.0, help="rows read and written at once (MiB)")
    args = ap.parse_args(argv)
    try:
        path = resolve(args.dir)
        if args.command == "inspect":
            unreadable = None
            try:
                _say(inspect(path))
            except ConfigError as e:
                if not args.verify:
                    raise
                unreadable = e  # a damaged manifest or index: --verify names the file
            if args.verify and not verify(path, args.threads):
                sys.exit(1)
            if unreadable is not None:
                raise unreadable
        else:
            names = [t for t in args.tables.split(",") if t] if args.tables else None
            args.out = args.out or str(Path("runs") / "tables" / Path(path).name)
            for w in export(path, Path(args.out), args.dtype, names, args.chunk_mib):
                _say(f"{w['table']}: {w['rows']} x {w['dim']} {w['dtype']} -> {w['path']}")
                if "ids_path" in w:
                    _say(f"{w['table']}: id -> row map -> {w['ids_path']}")
    except ConfigError as e:
        _say(f"error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
