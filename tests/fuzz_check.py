"""Train fuzz cases (fuzz_cases.py) on a process group and compare them with the plain-PyTorch reference.

Data flow: `run_cases(cases)` groups the cases by world size and makes ONE `run_distributed` call per world size
(spawning a process group costs seconds; world size 1 runs in this process); `fuzz_worker` loops over that world
size's cases on every rank, saving per case the outputs of every step, then every local shard's weights and
optimizer state, or the rank's traceback. A case that fails on some rank does not stop the batch: the ranks agree
after every case (one all-reduce on the default group) and move to a fresh process group, so a case left hanging (a
collective some rank never entered) times out after FUZZ_TIMEOUT_S and is reported, and the next case starts clean;
a case that kills the processes (NCCL's watchdog ends hung collectives that way) is reported and the cases after it
run in a new spawn. `check_case` then
trains the unsharded reference (tests/reference.py) on the global batches and compares outputs every step, then
final weights and optimizer state shard by shard, the shards' placement against the plan, and the dropped-id
counts. Each failure is reported with its seed, the command that reruns it and the case as Python source.
"""

from __future__ import annotations

import importlib
import os
import re
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from dist_harness import device_kind, run_distributed
from fuzz_cases import CW, Case, case_source, clean, column_wise_exact, feature_upstream, make_batches
from parity import to_kjt
from reference import ReferenceEBC

from embshard.runtime.comm import first_divergence

FUZZ_TIMEOUT_S = float(os.environ.get("EMBSHARD_FUZZ_TIMEOUT", "30"))  # a collective waiting longer is a hang
# fp32: GPU kernels sum in other orders (atomics) than the float64 reference. fp16 tables: every stored value is
# rounded to fp16 (2^-11 relative; stochastic rounding on FBGEMM: up to 2^-10) at init and after every update, and
# a bag sums up to ~10 such values with per-id weights up to 1.5.
TOL_FP32 = dict(rtol=1e-4, atol=1e-5)
TOL_FP16 = dict(rtol=1e-2, atol=1e-2)
# fp16/bf16 outputs: the pooled rows and their gradients are rounded to 8 (bf16) or 11 (fp16) significant bits.
TOL_LOW_OUTPUT = dict(rtol=2e-2, atol=2e-2)
# Adagrad's state under fp16/bf16 outputs sums squared gradients: a gradient's rounding error doubles in its square,
# and grows where the per-sample terms of a row's gradient cancel (seen: 2 of 2,944 elements 2.6% off on 4 GPUs, a
# table read by 18 samples). A lost or misplaced gradient is still 100% off.
TOL_LOW_OUTPUT_STATE = dict(rtol=5e-2, atol=2e-2)


@contextmanager
def _per_block_tiers(case: Case):
    """The case's extra per-block-state tiers (Case.per_block_tiers) in force in this process while it trains."""
    from embshard.spec.plan import MemoryTier

    column_wise = importlib.import_module(
        "embshard.sharding.column_wise"
    )  # the module (the package exports a function)

    saved = column_wise.PER_BLOCK_STATE_TIERS
    column_wise.PER_BLOCK_STATE_TIERS = saved | {MemoryTier(t) for t in case.per_block_tiers}
    try:
        yield
    finally:
        column_wise.PER_BLOCK_STATE_TIERS = saved


def _train(rank: int, device: torch.device, case: Case, group) -> dict:
    from embshard.runtime import comm

    with _per_block_tiers(case), comm.trace() as labels:
        result = _train_case(rank, device, case, group)
    result["collectives"] = [_unscoped(label) for label in labels]
    return result


def _unscoped(label: str) -> str:
    """A collective's label without the step numbers (ranks agree on them; a prefetch's label names the next)."""
    return re.sub(r"step \d+", "step", label)


