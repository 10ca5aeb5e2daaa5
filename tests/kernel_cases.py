"""Shared cases of the kernel tests (tests/kernels/test_kernels_*.py, tests/kernels_interpret_cases.py, bench/kernels.py
--check): small tables of several widths with Zipf ids (many repeated rows), empty and weighted bags, features
sharing a table, and the plain-PyTorch reference they are trained against."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import reference
import torch
from reference import ReferenceEBC

from embshard.lookup import LocalShard
from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.plan import MemoryTier, Shard
from embshard.spec.tables import TableConfig

TABLES = [
    TableConfig("ta", 40, 8, ("a1", "a2"), weighted=True),  # two features share a table
    TableConfig("tb", 30, 12, ("b1",)),  # width 12: a 16-wide tile with 4 masked columns
    TableConfig("tc", 25, 8, ("c1",)),  # second table of width 8: same width group as ta
    TableConfig("td", 50, 4, ("d1",), weighted=True),
]
OPTIMIZERS = {**reference.OPTIMIZERS, "sgd_wd": FusedOptimizerConfig("sgd", lr=0.1, weight_decay=0.05)}


def full_shards(tables: Sequence[TableConfig], device: torch.device) -> list[LocalShard]:
    """One shard per table holding the whole table."""
    tier = MemoryTier.HOST if device.type == "cpu" else MemoryTier.HBM
    return [
        LocalShard(t, i, Shard(0, 0, t.num_embeddings, 0, t.embedding_dim), t.feature_names, tier)
        for i, t in enumerate(tables)
    ]


def zipf_ids(n: int, rows: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """n ids in [0, rows) with P(i) ~ (i + 1)^-alpha (alpha 0: uniform)."""
    p = torch.arange(1, rows + 1, dtype=torch.float64) ** -alpha
    return torch.multinomial(p, n, replacement=True, generator=gen) if n else torch.zeros(0, dtype=torch.int64)


def random_step(tables: Sequence[TableConfig], B: int, gen: torch.Generator, alpha: float = 1.2, max_len: int = 7):
    """One step: feature-major (indices, offsets, per-sample weights) for every feature of `tables` in order, the
    same batch as {feature: (lengths, ids, weights)} for ReferenceEBC, and an upstream gradient per feature.
    Bag lengths 0..max_len with at least one empty bag per feature; weights in [0.5, 1.5) for every id (the
    lookups must ignore them for unweighted features)."""
    batch, upstream, ids_all, lengths_all, w_all = {}, {}, [], [], []
    for t in tables:
        for f in t.feature_names:
            lengths = torch.randint(0, max_len + 1, (B,), generator=gen)
            lengths[int(torch.randint(0, B, (1,), generator=gen))] = 0
            ids = zipf_ids(int(lengths.sum()), t.num_embeddings, alpha, gen)
            w = torch.rand(ids.numel(), generator=gen) + 0.5
            batch[f] = (lengths, ids, w if t.weighted else None)
            upstream[f] = torch.randn(B, t.embedding_dim, generator=gen)
            ids_all.append(ids)
            lengths_all.append(lengths)
            w_all.append(w)
    lengths = torch.cat(lengths_all)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.cat(ids_all), offsets, torch.cat(w_all), batch, upstream


def padded_step(idx, off, psw, tables: Sequence[TableConfig], B: int, gen: torch.Generator, max_fill: int = 3):
    """`random_step`'s batch (feature-major `idx`, `off`, `psw`) padded as the whole-step graph pads a ragged batch
    (embshard/training/step_graph.py): every bag keeps its ids and gains 0..max_fill filler ids after them (fresh Zipf ids of
    its table: they share rows with the bag's own ids), each of weight 0; an own id weighs its `psw` where its table
    is weighted, 1 elsewhere. Returns (indices, offsets, weights, positions of the fillers)."""
    features = [t for t in tables for _ in t.feature_names]
    ids_out, w_out, lengths, fillers, pos = [], [], [], [], 0
    for k, t in enumerate(features):
        for b in range(B):
            lo, hi = int(off[k * B + b]), int(off[k * B + b + 1])
            n = int(torch.randint(0, max_fill + 1, (1,), generator=gen))
            ids_out += [idx[lo:hi], zipf_ids(n, t.num_embeddings, 1.2, gen)]
            w_out += [psw[lo:hi] if t.weighted else torch.ones(hi - lo), torch.zeros(n)]
            fillers += range(pos + hi - lo, pos + hi - lo + n)
            lengths.append(hi - lo + n)
            pos += hi - lo + n
    assert fillers, "no filler drawn"
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])
    return torch.cat(ids_out), offsets, torch.cat(w_out), fillers


@contextmanager
def _every_id_weighted(lookup):
    """`lookup` pools every id with its weight while active (as a padded step's scheme sets it)."""
    lookup.every_id_weighted = True
    try:
        yield
    finally:
        lookup.every_id_weighted = False


def check_padded_like_unpadded(
    make_lookup, tables: Sequence[TableConfig], device: torch.device, exact: bool, steps: int = 2, B: int = 5
):
    """`make_lookup()` trained on `random_step` batches and a second one on the same batches padded (`padded_step`)
    with its `every_id_weighted` set, its backward after the flag is cleared (it must weigh the ids as its forward
    did): the same pooled sums every step, the same weights and optimizer states after it, bit for bit if `exact`
    (a filler adds an exact zero; the torch path, and the atomic kernels where they add in a fixed order: the
    interpreter), else within 1e-6 (atomics on a GPU; the sorted backward, whose tiles the fillers shift). A third
    one, whose batch gives one filler weight 1, must differ (pooled sums, weights or state), so that the check can
    fail."""
    tol = 0.0 if exact else 1e-6

    def same(got, want, what):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")

    plain, padded, wrong = make_lookup(), make_lookup(), make_lookup()
    gen = torch.Generator().manual_seed(31)
    for step in range(steps):
        idx, off, psw, _, upstream = random_step(tables, B, gen)
        up = torch.cat(list(upstream.values()), dim=1).to(device)
        pidx, poff, pw, fillers = padded_step(idx, off, psw, tables, B, gen)
        want = plain(idx.to(device), off.to(device), psw.to(device))
        (want * up).sum().backward()
        with _every_id_weighted(padded):
            got = padded(pidx.to(device), poff.to(device), pw.to(device))
        (got * up).sum().backward()
        same(got, want, f"step {step} pooled")
        for t, a, b in zip(tables, padded.shard_weights(), plain.shard_weights()):
            same(a, b, f"step {step} {t.name}")
        for t, sa, sb in zip(tables, padded.shard_optimizer_states(), plain.shard_optimizer_states()):
            for k in sb:
                same(sa[k], sb[k], f"step {step} {t.name} {k}")
        if step == 0:
            bad = pw.clone()
            bad[fillers[0]] = 1.0
            with _every_id_weighted(wrong):
                out = wrong(pidx.to(device), poff.to(device), bad.to(device))
            (out * up).sum().backward()
            assert (out - want).abs().max() > 1e-3, "a filler of weight 1 must add its row"
            # weights or optimizer state: adagrad's first step moves a row by about lr whatever its gradient's size
            moved = list(zip(wrong.shard_weights(), plain.shard_weights()))
            for sa, sb in zip(wrong.shard_optimizer_states(), plain.shard_optimizer_states()):
                moved += [(sa[k], sb[k]) for k in sb]
            assert max(float((a - b).abs().max()) for a, b in moved) > 1e-4, "a filler of weight 1 gets a gradient"


def train_against_reference(
    make_lookup,
    tables: Sequence[TableConfig],
    opt: FusedOptimizerConfig,
    device: torch.device,
    steps: int,
    B: int,
    alpha: float = 1.2,
    max_len: int = 7,
):
    """Train `make_lookup()` and ReferenceEBC side by side on `random_step` batches (Zipf `alpha` ids, bags of up to
    `max_len`); returns (lookup, reference, list of (got, want) forward outputs per step) for the caller to
    compare."""
    lookup = make_lookup()
    ref = ReferenceEBC(list(tables), opt, seed=7)
    gen = torch.Generator().manual_seed(11)
    outs = []
    features = [f for t in tables for f in t.feature_names]
    for _ in range(steps):
        idx, off, psw, batch, upstream = random_step(tables, B, gen, alpha, max_len)
        got = lookup(idx.to(device), off.to(device), psw.to(device))
        up = torch.cat([upstream[f] for f in features], dim=1).to(device)
        (got.float() * up).sum().backward()
        want = ref.step(batch, upstream)
        outs.append((got.detach().cpu().double(), torch.cat([want[f] for f in features], dim=1)))
    return lookup, ref, outs


def reference_row_gradients(tables: Sequence[TableConfig], idx, off, psw, upstream_BD: torch.Tensor):
    """{table: float64 gradient of every row} of the pooled sums of feature-major bags (`random_step`'s layout)
    times `upstream_BD` (features side by side), by autograd through F.embedding_bag: independent of the kernels."""
    import torch.nn.functional as F

    features = [(t, f) for t in tables for f in t.feature_names]
    B = (off.numel() - 1) // len(features)
    weights = {t.name: torch.zeros(t.num_embeddings, t.embedding_dim, dtype=torch.float64, requires_grad=True)
               for t in tables}  # fmt: skip
    total, col = 0.0, 0
    for k, (t, _) in enumerate(features):
        lo, hi = int(off[k * B]), int(off[(k + 1) * B])
        bag_off = off[k * B : (k + 1) * B + 1] - lo
        w = psw[lo:hi].double() if t.weighted else None
        pooled = F.embedding_bag(idx[lo:hi], weights[t.name], bag_off, mode="sum", per_sample_weights=w,
                                 include_last_offset=True)  # fmt: skip
        total = total + (pooled * upstream_BD[:, col : col + t.embedding_dim].double()).sum()
        col += t.embedding_dim
    total.backward()
    return {name: w.grad for name, w in weights.items()}


def reference_state(ref: ReferenceEBC, opt: FusedOptimizerConfig, table: str) -> dict[str, torch.Tensor]:
    """The reference's optimizer state under embshard.spec.optim's names."""
    st = ref.state[table]
    if opt.kind is OptimizerKind.ADAGRAD:
        return {"m": st["sum"]}
    if opt.kind is OptimizerKind.ROWWISE_ADAGRAD:
        return {"m": st["row_sum"][:, 0]}
    if opt.kind is OptimizerKind.ADAM:
        return {"m": st["m"], "v": st["v"]}
    return {}


def assert_close_scaled(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, name: str) -> None:
    """|got - want| <= atol + rtol * max|want| everywhere: for sums of many fp32 terms, whose rounding error
    follows the size of the terms, not of the (possibly cancelling) result."""
    tol = atol + rtol * float(want.abs().max()) if want.numel() else atol
    torch.testing.assert_close(got, want, atol=tol, rtol=0.0, msg=lambda m: f"{name}: {m}")


def check_against_reference(
    lookup,
    ref: ReferenceEBC,
    outs,
    opt: FusedOptimizerConfig,
    tables,
    atol=2e-5,
    rtol=1e-4,
    with_state=True,
    scaled=False,
):
    """Forward outputs of every step, weights and (`with_state`) optimizer state after the last step; `scaled`:
    rtol relative to each tensor's largest value (`assert_close_scaled`)."""

    def close(got, want, name):
        if scaled:
            assert_close_scaled(got, want, atol, rtol, name)
        else:
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")

    for step, (got, want) in enumerate(outs):
        close(got, want, f"step {step}")
    for t, w in zip(tables, lookup.shard_weights()):
        close(w.cpu().double(), ref.weights[t.name], t.name)
    if not with_state:
        return
    for t, st in zip(tables, lookup.shard_optimizer_states()):
        want = reference_state(ref, opt, t.name)
        assert set(st) == set(want), (t.name, set(st), set(want))
        for k in st:
            close(st[k].cpu().double(), want[k], f"{t.name} {k}")


def regroup_reference(blocks, keys, dims, groups):
    """{group: torch.cat of its keys' columns}: autograd gives the reference gradients."""
    cols = {}
    for b, k_list, d_list in zip(blocks, keys, dims):
        pos = 0
        for k, d in zip(k_list, d_list):
            cols[k] = b[:, pos : pos + d]
            pos += d
    return {name: torch.cat([cols[k] for k in members], dim=1) for name, members in groups.items()}


def regroup_grad_reference(upstream, keys, dims, groups, batch, dtype):
    """Expected block gradients: each column sums the upstream gradients of its uses in fp32, in group order, and
    is rounded once to `dtype` (the kernel's order); unused columns are zero."""
    grads = [torch.zeros(batch, sum(d), dtype=torch.float32) for d in dims]
    where = {}
    for i, (k_list, d_list) in enumerate(zip(keys, dims)):
        pos = 0
        for k, d in zip(k_list, d_list):
            where[k] = (i, pos, d)
            pos += d
    for name, members in groups.items():
        col = 0
        for k in members:
            i, pos, d = where[k]
            grads[i][:, pos : pos + d] += upstream[name][:, col : col + d].float().cpu()
            col += d
    return [g.to(dtype) for g in grads]


def random_regroup_case(seed: int, n_keys: int, width_choices: Sequence[int], n_blocks: int = 3):
    """Keys split into blocks, three groups: one whole block in order, a random mix with duplicates (within and
    across groups), a run; some keys unused."""
    gen = torch.Generator().manual_seed(seed)
    names = [f"k{i}" for i in range(n_keys)]
    cuts = sorted(torch.randperm(n_keys - 1, generator=gen)[: n_blocks - 1].add(1).tolist())
    bounds = [0, *cuts, n_keys]
    keys = [names[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    dims = [[width_choices[int(torch.randint(0, len(width_choices), (1,), generator=gen))] for _ in k] for k in keys]
    picks = torch.randint(0, n_keys, (max(3, n_keys // 2),), generator=gen).tolist()
    groups = {
        "whole": list(keys[1]),
        "mixed": [names[i] for i in picks] + [names[picks[0]]],
        "run": names[: max(1, n_keys // 4)],
    }
    return keys, dims, groups
