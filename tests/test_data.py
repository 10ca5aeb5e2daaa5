"""Loaders on the real samples (values checked against the raw text), stable hashing, missing values, rank splits,
jagged genres, and the synthetic generator's pooling factors and Zipf skew."""

from __future__ import annotations

import csv
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from embshard.config.data import CriteoConfig, MovieLensConfig, SyntheticConfig
from embshard.data.common import rank_positions, stable_hash
from embshard.data.criteo import criteo_source
from embshard.data.movielens import movielens_source
from embshard.data.synthetic import SyntheticSource, zipf_ranks
from embshard.tables import ConfigError, TableConfig

DATA = Path(__file__).resolve().parent.parent / "data"
CRITEO = DATA / "criteo_sample.txt"
MOVIELENS = DATA / "movielens_sample.txt"
ROWS = 1000
CRITEO_TABLES = [TableConfig(f"t_C{i}", ROWS, 8, (f"C{i}",)) for i in (1, 2, 19, 26)]


def raw_csv(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def expected_row(value: str, rows: int = ROWS) -> int:
    """The hash mapping, computed independently: 0 for missing, else 1 + blake2b-64 mod (rows - 1)."""
    if not value:
        return 0
    return 1 + int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little") % (rows - 1)


def criteo(path=CRITEO, rank=0, world=1, shard="strided", **kw):
    cfg = CriteoConfig(path=str(path), eval_fraction=0.2, **kw)
    return criteo_source(cfg, CRITEO_TABLES, 4, shard, False, 0, rank, world)


def test_stable_hash_is_fixed():
    # Fixed values: a change of hash function (or Python's salted hash()) would remap every trained row.
    assert stable_hash(["05db9164", "", "Comedy"]).tolist() == [
        4582638078171527438,
        13020603013274838756,
        8315559345618375674,
    ]


@pytest.mark.parametrize("world", [1, 2])
def test_criteo_csv_matches_raw_text(world):
    header, raw = raw_csv(CRITEO)
    assert len(raw) == 200
    for rank in range(world):
        src = criteo(rank=rank, world=world)
        assert len(src.train) == 160 // world and len(src.held_out) == 40 // world
        assert src.num_dense == 13
        for j in (0, 1, 2, 57, len(src.train) - 1):
            line = raw[rank + world * j]  # strided: rank r reads rows r, r + W, ...
            assert src.train.labels[j] == float(line[0])
            for k in range(13):
                text = line[header.index(f"I{k + 1}")]
                want = math.log1p(max(float(text), 0.0)) if text else 0.0
                assert src.train.dense[j, k] == pytest.approx(want, rel=1e-6)
            for f, col in src.train.sparse.items():
                assert col.lengths[j] == 1
                assert col.values[j] == expected_row(line[header.index(f)])
        line = raw[160 + rank]  # held-out rows are the file's last 40
        assert src.held_out.sparse["C1"].values[0] == expected_row(line[header.index("C1")])


def test_criteo_missing_and_negative_values():
    src = criteo()
    _, raw = raw_csv(CRITEO)
    assert raw[0][1] == "" and src.train.dense[0, 0] == 0.0  # missing I1 -> 0
    assert raw[1][2] == "-1" and src.train.dense[1, 1] == 0.0  # negative I2 clamped -> log(1 + 0)
    assert raw[0][14 + 18] == "" and src.train.sparse["C19"].values[0] == 0  # missing C19 -> row 0
    assert (src.train.sparse["C26"].values == 0).mean() > 0.3  # C26 is mostly empty in the sample


def test_criteo_tsv_equals_csv(tmp_path):
    _, raw = raw_csv(CRITEO)
    tsv = tmp_path / "day_0"
    tsv.write_text("".join("\t".join(r) + "\n" for r in raw))  # the original format: no header, tabs
    a, b = criteo(), criteo(path=tsv)
    np.testing.assert_array_equal(a.train.dense, b.train.dense)
    np.testing.assert_array_equal(a.train.labels, b.train.labels)
    for f in a.train.sparse:
        np.testing.assert_array_equal(a.train.sparse[f].values, b.train.sparse[f].values)


def test_criteo_malformed_line(tmp_path):
    _, raw = raw_csv(CRITEO)
    bad = tmp_path / "bad.tsv"
    lines = ["\t".join(r) for r in raw]
    lines[6] = "\t".join(raw[6][:30])
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"bad.tsv:7: 30 tsv fields, expected 40"):
        criteo(path=bad)


