"""Randomized parity cases: one integer seed draws a whole training setup, printable as Python source.

Data flow: `draw_case(seed, device, worlds)` -> `Case` (plain data: tables, plan, optimizer, lookup options, per-step
batch sizes of every rank, output groups, and how the ids are drawn) -> `make_batches(case)` -> per step, per rank,
a batch {feature: (lengths, ids, weights)} and the upstream gradient of each output. `case_source(case)` prints the
case as a `Case(...)` expression to paste into tests/test_fuzz_regressions.py. fuzz_check.py trains the cases and
compares them with the reference.

What a draw covers: 1-4 ranks (hosts of 1, 2 or 4 ranks; the table-row-wise output exchange flat or hierarchical,
which differ at 4 ranks as 2 hosts x 2), 1-6 tables of 1 to 5000 rows and 4 to 128 columns
(multiples of 4: FBGEMM's rule), sum or mean pooling, per-id weights, 1-3 features per table, fp32 or fp16 weights;
every sharding type (random rank orders, fewer row blocks than ranks, uneven column blocks, several blocks of a
table on one rank), every tier of the device (CPU: host; GPU: hbm, uvm, uvm_caching with a random cache size and
policy), every optimizer with weight decay where the device honours it; 2D layouts (sharding groups of a divisor of the
ranks, exact replica sync); local batches of 0 to 8 (some steps 0 on
every rank), empty bags, features with no ids on a rank, hot rows (repeated ids), out-of-range ids dropped by
bounds_check='drop' (some ranks lose every id) or raised by 'error' (every rank raises at that step; training goes
on), int32 or int64 ids, the KJT's keys in any order (changing between steps), output groups with repeated and
unused features, the next batch prefetched before the backward, fp16/bf16 outputs, 2-4 steps.
Only valid combinations are drawn; test_fuzz.invalid_setup draws refused ones.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from embshard import FusedOptimizerConfig, LookupOptions, ShardingPlan, TableConfig
from embshard.spec.plan import Shard, ShardingType, TablePlan, row_blocks
from embshard.spec.tables import DataType, Pooling

TW, RW, CW, TWRW, DP = (
    ShardingType.TABLE_WISE,
    ShardingType.ROW_WISE,
    ShardingType.COLUMN_WISE,
    ShardingType.TABLE_ROW_WISE,
    ShardingType.DATA_PARALLEL,
)
EXACT_OPTION = "column_wise_exact"  # LookupOptions field (when it exists): one row-wise Adagrad state per full row


def has_exact_option() -> bool:
    """Whether this embshard has LookupOptions(column_wise_exact=...)."""
    return EXACT_OPTION in {f.name for f in dataclasses.fields(LookupOptions)}


def column_wise_exact(options: dict) -> bool:
    """Whether column-wise tables should keep one row-wise Adagrad state per full row under these lookup options
    (else one per row of each column block): the option if given (a case asking for it where embshard lacks it
    then fails), else its default where it exists."""
    if EXACT_OPTION in options:
        return bool(options[EXACT_OPTION])
    return has_exact_option() and bool(LookupOptions().__dict__[EXACT_OPTION])


@dataclass
class Case:
    """One fuzz case: everything needed to train it and to rebuild its data (`make_batches`)."""

    seed: int
    world_size: int
    tables: list[TableConfig]
    plan: ShardingPlan
    optimizer: FusedOptimizerConfig
    batch_sizes: list[list[int]]  # [step][rank]
    options: dict = field(default_factory=dict)  # LookupOptions keyword arguments
    groups: dict[str, list[str]] | None = None  # output groups; None: the module returns a KeyedTensor
    key_order: list[str] | None = None  # the KJT's key order (default: the tables')
    shuffle_keys: bool = False  # every step's KJT lists the features in a new order (drawn from the seed)
    id_dtype: str = "int64"  # dtype of the KJT's ids: int64 or int32
    max_bag: dict[str, int] = field(default_factory=dict)  # bag lengths are 0..max_bag[feature] (default 3)
    id_span: dict[str, tuple[int, int]] = field(default_factory=dict)  # ids drawn from [lo, hi) (default all rows)
    silent: list[tuple[int, int, str]] = field(default_factory=list)  # (step, rank, feature): no ids at all
    # (step, rank, feature, share of its ids out of range); with bounds_check 'error' every rank must raise there
    bad: list[tuple[int, int, str, float]] = field(default_factory=list)
    rerun: str = ""  # how to rerun this case alone (default: by its seed)
    # Extra tiers whose column blocks keep per-block row-wise Adagrad state like uvm_caching's (column_wise
    # PER_BLOCK_STATE_TIERS): ("host",) lets the CPU run the GPU-only mix of exact and per-block column blocks.
    per_block_tiers: tuple[str, ...] = ()

    @property
    def steps(self) -> int:
        """Training steps."""
        return len(self.batch_sizes)

    @property
    def features(self) -> list[str]:
        """Features in the tables' order."""
        return [f for t in self.tables for f in t.feature_names]

    def lookup_options(self) -> LookupOptions:
        """The LookupOptions of the case (the exact column-wise option only where this embshard has it)."""
        opts = dict(self.options)
        if not has_exact_option():
            opts.pop(EXACT_OPTION, None)
        return LookupOptions(**opts)

    def keys_at(self, step: int) -> list[str]:
        """The KJT's key order at `step`."""
        order = self.key_order or self.features
        return random.Random(self.seed * 1009 + step).sample(order, len(order)) if self.shuffle_keys else order

    def output_widths(self) -> dict[str, list[tuple[str, int]]]:
        """Each output's (feature, width) columns, in order: groups, or one output per feature."""
        dim = {f: t.embedding_dim for t in self.tables for f in t.feature_names}
        spec = self.groups if self.groups is not None else {f: [f] for f in self.features}
        return {name: [(f, dim[f]) for f in members] for name, members in spec.items()}


