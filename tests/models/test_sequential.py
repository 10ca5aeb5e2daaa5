"""The sequential recommender (model kind hstu, embshard/models/sequential.py) and its data (data/sequences.py):
causal attention that padding does not reach, the synthetic chain's planted structure and world-size-independent
batches, CSV histories ordered by time with the last item held out, config errors, and `embshard train` of
configs/sequential_synthetic.yaml on 2 processes equal to 1 process on the same global batches (training losses,
held-out loss and metrics)."""

from __future__ import annotations

import re

import numpy as np
import paths
import pytest
import torch
from dist_harness import device_kind
from train_job import embshard_train

from embshard.config.data import SequencesConfig
from embshard.data.sequences import SequenceSource
from embshard.models.hstu_attention import host_positions
from embshard.models.sequential import HSTUDense
from embshard.spec.tables import ConfigError, TableConfig

# Under EMBSHARD_TEST_DEVICE=cuda the model runs on a GPU, and the training runs on 1 and 2 GPUs (NCCL).
CUDA = device_kind() == "cuda" and torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

TABLES = [
    TableConfig(name="t_item", num_embeddings=300, embedding_dim=16, feature_names=("item",)),
    TableConfig(name="t_user", num_embeddings=50, embedding_dim=4, feature_names=("user",)),
]


def test_hstu_is_causal_and_padding_does_not_leak():
    torch.manual_seed(0)
    model = HSTUDense(width=8, context_width=3, layers=2, heads=2, max_length=6).to(DEVICE).eval()
    lengths = torch.tensor([4, 1, 0, 7], device=DEVICE)
    items = torch.randn(int(lengths.sum()), 8, device=DEVICE)
    context = torch.randn(4, 3, device=DEVICE)
    out = model(items, lengths, context)
    assert out.shape == (12, 8)
    starts = [0, 4, 5, 5]
    for b, n in enumerate(lengths.tolist()):  # each user alone: the same queries as inside the padded batch
        alone = model(items[starts[b] : starts[b] + n], lengths[b : b + 1], context[b : b + 1])
        torch.testing.assert_close(alone, out[starts[b] : starts[b] + n], rtol=1e-5, atol=1e-5)
    changed = items.clone()
    changed[5 + 4] = torch.randn(8, device=DEVICE)  # the 5th item of the last user: its first 4 positions do not see it
    out2 = model(changed, lengths, context)
    torch.testing.assert_close(out2[5:9], out[5:9])
    assert not torch.allclose(out2[9:], out[9:])
    user, pos = host_positions(lengths.cpu(), DEVICE)
    assert user.tolist() == [0, 0, 0, 0, 1, 3, 3, 3, 3, 3, 3, 3] and pos.tolist() == [0, 1, 2, 3, 0, *range(7)]
    with pytest.raises(ValueError, match="longer than sequential.max_length"):
        model(torch.randn(8, 8, device=DEVICE), torch.tensor([8], device=DEVICE), context[:1])
    model.train()
    model(items, lengths, context).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def _source(rank=0, world=1, batch=16, **kw):
    cfg = SequencesConfig(item_feature="item", max_length=10, min_length=4, **kw)
    return SequenceSource(cfg, TABLES, batch, seed=3, rank=rank, world_size=world)


def test_synthetic_chain_has_planted_structure_and_is_world_invariant():
    one = _source(batch=16)
    b = next(one.train_batches(5))
    halves = [next(_source(rank=r, world=2, batch=8).train_batches(5)) for r in range(2)]
    items = b.sparse["item"]
    assert torch.equal(items.values(), torch.cat([h.sparse["item"].values() for h in halves]))
    assert torch.equal(items.lengths(), torch.cat([h.sparse["item"].lengths() for h in halves]))
    assert list(b.sparse.keys()) == ["item", "user"] and b.size == 16 and b.dense.shape == (16, 0)
    assert 4 <= int(items.lengths().min()) and int(items.lengths().max()) <= 11
    # transitions: ~strength of them land in the current item's successor set
    seqs = one.synthetic_sequences(7, np.arange(3000))
    prev, nxt = np.concatenate([s[:-1] for s in seqs]), np.concatenate([s[1:] for s in seqs])
    follows = (one.successors[prev] == nxt[:, None]).any(1)
    assert 0.88 < follows.mean() < 0.95  # 0.9 planted, plus jumps that land in the set by chance
    first = np.bincount([s[0] for s in seqs], minlength=300)
    assert first.max() > 20 * np.median(first[first > 0])  # Zipf-popular first items
    assert torch.equal(b.times, torch.cat([h.times for h in halves])) and b.times.shape == items.values().shape
    # times: each user's gaps around a mean of its own; with visit_gap, a long gap starts afresh (no successor)
    timed = _source(visit_gap=3600.0)
    seqs, times = timed.synthetic_histories(7, np.arange(2000))
    assert [s.tolist() for s in seqs[:50]] != [s.tolist() for s in one.synthetic_sequences(7, np.arange(50))]
    gaps = np.concatenate([np.diff(t) for t in times])
    assert gaps.min() >= 1 and 0.3 < (gaps <= 3600).mean() < 0.7
    prev, nxt = np.concatenate([s[:-1] for s in seqs]), np.concatenate([s[1:] for s in seqs])
    follows = (timed.successors[prev] == nxt[:, None]).any(1)
    assert 0.88 < follows[gaps <= 3600].mean() < 0.95 and follows[gaps > 3600].mean() < 0.2
    ev = [next(iter(_source(rank=r, world=1).eval_batches())) for r in range(1)]
    assert not torch.equal(ev[0].sparse["item"].values()[:20], items.values()[:20])  # held-out users are others


