"""The embedding step alone: the emb suite (against TorchRec's DistributedModelParallel), soak (memory over 5,000
steps), profile (torch.profiler of a step) and build (building the sharded module)."""

from __future__ import annotations

import argparse
import re

from bench.suites.common import (
    Machine,
    Step,
    bandwidth_step,
    cuda_env,
    nproc,
    py,
    results,
    step_blocks,
    torchrun,
)


# ---- emb ------------------------------------------------------------------------------------------------------
def emb_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    n = nproc(args, m)
    pairs = args.pairs or (1 if args.cpu else 2)
    steps_ = str(args.steps or (5 if args.cpu else 100))
    workloads = ["tiny"] if args.cpu else args.workloads.split(",")
    hbm = args.torchrec_hbm_gib or m.gpu_gib
    gpus = n
    out = bandwidth_step(args)
    for i in range(pairs):  # pair 1 of every workload, then pair 2, ...: a time limit still leaves one of each
        for w in workloads:
            base = ["bench/baselines/torchrec_dmp.py", "--workload", w]
            mine = ["-m", "bench.embshard_dmp", "--workload", w, "--plan", "planner", "--counts", "both"]
            if w == "hetero124":
                base += ["--hbm-gib", f"{hbm:g}", "--force", "small-dp"]
            elif w == "overflow":
                base = ["-m", "bench.torchrec_more", "--workload", w, "--hbm-gib", "16"]
                mine += ["--hbm-gib", "16"]
            elif w == "mlperf":  # the end-to-end model's tables (97 GiB): TorchRec planning for the whole card
                base = ["-m", "bench.torchrec_more", "--workload", w, "--hbm-gib", f"{hbm:g}"]
            runs = [(f"TorchRec {w}", base)]
            graph = getattr(args, "emb_graph", None)
            if graph != "only":
                runs.append((f"embshard {w}", mine))
            if graph:  # the same plan, each step one replay (host counts)
                runs.append((f"embshard {w} graph", ["host" if a == "both" else a for a in mine] + ["--graph"]))
            for label, argv in runs:
                out.append(
                    Step(
                        f"{label} (pair {i + 1})",
                        torchrun(n) + argv + ["--steps", steps_],
                        timeout=300,
                        needs_gpus=gpus,
                    )
                )
    return out


# ---- soak -----------------------------------------------------------------------------------------------------
def soak_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    steps_ = args.steps or (300 if args.cpu else 5000)
    workload = "tiny" if args.cpu else "uniform26"
    argv = torchrun(nproc(args, m)) + ["-m", "bench.embshard_dmp", "--workload", workload, "--plan", "planner"]
    argv += ["--steps", str(steps_), "--mem-at", f"100,{steps_}", "--bench", "soak"]
    return [Step(f"{workload}, {steps_} steps", argv, timeout=500, needs_gpus=nproc(args, m))]


def soak_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for r in results(log):
        marks = sorted(
            (int(k[len("allocated_gib_step") :]), float(v)) for k, v in r.items() if k.startswith("allocated_gib_step")
        )
        if len(marks) >= 2:
            (s0, a0), (s1, a1) = marks[0], marks[-1]
            growth = (a1 - a0) * 1024
            word = "no growth" if abs(growth) <= 1.0 else f"GROWTH {growth:+.1f} MiB"
            text = f"allocated {a0:.3f} GiB at step {s0}, {a1:.3f} GiB at step {s1}: {word}; {r['ms_per_step']} ms/step"
            rows.append((r.get("workload", "?"), text))
    return rows or [("soak", "no RESULT line (see soak.log)")]


def profile_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    n = nproc(args, m)
    out = []
    for w in ["tiny"] if args.cpu else args.workloads.split(","):
        base = ["bench/baselines/torchrec_dmp.py", "--workload", w]
        if w == "hetero124":
            base += ["--hbm-gib", f"{args.torchrec_hbm_gib or m.gpu_gib:g}", "--force", "small-dp"]
        elif w == "overflow":
            base = ["-m", "bench.torchrec_more", "--workload", w, "--hbm-gib", "16"]
        mine = ["-m", "bench.embshard_dmp", "--workload", w, "--plan", "planner"] + (
            ["--hbm-gib", "16"] if w == "overflow" else []
        )
        for who, script in (("TorchRec", base), ("embshard", mine)):
            argv = torchrun(n) + ["-m", "bench.profile_step", *script, "--steps", "10"]
            out.append(Step(f"profile {who} {w}", argv, timeout=200, needs_gpus=n))
    return out


def profile_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    syncs = re.findall(r"^syncs: (.*)$", log, re.M)
    return [("host syncs per run", "; ".join(syncs) or "none printed")]


# ---- build: building the module, UVM first touch on the GPU or on host threads -------------------------------------
def build_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """bench/uvm_fill.py (one GPU: FBGEMM's fill of a managed buffer against host threads), then hetero124's build
    (`--build-only`) with FBGEMM's fill and with the host first touch (EMBSHARD_UVM_FIRST_TOUCH), interleaved."""
    n = nproc(args, m)
    workload = ["--workload", "tiny"] if args.cpu else ["--workload", "hetero124", "--plan", "planner"]
    out = [] if args.cpu else [Step("uvm_fill (one GPU)", py() + ["-m", "bench.uvm_fill", "--gib", "16"], timeout=300)]
    for i in range(args.pairs or 2):
        for way in ("fbgemm", "host"):
            env = dict(cuda_env(args), EMBSHARD_UVM_FIRST_TOUCH=way)
            argv = torchrun(n) + ["-m", "bench.embshard_dmp", *workload, "--build-only"]
            out.append(Step(f"build, first touch {way} (pair {i + 1})", argv, env, timeout=300, needs_gpus=n))
    return out


def build_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for label, text in step_blocks(log):
        found = re.findall(r"^(plan [\d.]+ s, build .*?); plan:", text, re.M) or re.findall(r"^(.*GB/s.*)$", text, re.M)
        rows.append((label, "; ".join(found[-3:]) if found else "see build.log"))
    return rows