# ---- drawing ----------------------------------------------------------------------------------------------------
def _rows(rng: random.Random) -> int:
    lo, hi = rng.choices([(1, 4), (5, 64), (65, 1000), (1001, 5000)], weights=[3, 3, 2.5, 1.5])[0]
    return rng.randint(lo, hi)


def _tier(rng: random.Random, device: str) -> dict:
    if device == "cpu":
        return {"tier": "host"}
    tier = rng.choices(["hbm", "uvm", "uvm_caching"], weights=[5, 2, 3])[0]
    if tier != "uvm_caching":
        return {"tier": tier}
    return {
        "tier": tier,
        "cache_load_factor": rng.choice([0.01, 0.1, 0.3, 1.0]),
        "cache_algorithm": rng.choice(["lru", "lfu"]),
    }


def _table_plan(rng: random.Random, t: TableConfig, st: ShardingType, W: int, lws: int, device: str) -> TablePlan:
    R, D = t.num_embeddings, t.embedding_dim
    if st is TW:
        shards = [Shard(rng.randrange(W), 0, R, 0, D)]
    elif st is DP:
        shards = [Shard(r, 0, R, 0, D) for r in range(W)]
    elif st is CW:
        units = D // 4
        n = rng.randint(1, min(units, W + 1))
        cuts = [0] + sorted(rng.sample(range(1, units), n - 1)) + [units]
        shards = [Shard(rng.randrange(W), 0, R, 4 * a, 4 * (b - a)) for a, b in zip(cuts, cuts[1:])]
    else:  # row-wise over every rank, or table-row-wise over one host's ranks
        host = rng.randrange(W // lws)
        ranks = list(range(W)) if st is RW else list(range(host * lws, (host + 1) * lws))
        n = len(ranks) if rng.random() < 0.7 else rng.randint(1, len(ranks))
        blocks = row_blocks(R, n)
        chosen = rng.sample(ranks, len(blocks)) if rng.random() < 0.5 else ranks[: len(blocks)]
        starts = [sum(blocks[:i]) for i in range(len(blocks))]
        shards = [Shard(r, s, n_rows, 0, D) for r, s, n_rows in zip(chosen, starts, blocks)]
    return TablePlan(t.name, st, shards=tuple(shards), **_tier(rng, device))


def _optimizer(rng: random.Random, device: str) -> FusedOptimizerConfig:
    kind = rng.choice(["sgd", "adagrad", "rowwise_adagrad", "adam"])
    # eps >= 0.05 bounds how much an fp32 rounding of a tiny gradient can move an adaptive step (lr * dg / eps).
    kw = dict(lr=rng.choice([0.01, 0.05, 0.1]), eps=rng.choice([0.05, 0.1, 0.3]))
    if kind == "sgd":
        kw["lr"] = rng.choice([0.05, 0.2, 0.5])
    if kind == "adam":
        kw.update(beta1=rng.choice([0.9, 0.5]), beta2=rng.choice([0.999, 0.9]))
    # FBGEMM's GPU kernels honour weight decay only with rowwise_adagrad (embshard refuses the others there).
    if rng.random() < 0.25 and (device == "cpu" or kind == "rowwise_adagrad"):
        kw["weight_decay"] = rng.choice([0.01, 0.1])
    return FusedOptimizerConfig(kind, **kw)


def draw_case(seed: int, device: str = "cpu", worlds: Sequence[int] = (1, 2, 3, 4), corners: float = 0.0) -> Case:
    """A random valid case for `device` ('cpu' or 'cuda'), its world size one of `worlds`; with probability
    `corners` pushed into the corners where ranks hold or see different things (`to_corners`)."""
    case = _draw_case(seed, device, worlds)
    corner_rng = random.Random(seed * 7919 + 1)  # its own stream: the base draw of a seed never changes
    if corner_rng.random() < corners:
        case = to_corners(case, corner_rng, device)
    return case


def to_corners(case: Case, rng: random.Random, device: str) -> Case:
    """The case moved toward the corners where ranks differ (the collective-desync class): whole tables and every
    column block of a table on one rank (the others hold none of them), every table of a rank in a cached tier
    (GPU: uvm_caching; CPU: the host tier standing in for it through `per_block_tiers`), row-wise Adagrad with the
    exact column-wise update (the path whose backward all-to-all depends on what ranks hold), a rank whose features
    are all silent at a step, and empty local and global batches."""
    W = case.world_size
    group = case.plan.group_plan()  # 2D: the shards' ranks are ranks within a sharding group
    holder = rng.randrange(group.world_size)
    lws = group.local_world_size
    plans = []
    for tp in case.plan.tables:
        if tp.sharding_type in (TW, CW) and rng.random() < 0.7:
            tp = replace(tp, shards=tuple(replace(s, rank=holder) for s in tp.shards))
        elif tp.sharding_type is TWRW and rng.random() < 0.7:  # every host but the holder's holds no block
            host = holder // lws
            tp = replace(tp, shards=tuple(replace(s, rank=host * lws + s.rank % lws) for s in tp.shards))
        plans.append(tp)
    options = dict(case.options)
    optimizer, per_block = case.optimizer, case.per_block_tiers
    if rng.random() < 0.6 and optimizer.kind.value != "rowwise_adagrad":
        optimizer = FusedOptimizerConfig("rowwise_adagrad", lr=0.05, eps=0.1)
    if optimizer.kind.value == "rowwise_adagrad" and has_exact_option():
        options[EXACT_OPTION] = True
    if rng.random() < 0.6:
        if device == "cuda":
            lru = options.get("prefetch_pipeline")
            cached = [t for t in plans if rng.random() < 0.8]
            plans = [
                replace(
                    tp,
                    tier="uvm_caching",
                    cache_load_factor=rng.choice([0.01, 0.1, 1.0]),
                    cache_algorithm="lru" if lru else rng.choice(["lru", "lfu"]),
                )
                if any(tp is c for c in cached)
                else tp
                for tp in plans
            ]
        else:
            per_block = ("host",)
    sizes = [list(b) for b in case.batch_sizes]
    sizes[rng.randrange(len(sizes))][rng.randrange(W)] = 0
    if rng.random() < 0.2:
        sizes[rng.randrange(len(sizes))] = [0] * W
    silent = list(case.silent)
    step, rank = rng.randrange(len(sizes)), rng.randrange(W)
    silent += [(step, rank, f) for f in case.features]
    table = rng.choice(case.tables)
    silent += [(s, r, f) for s in range(len(sizes)) for r in range(W) if r != holder for f in table.feature_names]
    plan = replace(case.plan, tables=tuple(plans))
    plan.check(case.tables)
    return replace(
        case,
        plan=plan,
        optimizer=optimizer,
        options=options,
        batch_sizes=sizes,
        silent=silent,
        per_block_tiers=per_block,
    )


def _draw_case(seed: int, device: str, worlds: Sequence[int]) -> Case:
    rng = random.Random(seed)
    W = rng.choice(list(worlds))
    lws = rng.choice([d for d in (1, 2, 4) if W % d == 0 and d <= W])
    optimizer = _optimizer(rng, device)
    tables = []
    for i in range(rng.randint(1, 6)):
        fp16 = rng.random() < 0.15 and not (device == "cuda" and optimizer.kind.value == "adam")  # FBGEMM 1.6
        tables.append(
            TableConfig(
                f"t{i}",
                _rows(rng),
                rng.choices([4, 8, 12, 16, 24, 32, 48, 64, 96, 128], weights=[4, 4, 3, 3, 2, 2, 1, 1, 1, 1])[0],
                tuple(f"t{i}f{j}" for j in range(rng.choices([1, 2, 3], weights=[6, 3, 1.5])[0])),
                pooling=rng.choice(["sum", "mean"]),
                weighted=rng.random() < 0.3,
                data_type="fp16" if fp16 else "fp32",
            )
        )
    types = [TW, RW, CW, TWRW, DP]
    plans = [_table_plan(rng, t, rng.choice(types), W, lws, device) for t in tables]
    plan = ShardingPlan(W, lws, tuple(plans))
    plan.check(tables)
    features = [f for t in tables for f in t.feature_names]
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    steps = rng.randint(2, 4)
    batch_sizes = []
    for _ in range(steps):
        if rng.random() < 0.08:
            batch_sizes.append([0] * W)  # the whole global batch empty
        else:
            batch_sizes.append([0 if rng.random() < 0.15 else rng.randint(1, 8) for _ in range(W)])
    options: dict = {}
    if rng.random() < 0.3:
        options["bounds_check"] = "drop"
    if has_exact_option() and rng.random() < 0.5:
        options[EXACT_OPTION] = rng.random() < 0.5
    groups = None
    if rng.random() < 0.75:
        groups = {}
        for g in range(rng.randint(1, 3)):
            k = rng.randint(1, len(features) + 1)
            members = rng.choices(features, k=k) if rng.random() < 0.3 else rng.sample(features, min(k, len(features)))
            groups[f"g{g}"] = members
    key_order = rng.sample(features, len(features))
    max_bag = {f: rng.choice([1, 2, 3, 6]) for f in features}
    id_span = {}
    for f in features:
        if rows[f] > 4 and rng.random() < 0.3:  # hot rows: many repeated ids
            lo = rng.randrange(rows[f])
            id_span[f] = (lo, min(rows[f], lo + rng.randint(1, 3)))
    silent, bad = [], []
    for s in range(steps):
        for r in range(W):
            everything_bad = options.get("bounds_check") == "drop" and rng.random() < 0.1
            for f in features:
                if rng.random() < 0.12:
                    silent.append((s, r, f))
                elif everything_bad:
                    bad.append((s, r, f, 1.0))
                elif options.get("bounds_check") == "drop" and rng.random() < 0.2:
                    bad.append((s, r, f, rng.choice([0.1, 0.5, 1.0])))
    if "bounds_check" not in options and rng.random() < 0.15:  # error mode: every rank must raise at that step
        for _ in range(rng.randint(1, 2)):
            bad.append((rng.randrange(steps), rng.randrange(W), rng.choice(features), rng.choice([0.1, 1.0])))
    if rng.random() < 0.3:  # the plan's tables and shards in any order
        plans = [replace(tp, shards=tuple(rng.sample(tp.shards, len(tp.shards)))) for tp in plans]
        plan = ShardingPlan(W, lws, tuple(rng.sample(plans, len(plans))))
    # Table-row-wise output exchange: hierarchical in half the cases (it differs from flat with 2 hosts x 2), drawn
    # from a stream of its own so the rest of a seed's draw stays what it was.
    if random.Random(seed * 104729 + 3).random() < 0.5:
        plan = replace(plan, table_row_wise_exchange="hierarchical")
    if rng.random() < 0.15 and not (bad and "bounds_check" not in options):  # ebc.prefetch(next batch) each step
        options["prefetch_pipeline"] = True
        if device == "cuda":  # FBGEMM locks prefetched cache rows only under LRU
            plan = replace(plan, tables=tuple(replace(tp, cache_algorithm="lru") for tp in plan.tables))
    # fp16/bf16 outputs round the gradient too (2^-11, 2^-8): an SGD step of lr 0.5 then moves a weight by up to
    # 0.01 more or less than the reference's, and Adam's first step follows the sign of a tiny gradient. Only the
    # optimizers whose step error stays small against the tolerance draw them.
    kind = optimizer.kind.value
    if (kind in ("adagrad", "rowwise_adagrad") or (kind == "sgd" and optimizer.lr <= 0.05)) and rng.random() < 0.1:
        options["output_dtype"] = rng.choice(["fp16", "bf16"])
    if rng.random() < 0.2:
        options["stochastic_rounding"] = False
    plan = _twod(seed, plan, tables, bool(bad) or "bounds_check" in options, device)
    return Case(
        seed,
        W,
        tables,
        plan,
        optimizer,
        batch_sizes,
        options,
        groups,
        key_order,
        rng.random() < 0.2,
        rng.choice(["int64", "int32"]),
        max_bag,
        id_span,
        silent,
        bad,
    )


def _twod(seed: int, plan: ShardingPlan, tables: list[TableConfig], drops: bool, device: str) -> ShardingPlan:
    """The plan made 2D (exact replica sync) in a quarter of the cases of several ranks, from a stream of its own
    (the rest of a seed's draw stays what it was): sharding groups of G ranks, G a divisor of the world size below it
    (a multiple or a divisor of the ranks per host), each group the same layout, drawn afresh for G ranks with each
    table's sharding type. Not with out-of-range ids (each rank's dropped-id count would include its replicas')."""
    rng = random.Random(seed * 15485863 + 7)
    W, lws = plan.world_size, plan.local_world_size
    sizes = [g for g in range(1, W) if W % g == 0 and (g % lws == 0 or lws % g == 0)]
    if drops or not sizes or rng.random() >= 0.25:
        return plan
    G = rng.choice(sizes)
    group_lws = lws if G % lws == 0 else G
    by_name = {t.name: t for t in tables}
    plans = [
        replace(_table_plan(rng, by_name[tp.table], tp.sharding_type, G, group_lws, device), **_tier_of(tp))
        for tp in plan.tables
    ]
    twod = replace(plan, tables=tuple(plans), sharding_group_size=G, table_row_wise_exchange="flat")
    twod.check(tables)
    return twod


def _tier_of(tp: TablePlan) -> dict:
    return {"tier": tp.tier, "cache_load_factor": tp.cache_load_factor, "cache_algorithm": tp.cache_algorithm}


# ---- what a case covers -----------------------------------------------------------------------------------------
def case_tags(case: Case) -> set[tuple]:
    """What `case` exercises, as tags: (world size, sharding type, optimizer) of every table, and per world size
    and type the tiers, ranks per host, uneven or partial blocks, fp16, pooling and weights; the optimizer's
    weight decay; the lookup options; and the shapes of the data (empty steps and ranks, silent features, hot
    rows, dropped or refused ids, int32 ids, shuffled keys, output groups)."""
    W, opt = case.world_size, case.optimizer.kind.value
    tags: set[tuple] = {("ranks per host", W, case.plan.local_world_size), ("steps", case.steps)}
    tags |= {("2D", W, case.plan.sharding_group_size)} if case.plan.sharding_group_size else set()
    tables = {t.name: t for t in case.tables}
    for tp in case.plan.tables:
        st, t = tp.sharding_type.value, tables[tp.table]
        tags |= {(W, st, opt), ("tier", W, st, tp.tier.value), ("pooling", st, t.pooling.value)}
        tags.add(("tier cache", tp.tier.value, tp.cache_algorithm.value if tp.tier.value == "uvm_caching" else ""))
        tags |= {("weighted", st)} if t.weighted else set()
        tags |= {("fp16", st, opt)} if t.data_type is DataType.FP16 else set()
        ranks = [s.rank for s in tp.shards]
        if len(set(ranks)) < len(ranks):
            tags.add(("blocks sharing a rank", st))
        if tp.sharding_type in (RW, TWRW) and len(tp.shards) < (
            W if tp.sharding_type is RW else case.plan.local_world_size
        ):
            tags.add(("fewer row blocks than ranks", st))
        if tp.sharding_type is CW:
            tags.add(("column blocks", min(len(tp.shards), 3), column_wise_exact(case.options)))
        tags.add(("rows", st, next(i for i, hi in enumerate((4, 64, 1000, 5000)) if t.num_embeddings <= hi)))
    for st in {tp.sharding_type for tp in case.plan.tables}:  # ranks holding no shard of a type (to_corners)
        held = {s.rank for tp in case.plan.tables if tp.sharding_type is st for s in tp.shards}
        tags |= {("ranks without a shard of", st.value, W)} if len(held) < W else set()
    tags |= {("per-block state tiers", case.per_block_tiers)} if case.per_block_tiers else set()
    silent = set(case.silent)
    if any(all((s, r, f) in silent for f in case.features) for s, r, _ in silent):
        tags.add(("a rank without ids at a step",))
    if case.optimizer.weight_decay:
        tags.add(("weight decay", opt))
    for k, v in case.options.items():
        tags.add(("option", k, str(v)))
    errors = bool(case.bad) and "bounds_check" not in case.options
    tags |= {("ids out of range", "drop" if "bounds_check" in case.options else "error")} if case.bad else set()
    tags |= {("every id of a rank dropped",)} if any(share == 1.0 for *_, share in case.bad) and not errors else set()
    tags |= {("empty global step",)} if any(not any(b) for b in case.batch_sizes) else set()
    tags |= {("empty local batch", W)} if any(0 in b and any(b) for b in case.batch_sizes) else set()
    tags |= {("silent feature",)} if case.silent else set()
    tags |= {("hot rows",)} if case.id_span else set()
    tags |= {("ids", case.id_dtype), ("shuffled keys", case.shuffle_keys)}
    if case.groups is None:
        tags.add(("output", "keyed tensor"))
    else:
        members = [f for g in case.groups.values() for f in g]
        tags.add(("output", "groups", len(set(members)) < len(members), set(members) < set(case.features)))
    return tags


def covering_cases(cases: Sequence[Case]) -> list[Case]:
    """A few of `cases` that together have every tag (`case_tags`) any of them has: greedy, the case adding the
    most new tags first, the cheaper case (ranks x steps x tables) on ties; in their original order."""
    tags = [case_tags(c) for c in cases]
    cost = [c.world_size * c.steps * len(c.tables) for c in cases]
    left, chosen = set().union(*tags), []
    while left:
        best = max(range(len(cases)), key=lambda i: (len(tags[i] & left), -cost[i]))
        chosen.append(best)
        left -= tags[best]
    return [cases[i] for i in sorted(chosen)]


# ---- data -------------------------------------------------------------------------------------------------------
Batch = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def make_batches(case: Case) -> list[tuple[list[Batch], list[dict[str, torch.Tensor]]]]:
    """Per step: every rank's batch {feature: (lengths, ids, weights)} (out-of-range ids included) and every rank's
    upstream gradient per output. Deterministic in the case (its seed): every rank draws all ranks' data."""
    gen = torch.Generator().manual_seed(case.seed)
    tables = {f: t for t in case.tables for f in t.feature_names}
    silent = set(case.silent)
    bad = {(s, r, f): share for s, r, f, share in case.bad}
    widths = case.output_widths()
    any_weighted = any(t.weighted for t in case.tables)
    out = []
    for s, sizes in enumerate(case.batch_sizes):
        per_rank, upstream = [], []
        for r, B in enumerate(sizes):
            batch: Batch = {}
            for f in case.features:
                t = tables[f]
                lengths = torch.randint(0, case.max_bag.get(f, 3) + 1, (B,), generator=gen)
                if (s, r, f) in silent:
                    lengths.zero_()
                lo, hi = case.id_span.get(f, (0, t.num_embeddings))
                ids = torch.randint(lo, hi, (int(lengths.sum()),), generator=gen)
                share = bad.get((s, r, f), 0.0)
                if share and ids.numel():
                    n = math.ceil(share * ids.numel())
                    pos = torch.randperm(ids.numel(), generator=gen)[:n]
                    far = torch.randint(0, 1000, (n,), generator=gen)
                    ids[pos] = torch.where(torch.rand(n, generator=gen) < 0.5, -1 - far, t.num_embeddings + far)
                # The KJT carries weights for every feature when one table is weighted: junk for the others.
                w = torch.rand(ids.numel(), generator=gen) + 0.5 if any_weighted else None
                batch[f] = (lengths, ids, w)
            per_rank.append(batch)
            upstream.append({n: torch.randn(B, sum(w for _, w in cols), generator=gen) for n, cols in widths.items()})
        out.append((per_rank, upstream))
    return out


def clean(batch: Batch, rows: dict[str, int]) -> Batch:
    """The batch without its out-of-range ids (and their weights): what bounds_check='drop' trains on."""
    out = {}
    for f, (lengths, ids, w) in batch.items():
        keep = (ids >= 0) & (ids < rows[f])
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        out[f] = (torch.bincount(bag[keep], minlength=lengths.numel()), ids[keep], w[keep] if w is not None else None)
    return out


def feature_upstream(case: Case, upstream: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The upstream gradient of each feature: the sum of its columns over every appearance in the outputs (zero
    for features no output uses)."""
    B = next(iter(upstream.values())).shape[0] if upstream else 0
    dim = {f: t.embedding_dim for t in case.tables for f in t.feature_names}
    out = {f: torch.zeros(B, dim[f]) for f in case.features}
    for name, cols in case.output_widths().items():
        c0 = 0
        for f, w in cols:
            out[f] = out[f] + upstream[name][:, c0 : c0 + w]
            c0 += w
    return out


# ---- printing ---------------------------------------------------------------------------------------------------
def _table_source(t: TableConfig) -> str:
    extra = "".join(
        [
            ', pooling="mean"' if t.pooling is Pooling.MEAN else "",
            ", weighted=True" if t.weighted else "",
            ', data_type="fp16"' if t.data_type is DataType.FP16 else "",
        ]
    )
    return f'TableConfig("{t.name}", {t.num_embeddings}, {t.embedding_dim}, {t.feature_names!r}{extra})'


def _plan_source(tp: TablePlan) -> str:
    shards = ", ".join(
        f"Shard({s.rank}, {s.row_offset}, {s.num_rows}, {s.col_offset}, {s.num_cols})" for s in tp.shards
    )
    cache = ""
    if tp.tier.value == "uvm_caching":
        cache = f', cache_load_factor={tp.cache_load_factor}, cache_algorithm="{tp.cache_algorithm.value}"'
    return f'TablePlan("{tp.table}", "{tp.sharding_type.value}", "{tp.tier.value}", ({shards},){cache})'


def _optimizer_source(o: FusedOptimizerConfig) -> str:
    default = FusedOptimizerConfig()
    kw = [
        f"{k}={getattr(o, k)!r}"
        for k in ("lr", "eps", "weight_decay", "beta1", "beta2")
        if getattr(o, k) != getattr(default, k)
    ]
    return f'FusedOptimizerConfig("{o.kind.value}"' + "".join(", " + k for k in kw) + ")"


def case_source(case: Case) -> str:
    """The case as a Python expression (imports: Case, TableConfig, ShardingPlan, TablePlan, Shard,
    FusedOptimizerConfig), to paste into a regression test."""
    ind = "        "
    lines = [
        "Case(",
        f"    seed={case.seed},",
        f"    world_size={case.world_size},",
        "    tables=[",
        *[f"{ind}{_table_source(t)}," for t in case.tables],
        "    ],",
        f"    plan=ShardingPlan({case.plan.world_size}, {case.plan.local_world_size}, (",
        *[f"{ind}{_plan_source(tp)}," for tp in case.plan.tables],
        f"    ), {case.plan.table_row_wise_exchange.value!r}"
        + (f", sharding_group_size={case.plan.sharding_group_size}" if case.plan.sharding_group_size else "")
        + "),",
        f"    optimizer={_optimizer_source(case.optimizer)},",
        f"    batch_sizes={case.batch_sizes!r},",
        f"    options={case.options!r},",
        f"    groups={case.groups!r},",
        f"    key_order={case.key_order!r},",
        f"    shuffle_keys={case.shuffle_keys!r},",
        f"    id_dtype={case.id_dtype!r},",
        f"    max_bag={case.max_bag!r},",
        f"    id_span={case.id_span!r},",
        f"    silent={case.silent!r},",
        f"    bad={case.bad!r},",
        *([f"    per_block_tiers={case.per_block_tiers!r},"] if case.per_block_tiers else []),
        ")",
    ]
    return "\n".join(lines)
