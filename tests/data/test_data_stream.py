"""Streaming: every row of a shuffled batch keeps its own values (jagged gathers across windows, carries and
epochs), bounded memory on a file much larger than the shuffle window, exact resume from a batch's position (in
this process and with worker processes, from a step count, refused when the settings changed), worker processes
deliver the same round robin as this process, and the shards of ranks and workers are disjoint and complete."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import paths
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dist_harness import run_scripts

from embshard.config.data import CategoricalColumnConfig, DataConfig, DenseColumnConfig, TableSourceConfig
from embshard.data.source import TableSource, _Train
from embshard.data.stream import train_stream
from embshard.spec.tables import ConfigError, TableConfig

ROOT = paths.ROOT


def tags_of(rowid: int) -> list[int]:
    """A row's bag of ids, a function of its row id: 0 to 3 ids."""
    return [(rowid * 7 + j) % 50 for j in range(rowid % 4)]


def write_rows(path: Path, n: int, group_sizes: list[int] | None = None) -> None:
    rowid = np.arange(n)
    tags = [tags_of(int(i)) for i in rowid]
    table = pa.table(
        {
            "y": (rowid % 3 == 0).astype(np.float32),
            "x": rowid.astype(np.float64) / n,
            "rowid": rowid,
            "tags": pa.array(tags, pa.list_(pa.int64())),
        }
    )
    with pq.ParquetWriter(path, table.schema) as w:
        at = 0
        for size in group_sizes or [n]:
            w.write_table(table.slice(at, size))
            at += size


def source(path: Path, n: int, batch: int = 16, rank: int = 0, world: int = 1, **data) -> TableSource:
    cfg = TableSourceConfig(
        files=(str(path),),
        label="y",
        dense=(DenseColumnConfig("x"),),
        categorical=(CategoricalColumnConfig("rowid"), CategoricalColumnConfig("tags")),
        mapping="identity",
        eval_fraction=data.pop("eval_fraction", 0.1),
    )
    tables = [TableConfig("t_row", n, 4, ("rowid",)), TableConfig("t_tag", 50, 4, ("tags",))]
    return TableSource(cfg, DataConfig(source="table", table=cfg, **data), tables, batch, 0, rank, world)


def check_rows(batch) -> list[int]:
    """The batch's row ids, after checking that every row's label, dense value and bag belong to it."""
    rowid = batch.sparse["rowid"].values()
    assert batch.sparse["rowid"].lengths().eq(1).all()
    ids = rowid.tolist()
    assert batch.labels.tolist() == [float(i % 3 == 0) for i in ids]
    tags = batch.sparse["tags"]
    assert tags.lengths().tolist() == [len(tags_of(i)) for i in ids]
    assert tags.values().tolist() == [t for i in ids for t in tags_of(i)]
    return ids


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("stream") / "rows.parquet"
    sizes = [int(s) for s in np.random.default_rng(0).integers(20, 90, 30)]
    write_rows(path, sum(sizes), sizes)
    return path, sum(sizes)


@pytest.mark.parametrize("workers", [0, 2])
def test_shuffled_rows_stay_whole_and_resume_exactly(rows_file, workers):
    path, n = rows_file
    src = source(path, n, batch=50, workers=workers, shuffle_rows=300)
    got = list(itertools.islice(src.train_batches(), 70))  # several epochs of each stream
    seen = [check_rows(b) for b in got]
    assert len({i for s in seen[:10] for i in s}) == 500  # no row twice within the first batches
    assert sorted(seen[0]) != seen[0]  # shuffled
    k = 37
    again = list(itertools.islice(src.train_batches(got[k - 1].position), 70 - k))
    for a, b in zip(again, got[k:]):
        assert torch.equal(a.sparse.values(), b.sparse.values()) and torch.equal(a.dense, b.dense)
    assert src.position_at(k) == got[k - 1].position  # the cursor from row counts alone
    from_step = next(src.train_batches(k))
    assert torch.equal(from_step.sparse.values(), got[k].sparse.values())
    other = source(path, n, batch=50, workers=workers + 3, shuffle_rows=300)
    with pytest.raises(ConfigError, match=r"does not fit this run \(streams: saved \d, now \d\)"):
        next(other.train_batches(got[k - 1].position))