def test_csv_histories_are_ordered_by_time_with_the_last_item_held_out(tmp_path):
    path = tmp_path / "ratings.csv"
    rows = [(1, 10, 300), (1, 11, 100), (1, 12, 200), (1, 13, 400), (2, 10, 5), (2, 14, 1), (3, 10, 9)]
    path.write_text("user_id,movie_id,rating,timestamp\n" + "".join(f"{u},{m},4,{t}\n" for u, m, t in rows))
    cfg = SequencesConfig(item_feature="item", path=str(path), max_length=2, item_column="movie_id")
    tables = [TABLES[0], TableConfig(name="t_u", num_embeddings=50, embedding_dim=4, feature_names=("user_id",))]
    src = SequenceSource(cfg, tables, 4, seed=0, rank=0, world_size=1)
    # by time: user 1 (11, 12, 10, 13), user 2 (14, 10), user 3 (10); rows: 10 (3 ratings) -> 0, the others 1..4
    train = [b for b, _ in zip(src.train_batches(0), range(src.steps_per_epoch), strict=False)]
    assert len(train) == 1 and train[0].size == 1  # user 1 only (3 or more items)
    seq = train[0].sparse["item"].values().tolist()
    assert len(seq) == 3 and seq[2] == 0  # its last max_length + 1 items before the held-out 13: 11, 12, 10
    assert train[0].times.tolist() == [100, 200, 300]  # each item's time, in the ids' order
    ev = list(src.eval_batches())
    by_len = {len(s): s for s in _sequences(ev[0])}
    assert sorted(by_len) == [2, 3]  # user 2: (14, 10); user 1: its last 3, (12, 10, 13)
    assert by_len[2][1] == 0 and by_len[3][1] == 0 and by_len[3][0] == seq[1]
    held_times = ev[0].times.split(ev[0].sparse["item"].lengths().tolist())
    assert sorted(t.tolist() for t in held_times) == [[1, 5], [200, 300, 400]]  # user 2's 2 items, user 1's last 3
    assert len({seq[0], seq[1], by_len[3][2], by_len[2][0]}) == 4 and 0 not in (seq[0], by_len[2][0])
    u = ev[0].sparse["user_id"].values()
    assert bool((u >= 1).all()) and bool((u < 50).all())
    sample = SequencesConfig(item_feature="item", path=str(paths.DATA / "movielens_sample.txt"))
    with pytest.raises(ConfigError, match="no user of its 193 has 3 or more items"):
        SequenceSource(sample, tables, 4, 0, 0, 1)
    with pytest.raises(ConfigError, match="has no column"):
        SequenceSource(SequencesConfig(item_feature="item", path=str(path), time_column="ts"), tables, 4, 0, 0, 1)


def _sequences(batch) -> list[list[int]]:
    f = batch.sparse["item"]
    v, out, i = f.values().tolist(), [], 0
    for n in f.lengths().tolist():
        out.append(v[i : i + n])
        i += n
    return out


