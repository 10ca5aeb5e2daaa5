"""Randomized parity fuzzer: random tables, plans mixing every sharding type and tier, random per-rank batches
(0 included), every optimizer, output groups with repeated and unused features, out-of-range ids dropped; outputs
every step, then weights and optimizer state, against the plain-PyTorch reference (fuzz_cases.py draws the cases,
fuzz_check.py trains and compares them). Also: every rank enters every collective whatever its local data (fixed
scenarios, trained in the same spawns as the random cases), and invalid setups drawn at random raise ConfigError.

By default the suite trains the few of the first CANDIDATES random cases that together cover everything those
cover (fuzz_cases.case_tags: every sharding type x world size x optimizer, the tiers, options and data shapes;
about 30 of 400, seconds on 2 CPU cores), the scenarios on 2 of the 4 optimizers per world size (all 4 per
scenario; the hierarchical one on rowwise_adagrad and adam), and SEQ_CASES random sequence cases
(fuzz_sequence.py); EMBSHARD_FUZZ_CASES trains every case drawn and every scenario with every optimizer.

Environment:
  EMBSHARD_FUZZ_CASES=N     random cases to run: the first N (default: the covering subset of CANDIDATES)
  EMBSHARD_FUZZ_SEED=S      run only random case S (a failure prints its seed)
  EMBSHARD_FUZZ_FIRST_SEED  seed of the first random case (default FIRST_SEED; others explore new cases)
  EMBSHARD_FUZZ_WORLDS=1,2  world sizes to draw from (default 1-4 on CPU, 1 and 2 GPUs where present)
  EMBSHARD_FUZZ_SEQ_CASES=N random sequence cases (ShardedEmbeddingCollection, fuzz_sequence.py; default
                            SEQ_CASES); EMBSHARD_FUZZ_SEQ_SEED=S runs only sequence case S
  EMBSHARD_FUZZ_TIMEOUT=T   seconds a collective may wait before its case counts as hung (default 30)
  EMBSHARD_FUZZ_CORNERS=P   share of random cases pushed into the corners where ranks hold or see different
                            things (fuzz_cases.to_corners; default DEFAULT_CORNERS)
  EMBSHARD_TEST_DEVICE=cuda the same on GPUs (NCCL; GPU tiers drawn)
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import replace

import pytest
import torch
from dist_harness import device_kind as device_kind
from fuzz_cases import CW, DP, RW, TW, TWRW, Case, case_tags, covering_cases, draw_case
from fuzz_check import run_cases
from fuzz_sequence import draw_sequence_case, run_sequence_cases
from parity import to_kjt

from embshard import ConfigError, FusedOptimizerConfig, LookupOptions, ShardingPlan, TableConfig
from embshard.spec.plan import Shard, TablePlan

# pytest-xdist (--dist loadgroup): the module's tests on one worker, which trains every case once (fuzz_run)
pytestmark = pytest.mark.xdist_group("fuzz")

CANDIDATES = 400  # random cases drawn by default, of which the suite trains a covering subset
DEFAULT_CORNERS = 0.3  # share of random cases drawn into the corners (to_corners): the collective-desync class
FIRST_SEED = 1000  # random case i has seed FIRST_SEED + i
SEQ_CASES = 8  # random sequence cases (world sizes in turn)
SEQ_FIRST_SEED = 50_000  # sequence case i has seed SEQ_FIRST_SEED + i


def _worlds() -> list[int]:
    env = os.environ.get("EMBSHARD_FUZZ_WORLDS")
    if env:
        return [int(w) for w in env.split(",")]
    if device_kind() == "cpu":
        return [1, 2, 3, 4]
    return [n for n in (1, 2) if n <= torch.cuda.device_count()]


def _covering() -> bool:
    """Whether the suite trains the covering subset of the candidates (neither a seed nor a case count given)."""
    return not (os.environ.get("EMBSHARD_FUZZ_SEED") or os.environ.get("EMBSHARD_FUZZ_CASES"))


def _random_cases(device: str, worlds: list[int]) -> list[Case]:
    corners = float(os.environ.get("EMBSHARD_FUZZ_CORNERS", DEFAULT_CORNERS))
    if os.environ.get("EMBSHARD_FUZZ_SEED"):
        return [draw_case(int(os.environ["EMBSHARD_FUZZ_SEED"]), device, worlds, corners)]
    first = int(os.environ.get("EMBSHARD_FUZZ_FIRST_SEED", FIRST_SEED))
    n = int(os.environ.get("EMBSHARD_FUZZ_CASES", CANDIDATES))
    cases = [draw_case(first + i, device, worlds, corners) for i in range(n)]
    return covering_cases(cases) if _covering() else cases


# ---- every rank enters every collective, whatever its local data ------------------------------------------------
SCENARIOS = ("rank_batch_0", "all_ranks_0", "feature_without_ids", "all_ids_dropped", "rank_without_shards")
SPEC_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def spec_case(scenario: str, optimizer: str, W: int, device: str, seed: int) -> Case:
    """A fixed case of `scenario` on W ranks. Its plan leaves ranks without a shard of a scheme: the table-wise
    table on rank 1 (ranks 0 and 2 hold none), both column blocks on rank 0, a 2-row row-wise table (rank 2 holds
    no block), the table-row-wise table on host 1 of 1-rank hosts; rank 2 holds only data-parallel replicas."""
    tables = [
        TableConfig("tw", 11, 8, ("tw_a", "tw_b")),
        TableConfig("cw", 7, 12, ("cw_a",), pooling="mean"),
        TableConfig("rw", 2, 4, ("rw_a",), weighted=True),
        TableConfig("twrw", 9, 8, ("twrw_a",), pooling="mean", weighted=True),
        TableConfig("dp", 5, 4, ("dp_a", "dp_b")),
    ]
    gpu = device == "cuda"
    last = W - 1
    shards = {
        "tw": [Shard(min(1, last), 0, 11, 0, 8)],
        "cw": [Shard(0, 0, 7, 0, 4), Shard(0, 0, 7, 4, 8)],
        "rw": [Shard(r, r, 1, 0, 4) for r in range(min(2, W))] if W > 1 else [Shard(0, 0, 2, 0, 4)],
        "twrw": [Shard(min(1, last), 0, 9, 0, 8)],
        "dp": [Shard(r, 0, 5, 0, 4) for r in range(W)],
    }
    types = {"tw": TW, "cw": CW, "rw": RW, "twrw": TWRW, "dp": DP}
    tiers = {"tw": "uvm_caching", "cw": "uvm"} if gpu else {}
    plan = ShardingPlan(
        W, 1, tuple(TablePlan(n, types[n], tiers.get(n, "hbm" if gpu else "host"), tuple(s)) for n, s in shards.items())
    )
    features = [f for t in tables for f in t.feature_names]
    sizes = [[3 + r for r in range(W)] for _ in range(3)]
    silent, bad, options = [], [], {}
    if scenario == "rank_batch_0":
        sizes = [[0 if r == s % W else 2 + r for r in range(W)] for s in range(3)]
    elif scenario == "all_ranks_0":
        sizes = [[0] * W, sizes[0], [0] * W, sizes[1]]
    elif scenario == "feature_without_ids":
        silent = [(0, 0, "tw_a"), (0, 0, "rw_a"), (1, last, "cw_a"), (1, last, "twrw_a")]
        silent += [(2, 0, f) for f in features]  # a rank with samples but no id at all
    elif scenario == "all_ids_dropped":
        options = {"bounds_check": "drop"}
        bad = [(0, 0, f, 1.0) for f in features] + [(1, last, f, 1.0) for f in features] + [(2, 0, "dp_a", 1.0)]
    groups = {"all": features, "some": ["rw_a", "tw_b", "rw_a"]}
    opt = FusedOptimizerConfig(optimizer, lr=0.05, eps=0.1)
    rerun = f"pytest tests/test_fuzz.py -k '{scenario}'"
    return Case(seed, W, tables, plan, opt, sizes, options, groups, silent=silent, bad=bad, rerun=rerun)


HIERARCHICAL = "hierarchical_exchange"  # a scenario of its own: 4 ranks as 2 hosts x 2


def hierarchical_case(optimizer: str, device: str, seed: int) -> Case:
    """4 ranks as 2 hosts x 2 with the hierarchical table-row-wise exchange: every table-row-wise table on host 1
    (host 0 holds no block), one of them in a single block (rank 2 holds none of it), one with its blocks in reverse
    rank order, beside table-wise, row-wise and data-parallel tables; ranks without samples, a step without any, a
    rank whose features are all silent, another with one silent feature."""
    tables = [
        TableConfig("twrw_a", 13, 8, ("a1", "a2"), pooling="mean"),
        TableConfig("twrw_b", 6, 4, ("b1",), weighted=True),
        TableConfig("twrw_c", 3, 12, ("c1",)),
        TableConfig("tw", 9, 8, ("tw1",)),
        TableConfig("rw", 11, 4, ("rw1",), weighted=True),
        TableConfig("dp", 5, 4, ("dp1",)),
    ]
    shards = {
        "twrw_a": [Shard(2, 0, 7, 0, 8), Shard(3, 7, 6, 0, 8)],
        "twrw_b": [Shard(3, 0, 3, 0, 4), Shard(2, 3, 3, 0, 4)],
        "twrw_c": [Shard(3, 0, 3, 0, 12)],
        "tw": [Shard(0, 0, 9, 0, 8)],
        "rw": [Shard(r, 3 * r, 3 if r < 3 else 2, 0, 4) for r in range(4)],
        "dp": [Shard(r, 0, 5, 0, 4) for r in range(4)],
    }
    types = {"twrw_a": TWRW, "twrw_b": TWRW, "twrw_c": TWRW, "tw": TW, "rw": RW, "dp": DP}
    tier = "hbm" if device == "cuda" else "host"
    plans = tuple(TablePlan(n, types[n], tier, tuple(s)) for n, s in shards.items())
    plan = ShardingPlan(4, 2, plans, "hierarchical")
    features = [f for t in tables for f in t.feature_names]
    sizes = [[3, 0, 4, 2], [0, 0, 0, 0], [0, 5, 0, 1], [2, 3, 0, 0]]
    silent = [(2, 1, f) for f in features] + [(0, 2, "a1"), (3, 0, "c1")]
    groups = {"all": features, "some": ["c1", "a1", "c1"]}
    opt = FusedOptimizerConfig(optimizer, lr=0.05, eps=0.1)
    rerun = f"pytest tests/test_fuzz.py -k '{HIERARCHICAL}'"
    return Case(seed, 4, tables, plan, opt, sizes, {}, groups, silent=silent, rerun=rerun)


# ---- one run of every case: one spawn per world size --------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_run():
    worlds, device = _worlds(), device_kind()
    cases = _random_cases(device, worlds)
    spec = {}
    if not os.environ.get("EMBSHARD_FUZZ_SEED"):
        spec_worlds = [w for w in worlds if w in (2, 3)] or [max(worlds)]
        for j, W in enumerate(spec_worlds):
            for i, sc in enumerate(SCENARIOS):
                opts = SPEC_OPTIMIZERS
                if _covering() and len(spec_worlds) > 1:  # 2 optimizers per world size, all 4 per scenario
                    opts = [SPEC_OPTIMIZERS[(i + 2 * j + k) % len(SPEC_OPTIMIZERS)] for k in (0, 1)]
                for opt in opts:
                    spec[len(cases)] = sc
                    cases.append(spec_case(sc, opt, W, device, seed=len(spec)))
        if 4 in worlds:  # in the spawn of world 4's random cases; covering: the 2 optimizers with state per row
            for opt in SPEC_OPTIMIZERS[2:] if _covering() else SPEC_OPTIMIZERS:
                spec[len(cases)] = HIERARCHICAL
                cases.append(hierarchical_case(opt, device, seed=len(spec)))
    t0 = time.perf_counter()
    outcome = run_cases(cases, ",".join(map(str, worlds)))
    n = len(cases) - len(spec)
    print(f"fuzz: {n} random cases and {len(spec)} scenario cases on {device} in {time.perf_counter() - t0:.1f} s")
    return cases, outcome, spec


def test_fuzz_parity_with_reference(fuzz_run):
    cases, outcome, spec = fuzz_run
    failures = [f for i, f in outcome.items() if f is not None and i not in spec]
    per_world = {w: sum(c.world_size == w for i, c in enumerate(cases) if i not in spec) for w in _worlds()}
    print(f"fuzz: {len(cases) - len(spec)} random cases, per world size {per_world}, {len(failures)} failed")
    assert not failures, f"{len(failures)} fuzz cases failed:\n\n" + "\n".join(failures)
    if _covering():  # every sharding type x world size x optimizer trained (else draw_case changed: widen CANDIDATES)
        trained = set().union(*(case_tags(c) for i, c in enumerate(cases) if i not in spec))
        types, opts = [TW, RW, CW, TWRW, DP], ["sgd", "adagrad", "rowwise_adagrad", "adam"]
        want = {(w, st.value, o) for w in _worlds() for st in types for o in opts}
        assert want <= trained, f"no random case trains {sorted(want - trained)}"


@pytest.mark.parametrize("scenario", [*SCENARIOS, HIERARCHICAL])
def test_every_rank_enters_every_collective(fuzz_run, scenario):
    """Batch of 0 on one rank, on all ranks, a feature (or a whole rank's batch) without ids, every id of a rank
    dropped, ranks holding no shard of a scheme, and the same at 4 ranks as 2 hosts x 2 with the hierarchical
    table-row-wise exchange (a host without blocks): nothing hangs, every rank starts the same collectives, and
    everything matches the reference."""
    if os.environ.get("EMBSHARD_FUZZ_SEED"):
        pytest.skip("EMBSHARD_FUZZ_SEED runs one random case only")
    if scenario == HIERARCHICAL and 4 not in _worlds():
        pytest.skip("needs world size 4 (EMBSHARD_FUZZ_WORLDS)")
    _, outcome, spec = fuzz_run
    ran = [i for i, sc in spec.items() if sc == scenario]
    failures = [outcome[i] for i in ran if outcome[i] is not None]
    assert ran and not failures, f"{len(failures)} of {len(ran)} cases failed:\n\n" + "\n".join(failures)


# ---- sequence tables: random ShardedEmbeddingCollection cases against the reference -----------------------------
def test_fuzz_sequence_parity():
    """Random sequence tables (every sharding type, dedup on, off or per table, every optimizer, max_length cuts,
    empty local batches) on the world sizes in turn: rows and lengths every step, then weights, as tests/sequence."""
    worlds = _worlds()
    if os.environ.get("EMBSHARD_FUZZ_SEQ_SEED"):
        seed = int(os.environ["EMBSHARD_FUZZ_SEQ_SEED"])
        cases = [draw_sequence_case(seed, worlds[(seed - SEQ_FIRST_SEED) % len(worlds)])]
    else:
        n = int(os.environ.get("EMBSHARD_FUZZ_SEQ_CASES", SEQ_CASES))
        cases = [draw_sequence_case(SEQ_FIRST_SEED + i, worlds[i % len(worlds)]) for i in range(n)]
    failures = [f for f in run_sequence_cases(cases).values() if f is not None]
    rerun = "rerun one with EMBSHARD_FUZZ_SEQ_SEED=<seed>"
    assert not failures, f"{len(failures)} sequence fuzz cases failed ({rerun}):\n\n" + "\n".join(failures)


# ---- invalid setups raise ConfigError naming the item, the value and the fix ------------------------------------
def invalid_setup(seed: int, device: str) -> tuple[str, dict, str]:
    """A valid 1-rank case with one thing made invalid: (what, ShardedEmbeddingBagCollection arguments plus "kjt"
    when the error comes at the first forward, the message's pattern)."""
    rng = random.Random(seed)
    case = draw_case(seed, device, [1])
    tables, plan = list(case.tables), case.plan
    t = tables[0]
    tw = lambda tier, dim=t.embedding_dim: TablePlan(t.name, TW, tier, (Shard(0, 0, t.num_embeddings, 0, dim),))  # noqa: E731
    kinds = ["gpu_tier", "width", "unknown_group_feature", "world_size", "missing_table", "kjt_keys", "uneven_rows"]
    if device == "cuda":
        kinds = [k for k in kinds if k != "gpu_tier"] + ["host_tier", "weight_decay", "adam_fp16", "lfu_prefetch"]
    kind = rng.choice(kinds)
    args = dict(tables=tables, plan=plan, optimizer=case.optimizer, output_groups=case.groups)
    args["options"] = case.lookup_options()
    gpu_tier = "hbm" if device == "cuda" else "host"
    if kind == "gpu_tier":
        tier = rng.choice(["hbm", "uvm", "uvm_caching"])
        pattern = rf"'{t.name}'.*memory tier '{tier}' needs a GPU, but this process computes on the CPU.*tier 'host'"
        args["plan"] = _replace_plan(plan, tw(tier))
    elif kind == "width":
        dim = 4 * rng.randint(1, 8) + rng.choice([1, 2, 3])
        args["tables"] = [replace(t, embedding_dim=dim)] + tables[1:]
        args["plan"] = _replace_plan(plan, tw(gpu_tier, dim))
        pattern = rf"table '{t.name}': a shard is {dim} columns wide; FBGEMM's TBE needs a multiple of 4"
    elif kind == "unknown_group_feature":
        args["output_groups"] = {"g": [t.feature_names[0], "no_such_feature"]}
        pattern = r"output group 'g' names features \['no_such_feature'\] that no table lists; known features"
    elif kind == "world_size":
        two = [
            replace(tp, shards=(*tp.shards, replace(tp.shards[0], rank=1))) if tp.sharding_type is DP else tp
            for tp in plan.tables
        ]
        args["plan"] = ShardingPlan(2, 1, tuple(two))  # a valid plan for 2 ranks
        pattern = r"the plan is for world_size=2 but the process group has 1 ranks: plan again"
    elif kind == "missing_table":
        args["plan"] = ShardingPlan(1, 1, tuple(tp for tp in plan.tables if tp.table != t.name))
        pattern = rf"plan does not match the tables: missing from plan \['{t.name}'\]"
    elif kind == "kjt_keys":
        args["kjt"] = [f for f in case.features if f != t.feature_names[0]]
        pattern = rf"KeyedJaggedTensor keys do not match the tables' features: missing \['{t.feature_names[0]}'\]"
    elif kind == "uneven_rows":
        rows = max(t.num_embeddings, 3)
        args["tables"] = [replace(t, num_embeddings=rows)] + tables[1:]
        blocks = (Shard(0, 0, 1, 0, t.embedding_dim), Shard(0, 1, rows - 1, 0, t.embedding_dim))
        args["plan"] = _replace_plan(plan, TablePlan(t.name, RW, gpu_tier, blocks))
        pattern = rf"plan for table '{t.name}' \(row_wise\): row blocks of sizes \[1, {rows - 1}\] are not uniform"
    elif kind == "host_tier":
        args["plan"] = _replace_plan(plan, tw("host"))
        pattern = rf"'{t.name}'.*memory tier 'host' is for CPU training.*plan with tier hbm, uvm or uvm_caching"
    elif kind == "weight_decay":
        args["optimizer"] = FusedOptimizerConfig(rng.choice(["sgd", "adagrad", "adam"]), weight_decay=0.01)
        args["plan"] = _replace_plan(plan, tw("hbm"))
        pattern = r"weight_decay=0.01: FBGEMM's fused GPU kernel ignores weight decay.*use rowwise_adagrad"
    elif kind == "adam_fp16":
        args["optimizer"] = FusedOptimizerConfig("adam")
        args["tables"] = [replace(t, data_type="fp16")] + [replace(x, data_type="fp32") for x in tables[1:]]
        args["plan"] = _replace_plan(plan, tw("hbm"))
        pattern = rf"'{t.name}'.*fp16 weights with adam fail inside FBGEMM's GPU kernel.*use data_type fp32"
    else:  # lfu_prefetch
        lru = ShardingPlan(1, 1, tuple(replace(tp, cache_algorithm="lru") for tp in plan.tables))
        args["plan"] = _replace_plan(lru, replace(tw("uvm_caching"), cache_algorithm="lfu"))
        args["options"] = LookupOptions(prefetch_pipeline=True)
        pattern = rf"tables \['{t.name}'\] use cache_algorithm 'lfu', but prefetch_pipeline needs 'lru'"
    return kind, args, pattern


def _replace_plan(plan: ShardingPlan, table_plan: TablePlan) -> ShardingPlan:
    return ShardingPlan(
        plan.world_size,
        plan.local_world_size,
        tuple(table_plan if tp.table == table_plan.table else tp for tp in plan.tables),
    )


INVALID_SEEDS = range(7000, 7040)


def test_invalid_setups_raise_config_error():
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    device = torch.device("cuda", torch.cuda.current_device()) if device_kind() == "cuda" else torch.device("cpu")
    seen = set()
    for seed in INVALID_SEEDS:
        kind, args, pattern = invalid_setup(seed, device_kind())
        seen.add(kind)
        keys = args.pop("kjt", None)
        with pytest.raises(ConfigError, match=pattern) as info:
            ebc = ShardedEmbeddingBagCollection(**args, device=device, seed=seed)
            if keys is not None:
                batch = {f: (torch.ones(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), None) for f in keys}
                ebc(to_kjt(batch, keys, device))
        assert info.value is not None, f"seed {seed} ({kind})"
    assert len(seen) >= 6, f"only {sorted(seen)} drawn"