@pytest.mark.parametrize("slots", [False, True], ids=["fresh-blocks", "reused-slots"])
def test_worker_processes_give_the_in_process_round_robin(rows_file, slots):
    """Batches from workers (fresh shared memory per batch on CPU; reused slots, as with CUDA, where the pin copy
    is a plain copy here) equal the same streams read in this process."""
    path, n = rows_file
    src = source(path, n, batch=40, workers=3, shuffle_rows=200, prefetch=2)
    src.pin = slots  # on a CPU machine the DataLoader does not pin: SlotBatch.take copies
    assert src.train_plan.streams == 3
    with_workers = list(itertools.islice(src.train_batches(5), 30))  # 10 batches a worker: each slot reused
    here = list(
        itertools.islice(iter(_Train(src.train_plan, 5, [tuple(c) for c in src.position_at(5)["streams"]])), 30)
    )
    for a, b in zip(with_workers, here):
        assert a.sparse.values().tolist() == b["values"].tolist()
        assert a.labels.tolist() == b["labels"].tolist()
    held_workers = [check_rows(b) for b in src.eval_batches()]
    held_here = [check_rows(b) for b in source(path, n, batch=40, workers=0).eval_batches()]
    assert sorted(i for b in held_workers for i in b) == [i for b in held_here for i in b]


@pytest.mark.parametrize("world,workers", [(3, 2), (2, 4)])
def test_shards_of_ranks_and_workers_are_disjoint_and_complete(rows_file, world, workers):
    path, n = rows_file
    n_eval = round(n * 0.1)
    q = (n - n_eval) // world
    train_rows, held_rows = [], []
    for rank in range(world):
        src = source(path, n, batch=1, rank=rank, world=world, workers=workers, shuffle_rows=100)
        plan = src.train_plan
        assert plan.streams == workers
        for j in range(plan.streams):  # one epoch of each stream, batch size 1: its rows exactly
            rows = sum(p.rows for w in plan.windows(j, 0) for p in w)
            batches = itertools.islice(train_stream(plan, j, (0, 0, 0)), rows)
            train_rows += [int(b["values"][0]) for b in batches]
        held_rows += [int(i) for b in src.eval_batches() for i in b.sparse["rowid"].values()]
    assert sorted(train_rows) == list(range(world * q))
    e0 = n - n_eval
    assert sorted(held_rows) == list(range(e0, e0 + world * (n_eval // world)))


_PEAK_SCRIPT = """
import sys, tracemalloc, itertools, importlib.metadata as md
sys.path[:0] = {path!r}
import pyarrow as pa
from pathlib import Path
from test_data_stream import source
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # imported first: its modules are not data
src = source(Path({file!r}), {n}, batch=512, shuffle_rows=4000)
batches = src.train_batches()
rows, peak, holders = next(batches).size, 0, []  # the modules the first batch imports lazily are not data
tracemalloc.start(3)  # the 3 newest frames: what HOLDERS prints (deeper tracebacks cost every allocation)
for b in itertools.islice(batches, 2 * {n} // 512 - 1):  # two epochs
    rows += b.size
    now = tracemalloc.get_traced_memory()[1]
    if now > peak:  # what is held when the peak rose (a transient peak shows as little held)
        peak = now
        top = tracemalloc.take_snapshot().statistics("traceback")[:3]
        holders = [f"{{s.size / 1e6:.1f}} MB at " + " < ".join(f"{{f.filename.split('/')[-1]}}:{{f.lineno}}"
                   for f in s.traceback[-3:]) for s in top]
print("VERSIONS", "numpy", md.version("numpy"), "pyarrow", pa.__version__)
print("HOLDERS", " | ".join(holders))
print("RESULT", peak, pa.default_memory_pool().max_memory(), rows)
"""


def _stream_peaks(paths_rows: list[tuple[Path, int]], tmp: Path) -> list[tuple[int, int, str]]:
    """Stream each file (path, n rows) for two epochs in a process of its own, all at once (a fork of the test
    harness's server where there is no CUDA: dist_harness.run_scripts): (numpy peak + Arrow pool peak, rows,
    diagnostics) each."""
    runs = []
    for i, (path, n) in enumerate(paths_rows):
        script = tmp / f"peak_{i}.py"
        script.write_text(
            _PEAK_SCRIPT.format(
                path=[str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "data")], file=str(path), n=n
            )
        )
        runs.append((str(script), [], paths.cpu_subprocess_env()))  # host memory, without the CUDA path's pinned slots
    out = []
    for res in run_scripts(runs, str(ROOT), timeout=300):
        assert res.returncode == 0, res.stderr[-3000:]
        numpy_peak, arrow_peak, rows = map(int, res.stdout.split("RESULT")[1].split())
        diag = " ".join(line for line in res.stdout.splitlines() if line.startswith(("VERSIONS", "HOLDERS")))
        out.append(
            (numpy_peak + arrow_peak, rows, f"numpy {numpy_peak / 1e6:.1f} MB, Arrow {arrow_peak / 1e6:.1f} MB; {diag}")
        )
    return out


def _write_tagged(path: Path, n: int, rng: np.random.Generator) -> int:
    offsets = np.concatenate([[0], np.cumsum(rng.integers(40, 80, n))])
    tags = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 50, offsets[-1])))
    table = pa.table({"y": np.zeros(n, np.float32), "x": rng.random(n), "rowid": np.arange(n), "tags": tags})
    pq.write_table(table, path, row_group_size=2_000)
    return table.nbytes