def test_criteo_vocab():
    header, raw = raw_csv(CRITEO)
    src = criteo(categorical="vocab")
    col = header.index("C1")
    train_values = [r[col] for r in raw[:160] if r[col]]
    counts = {v: train_values.count(v) for v in set(train_values)}
    top = max(sorted(counts), key=lambda v: counts[v])
    rows = src.train.sparse["C1"].values
    first = [r[col] for r in raw[:160]]
    assert rows[first.index(top)] == 2  # the most frequent training value gets the first vocabulary row
    for v, r in zip(first, rows):
        assert (r == 0) == (v == "")
    unseen = [i for i, r in enumerate(raw[160:]) if r[col] and r[col] not in counts]
    assert unseen, "the sample has held-out values unseen in training"
    assert src.held_out.sparse["C1"].values[unseen[0]] == 1  # out of vocabulary


def test_criteo_batches_and_errors():
    src = criteo()
    batch = next(src.train_batches())
    assert batch.dense.shape == (4, 13) and batch.labels.shape == (4,)
    kjt = batch.sparse
    assert kjt.keys() == ["C1", "C2", "C19", "C26"]
    np.testing.assert_array_equal(kjt["C2"].values().numpy(), src.train.sparse["C2"].values[:4])
    assert len(list(src.eval_batches())) == 10
    with pytest.raises(ConfigError, match=r"features \['C99'\] are not Criteo columns"):
        criteo_source(CriteoConfig(path=str(CRITEO)), [TableConfig("t", 10, 4, ("C99",))], 4, "strided", False, 0, 0, 1)
    with pytest.raises(ConfigError, match="fewer than schedule.batch_size=500"):
        criteo_source(CriteoConfig(path=str(CRITEO)), CRITEO_TABLES, 500, "strided", False, 0, 0, 1)
    with pytest.raises(ConfigError, match="does not exist"):
        criteo(path="no/such/file.txt")


@pytest.mark.parametrize("mode", ["strided", "contiguous"])
def test_rank_split_is_disjoint_and_even(mode):
    parts = [set(rank_positions(103, r, 4, mode).tolist()) for r in range(4)]
    assert all(len(p) == 25 for p in parts)
    assert len(set.union(*parts)) == 100 and max(set.union(*parts)) < 103
    _, raw = raw_csv(CRITEO)
    src = criteo(rank=1, world=2, shard=mode)
    first = 1 if mode == "strided" else 80
    assert src.train.sparse["C2"].values[0] == expected_row(raw[first][15])


ML_TABLES = [
    TableConfig("t_user", 500, 8, ("user_id",)),
    TableConfig("t_zip", 100, 4, ("zip",)),
    TableConfig("t_genre", 40, 8, ("genres",), pooling="mean"),
    TableConfig("t_movie", 500, 8, ("movie_id",)),
]


def test_movielens_matches_raw_text():
    header, raw = raw_csv(MOVIELENS)
    src = movielens_source(MovieLensConfig(path=str(MOVIELENS)), ML_TABLES, 8, "strided", False, 0, 0, 1)
    assert len(src.train) == 180 and len(src.held_out) == 20 and src.num_dense == 0
    genres = src.train.sparse["genres"]
    want_lengths = [len(r[header.index("genres")].split("|")) for r in raw[:180]]
    assert genres.lengths.tolist() == want_lengths
    assert max(want_lengths) >= 3
    offsets = genres.offsets()
    assert "," in raw[2][header.index("title")]  # a quoted title with a comma: the columns after it must still align
    for j in (0, 2, 101):
        row = raw[j]
        want = [expected_row(g, 40) for g in row[header.index("genres")].split("|")]
        assert genres.values[offsets[j] : offsets[j + 1]].tolist() == want
        assert src.train.sparse["zip"].values[j] == expected_row(row[header.index("zip")], 100)
        assert src.train.labels[j] == float(int(row[header.index("rating")]) >= 4)
    batch = src.train.take(np.array([2, 0]))
    kjt = batch.sparse
    assert kjt["genres"].lengths().tolist() == [want_lengths[2], want_lengths[0]]
    assert kjt["genres"].values().tolist() == (
        genres.values[offsets[2] : offsets[3]].tolist() + genres.values[offsets[0] : offsets[1]].tolist()
    )
    with pytest.raises(ConfigError, match=r"features \['rating'\] are not columns"):
        movielens_source(
            MovieLensConfig(path=str(MOVIELENS)), [TableConfig("t", 10, 4, ("rating",))], 8, "strided", False, 0, 0, 1
        )


def test_movielens_positive_rating_and_ranks():
    _, raw = raw_csv(MOVIELENS)
    cfg = MovieLensConfig(path=str(MOVIELENS), positive_rating=3, eval_fraction=0.2)
    a = movielens_source(cfg, ML_TABLES, 8, "contiguous", False, 0, 1, 2)
    assert len(a.train) == 80 and len(a.held_out) == 20
    assert a.train.labels.tolist() == [float(int(r[2]) >= 3) for r in raw[80:160]]


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
