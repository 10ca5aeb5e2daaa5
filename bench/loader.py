"""Loader throughput: samples/s and peak RSS of embshard's table source alone, on MLPerf-shaped Parquet, with N worker
processes, beside TorchRec's InMemoryBinaryCriteoIterDataPipe (torchrec.datasets.criteo) on the same rows.

Usage: python -m bench.loader [--rows 2000000] [--workers 0,1,2,4,8,16] [--data-dir /tmp/embshard_loader]

Data (generated once into --data-dir, reused by later runs): 13 dense float columns, a label and 26 categorical
columns with the MLPerf DLRM-DCNv2 multi-hot sizes (3, 2, 1, 2, 6, ... 214 ids a row) and row counts (capped at
40M), ids uniform. Layouts:
  multihot-list    C1..C26 as Parquet list<int32> columns (what any writer produces)
  multihot-packed  the multi-hot columns as fixed_size_binary, packed little-endian int32 ids (field metadata
                   embshard.packed: int32; what `embshard preprocess --packed` writes); one-hot columns int32
  onehot           26 int32 columns, one id a row (Criteo 1TB after preprocessing)
  torchrec-onehot  the onehot rows as .npy files read by TorchRec's InMemoryBinaryCriteoIterDataPipe, which only
                   takes one-hot rows and loads the whole split into memory (its best case: no decoding)
Every measurement runs in a fresh process: batches of --batch-size rows are drawn for --seconds (after --warmup
batches); samples/s counts rows delivered as Batch / torchrec Batch objects (KJT built, on the CPU); samples per
CPU-second divides them by the CPU time of the process and its workers (a measure that other load on the machine
barely changes); peak RSS is the sum over the process and its workers (shared pages counted in each), sampled every
0.1 s. With --repeat R the fastest of R runs is reported.

--stages: instead, where one stream's time goes in the training process (workers 0): CPU time of the thread per row
in each stage (file read, decoding with checks and id mapping, of which hashing, stacking small bags, the gather into
the KeyedJaggedTensor layout, the KJT), for each layout and for `onehot-hash` (the one-hot file with mapping: hash,
its integer ids hashed as text).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
ROWS = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938, 155, 4, 976,
    14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]  # fmt: skip
DENSE = [f"I{i}" for i in range(1, 14)]
CAT = [f"C{i}" for i in range(1, 27)]


def generate(folder: Path, rows: int, row_group: int) -> None:
    """Write every layout's files for `rows` rows (skipped when already there)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = folder / f"done_{rows}_{row_group}"
    if done.exists():
        return
    folder.mkdir(parents=True, exist_ok=True)
    int_item = pa.field("item", pa.int32(), nullable=False)
    fields = [pa.field("label", pa.float32(), nullable=False)] + [
        pa.field(c, pa.float32(), nullable=False) for c in DENSE
    ]
    schemas = {
        "multihot-list": pa.schema(fields + [pa.field(c, pa.list_(int_item), nullable=False) for c in CAT]),
        "multihot-packed": pa.schema(
            fields
            + [
                pa.field(c, pa.int32(), nullable=False)
                if h == 1
                else pa.field(c, pa.binary(4 * h), nullable=False, metadata={"embshard.packed": "int32"})
                for c, h in zip(CAT, HOT)
            ]
        ),
        "onehot": pa.schema(fields + [pa.field(c, pa.int32(), nullable=False) for c in CAT]),
    }
    writers = {  # as `embshard preprocess` writes: lz4, no dictionaries
        k: pq.ParquetWriter(folder / f"{k}.parquet", s, compression="lz4", use_dictionary=False)
        for k, s in schemas.items()
    }
    npy = {k: np.lib.format.open_memmap(folder / f"day_0_{k}.npy", "w+", dt, shape) for k, dt, shape in [
        ("dense", np.float32, (rows, 13)), ("sparse", np.int32, (rows, 26)), ("labels", np.int32, (rows, 1))]}  # fmt: skip
    rng = np.random.default_rng(0)
    for lo in range(0, rows, row_group):
        n = min(row_group, rows - lo)
        labels = (rng.random(n) < 0.25).astype(np.float32)
        dense = rng.lognormal(0, 2, (n, 13)).astype(np.float32)
        ids = [rng.integers(0, r, (n, h), dtype=np.int32) for r, h in zip(ROWS, HOT)]
        base = [pa.array(labels)] + [pa.array(dense[:, j]) for j in range(13)]
        offsets = [pa.array(np.arange(0, n * h + 1, h, dtype=np.int32)) for h in HOT]
        lists = [
            pa.ListArray.from_arrays(o, pa.array(x.ravel()), type=pa.list_(int_item)) for o, x in zip(offsets, ids)
        ]
        packed = [
            pa.array(x[:, 0]) if h == 1 else pa.FixedSizeBinaryArray.from_buffers(pa.binary(4 * h), n, [None, pa.py_buffer(x.tobytes())])
            for x, h in zip(ids, HOT)
        ]  # fmt: skip
        onehot = [pa.array(x[:, 0]) for x in ids]
        for k, cols in (("multihot-list", lists), ("multihot-packed", packed), ("onehot", onehot)):
            writers[k].write_table(pa.Table.from_arrays(base + cols, schema=schemas[k]), row_group_size=row_group)
        npy["dense"][lo : lo + n] = dense
        npy["sparse"][lo : lo + n] = np.stack([x[:, 0] for x in ids], axis=1)
        npy["labels"][lo : lo + n, 0] = labels.astype(np.int32)
    for w in writers.values():
        w.close()
    for a in npy.values():
        a.flush()
    done.touch()