def _train_case(rank: int, device: torch.device, case: Case, group) -> dict:
    from embshard.collection.bounds import DroppedIdsWarning
    from embshard.collection.sharded import ShardedEmbeddingBagCollection

    ebc = ShardedEmbeddingBagCollection(
        case.tables,
        case.plan,
        case.optimizer,
        output_groups=case.groups,
        device=device,
        group=group,
        seed=case.seed,
        options=case.lookup_options(),
    )
    names = list(case.output_widths())
    batches = make_batches(case)
    kjts = []
    for step, (per_rank, _) in enumerate(batches):
        batch = {
            f: (lengths, ids.to(getattr(torch, case.id_dtype)), w) for f, (lengths, ids, w) in per_rank[rank].items()
        }
        kjts.append(to_kjt(batch, case.keys_at(step), device))
    outputs, dtypes, handle = [], set(), None
    for step, (_, upstream) in enumerate(batches):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DroppedIdsWarning)
            try:
                out = ebc(kjts[step], prefetched=handle)
            except ValueError as e:  # out-of-range ids in error mode: every rank must raise at this step
                outputs.append({"raised": str(e)})
                continue
            prefetch = case.options.get("prefetch_pipeline") and step + 1 < len(kjts)
            handle = ebc.prefetch(kjts[step + 1]) if prefetch else None  # before this step's backward
        got = out if case.groups is not None else out.to_dict()
        dtypes |= {str(got[n].dtype) for n in names}
        loss = sum((got[n].float() * upstream[rank][n].to(device)).sum() for n in names)
        loss.backward()
        outputs.append({n: got[n].detach().float().cpu() for n in names})
    weights = [(name, s, w.detach().float().cpu().clone()) for name, s, w in ebc.local_shards()]
    states = [
        (name, s, {k: v.detach().float().cpu().clone() for k, v in st.items()})
        for name, s, st in ebc.local_optimizer_states()
    ]
    return {"outputs": outputs, "weights": weights, "states": states, "dropped": ebc.dropped_ids(), "dtypes": dtypes}


