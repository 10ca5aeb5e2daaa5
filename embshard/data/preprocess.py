"""`embshard preprocess CONFIG --out DIR`: raw files (Criteo TSV day files, CSV, Parquet) to Parquet with every value
already a table row, dense transforms applied, bad rows handled: the training loader then only decodes.

    CONFIG's data section (table, criteo or movielens) and model tables -> the loader's own reader (same hashing,
    vocabulary, transforms and bad-row rules) -> parts: consecutive groups of one input file, at most --part-rows
    rows -> one process per part (--workers) -> DIR/train/<input>.part-NNNNN.parquet (and DIR/eval/...),
    one row group per input group, written to a temporary name and renamed when complete
    -> DIR/manifest.json (inputs, parts, rows, skipped rows) and DIR/data.yaml (the data section that trains on DIR)

Resumable per part: a rerun skips parts whose file exists (a part is renamed into place only when complete) and
refuses a folder made with another configuration (--overwrite starts over). Deterministic: a part's bytes depend
only on its input rows and the configuration, so a rerun, with any number of workers, writes identical files.
Output columns: `label` (float32, already 0/1), each dense column (float32, transformed), each feature (named
after it; int32 rows when the table has fewer than 2^31 rows, else int64): a plain column for one-id features, a
list column for multi-valued ones, packed fixed-width ids (fixed_size_binary, field metadata embshard.packed) for
inputs of fixed bag size; `<feature>_weights` (float32) for weighted tables. With mapping vocab (and no
vocab_dir) the vocabulary is counted first over the training rows and written to DIR/vocab/ (--vocab-only stops
there; point vocab_dir at it to map values on the fly).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embshard.data.chunk import Chunk, ReadSpec
from embshard.data.decode import PACKED_KEY, Reader
from embshard.data.layout import Layout, Piece, detect_format, resolve_files, scan
from embshard.data.vocab import Counter, write_vocab
from embshard.spec.tables import ConfigError


@dataclass(frozen=True)
class Task:
    """One output part: groups [first, last] of one input file of one split."""

    split: str
    file: int
    groups: tuple[int, ...]  # indexes into the layout's groups
    out: str


def plan_parts(layout: Layout, split: str, lo: int, hi: int, part_rows: int, out_dir: Path) -> list[Task]:
    """Parts of rows [lo, hi) of a layout: consecutive groups of one file, up to part_rows rows each."""
    tasks: list[Task] = []
    at = 0
    cur: list[int] = []
    rows = 0

    def close() -> None:
        nonlocal cur, rows
        if cur:
            g = layout.groups[cur[0]]
            stem = Path(layout.files[g.file]).name.split(".")[0]
            n = sum(1 for t in tasks if t.file == g.file)
            tasks.append(Task(split, g.file, tuple(cur), str(out_dir / split / f"{stem}.part-{n:05d}.parquet")))
        cur, rows = [], 0

    for i, g in enumerate(layout.groups):
        inside = max(0, min(hi, at + g.rows) - max(lo, at))
        at += g.rows
        if not inside:
            continue
        if cur and (layout.groups[cur[0]].file != g.file or rows + g.rows > part_rows):
            close()
        cur.append(i)
        rows += g.rows
    close()
    return tasks


def chunk_table(chunk: Chunk, spec: ReadSpec, packed: dict[str, int | None]) -> pa.Table:
    """A Chunk as the output columns."""
    cols: dict[str, pa.Array] = {"label": pa.array(chunk.labels.astype(np.float32))}
    for j, d in enumerate(spec.dense):
        cols[d.column] = pa.array(np.ascontiguousarray(chunk.dense[:, j]))
    fields = []
    for f, lens, vals, w in zip(
        spec.features, chunk.lengths, chunk.values, chunk.weights or [None] * len(spec.features)
    ):
        dtype = np.int32 if f.rows < 2**31 else np.int64
        vals = vals.astype(dtype, copy=False)
        k = packed.get(f.name)
        single = not (f.separator or k or packed.get(f.name + "/list"))
        if single:
            valid = lens > 0
            full = np.zeros(len(lens), dtype=dtype)
            full[valid] = vals
            cols[f.name] = pa.array(full, mask=~valid)
        elif k:
            cols[f.name] = pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(k * vals.itemsize), len(lens), [None, pa.py_buffer(vals.tobytes())]
            )
        else:
            offsets = np.zeros(len(lens) + 1, dtype=np.int32)
            np.cumsum(lens, out=offsets[1:])
            cols[f.name] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(vals))
        if w is not None:
            if single:
                cols[f.name + "_weights"] = pa.array(np.where(lens > 0, _scatter(w, lens), 1.0).astype(np.float32))
            else:
                offsets = np.zeros(len(lens) + 1, dtype=np.int32)
                np.cumsum(lens, out=offsets[1:])
                cols[f.name + "_weights"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(w))
        if k:
            fields.append((f.name, np.dtype(dtype).name))
    table = pa.table(cols)
    for name, dtype in fields:
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i).with_metadata({PACKED_KEY: dtype.encode()}), table[name])
    return table


def _scatter(w: np.ndarray, lens: np.ndarray) -> np.ndarray:
    out = np.ones(len(lens), dtype=np.float32)
    out[lens > 0] = w
    return out


_STATE: dict = {}


def _init(state: dict) -> None:
    _STATE.update(state)


def run_task(task: Task) -> dict:
    """Convert one part (in a worker process); returns its rows and skipped rows."""
    layout: Layout = _STATE["layouts"][task.split]
    spec: ReadSpec = _STATE["spec"]
    reader = Reader(spec, layout, _STATE["vocab"])
    rows = skipped = 0
    first = None
    writer = None
    tmp = f"{task.out}.tmp{os.getpid()}"
    Path(task.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        for gi in task.groups:
            g = layout.groups[gi]
            chunk, bad, message = reader.read(Piece(g, 0, g.rows))
            skipped += bad
            first = first or message
            table = chunk_table(chunk, spec, _STATE["packed"])
            if writer is None:
                writer = pq.ParquetWriter(
                    tmp,
                    table.schema,
                    compression=_STATE["compression"],
                    use_dictionary=False,
                    write_page_checksum=True,  # the reader verifies every page: a damaged byte is an error
                )
            writer.write_table(table, row_group_size=max(1, table.num_rows))
            rows += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    os.replace(tmp, task.out)
    return {"out": task.out, "rows": rows, "skipped": skipped, "first_bad": first}


def count_task(piece_list: list[Piece]) -> dict:
    """Value counts of the training rows of some pieces (vocabulary pass)."""
    reader = Reader(_STATE["spec"], _STATE["layouts"]["train"])
    counters: dict[str, Counter] = {}
    for p in piece_list:
        for col, values in reader.raw(p).items():
            counters.setdefault(col, Counter()).add(values)
    return {c: k.table() for c, k in counters.items()}


def fingerprint(obj: object) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="embshard preprocess", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="training YAML: its data section (table, criteo or movielens) and model tables")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides, as for embshard train")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    ap.add_argument("--part-rows", type=int, default=1 << 20, help="rows per output file, at most (whole input groups)")
    ap.add_argument("--compression", default="lz4", help="Parquet compression: lz4, zstd, snappy, none")
    ap.add_argument("--vocab-only", action="store_true", help="only count the vocabulary into OUT/vocab")
    ap.add_argument("--overwrite", action="store_true", help="start over in an OUT made with another configuration")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_intermixed_args(argv)
    try:
        preprocess(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def preprocess(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from embshard.config import load_config
    from embshard.data import table_config
    from embshard.data.source import check_not_empty, read_spec

    cfg = load_config(args.config, args.overrides)
    if cfg.data.source == "synthetic":
        raise ConfigError(f"{args.config}: data.source is synthetic: there are no files to preprocess")
    tables = list(cfg.model.tables)
    tcfg = table_config(cfg.data, tables)
    where = f"data.{cfg.data.source}"
    files = resolve_files(tcfg.files, f"{where}.files")
    fmt = detect_format(files, tcfg.format, where)
    spec = read_spec(tcfg, tables, fmt, cfg.data.on_bad_row, where)
    train = scan(files, fmt, tcfg.header, tcfg.column_names, spec.delimiter, spec.chunk_rows)
    check_not_empty(train, f"{where}.files")
    layouts = {"train": train}
    out = Path(args.out)
    if tcfg.eval_files is not None:
        held = scan(resolve_files(tcfg.eval_files, f"{where}.eval_files"), fmt, tcfg.header, tcfg.column_names,
                    spec.delimiter, spec.chunk_rows)  # fmt: skip
        check_not_empty(held, f"{where}.eval_files")
        layouts["eval"] = held
        train_rows = train.rows
    else:
        train_rows = train.rows - max(1, round(train.rows * tcfg.held_out_fraction))
    config_id = fingerprint({"spec": asdict(spec), "files": files, "eval": tcfg.eval_files, "part": args.part_rows,
                             "compression": args.compression})  # fmt: skip
    manifest_path = out / "manifest.json"
    if manifest_path.exists() and not args.overwrite:
        old = json.loads(manifest_path.read_text()).get("config")
        if old != config_id:
            raise ConfigError(
                f"{out} holds output of another configuration (config {old}, now {config_id}): choose another --out, "
                "or pass --overwrite to start over"
            )
    if args.overwrite and out.exists():
        for sub in ("train", "eval", "vocab"):
            for p in (out / sub).glob("*") if (out / sub).exists() else []:
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps({"config": config_id, "status": "running"}, indent=1) + "\n")
    state = {"spec": spec, "layouts": layouts, "vocab": None, "packed": {}, "compression": args.compression}
    workers = max(1, args.workers)
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    bar = tqdm(disable=args.no_progress, unit="rows", unit_scale=True, file=sys.stderr, mininterval=1.0)
    vocab_counts = None
    if spec.mapping == "vocab" and (tcfg.vocab_dir is None or args.vocab_only):
        pieces = train.pieces(0, train_rows)
        batches = [pieces[i : i + 4] for i in range(0, len(pieces), 4)]
        counters = {c: Counter() for c in dict.fromkeys(f.column for f in spec.features)}
        bar.set_description("counting values")
        bar.reset(total=train_rows)
        with ctx.Pool(workers, _init, (state,)) as pool:
            for part, got in zip(batches, pool.imap(count_task, batches)):
                for c, t in got.items():
                    counters[c].parts.append(t)
                    if len(counters[c].parts) >= 16:
                        counters[c].parts = [counters[c].table()]
                bar.update(sum(p.rows for p in part))
        for c, k in counters.items():
            write_vocab(str(out / "vocab"), c, k)
        vocab_counts = {c: len(k.table()) for c, k in counters.items()}
        if args.vocab_only:
            bar.close()
            manifest_path.write_text(
                json.dumps({"config": config_id, "status": "vocab", "vocab": vocab_counts}, indent=1) + "\n"
            )
            print(f"vocabulary of {len(counters)} columns written to {out / 'vocab'}", file=sys.stderr)
            return {"vocab": vocab_counts}
    if spec.mapping == "vocab":
        from dataclasses import replace

        from embshard.data.source import build_vocab

        vdir = tcfg.vocab_dir or str(out / "vocab")
        state["vocab"] = build_vocab(replace(tcfg, vocab_dir=vdir), spec, train, 0, train_rows)
    state["packed"] = packed_features(spec, layouts)
    tasks = plan_parts(train, "train", 0, train.rows, args.part_rows, out)
    if "eval" in layouts:
        tasks += plan_parts(layouts["eval"], "eval", 0, layouts["eval"].rows, args.part_rows, out)
    todo = [t for t in tasks if not os.path.exists(t.out)]
    total = sum(layouts[t.split].groups[g].rows for t in todo for g in t.groups)
    bar.set_description(f"{len(todo)} of {len(tasks)} parts")
    bar.reset(total=total)
    results = []
    with ctx.Pool(workers, _init, (state,)) as pool:
        for r in pool.imap(run_task, todo):  # in order: the first bad part in file order is the one reported
            results.append(r)
            bar.update(r["rows"] + r["skipped"])
    bar.close()
    parts = []
    for t in tasks:
        meta = pq.ParquetFile(t.out).metadata
        parts.append(
            {"out": os.path.relpath(t.out, out), "input": layouts[t.split].files[t.file], "rows": meta.num_rows}
        )
    skipped = {}
    for r in results:
        if r["skipped"]:
            skipped[os.path.relpath(r["out"], out)] = [r["skipped"], r["first_bad"]]
            print(f"warning: {r['out']}: skipped {r['skipped']} bad rows (first: {r['first_bad']})", file=sys.stderr)
    manifest = {"config": config_id, "status": "complete", "parts": parts, "skipped_this_run": skipped}
    if vocab_counts:
        manifest["vocab"] = vocab_counts
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "data.yaml").write_text(data_yaml(spec, tcfg, out, "eval" in layouts))
    print(f"{len(todo)} parts written, {len(tasks) - len(todo)} already there; train on it with {out / 'data.yaml'}",
          file=sys.stderr)  # fmt: skip
    return manifest


def packed_features(spec: ReadSpec, layouts: dict[str, Layout]) -> dict[str, int | None]:
    """Features whose input column has a fixed bag size (Parquet fixed_size_list or packed ids): written packed;
    features from Parquet list columns are marked '<name>/list' (written as lists)."""
    out: dict[str, int | None] = {}
    if spec.fmt != "parquet":
        return out
    schema = pq.ParquetFile(layouts["train"].files[0]).schema_arrow
    for f in spec.features:
        field = schema.field(f.column)
        t = field.type
        if pa.types.is_fixed_size_list(t):
            out[f.name] = t.list_size
        elif pa.types.is_fixed_size_binary(t) and PACKED_KEY in (field.metadata or {}):
            out[f.name] = t.byte_width // np.dtype(field.metadata[PACKED_KEY].decode()).itemsize
        elif pa.types.is_list(t) or pa.types.is_large_list(t):
            out[f.name + "/list"] = 1
    return out


def data_yaml(spec: ReadSpec, tcfg, out: Path, has_eval: bool) -> str:
    """The data section that trains on the preprocessed folder."""
    import yaml

    table: dict = {"files": [str(out / "train" / "*.parquet")], "label": "label"}
    if spec.dense:
        table["dense"] = [{"column": d.column} for d in spec.dense]
    cats = []
    for f in spec.features:
        c: dict = {"column": f.name}
        if f.weights:
            c["weights"] = f.name + "_weights"
        cats.append(c)
    table["categorical"] = cats
    table["mapping"] = "identity"
    if has_eval:
        table["eval_files"] = [str(out / "eval" / "*.parquet")]
        if tcfg.eval_fraction is not None:
            table["eval_fraction"] = tcfg.eval_fraction
    else:
        table["eval_fraction"] = tcfg.held_out_fraction
    head = "# written by embshard preprocess: paste as the data section of a training config\n"
    return head + yaml.safe_dump({"data": {"source": "table", "table": table}}, sort_keys=False, width=120)


if __name__ == "__main__":
    main()