class RssSampler:
    """Peak of the summed VmRSS of this process and its descendants."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @staticmethod
    def tree_cpu() -> dict[int, float]:
        """CPU seconds (user + system) so far of this process and each descendant."""
        tick = os.sysconf("SC_CLK_TCK")
        out = {}
        for p in RssSampler._tree():
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[p] = (int(fields[11]) + int(fields[12])) / tick
            except OSError:
                pass
        return out

    @staticmethod
    def _tree() -> set[int]:
        me = os.getpid()
        parents: dict[int, int] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        parents[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    pass
        tree, grew = {me}, True
        while grew:
            new = {p for p, pp in parents.items() if pp in tree} - tree
            tree |= new
            grew = bool(new)
        return tree

    @staticmethod
    def _tree_rss() -> int:
        total = 0
        for p in RssSampler._tree():
            try:
                with open(f"/proc/{p}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._tree_rss())
            time.sleep(0.1)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, self._tree_rss())


def tables_for(layout: str):
    from embshard.spec.tables import TableConfig

    return [TableConfig(f"t_{c}", r, 16, (c,)) for c, r in zip(CAT, ROWS)]


def make_source(folder: Path, layout: str, workers: int, args):
    """embshard's table source on one layout's file (onehot-hash: the one-hot file, its ids hashed as text)."""
    from embshard.config.data import CategoricalColumnConfig, DataConfig, DenseColumnConfig, TableSourceConfig
    from embshard.data.source import TableSource

    hashed = layout == "onehot-hash"
    cfg = TableSourceConfig(
        files=(str(folder / f"{'onehot' if hashed else layout}.parquet"),),
        label="label",
        categorical=tuple(CategoricalColumnConfig(c) for c in CAT),
        dense=tuple(DenseColumnConfig(c) for c in DENSE),
        mapping="hash" if hashed else "identity",
        eval_fraction=0.01,
    )
    data = DataConfig(source="table", table=cfg, workers=workers, shuffle_rows=args.shuffle_rows, prefetch=4)
    return TableSource(cfg, data, tables_for(layout), args.batch_size, 0, 0, 1)


def measure_embshard(folder: Path, layout: str, workers: int, args) -> dict:
    rss = RssSampler()
    t0 = time.perf_counter()
    source = make_source(folder, layout, workers, args)
    batches = source.train_batches()
    for _ in range(args.warmup):
        next(batches)
    start, cpu0 = time.perf_counter(), rss.tree_cpu()
    setup = start - t0
    n = ids = 0
    while time.perf_counter() - start < args.seconds:
        b = next(batches)
        n += b.size
        ids += b.sparse.values().numel()
    dt = time.perf_counter() - start
    cpu = _cpu_since(rss, cpu0)
    batches.close()
    return {"samples_per_s": n / dt, "ids_per_s": ids / dt, "setup_s": setup, "peak_rss": rss.stop(), "cpu_s": cpu,
            "samples": n}  # fmt: skip


def _cpu_since(rss: RssSampler, before: dict[int, float]) -> float:
    """CPU seconds the process tree used since `before` (processes started since count from 0)."""
    now = rss.tree_cpu()
    return sum(t - before.get(p, 0.0) for p, t in now.items())


def measure_torchrec(folder: Path, args) -> dict:
    from torchrec.datasets.criteo import InMemoryBinaryCriteoIterDataPipe

    rss = RssSampler()
    t0 = time.perf_counter()
    pipe = InMemoryBinaryCriteoIterDataPipe(
        stage="train",
        dense_paths=[str(folder / "day_0_dense.npy")],
        sparse_paths=[str(folder / "day_0_sparse.npy")],
        labels_paths=[str(folder / "day_0_labels.npy")],
        batch_size=args.batch_size,
        rank=0,
        world_size=1,
        shuffle_batches=True,
        hashes=ROWS,  # ids modulo the table sizes (no-op here); torchrec 1.6 requires them, 1.8 takes None
    )
    setup = time.perf_counter() - t0
    n = ids = 0
    it = iter(pipe)
    for _ in range(args.warmup):
        next(it)
    start, cpu0 = time.perf_counter(), rss.tree_cpu()
    while time.perf_counter() - start < args.seconds:
        try:
            b = next(it)
        except StopIteration:
            it = iter(pipe)
            continue
        n += b.labels.numel()
        ids += b.sparse_features.values().numel()
    dt = time.perf_counter() - start
    cpu = _cpu_since(rss, cpu0)
    return {"samples_per_s": n / dt, "ids_per_s": ids / dt, "setup_s": setup, "peak_rss": rss.stop(), "cpu_s": cpu,
            "samples": n}  # fmt: skip


# --stages: where the time of one stream goes, in the training process (workers 0), per stage (CPU time of the thread)
STAGES = [  # (label, module, class or None, function); the hashing stages run inside "decode"
    ("file read", "embshard.data.decode", "Reader", "table"),
    ("decode, checks, id mapping", "embshard.data.decode", "Reader", "convert"),
    ("  of which hashing", "embshard.data.decode", None, "hash_values"),
    ("  of which hashing", "embshard.data.decode", None, "hash_rows"),
    ("  of which hashing", "embshard.data.vocab", "VocabLookup", "__call__"),
    ("stack small bags", "embshard.data.stream", "Part", "__init__"),
    ("gather into the KJT layout", "embshard.data.stream", None, "assemble"),
    ("KJT and Batch", "embshard.data.source", "TableSource", "_batch"),
]


def measure_stages(folder: Path, layout: str, args) -> dict:
    """Per stage, CPU ns a row over --stage-batches batches (workers 0), the best of --repeat rounds by total."""
    import importlib

    spent: dict[str, float] = {}

    def timer(f, label: str):
        def timed(*a, **k):
            c0 = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - c0

        return timed

    for label, module, cls, fn in STAGES:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        setattr(owner, fn, timer(getattr(owner, fn), label))
    batches = make_source(folder, layout, 0, args).train_batches()
    for _ in range(args.warmup):
        next(batches)
    best = None
    for _ in range(args.repeat):
        spent.clear()
        c0, rows = time.process_time(), 0
        for _ in range(args.stage_batches):
            rows += next(batches).size
        ns = {k: v / rows * 1e9 for k, v in spent.items()}
        ns["total"] = (time.process_time() - c0) / rows * 1e9
        if best is None or ns["total"] < best["total"]:
            best = ns
    return best


def child(args) -> None:
    folder = Path(args.data_dir)
    if args.child_stages:
        out = measure_stages(folder, args.child, args)
    elif args.child == "torchrec-onehot":
        out = measure_torchrec(folder, args)
    else:
        out = measure_embshard(folder, args.child, args.child_workers, args)
    print("RESULT " + json.dumps(out), flush=True)


def stages(folder: Path, args, env: dict) -> None:
    """The --stages table: one fresh process per layout."""
    layouts = [x for x in args.layouts.split(",") if x != "torchrec-onehot"] + ["onehot-hash"]
    out = {}
    for layout in layouts:
        cmd = [sys.executable, "-m", "bench.loader", "--child", layout, "--child-stages", "--data-dir", str(folder)]
        cmd += ["--batch-size", str(args.batch_size), "--warmup", str(args.warmup), "--repeat", str(args.repeat)]
        cmd += ["--shuffle-rows", str(args.shuffle_rows), "--stage-batches", str(args.stage_batches)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
        if res.returncode or not line:
            print(f"{layout}: failed\n{res.stderr[-2000:]}", flush=True)
            continue
        out[layout] = json.loads(line[0][7:])
    names = list(dict.fromkeys(label for label, *_ in STAGES))
    print(
        f"\nCPU ns a row per stage, workers 0 (best of {args.repeat} x {args.stage_batches} batches of {args.batch_size})"
    )
    print("| stage | " + " | ".join(out) + " |")
    print("| --- |" + " ---: |" * len(out))
    for name in [*names, "other (windows, shuffle order, carried rows)", "total"]:
        cells = []
        for ns in out.values():
            v = ns.get(name, 0.0)
            if name.startswith("other"):
                v = ns["total"] - sum(ns.get(n, 0.0) for n in names if not n.startswith("  "))
            cells.append(f"{v:.0f}")
        print(f"| {name.strip()} | " + " | ".join(cells) + " |")
    print("| M rows per CPU-s | " + " | ".join(f"{1e3 / ns['total']:.2f}" for ns in out.values()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows of generated data (per layout)")
    ap.add_argument("--row-group", type=int, default=65536, help="Parquet row group size (rows)")
    ap.add_argument("--batch-size", type=int, default=8192, help="rows per batch")
    ap.add_argument("--workers", default="0,1,2", help="comma-separated worker counts to measure")
    ap.add_argument("--layouts", default="multihot-list,multihot-packed,onehot,torchrec-onehot")
    ap.add_argument("--seconds", type=float, default=10.0, help="timed seconds per measurement")
    ap.add_argument("--warmup", type=int, default=3, help="batches before timing")
    ap.add_argument("--shuffle-rows", type=int, default=65536, help="data.shuffle_rows")
    ap.add_argument("--repeat", type=int, default=1, help="runs per measurement; the fastest is reported")
    ap.add_argument("--data-dir", default="/tmp/embshard_loader")
    ap.add_argument("--stages", action="store_true", help="per-stage CPU time a row (workers 0) instead of the table")
    ap.add_argument("--stage-batches", type=int, default=32, help="--stages: batches per round")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-stages", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-workers", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    folder = Path(args.data_dir) / f"rows{args.rows}"
    t0 = time.perf_counter()
    generate(folder, args.rows, args.row_group)
    print(f"data in {folder} ({time.perf_counter() - t0:.0f} s); {os.cpu_count()} CPUs", flush=True)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]),
    )
    if args.stages:
        stages(folder, args, env)
        return
    rows = []
    for layout in args.layouts.split(","):
        for w in [0] if layout == "torchrec-onehot" else [int(x) for x in args.workers.split(",")]:
            cmd = [
                sys.executable,
                "-m",
                "bench.loader",
                "--child",
                layout,
                "--child-workers",
                str(w),
                "--data-dir",
                str(folder),
            ]
            cmd += ["--batch-size", str(args.batch_size), "--seconds", str(args.seconds), "--warmup", str(args.warmup)]
            cmd += ["--shuffle-rows", str(args.shuffle_rows)]
            runs = []
            for _ in range(args.repeat):
                res = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
                if res.returncode or not line:
                    print(f"{layout} workers={w}: failed\n{res.stderr[-2000:]}", flush=True)
                    break
                runs.append(json.loads(line[0][7:]))
            if not runs:
                continue
            r = max(runs, key=lambda x: x["samples_per_s"])
            r["per_cpu_s"] = max(x["samples"] / x["cpu_s"] for x in runs)
            rows.append((layout, w, r))
            print(f"{layout:16s} workers={w:2d}  {r['samples_per_s'] / 1e6:7.3f} M samples/s  "
                  f"{r['ids_per_s'] / 1e6:8.1f} M ids/s  {r['per_cpu_s'] / 1e6:6.3f} M samples/CPU-s  "
                  f"peak RSS {r['peak_rss'] / 2**30:6.2f} GiB  setup {r['setup_s']:.1f} s", flush=True)  # fmt: skip
            framework = "torchrec" if layout == "torchrec-onehot" else "embshard"
            print(f"RESULT framework={framework} bench=loader layout={layout} workers={w} batch={args.batch_size} "
                  f"cpus={os.cpu_count()} samples_per_s={r['samples_per_s']:.0f} ids_per_s={r['ids_per_s']:.0f} "
                  f"samples_per_cpu_s={r['per_cpu_s']:.0f} peak_rss_gib={r['peak_rss'] / 2**30:.2f} "
                  f"setup_s={r['setup_s']:.1f}", flush=True)  # fmt: skip
    print(f"\nsummary ({os.cpu_count()} CPUs, batch {args.batch_size}, {args.rows} rows, row groups {args.row_group})")
    print("| layout | workers | M samples/s | M ids/s | M samples per CPU-s | peak RSS GiB | setup s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layout, w, r in rows:
        print(f"| {layout} | {w} | {r['samples_per_s'] / 1e6:.3f} | {r['ids_per_s'] / 1e6:.1f} | "
              f"{r['per_cpu_s'] / 1e6:.3f} | {r['peak_rss'] / 2**30:.2f} | {r['setup_s']:.1f} |")  # fmt: skip
    print("M samples per CPU-s: samples over the CPU seconds of the process and its workers (robust to other load).")


if __name__ == "__main__":
    main()