def test_config_errors_name_the_key():
    from embshard.config import load_config

    base = paths.ROOT / "configs" / "sequential_synthetic.yaml"
    with pytest.raises(ConfigError, match="context_features"):
        load_config(base, ["model.sequential.context_features=[]"])
    with pytest.raises(ConfigError, match=r"data.sequences.max_length.*model.sequential.max_length=20"):
        load_config(base, ["data.sequences.max_length=30"])
    with pytest.raises(ConfigError, match="multiple of sequential.num_heads"):
        load_config(base, ["model.sequential.num_heads=3"])
    with pytest.raises(ConfigError, match="item_feature"):
        load_config(base, ["data.sequences.item_feature=user"])
    with pytest.raises(ConfigError, match=r"tables\[1\].pooling=.none.*context feature"):
        load_config(base, ["model.tables[1].pooling=none"])
    with pytest.raises(ConfigError, match=r"sequential_synthetic.yaml.*attention='dense'"):
        load_config(base, ["model.sequential.attention=dense"])
    with pytest.raises(ConfigError, match=r"attention_tile=0.*>= 1"):
        load_config(base, ["model.sequential.attention_tile=0"])
    with pytest.raises(ConfigError, match=r"visit_gap=-1.0.*> 0 seconds"):
        load_config(base, ["data.sequences.visit_gap=-1"])
    with pytest.raises(ConfigError, match=r"time_bias=True.*data.source 'synthetic' has no timestamps"):
        load_config(base, ["data.source=synthetic", "data.sequences=null", "model.sequential.time_bias=true"])


TINY = [
    "model.tables[0].pooling=none",  # the catalog as a sequence table (one embedding per id)
    "model.tables[0].num_embeddings=300",
    "model.tables[0].embedding_dim=16",
    "model.tables[1].num_embeddings=50",
    "model.sequential.max_length=10",
    "data.sequences.max_length=10",
    "data.sequences.min_length=4",
    "schedule.eval_every=0",
    "schedule.eval_at_start=false",
    "logging.log_every=1",
    "logging.progress_bar=false",
]


def _losses(out: str) -> tuple[list[float], dict[str, float]]:
    train = [float(x) for x in re.findall(r"train step +\d+  loss (\S+)", out)]
    last = out[out.rindex("eval  step") :]
    return train, {k: float(v) for k, v in re.findall(r"(\S+@10|loss) ([0-9.]+)", last)}


@pytest.mark.timeout(240)
def test_two_processes_train_like_one():
    """The global batch of every step is the same for 1 x 16 and 2 x 8 users (jagged attention, time bias): the
    training losses, the held-out loss
    and the metrics agree to the printed digits (every row's gradient is one process's, whatever the number of ranks).
    That HR@10 beats the popularity baseline is checked by bench/seq_train.py (longer training)."""
    config = "configs/sequential_synthetic.yaml"
    steps = ["schedule.steps=8", "data.sequences.eval_batches=1"]
    # the jagged attention in tiles of 4 positions (histories of 4..11 items) and the time bias on timed visits
    steps += ["model.sequential.attention_tile=4", "model.sequential.time_bias=true", "data.sequences.visit_gap=3600"]
    env = None
    if CUDA and torch.cuda.device_count() >= 2:  # the command line on the GPUs (else: the CPU)
        env = dict(paths.cpu_subprocess_env())
        env.pop("CUDA_VISIBLE_DEVICES")
    one = embshard_train([config, *TINY, *steps, "schedule.batch_size=16"], 1, env=env)
    two = embshard_train([config, *TINY, *steps, "schedule.batch_size=8"], 2, env=env)
    l1, m1 = _losses(one.stdout)
    l2, m2 = _losses(two.stdout)
    assert len(l1) == len(l2) == 8
    np.testing.assert_allclose(l2, l1, rtol=0, atol=1.01e-4)  # to the printed digits
    assert l1[-1] < l1[0] - 0.5
    assert set(m1) == {"loss", "hr@10", "ndcg@10", "pop_hr@10", "pop_ndcg@10"}
    for k in m1:
        assert abs(m1[k] - m2[k]) <= 1.01e-4, (k, m1, m2)


def test_movielens_config_reads_a_file_of_its_layout(tmp_path):
    from embshard.config import load_config
    from embshard.data import build_source

    path = tmp_path / "ratings.csv"
    lines = [f"{u},{(u * 7 + t * 13) % 50},4,{1000 + t}" for u in range(6) for t in range(u + 1)]
    path.write_text("user_id,movie_id,rating,timestamp\n" + "\n".join(lines) + "\n")
    cfg = load_config(paths.ROOT / "configs" / "sequential_movielens.yaml", [f"data.sequences.path={path}"])
    src = build_source(cfg.data, list(cfg.model.tables), 4, cfg.seed, 0, 1)
    assert src.steps_per_epoch == 1  # users 2..5 have 3 or more ratings
    held = [b.size for b in src.eval_batches()]
    assert sum(held) == 5  # users 1..5 have 2 or more
