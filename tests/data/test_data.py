"""Loaders on the real samples (values checked against the raw text with an independent pure-Python hash), the
hash itself (fixed values, every byte length, sliced and null arrays, integers as text), the criteo and movielens
presets of the table source (TSV = CSV, missing values, vocabulary, rank splits, errors), and the synthetic
generator's pooling factors and Zipf skew."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import paths
import pyarrow as pa
import pytest
import torch

from embshard.config.data import CriteoConfig, DataConfig, MovieLensConfig, SyntheticConfig
from embshard.data import build_source
from embshard.data.hashing import hash_strings, hash_values
from embshard.data.synthetic import SyntheticSource, zipf_ranks
from embshard.spec.tables import ConfigError, TableConfig

DATA = paths.DATA
CRITEO = DATA / "criteo_sample.txt"
MOVIELENS = DATA / "movielens_sample.txt"
ROWS = 1000
CRITEO_TABLES = [TableConfig(f"t_C{i}", ROWS, 8, (f"C{i}",)) for i in (1, 2, 19, 26)]
M64 = (1 << 64) - 1


def fmix(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & M64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & M64
    return k ^ (k >> 33)


def ref_hash(value: str | bytes) -> int:
    """embshard-hash-v1 written out byte by byte (docs/data.md), independent of the numpy implementation."""
    s = value.encode() if isinstance(value, str) else value
    words = (len(s) + 7) // 8
    padded = s + b"\0" * (8 * words - len(s))
    total = 0
    for j in range(words):
        w = int.from_bytes(padded[8 * j : 8 * j + 8], "little")
        total = (total + fmix((w + (j + 1) * 0xC2B2AE3D27D4EB4F) & M64)) & M64
    return fmix((len(s) * 0x9E3779B97F4A7C15 + total) & M64)


def expected_row(value: str, rows: int = ROWS) -> int:
    """0 for a missing value, else 1 + hash mod (rows - 1)."""
    return 0 if not value else 1 + ref_hash(value) % (rows - 1)


def raw_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def criteo(path=CRITEO, rank=0, world=1, batch=4, tables=CRITEO_TABLES, **kw):
    cfg = DataConfig(source="criteo", criteo=CriteoConfig(path=str(path), eval_fraction=0.2, **kw), shuffle=False)
    return build_source(cfg, tables, batch, 0, rank, world)


def rows_of(batches) -> dict:
    """Concatenated labels, dense and per-feature (lengths, ids) of some batches."""
    out = {"labels": [], "dense": [], "sparse": {}}
    for b in batches:
        out["labels"].append(b.labels)
        out["dense"].append(b.dense)
        for k in b.sparse.keys():
            jt = b.sparse[k]
            out["sparse"].setdefault(k, ([], []))
            out["sparse"][k][0].append(jt.lengths())
            out["sparse"][k][1].append(jt.values())
    return {
        "labels": torch.cat(out["labels"]),
        "dense": torch.cat(out["dense"]),
        "sparse": {k: (torch.cat(a), torch.cat(b)) for k, (a, b) in out["sparse"].items()},
    }


def test_hash_is_fixed_and_matches_the_reference():
    # Fixed values: a change of the function would remap every trained row (and preprocessed files).
    assert hash_strings(["05db9164", "", "Comedy"]).tolist() == [
        3594015254338282171,
        0,
        9737968226417342519,
    ]
    rng = np.random.default_rng(0)
    values = ["", "a", "é€", "x" * 8, "y" * 9, "z" * 16, "w" * 17, "0123456789abcdef" * 5 + "!"]
    values += ["".join(chr(c) for c in rng.integers(32, 0x2FF, n)) for n in rng.integers(0, 40, 200)]
    assert hash_strings(values).tolist() == [ref_hash(v) for v in values]
    arr = pa.array(["ab", None, "abcdefgh", "q", "tail"]).slice(1, 3)  # nulls and an offset into the buffers
    assert hash_values(arr).tolist() == [ref_hash(""), ref_hash("abcdefgh"), ref_hash("q")]
    assert hash_values(pa.array([235, -1, 0])).tolist() == [ref_hash("235"), ref_hash("-1"), ref_hash("0")]
    assert hash_values(pa.array([b"\x00\xff"], pa.binary())).tolist() == [ref_hash(b"\x00\xff")]


@pytest.mark.parametrize("world", [1, 2])
def test_criteo_csv_matches_raw_text(world):
    header, raw = raw_csv(CRITEO)
    assert len(raw) == 200
    for rank in range(world):
        src = criteo(rank=rank, world=world)
        assert src.num_dense == 13 and src.steps_per_epoch == 160 // world // 4
        got = rows_of(_take(src.train_batches(), src.steps_per_epoch))  # one epoch, file order
        first = rank * (160 // world)  # contiguous: rank r reads the r-th block of the training rows
        for j in (0, 1, 2, 57 % (160 // world), 160 // world - 1):
            line = raw[first + j]
            assert got["labels"][j] == float(line[0])
            for k in range(13):
                text = line[header.index(f"I{k + 1}")]
                want = math.log1p(max(float(text), 0.0)) if text else 0.0
                assert got["dense"][j, k].item() == pytest.approx(want, rel=1e-6)
            for f, (lengths, ids) in got["sparse"].items():
                assert lengths[j] == 1
                assert ids[j] == expected_row(line[header.index(f)])
        held = rows_of(src.eval_batches())
        assert len(held["labels"]) == 40 // world
        line = raw[160 + rank * (40 // world)]  # held-out rows are the file's last 40
        assert held["sparse"]["C1"][1][0] == expected_row(line[header.index("C1")])


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_criteo_missing_and_negative_values():
    _, raw = raw_csv(CRITEO)
    got = rows_of(_take(criteo().train_batches(), 40))
    assert raw[0][1] == "" and got["dense"][0, 0] == 0.0  # missing I1 -> 0
    assert raw[1][2] == "-1" and got["dense"][1, 1] == 0.0  # negative I2 raised to 0 -> log(1 + 0)
    assert raw[0][14 + 18] == "" and got["sparse"]["C19"][1][0] == 0  # missing C19 -> row 0
    assert (got["sparse"]["C26"][1] == 0).float().mean() > 0.3  # C26 is mostly empty in the sample


def test_criteo_tsv_equals_csv(tmp_path):
    _, raw = raw_csv(CRITEO)
    tsv = tmp_path / "day_0"
    tsv.write_text("".join("\t".join(r) + "\n" for r in raw))  # the original format: no header, tabs
    a, b = criteo(), criteo(path=tsv)
    x, y = rows_of(_take(a.train_batches(), 40)), rows_of(_take(b.train_batches(), 40))
    assert torch.equal(x["dense"], y["dense"]) and torch.equal(x["labels"], y["labels"])
    for f in x["sparse"]:
        assert torch.equal(x["sparse"][f][1], y["sparse"][f][1])


def test_criteo_vocab():
    header, raw = raw_csv(CRITEO)
    src = criteo(categorical="vocab")
    col = header.index("C1")
    train_values = [r[col] for r in raw[:160] if r[col]]
    counts = {v: train_values.count(v) for v in set(train_values)}
    ranked = sorted(counts, key=lambda v: (-counts[v], v))
    got = rows_of(_take(src.train_batches(), 40))["sparse"]["C1"][1].tolist()
    want = [0 if not r[col] else 2 + ranked.index(r[col]) for r in raw[:160]]
    assert got == want  # most frequent first, ties by value; row 0 missing
    held = rows_of(src.eval_batches())["sparse"]["C1"][1].tolist()
    for r, row in zip(raw[160:], held):
        assert row == (0 if not r[col] else (2 + ranked.index(r[col]) if r[col] in counts else 1))
    assert 1 in held  # the sample has held-out values unseen in training: out of vocabulary


def test_criteo_batches_and_errors():
    src = criteo()
    batch = next(src.train_batches())
    assert batch.dense.shape == (4, 13) and batch.labels.shape == (4,)
    kjt = batch.sparse
    assert kjt.keys() == ["C1", "C2", "C19", "C26"] and kjt.values().dtype == torch.int64
    assert kjt.lengths().dtype == torch.int32 and kjt.stride() == 4
    assert len(list(src.eval_batches())) == 10
    with pytest.raises(ConfigError, match=r"features \['C99'\] are not Criteo columns"):
        criteo(tables=[TableConfig("t", 10, 4, ("C99",))])
    with pytest.raises(ConfigError, match="fewer than schedule.batch_size=500"):
        criteo(batch=500)
    with pytest.raises(ConfigError, match="does not exist"):
        criteo(path="no/such/file.txt")
    with pytest.raises(ConfigError, match="matches no file"):
        criteo(path="no/such/day_*")


@pytest.mark.parametrize("world", [2, 3])
def test_rank_split_is_contiguous_disjoint_and_even(world):
    _, raw = raw_csv(CRITEO)
    per_rank = 160 // world
    seen = []
    for rank in range(world):
        src = criteo(rank=rank, world=world)
        ids = rows_of(_take(src.train_batches(), per_rank // 4))["sparse"]["C2"][1].tolist()
        seen.append(ids)
        assert ids == [expected_row(r[15]) for r in raw[rank * per_rank : rank * per_rank + len(ids)]]
    assert sum(len(s) for s in seen) == world * (per_rank // 4) * 4


ML_TABLES = [
    TableConfig("t_user", 500, 8, ("user_id",)),
    TableConfig("t_zip", 100, 4, ("zip",)),
    TableConfig("t_genre", 40, 8, ("genres",), pooling="mean"),
    TableConfig("t_movie", 500, 8, ("movie_id",)),
]


def movielens(rank=0, world=1, **kw):
    cfg = DataConfig(source="movielens", movielens=MovieLensConfig(path=str(MOVIELENS), **kw), shuffle=False)
    return build_source(cfg, ML_TABLES, 4, 0, rank, world)


def test_movielens_matches_raw_text():
    header, raw = raw_csv(MOVIELENS)
    src = movielens()
    assert src.steps_per_epoch == 45 and src.num_dense == 0
    got = rows_of(_take(src.train_batches(), 45))
    lengths, ids = got["sparse"]["genres"]
    want_lengths = [len(r[header.index("genres")].split("|")) for r in raw[:180]]
    assert lengths.tolist() == want_lengths and max(want_lengths) >= 3
    offsets = np.concatenate([[0], np.cumsum(want_lengths)])
    assert "," in raw[2][header.index("title")]  # a quoted title with a comma: the columns after it must still align
    for j in (0, 2, 101):
        row = raw[j]
        want = [expected_row(g, 40) for g in row[header.index("genres")].split("|")]
        assert ids[offsets[j] : offsets[j + 1]].tolist() == want
        assert got["sparse"]["zip"][1][j] == expected_row(row[header.index("zip")], 100)
        assert got["labels"][j] == float(int(row[header.index("rating")]) >= 4)
    with pytest.raises(ConfigError, match=r"features \['rating'\] are not MovieLens feature columns"):
        build_source(
            DataConfig(source="movielens", movielens=MovieLensConfig(path=str(MOVIELENS))),
            [TableConfig("t", 10, 4, ("rating",))],
            8,
            0,
            0,
            1,
        )


def test_movielens_positive_rating_and_ranks():
    _, raw = raw_csv(MOVIELENS)
    src = movielens(rank=1, world=2, positive_rating=3, eval_fraction=0.2)
    got = rows_of(_take(src.train_batches(), 20))
    assert got["labels"].tolist() == [float(int(r[2]) >= 3) for r in raw[80:160]]
    assert sum(b.size for b in src.eval_batches()) == 20


SYN_TABLES = [
    TableConfig("big", 100_000, 8, ("a",), ids_per_bag=3),
    TableConfig("small", 50, 8, ("b", "c"), ids_per_bag=0.5, weighted=True),
]


def test_synthetic_pooling_skew_and_determinism():
    cfg = SyntheticConfig(num_dense=5, pooling={"c": 6.0}, zipf_exponent=1.2, scramble=False)
    src = SyntheticSource(cfg, SYN_TABLES, 4096, seed=3, rank=0)
    batch = src.batch(0)
    kjt = batch.sparse
    assert batch.dense.shape == (4096, 5) and set(batch.labels.unique().tolist()) == {0.0, 1.0}
    assert kjt["a"].lengths().float().mean() == pytest.approx(3.0, rel=0.05)
    assert kjt["b"].lengths().float().mean() == pytest.approx(0.5, rel=0.1)
    assert kjt["c"].lengths().float().mean() == pytest.approx(6.0, rel=0.05)
    assert kjt.weights() is not None and (kjt["a"].weights() == 1).all() and kjt["b"].weights().min() >= 0.5
    ids = kjt["a"].values()
    assert ids.max() < 100_000 and ids.min() >= 0
    top = (ids == 0).float().mean().item()  # Zipf(1.2): the top row alone is a sizeable share
    assert 0.1 < top < 0.4
    again = src.batch(0).sparse
    assert torch.equal(again.values(), kjt.values())
    other = SyntheticSource(cfg, SYN_TABLES, 4096, seed=3, rank=1).batch(0).sparse
    assert not torch.equal(other["a"].values()[:100], kjt["a"].values()[:100])


def test_zipf_shapes():
    rng = np.random.default_rng(0)
    uniform = zipf_ranks(rng, 200_000, 10, 0.0)
    assert np.bincount(uniform, minlength=10).min() > 18_000
    skewed = np.bincount(zipf_ranks(rng, 200_000, 1000, 1.0), minlength=1000)
    assert skewed[0] > 5 * skewed[9] > 0  # ~ 1/k
    scrambled = SyntheticSource(SyntheticConfig(zipf_exponent=1.0), SYN_TABLES, 2048, 0, 0).batch(1).sparse
    values = scrambled["a"].values()
    assert values.max() < 100_000 and len(values.unique()) > 100


def test_synthetic_workers_fixed_bags_and_host_counts():
    """Worker processes give the batches of an in-process source, in step order, from any start; fixed bags hold
    round(p) ids; every id is inside its table (the source declares ids_in_range)."""
    cfg = SyntheticConfig(num_dense=3, zipf_exponent=0.0, bag_lengths="fixed", pooling={"a": 3.0, "b": 1.0, "c": 2.0})
    local = SyntheticSource(cfg, SYN_TABLES, 64, seed=1, rank=0).train_batches(5)
    workers = SyntheticSource(cfg, SYN_TABLES, 64, seed=1, rank=0, workers=2).train_batches(5)
    for _ in range(5):
        a, b = next(local), next(workers)
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.sparse.values(), b.sparse.values()) and torch.equal(a.sparse.lengths(), b.sparse.lengths())
        assert torch.equal(a.sparse.weights(), b.sparse.weights())
    kjt = a.sparse
    assert (kjt["a"].lengths() == 3).all() and (kjt["b"].lengths() == 1).all() and (kjt["c"].lengths() == 2).all()
    assert SyntheticSource.ids_in_range and kjt["a"].values().max() < 100_000 and kjt["c"].values().max() < 50
    with pytest.raises(ConfigError, match="fixed bags hold round"):
        SyntheticSource(SyntheticConfig(bag_lengths="fixed"), SYN_TABLES, 8, 0, 0)  # table small: 0.5 ids per bag


def test_synthetic_workers_reuse_their_slots_without_touching_held_batches():
    """Workers write batches into reused shared-memory slots (data/slots.py): batches dropped at once free their
    slot for a later batch, and batches the caller keeps (more than the slots) stay as they were drawn."""
    cfg = SyntheticConfig(num_dense=3, zipf_exponent=1.05, bag_lengths="poisson", pooling={"a": 3.0, "b": 1.0})
    local = SyntheticSource(cfg, SYN_TABLES, 32, seed=2, rank=1).train_batches(0)
    expected = [next(local) for _ in range(40)]
    workers = SyntheticSource(cfg, SYN_TABLES, 32, seed=2, rank=1, workers=2, prefetch=2).train_batches(0)
    held = [next(workers) for _ in range(20)]  # 20 held batches: more than the 2 x 6 slots
    for i in range(20, 40):  # each dropped before the next
        b = next(workers)
        assert torch.equal(b.sparse.values(), expected[i].sparse.values()), i
        assert torch.equal(b.dense, expected[i].dense), i
        del b
    for i, b in enumerate(held):
        assert torch.equal(b.sparse.values(), expected[i].sparse.values()), i
        assert torch.equal(b.sparse.lengths(), expected[i].sparse.lengths()), i
        assert torch.equal(b.dense, expected[i].dense) and torch.equal(b.labels, expected[i].labels), i