def test_memory_is_bounded_by_the_window(tmp_path):
    """Files of ~30 and ~90 MB decoded, streamed with a window of 4000 rows in processes of their own: the peak of Arrow's
    pool plus Python's allocations (numpy's; counted from the second batch, after the imports the first makes) does
    not grow with the file (a window's worth of slack) and stays far below it."""
    rng = np.random.default_rng(1)
    small, big = 60_000, 180_000
    _write_tagged(tmp_path / "small.parquet", small, rng)
    big_bytes = _write_tagged(tmp_path / "big.parquet", big, rng)
    assert big_bytes > 80e6
    (peak_small, rows_small, diag_small), (peak_big, rows_big, diag_big) = _stream_peaks(
        [(tmp_path / "small.parquet", small), (tmp_path / "big.parquet", big)], tmp_path
    )
    assert (rows_small, rows_big) == (2 * small // 512 * 512, 2 * big // 512 * 512)
    window_bytes = big_bytes / big * 6_000  # a window: at least 4000 rows, whole row groups of 2000
    growth = peak_big - peak_small
    assert growth < window_bytes, f"peak grew {growth / 1e6:.1f} MB with the file: {diag_small} -> {diag_big}"
    assert peak_big < big_bytes / 4, f"peak {peak_big / 1e6:.1f} MB of a {big_bytes / 1e6:.0f} MB file: {diag_big}"


def test_a_batch_spanning_several_windows_keeps_its_one_hot_rows(tmp_path):
    """Windows much smaller than a batch: the rows carried from one window are carried again by the next (a carry
    whose one-hot features are stacked into one matrix), and every row still keeps its own ids."""
    n = 900
    rowid = np.arange(n)
    table = pa.table({"y": (rowid % 3 == 0).astype(np.float32), "x": rowid / n, "a": rowid, "b": rowid * 3 + 1})
    pq.write_table(table, tmp_path / "onehot.parquet", row_group_size=40)
    cfg = TableSourceConfig(
        files=(str(tmp_path / "onehot.parquet"),),
        label="y",
        dense=(DenseColumnConfig("x"),),
        categorical=(CategoricalColumnConfig("a"), CategoricalColumnConfig("b")),
        mapping="identity",
        eval_fraction=0.1,
    )
    tables = [TableConfig("t_a", n, 4, ("a",)), TableConfig("t_b", 3 * n + 1, 4, ("b",))]
    src = TableSource(cfg, DataConfig(source="table", table=cfg, shuffle_rows=50), tables, 256, 0, 0, 1)
    seen = []
    for batch in itertools.islice(src.train_batches(), 6):
        a, b = batch.sparse["a"].values(), batch.sparse["b"].values()
        assert torch.equal(b, a * 3 + 1), "a row's one-hot ids were mixed with another row's"
        assert batch.labels.tolist() == [float(i % 3 == 0) for i in a.tolist()]
        seen += a.tolist()
    assert len(set(seen[:700])) == 700  # the first epoch's rows, each once