def fuzz_worker(rank: int, world_size: int, device: torch.device, cases: list[Case], out_dir: str) -> None:
    """Train every case on this rank, saving each case's result as soon as it is done to `out_dir`/<i>.<rank>.pt:
    {"outputs", "weights", "states", "dropped"}, or {"error": traceback}. `out_dir`/running.<rank> names the case
    in progress, so a case that kills the process is known and the cases done before it are kept."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=FUZZ_TIMEOUT_S)
    group = dist.new_group(backend=backend, timeout=timeout) if world_size > 1 else None
    for i, case in enumerate(cases):
        with open(os.path.join(out_dir, f"running.{rank}"), "w") as f:
            f.write(str(i))
        try:
            result = _train(rank, device, case, group)
        except Exception:
            result = {"error": traceback.format_exc()}
        torch.save(result, os.path.join(out_dir, f"{i}.{rank}.pt"))
        if world_size > 1:
            failed = torch.tensor(["error" in result], dtype=torch.int32, device=device)
            dist.all_reduce(failed)  # the default group: every rank gets here, hung cases timed out
            if int(failed):
                group = dist.new_group(backend=backend, timeout=timeout)  # leave the failed case's collectives


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device_kind() == "cuda" else torch.device("cpu")


def _close(got: torch.Tensor, want: torch.Tensor, tol: dict, what: str) -> str | None:
    try:
        torch.testing.assert_close(got.double(), want.double(), **tol)
    except AssertionError as e:
        return f"{what}: {e}"
    return None


def check_case(case: Case, results: list[dict]) -> list[str]:
    """Every way the ranks' results differ from the reference (empty: the case passed)."""
    if "died" in results[0]:
        return [results[0]["died"]]
    errors = [f"rank {r} raised:\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        return errors
    diverged = first_divergence([res["collectives"] for res in results])
    if diverged:  # a desync: on NCCL it hangs or corrupts; gloo may pair mismatched collectives of equal sizes
        return [f"the ranks started different collectives: {diverged}"]
    exact = column_wise_exact(case.options)
    per_block = {"uvm_caching", *case.per_block_tiers}
    cw_blocks = {  # column-wise tables whose blocks keep their own row-wise state (not exact, or per-block tiers)
        tp.table: [s.num_cols for s in sorted(tp.shards, key=lambda s: s.col_offset)]
        for tp in case.plan.tables
        if tp.sharding_type is CW and not (exact and tp.tier.value not in per_block)
    }
    ref = ReferenceEBC(case.tables, case.optimizer, case.seed, column_blocks=cw_blocks)
    table_of = {f: t for t in case.tables for f in t.feature_names}
    rows = {f: t.num_embeddings for f, t in table_of.items()}
    widths = case.output_widths()
    fp16_out = {n: any(table_of[f].data_type.value == "fp16" for f, _ in cols) for n, cols in widths.items()}
    out_dtype = case.lookup_options().output_dtype
    low = out_dtype.value != "fp32"
    for r, res in enumerate(results):
        if res["dtypes"] - {str(out_dtype.torch_dtype)}:
            errors.append(f"rank {r}: outputs of dtypes {sorted(res['dtypes'])}, want {out_dtype.torch_dtype}")
    batches = make_batches(case)
    drop = case.options.get("bounds_check") == "drop"
    for step, (per_rank, upstream) in enumerate(batches):
        errors += _raised_as_expected(step, per_rank, results, rows, drop)
        if any("raised" in res["outputs"][step] for res in results):
            if errors:
                return errors
            continue  # every rank stopped before any exchange: nothing trained, the reference skips the step too
        per_rank = [clean(b, rows) for b in per_rank]
        glob = {
            f: tuple(
                torch.cat([b[f][i] for b in per_rank]) if per_rank[0][f][i] is not None else None for i in range(3)
            )
            for f in case.features
        }
        up = {n: torch.cat([u[n] for u in upstream]) for n in widths}
        want_f = ref.step(glob, feature_upstream(case, up))
        want = {n: torch.cat([want_f[f] for f, _ in cols], dim=1) for n, cols in widths.items()}
        start = 0
        for r, B in enumerate(case.batch_sizes[step]):
            for n, w in want.items():
                got = results[r]["outputs"][step][n]
                tol = TOL_LOW_OUTPUT if low else TOL_FP16 if fp16_out[n] else TOL_FP32
                err = _close(got, w[start : start + B], tol, f"step {step} rank {r} output {n!r}")
                if err:
                    errors.append(err)
            start += B
        if errors:
            return errors  # later steps only repeat the difference
    fp16 = {t.name: t.data_type.value == "fp16" for t in case.tables}
    placed = set()
    for r, res in enumerate(results):
        for (name, s, w), (name2, s2, st) in zip(res["weights"], res["states"]):
            if (name, s) != (name2, s2):
                errors.append(f"rank {r}: local_shards() lists {name} {s}, local_optimizer_states() {name2} {s2}")
            placed.add((name, s))
            rows_, cols = slice(s.row_offset, s.row_offset + s.num_rows), slice(s.col_offset, s.col_offset + s.num_cols)
            tol = TOL_LOW_OUTPUT if low else TOL_FP16 if fp16[name] else TOL_FP32
            where = (
                f"table {name!r} shard rows {s.row_offset}+{s.num_rows} cols {s.col_offset}+{s.num_cols} on rank {r}"
            )
            if s.rank != r % case.plan.group_size:  # 2D: ranks within a sharding group
                errors.append(f"{where}: the shard says rank {s.rank}")
            err = _close(w, ref.weights[name][rows_, cols], tol, f"weights of {where}")
            errors += [err] if err else []
            want_st = ref.optimizer_state(name, s.row_offset, s.num_rows, s.col_offset, s.num_cols)
            if set(st) != set(want_st):
                errors.append(f"optimizer state of {where}: names {sorted(st)}, want {sorted(want_st)}")
                continue
            for k in want_st:
                err = _close(
                    st[k],
                    want_st[k],
                    TOL_LOW_OUTPUT_STATE if low else tol if case.optimizer.weight_decay else TOL_FP32,
                    f"state {k!r} of {where}",
                )
                errors += [err] if err else []
    planned = {(tp.table, s) for tp in case.plan.tables for s in tp.shards}
    if placed != planned:
        errors.append(
            f"shards held {sorted(map(str, placed - planned))} not planned, {sorted(map(str, planned - placed))} missing"
        )
    for r, res in enumerate(results):
        want_dropped: dict[str, int] = defaultdict(int)
        for per_rank, _ in batches if drop else []:
            for f, (_, ids, _) in per_rank[r].items():
                n = int(((ids < 0) | (ids >= rows[f])).sum())
                if n:
                    want_dropped[f] += n
        if res["dropped"] != dict(want_dropped):
            errors.append(f"rank {r}: dropped_ids() {res['dropped']}, want {dict(want_dropped)}")
    return errors


def _raised_as_expected(step: int, per_rank: list, results: list[dict], rows: dict, drop: bool) -> list[str]:
    """In error mode a step with out-of-range ids on some ranks raises on every rank: those ranks name the feature,
    the table and the value, the others name the ranks. Any other step raises nowhere."""
    bad = [
        r
        for r, b in enumerate(per_rank)
        if any(bool(((ids < 0) | (ids >= rows[f])).any()) for f, (_, ids, _) in b.items())
    ]
    errors = []
    for r, res in enumerate(results):
        got = res["outputs"][step].get("raised")
        where = f"step {step} rank {r}"
        if not bad or drop:
            errors += [f"{where} raised: {got}"] if got is not None else []
        elif got is None:
            errors.append(f"{where}: ranks {bad} have out-of-range ids (bounds_check='error') but nothing was raised")
        elif r in bad and not re.match(r"feature '\w+': id -?\d+ is outside table '\w+' \(rows 0\.\.\d+\)", got):
            errors.append(f"{where} has out-of-range ids; the error does not name feature, table and value: {got}")
        elif r not in bad and f"ranks {bad} have ids outside their tables" not in got:
            errors.append(f"{where}: ranks {bad} have out-of-range ids; the error does not name them: {got}")
    return errors


def describe_failure(case: Case, errors: list[str], worlds: str) -> str:
    """A failed case: its seed, how to rerun it, what differed, and the case as Python source."""
    head = "\n".join(e if len(e) < 3000 else e[:1500] + "\n...\n" + e[-1500:] for e in errors[:3])
    more = f"\n... and {len(errors) - 3} more differences" if len(errors) > 3 else ""
    corners = os.environ.get("EMBSHARD_FUZZ_CORNERS")
    env = f"EMBSHARD_FUZZ_SEED={case.seed} EMBSHARD_FUZZ_WORLDS={worlds}" + (
        f" EMBSHARD_FUZZ_CORNERS={corners}" if corners else ""
    )
    rerun = case.rerun or f"{env} pytest tests/test_fuzz.py"
    return (
        f"FUZZ CASE {case.seed} FAILED (world {case.world_size}); rerun: {rerun}\n{head}{more}\n{case_source(case)}\n"
    )


def _train_batch(cases: list[Case], W: int) -> tuple[list[list[dict] | None], str | None]:
    """Train `cases` on W ranks (W == 1: in this process). Per case the ranks' results, or None where the batch
    died before; and what killed it, if something did (the case in progress gets that as its error)."""
    with tempfile.TemporaryDirectory() as out_dir:
        death = None
        try:
            if W == 1:
                fuzz_worker(0, 1, _device(), cases, out_dir)
            else:
                run_distributed(fuzz_worker, W, cases, out_dir)
        except Exception as e:  # a rank crashed, or NCCL's watchdog ended a hung case
            death = f"the processes of world {W} died in this case:\n{e}"
        results = []
        for i in range(len(cases)):
            paths = [os.path.join(out_dir, f"{i}.{r}.pt") for r in range(W)]
            done = all(os.path.exists(p) for p in paths)
            results.append([torch.load(p, weights_only=False) for p in paths] if done else None)
        if death is not None and None in results:
            running = [os.path.join(out_dir, f"running.{r}") for r in range(W)]
            started = [int(open(p).read()) for p in running if os.path.exists(p)]
            i = max(started) if started else results.index(None)
            if results[i] is None:  # what the ranks that finished the case saw (an error there explains a hang)
                seen = {r: os.path.join(out_dir, f"{i}.{r}.pt") for r in range(W)}
                seen = {r: torch.load(p, weights_only=False) for r, p in seen.items() if os.path.exists(p)}
                raised = [f"(rank {r} had raised) {res['error']}" for r, res in seen.items() if "error" in res]
                results[i] = [{"died": "\n".join([death, *raised])}]
        return results, death


def run_cases(cases: list[Case], worlds: str = "", max_deaths: int = 3) -> dict[int, str | None]:
    """Train and check `cases`: one spawn per world size (another after a case kills the processes, up to
    `max_deaths` times). Returns, per case index, its failure description or None."""
    by_world: dict[int, list[int]] = defaultdict(list)
    for i, c in enumerate(cases):
        by_world[c.world_size].append(i)
    outcome: dict[int, str | None] = {}
    deaths = 0
    for W, todo in sorted(by_world.items()):
        t0, checked = time.perf_counter(), 0.0
        while todo:
            results, death = _train_batch([cases[i] for i in todo], W)
            t1 = time.perf_counter()
            for i, res in zip(todo, results):
                if res is not None:
                    errors = check_case(cases[i], res)
                    outcome[i] = describe_failure(cases[i], errors, worlds) if errors else None
            checked += time.perf_counter() - t1
            todo = [i for i, res in zip(todo, results) if res is None]
            deaths += death is not None
            if death is not None and deaths >= max_deaths:
                for i in todo:
                    outcome[i] = describe_failure(cases[i], [f"not run: the processes died {deaths} times"], worlds)
                todo = []
        n = len(by_world[W])
        print(f"fuzz: world {W}: {n} cases in {time.perf_counter() - t0:.1f} s (checking {checked:.1f} s)")
    return outcome
