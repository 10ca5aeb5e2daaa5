"""The seq suite: sequence embeddings (one row per id), embshard's ShardedEmbeddingCollection (bench/embshard_ec.py)
against TorchRec's EmbeddingCollection under DistributedModelParallel (bench/baselines/torchrec_ec.py), dedup off
and on, uniform and Zipf ids, interleaved (per round and id law: TorchRec, embshard, TorchRec dedup, embshard
dedup)."""

from __future__ import annotations

import argparse
import statistics

from bench.suites.common import Machine, Step, nproc, results, torchrun

ID_LAWS = ("uniform", "zipf")


def seq_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """Round 1 of every (id law, dedup) for both frameworks, then round 2, ...: a time limit still leaves one of
    each. --cpu: tiny, and TorchRec without dedup only (its dedup has no CPU kernel)."""
    n = nproc(args, m)
    rounds = args.pairs or (1 if args.cpu else 2)
    workload = "tiny" if args.cpu else "seq4"
    timing = [
        "--steps",
        str(args.steps or (3 if args.cpu else 30)),
        "--warmup",
        str(args.warmup or (1 if args.cpu else 5)),
    ]
    out = []
    for i in range(rounds):
        for law in ID_LAWS:
            for dedup in ([], ["--dedup"]):
                tag = f"{workload} {law}{' dedup' if dedup else ''} (round {i + 1})"
                common = ["--workload", workload, "--ids", law, *dedup, *timing]
                for who, script in (
                    ("TorchRec", ["bench/baselines/torchrec_ec.py"]),
                    ("embshard", ["-m", "bench.embshard_ec"]),
                ):
                    if who == "TorchRec" and dedup and args.cpu:
                        continue  # TorchRec's dedup needs fbgemm's jagged_unique_indices, which has no CPU kernel
                    if who == "embshard" and dedup and getattr(args, "seq_dedup", "both") == "torchrec":
                        continue
                    argv = torchrun(n) + script + common
                    out.append(Step(f"{who} {tag}", argv, timeout=300, needs_gpus=n, exit_after_result_s=45))
    return out


def _ms(runs: list[dict[str, str]]) -> float | None:
    return statistics.median(float(r["ms_per_step"]) for r in runs) if runs else None


def seq_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Per workload, world and id law: each framework's median ms/step with dedup off and on, the best of the two
    per framework, TorchRec's best over embshard's best (> 1: embshard faster), and embshard's floor."""
    found = [r for r in results(log) if r.get("module") == "ec"]
    rows = []
    cases = sorted({(r.get("workload", "?"), r.get("world", "?"), r.get("ids", "uniform")) for r in found})
    for workload, world, law in cases:
        mine = [
            r
            for r in found
            if (r.get("workload", "?"), r.get("world", "?"), r.get("ids", "uniform")) == (workload, world, law)
        ]
        best, parts = {}, []
        for who in ("torchrec", "embshard"):
            times = {d: _ms([r for r in mine if r.get("framework") == who and r.get("dedup") == d]) for d in ("0", "1")}
            got = {d: t for d, t in times.items() if t is not None}
            if got:
                best[who] = min(got.values())
                modes = {d: sorted({r.get("step", "eager") for r in mine if r.get("framework") == who
                                    and r.get("dedup") == d}) for d in got}  # fmt: skip
                text = ", ".join(
                    f"dedup {'on' if d == '1' else 'off'} {t:.2f}"
                    + (f" ({'/'.join(modes[d])})" if who == "embshard" else "")
                    for d, t in sorted(got.items())
                )
                parts.append(f"{'TorchRec' if who == 'torchrec' else 'embshard'} {text} ms")
        if len(best) == 2:
            ratio = best["torchrec"] / best["embshard"]
            parts.append(f"best/best {ratio:.2f}x ({'embshard' if ratio > 1 else 'TorchRec'} faster)")
        priced = [
            (float(r["ms_per_step"]) - float(r["loss_ms"])) / float(r["predicted_ms"]) - 1
            for r in mine
            if r.get("framework") == "embshard" and float(r.get("predicted_ms", 0)) > 0 and "loss_ms" in r
        ]
        if priced:
            parts.append(f"embshard without the loss against the planner {statistics.median(priced):+.0%}")
        floor = [float(r["floor_ms"]) for r in mine if r.get("framework") == "embshard" and "floor_ms" in r]
        if floor:
            parts.append(f"floor {min(floor):.2f} ms")
        rows.append((f"{workload} world {world} {law} ids", "; ".join(parts)))
    return rows or [("seq", "no RESULT lines (see seq.log)")]
