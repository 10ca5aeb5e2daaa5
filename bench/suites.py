"""The suites of bench/run.py: each one's steps (commands, environment, time limit) and the summary rows it
reads back from its log. Kept apart from the runner so that the commands can be checked without running them."""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
E2E_CONFIG = "configs/dlrm_dcnv2_mlperf.yaml"
CKPT_DIR = "/tmp/embshard_ckpt_bench"
LOADER_DIR = "/tmp/embshard_loader"
TOPOLOGY_FILE = "/tmp/embshard_topology.yaml"
INTEROP_DIR = "/tmp/embshard_interop"
PYTEST_LINE = r"^=*\s*(\d+ (?:passed|failed|error|skipped|deselected).*?)\s*=*$"  # pytest's last line


@dataclass
class Machine:
    """What the runner found (or, for --dry-run, assumes): GPUs, their memory, host CPUs."""

    gpus: int = 0
    gpu: str = ""
    gpu_mib: int = 0
    cpus: int = 1

    @property
    def gpu_gib(self) -> int:
        """The card's memory, whole GiB (what TorchRec's planner is given as --hbm-gib)."""
        return int(self.gpu_mib / 1024)


@dataclass
class Step:
    """One command of a suite."""

    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 300.0
    needs_gpus: int = 0
    """GPUs the step needs (skipped with a note when the machine has fewer; 0: runs anywhere)."""
    epilogue: Callable[[], str] | None = None
    """Text written into the log after the command ends, stopped at its time limit or not."""
    exit_after_result_s: float = 0.0
    """If > 0: the command prints its RESULT line last, and is stopped if it has not exited this many seconds after
    it (a process hung in its teardown keeps its result but does not hold the suite's time)."""


@dataclass(frozen=True)
class Suite:
    name: str
    what: str
    gpus: str
    typical: str
    steps: Callable[[argparse.Namespace, Machine], list[Step]]
    summary: Callable[[str, argparse.Namespace], list[tuple[str, str]]]


def py() -> list[str]:
    return [sys.executable]


def pytest(*args: str) -> list[str]:
    """This Python's pytest, quiet, without its cache folder, on `args`."""
    return py() + ["-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]


def cuda_env(args: argparse.Namespace) -> dict[str, str]:
    return {} if args.cpu else {"EMBSHARD_TEST_DEVICE": "cuda"}


def nproc(args: argparse.Namespace, m: Machine) -> int:
    return args.nproc or (2 if args.cpu else max(1, min(m.gpus, 2)))


def results(log: str) -> list[dict[str, str]]:
    return [r for r in (report.parse_line(x) for x in log.splitlines()) if r is not None]


def bandwidth_step(args: argparse.Namespace) -> list[Step]:
    """`embshard calibrate` without the kernel fits: the bandwidths the physical floors divide by."""
    if args.cpu or args.no_bandwidth:
        return []
    argv = py() + ["-m", "embshard.cli", "calibrate", "--out", TOPOLOGY_FILE, "--iters", "5", "--no-kernels"]
    return [Step("bandwidth (embshard calibrate)", argv, timeout=150, needs_gpus=1)]


def last_match(log: str, pattern: str) -> str:
    found = re.findall(pattern, log, re.M)
    return found[-1] if found else ""


# ---- tests ----------------------------------------------------------------------------------------------------
def tests_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    argv = pytest("--durations=30")
    argv.append(f"--junitxml={args.out}/tests_junit.xml")
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv.append(f"--timeout={args.test_timeout}")
    workers = args.test_workers if args.test_workers >= 0 else (8 if m.gpus and m.cpus >= 16 and not args.cpu else 0)
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        # work units to whichever worker is free, longest first: a test alone, or a module that defines a
        # module-scoped fixture (set up once, on one worker): tests/conftest.py's scheduler and order
        argv += ["-n", str(workers), "--dist", "loadgroup"]
    argv += args.pytest_args.split() if args.pytest_args else ["tests"]
    times = f"{args.out}/test_times.txt"
    env = cuda_env(args) | {"EMBSHARD_TEST_TIMES": times}  # kept if the time limit stops it
    return [Step("pytest", argv, env, timeout=600, epilogue=lambda: failures_text(times))]


def failures_text(times: str) -> str:
    """The failures tests/conftest.py wrote to TIMES.failures as they happened, for the log: pytest prints its own
    at the end only (pytest-xdist too), which a run stopped at its time limit never reaches."""
    path = Path(f"{times}.failures")
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    return f"\n--- failed tests as they ended ({path.name}) ---\n{text}\n--- end of {path.name} ---\n" if text else ""


def tests_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    final = last_match(log, PYTEST_LINE) or "no pytest summary line"
    rows = [("pytest", final)]
    times = Path(args.out) / "test_times.txt"
    if times.exists():
        entries = [line.split(None, 3) for line in times.read_text().splitlines() if line.strip()]
        per_file: dict[str, float] = {}
        for sec, _, node, _ in (e for e in entries if len(e) == 4):
            name = node.split("::")[0]
            per_file[name] = per_file.get(name, 0.0) + float(sec)
        top = sorted(per_file.items(), key=lambda kv: -kv[1])[:6]
        rows.append(("slowest files", ", ".join(f"{name} {sec:.0f} s" for name, sec in top) + " (test_times.txt)"))
    failed = list(dict.fromkeys(re.findall(r"^(?:FAILED|ERROR) (\S+)", log, re.M)))  # failures file, then pytest's
    if failed:
        rows.append(("failed", ", ".join(failed[:5]) + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")))
    return rows


# ---- fuzz -----------------------------------------------------------------------------------------------------
def fuzz_plan(args: argparse.Namespace) -> list[tuple[int, int]]:
    spec = args.fuzz or ("2:20,1:10" if args.cpu else "2:300,1:100")
    try:
        return [(int(w), int(n)) for w, n in (item.split(":") for item in spec.split(","))]
    except ValueError:
        raise SystemExit(f"--fuzz {spec!r}: expected WORLD:CASES[,WORLD:CASES...], e.g. 2:300,1:100") from None


def fuzz_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    steps = []
    for world, cases in fuzz_plan(args):
        env = cuda_env(args) | {"EMBSHARD_FUZZ_CASES": str(cases), "EMBSHARD_FUZZ_WORLDS": str(world)}
        argv = pytest("-s", "tests/test_fuzz.py")
        steps.append(Step(f"world {world}, {cases} cases", argv, env, timeout=420, needs_gpus=world))
    argv = pytest("tests/test_fuzz_regressions.py")
    steps.append(Step("regressions", argv, cuda_env(args), timeout=120))
    return steps


def step_blocks(log: str) -> list[tuple[str, str]]:
    """(step label, its output) for each command of a suite's log."""
    parts = re.split(r"^\+ \[\S+ \d+/\d+\] (.*?): .*$", log, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def fuzz_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for label, text in step_blocks(log):
        found = re.findall(r"fuzz: (\d+ random cases, per world size .*?, \d+ failed)", text)
        rows.append((label, found[-1] if found else last_match(text, PYTEST_LINE) or "no summary line (see fuzz.log)"))
        rows += [("failed case", x) for x in re.findall(r"^E +(FUZZ CASE.*)$", text, re.M)[:5]]
    return rows or [("fuzz", "no summary line (see fuzz.log)")]


# ---- e2e ------------------------------------------------------------------------------------------------------
def e2e_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    n = nproc(args, m)
    pairs = args.pairs or (1 if args.cpu else 3)
    steps_, warmup = args.steps or (3 if args.cpu else 60), args.warmup or (1 if args.cpu else 20)
    scale = args.scale or (1e-5 if args.cpu else None)
    size, tr_size = [], []
    if scale:  # embshard's --scale multiplies the rows, the baseline's divides them
        size, tr_size = ["--scale", f"{scale:g}"], ["--scale", f"{1 / scale:g}"]
    if args.cpu:
        size, tr_size = size + ["--batch-size", "64"], tr_size + ["--batch-size", "64"]
    timing = ["--steps", str(steps_), "--warmup", str(warmup)]
    tr_law, law = [], []  # the MLPerf law (uniform ids, fixed bags) by default; both frameworks draw the same law
    if args.data_law == "zipf-poisson":
        tr_law = ["--ids", "zipf", "--zipf-alpha", "1.05", "--bag-lengths", "poisson"]
        law = ["data.synthetic.zipf_exponent=1.05", "data.synthetic.bag_lengths=poisson"]
        law.append("planner.settings.zipf_alpha=1.05")  # the planner prices the skew (UVM-cache hits)

    def torchrec(precision: str) -> Step:
        argv = torchrun(n) + ["bench/baselines/torchrec_dlrm_train.py", *timing, "--precision", precision, *tr_size]
        return Step(f"TorchRec {precision}", argv + tr_law, timeout=240, needs_gpus=n, exit_after_result_s=45)

    def embshard(tag: str, *extra: str) -> Step:
        argv = py() + ["bench/train_e2e.py", "--config", E2E_CONFIG, "--nproc", str(n), *timing, "--eval", *size]
        argv += ["--tag", tag, *extra, *law]
        return Step(f"embshard {tag}", argv, timeout=240, needs_gpus=n, exit_after_result_s=45)

    out = bandwidth_step(args)
    precisions = args.precisions.split(",")
    compile_ = ["--compile", args.compile] if args.compile else []
    for i in range(pairs):
        last = i == pairs - 1
        for p in precisions:
            pooled = ["lookup.output_dtype=bf16"] if p == "bf16" and args.bf16_pooled == "bf16" else []
            profile = ["--profile-steps", "3"] if (args.profile or args.timeline) and last else []
            profile += ["--trace", f"/tmp/embshard_trace_{p}.json"] if args.timeline and last else []
            out.append(torchrec(p))
            if args.cuda_graph != "only":
                out.append(embshard(p, "--precision", p, *profile, *pooled, *compile_))
            if args.cuda_graph:  # the step as one CUDA graph (holding compiled kernels, not reduce-overhead's graphs)
                graph = ["training.cuda_graph=true"] + (profile if args.cuda_graph == "only" else [])
                graph += compile_ if args.compile != "reduce-overhead" else []
                out.append(embshard(f"{p}_graph", "--precision", p, *pooled, *graph))
    if args.timeline:  # the traces stay in /tmp; only the pictures go to the output folder
        for p in precisions:
            argv = py() + [
                "bench/timeline.py",
                f"/tmp/embshard_trace_{p}.json",
                "--out",
                f"{args.out}/timeline_{p}.png",
            ]
            out.append(Step(f"timeline {p}", argv + ["--steps", "2", "--gaps", "8"], timeout=90))
    if args.variants:  # embshard's other settings, each once
        out.append(
            embshard("semi_sync_bf16", "--precision", "bf16", "--pipeline", "semi_sync", "lookup.output_dtype=bf16")
        )
        out += [torchrec("tf32"), embshard("tf32", "--precision", "tf32")]
        out.append(embshard("none_fp32", "--pipeline", "none"))
    if args.loss_steps:
        argv = py() + [
            "bench/loss_curves.py",
            "--config",
            E2E_CONFIG,
            "--nproc",
            str(n),
            "--steps",
            str(args.loss_steps),
        ]
        argv += ["--out", f"{args.out}/loss_curves.png"] + (["--scale", f"{scale:g}", "--small"] if args.cpu else [])
        out.append(Step("loss curves", argv, timeout=300, needs_gpus=n))
    return out


def compare_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Per case: TorchRec and embshard medians, the ratio's median and spread over pairs, and the floor."""
    folder = report.Folder(Path(args.out))
    folder.runs = [r | {"_file": "log"} for r in results(log)]
    for name, pattern in report.BANDWIDTH_LINES.items():
        found = [float(x) for x in pattern.findall(log)]
        if found:
            folder.bandwidth[name] = statistics.median(found) * 1e9
    folder.meta["gpu"] = last_match(log, r'^META .*gpu="([^"]*)"')
    rows = []
    for row in report.rows_of(folder).values():
        ems = [float(r["ms_per_step"]) for r in row.emb]
        text = f"embshard {report.fmt_ms(ems)} ms"
        if row.base:
            text = f"TorchRec {report.fmt_ms([float(r['ms_per_step']) for r in row.base])} ms, " + text
            text += f"; ratio {report.fmt_ratio(row.ratios).replace('**', '')}: {report.verdict(row.ratios)}"
        pred = [float(r["predicted_ms"]) for r in row.emb if "predicted_ms" in r]
        if pred:
            text += f"; predicted {statistics.median(pred):.2f} ms"
        floor = [f for f in (report.floor_terms(r, folder)[0] for r in row.emb) if f is not None]
        if floor:
            text += f"; floor {statistics.median(floor):.2f} ms"
        world = int(row.emb[0].get("world", 1))
        if report.bench_of(row.emb[0]) == "e2e" and all("samples_per_s" in r for r in row.emb):
            per_gpu = statistics.median(float(r["samples_per_s"]) for r in row.emb) / world
            text += f"; {per_gpu / 1e6:.3f} M samples/s per GPU"
        rows.append((report.case_title(row), text))
    return rows or [("results", "no RESULT lines (see the log)")]


# ---- scaling: weak scaling of the MLPerf model, 1, 2 and 4 GPUs at 8192 samples per GPU -------------------------
SCALING_ONE_GPU_ROWS = 0.5
"""At 1 GPU the MLPerf tables (97 GiB) do not fit one card: every table keeps this fraction of its rows."""


def scaling_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """Per round and precision: TorchRec at 4 GPUs, embshard at 4, embshard at 2 (the pair is TorchRec and
    embshard at 4); after the rounds, embshard at 1 GPU on tables at half their rows, once per precision."""
    pairs = args.pairs or (1 if args.cpu else 2)
    timing = [
        "--steps",
        str(args.steps or (3 if args.cpu else 60)),
        "--warmup",
        str(args.warmup or (1 if args.cpu else 20)),
    ]
    scale = args.scale or (1e-5 if args.cpu else 1.0)
    small = ["--batch-size", "64"] if args.cpu else []
    graph = ["training.cuda_graph=true"] if args.cuda_graph else []

    def torchrec(n: int, p: str) -> Step:
        size = ["--scale", f"{1 / scale:g}"] if scale != 1.0 else []
        argv = torchrun(n) + ["bench/baselines/torchrec_dlrm_train.py", *timing, "--precision", p, *size, *small]
        return Step(
            f"TorchRec {p}, {n} GPUs", argv, timeout=240, needs_gpus=0 if args.cpu else n, exit_after_result_s=45
        )

    def embshard(n: int, p: str, rows: float) -> Step:
        argv = py() + ["bench/train_e2e.py", "--config", E2E_CONFIG, "--nproc", str(n), *timing, *small]
        argv += ["--scale", f"{rows:g}"] if rows != 1.0 else []
        argv += ["--tag", f"{p}_x{n}", "--precision", p] + (["lookup.output_dtype=bf16"] if p == "bf16" else [])
        return Step(f"embshard {p}, {n} GPUs", argv + (graph if p == "bf16" else []), timeout=240,
                    needs_gpus=0 if args.cpu else n, exit_after_result_s=45)  # fmt: skip

    out = []
    precisions = args.precisions.split(",")
    for _ in range(pairs):
        for p in precisions:
            out += [torchrec(4, p), embshard(4, p, scale), embshard(2, p, scale)]
    out += [embshard(1, p, scale * SCALING_ONE_GPU_ROWS) for p in precisions]
    return out


def scaling_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Per precision: samples/s per GPU at 1, 2 and 4 GPUs (median of the runs), 4 GPUs against 2, and the ratio
    to TorchRec at 4 GPUs (median and spread over the pairs bench/report.py makes: each embshard run with the
    TorchRec run of its case before it)."""
    runs = [r for r in results(log) if "samples_per_s" in r and "world" in r]
    folder = report.Folder(Path(args.out))
    folder.runs = [r | {"_file": "log"} for r in runs]
    ratios = {report.case_of(row.emb[0]): row.ratios for row in report.rows_of(folder).values()}
    rows = []
    for p in args.precisions.split(","):
        per_gpu: dict[tuple[str, int], list[float]] = {}
        for r in runs:
            if (r.get("precision") or "fp32") == p:
                key = (r.get("framework", "?"), int(r["world"]))
                per_gpu.setdefault(key, []).append(float(r["samples_per_s"]) / int(r["world"]))
        if not per_gpu:
            continue
        med = {k: statistics.median(v) for k, v in per_gpu.items()}
        text = ", ".join(f"{n} GPUs {med[('embshard', n)]:,.0f}" for n in (1, 2, 4) if ("embshard", n) in med)
        text = f"embshard samples/s per GPU: {text}"
        if ("embshard", 2) in med and ("embshard", 4) in med:
            text += f"; 4 GPUs keep {med[('embshard', 4)] / med[('embshard', 2)]:.1%} of 2 GPUs' per-GPU rate"
        at4 = [r for r in runs if r.get("framework") == "embshard" and r["world"] == "4" and r.get("precision") == p]
        paired = ratios.get(report.case_of(at4[0]), []) if at4 else []
        if paired:
            text += f"; TorchRec at 4 GPUs {med[('torchrec', 4)]:,.0f} per GPU, embshard {report.fmt_ratio(paired)}"
        rows.append((f"weak scaling, {p}", text.replace("**", "")))
    return rows or [("scaling", "no RESULT lines (see scaling.log)")]


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
            mine = ["bench/embshard_dmp.py", "--workload", w, "--plan", "planner", "--counts", "both"]
            if w == "hetero124":
                base += ["--hbm-gib", f"{hbm:g}", "--force", "small-dp"]
            elif w == "overflow":
                base = ["bench/torchrec_more.py", "--workload", w, "--hbm-gib", "16"]
                mine += ["--hbm-gib", "16"]
            elif w == "mlperf":  # the end-to-end model's tables (97 GiB): TorchRec planning for the whole card
                base = ["bench/torchrec_more.py", "--workload", w, "--hbm-gib", f"{hbm:g}"]
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
    argv = torchrun(nproc(args, m)) + ["bench/embshard_dmp.py", "--workload", workload, "--plan", "planner"]
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


# ---- rawids ---------------------------------------------------------------------------------------------------
def rawids_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """The raw-id tests on the GPUs (the map's step under CUDA's sync debug mode, parity with a static table), the
    map's step profiled in one process (bench/raw_ids_profile.py: kernels, launches and syncs per phase), then
    uniform26 with every table ids: raw (capacity = rows) against static, interleaved: ids within the rows (after
    the first batches every id is resident) and from 10 x rows values (admitting and evicting every step); then the
    same against TorchRec's managed-collision tables (bench/torchrec_mc.py: MCH modules, capacity = rows, against its
    static tables, interleaved) on the same ranks, id spaces and batches."""
    n = nproc(args, m)
    tests = pytest("tests/rawids")
    out = [Step("tests/rawids", tests, cuda_env(args), timeout=400)]
    profile = py() + ["bench/raw_ids_profile.py", "--out", f"{args.out}/rawids_profile.txt"]
    profile += ["--scale", "small", "--steps", "2"] if args.cpu else ["--device", "cuda", "--uniform26"]
    out.append(Step("the map's step profiled (one process)", profile, cuda_env(args), timeout=300))
    workload = "tiny" if args.cpu else "uniform26"
    timed = ["--batches", "8", "--rounds", "3", "--steps", str(args.steps or (5 if args.cpu else 20))]
    for space in ("1", "10"):
        argv = torchrun(n) + ["bench/embshard_dmp.py", "--workload", workload, "--ids", "both", "--id-space", space]
        out.append(Step(f"{workload} static vs raw, id space {space} x rows", argv + timed, timeout=400,
                        needs_gpus=n))  # fmt: skip
    argv = torchrun(n) + ["bench/embshard_dmp.py", "--workload", workload, "--ids", "both", "--id-space", "1"]
    out.append(Step(f"{workload} static vs raw, the map's step eager (EMBSHARD_RAWID_GRAPH=0)", argv + timed,
                    {"EMBSHARD_RAWID_GRAPH": "0"}, timeout=400, needs_gpus=n))  # fmt: skip
    for space in ("1", "10"):
        argv = torchrun(n) + ["bench/torchrec_mc.py", "--workload", workload, "--id-space", space]
        out.append(Step(f"{workload} TorchRec static vs managed collisions, id space {space} x rows", argv + timed,
                        timeout=400, needs_gpus=n))  # fmt: skip
    return out


def rawids_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    """Per id space: embshard's raw/static ratio and, beside it, TorchRec's managed-collision/static ratio."""
    rows = [("tests/rawids", last_match(log, PYTEST_LINE) or "no pytest summary line")]
    runs = [r for r in results(log) if r.get("bench") == "rawids"]
    theirs = [r for r in results(log) if r.get("bench") == "torchrec_mc"]
    eager = [r for r in runs if r.get("map_graph") == "0"]
    runs = [r for r in runs if r.get("map_graph") != "0"]
    for space in dict.fromkeys(r.get("id_space") for r in runs + theirs):
        ms = {r["ids"]: float(r["ms_per_step"]) for r in runs if r.get("id_space") == space}
        tr = {r["ids"]: float(r["ms_per_step"]) for r in theirs if r.get("id_space") == space}
        parts, first = [], next(r for r in runs + theirs if r.get("id_space") == space)
        if {"static", "raw"} <= ms.keys():
            raw = next(r for r in runs if r.get("id_space") == space and r["ids"] == "raw")
            parts.append(f"embshard static {ms['static']:.2f} ms, raw {ms['raw']:.2f} ms "
                         f"({ms['raw'] / ms['static']:.2f}x; admitted {raw.get('admitted')}, "
                         f"evicted {raw.get('evicted')})")  # fmt: skip
        if {"static", "mc"} <= tr.keys():
            parts.append(f"TorchRec static {tr['static']:.2f} ms, managed collisions {tr['mc']:.2f} ms "
                         f"({tr['mc'] / tr['static']:.2f}x)")  # fmt: skip
        if parts:
            rows.append((f"{first['workload']} world {first['world']}, id space {space} x rows", "; ".join(parts)))
    ms = {r["ids"]: float(r["ms_per_step"]) for r in eager}
    if {"static", "raw"} <= ms.keys():
        rows.append(("the map's step eager (EMBSHARD_RAWID_GRAPH=0), id space 1 x rows",
                     f"embshard static {ms['static']:.2f} ms, raw {ms['raw']:.2f} ms "
                     f"({ms['raw'] / ms['static']:.2f}x)"))  # fmt: skip
    return rows


# ---- retrieval, ckpt, loader ----------------------------------------------------------------------------------
def retrieval_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    argv = torchrun(2) + ["bench/full_softmax.py"] + (["--cpu"] if args.cpu else [])
    return [Step("full softmax, 1M x 64 items, 2 ranks", argv, timeout=300, needs_gpus=2)]


def retrieval_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for r in results(log):
        if r.get("bench") == "retrieval":
            text = (f"sharded peak {r['sharded_peak_gib']} GiB vs materialized {r['materialized_peak_gib']} GiB "
                    f"(logits alone {r['logits_gib']} GiB): {float(r['peak_share']):.1%}; "
                    f"{r['sharded_ms']} vs {r['materialized_ms']} ms/step")  # fmt: skip
            rows.append((f"{r['items']} x {r['dim']}, {r['world']} ranks", text))
    parity = last_match(log, r"^(max \|sharded - materialized\|.*)$")
    return rows + ([("parity", parity)] if parity else []) or [("retrieval", "no RESULT line (see retrieval.log)")]


def ckpt_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    n = nproc(args, m)
    scale = args.ckpt_scale or (0.0005 if args.cpu else 0.1)
    argv = torchrun(n) + ["bench/checkpoint_bench.py", "--dir", CKPT_DIR, "--scale", f"{scale:g}"]
    out = [Step(f"checkpoint_bench, {n} ranks, scale {scale:g}", argv, timeout=420, needs_gpus=n)]
    if not args.cpu:
        argv = pytest("tests/checkpoint")
        out.append(Step("checkpoint tests on the GPUs", argv, cuda_env(args), timeout=240))
    return out


def ckpt_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for r in results(log):
        if r.get("bench") == "ckpt":
            text = (f"{r['gb']} GB: dd {r['dd_gbs']} GB/s, sync save {r['sync_save_gbs']} GB/s, async save "
                    f"blocks {r['async2_blocking_s']} s (first {r['async1_blocking_s']} s), commits at "
                    f"{r['async2_commit_gbs']} GB/s; verify {r.get('verify_gbs', '-')} GB/s; reload "
                    f"{r['reload_gbs']} GB/s (unchecked {r.get('reload_unchecked_gbs', '-')}), parity "
                    f"{r['reload_parity']}; peak RSS {r['peak_rss_gib']} GiB")  # fmt: skip
            rows.append((f"{r['world']} ranks, scale {r['scale']}", text))
    tests = last_match(log, PYTEST_LINE)
    return rows + ([("tests/checkpoint", tests)] if tests else []) or [("ckpt", "no RESULT line (see ckpt.log)")]


def loader_workers(args: argparse.Namespace, m: Machine) -> str:
    if args.loader_workers:
        return args.loader_workers
    if args.cpu:
        return "0,1"
    counts = [0] + [w for w in (8, 16, 32) if w <= m.cpus]
    return ",".join(str(w) for w in counts)


def loader_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    argv = py() + ["bench/loader.py", "--data-dir", LOADER_DIR, "--workers", loader_workers(args, m)]
    if args.cpu:
        argv += ["--rows", "20000", "--seconds", "1", "--layouts", "multihot-packed,onehot"]
    else:
        argv += ["--rows", "1000000", "--seconds", "8"]
    return [Step(f"loader, workers {loader_workers(args, m)}", argv, timeout=540)]


def loader_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    best: dict[str, dict[str, str]] = {}
    for r in results(log):
        if r.get("bench") == "loader":
            cur = best.get(r["layout"])
            if cur is None or float(r["samples_per_s"]) > float(cur["samples_per_s"]):
                best[r["layout"]] = r
    rows = []
    for layout, r in best.items():
        text = (f"{float(r['samples_per_s']) / 1e6:.3f} M samples/s with {r['workers']} workers "
                f"({r['cpus']} CPUs), peak RSS {r['peak_rss_gib']} GiB")  # fmt: skip
        rows.append((f"{r['framework']} {layout}", text))
    return rows or [("loader", "no RESULT lines (see loader.log)")]


# ---- kernels, tiers, profile, bandwidth (one GPU unless said) --------------------------------------------------
def kernels_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    cpu = ["--cpu", "--small"] if args.cpu else []
    env = {"CUDA_VISIBLE_DEVICES": "0"} if not args.cpu else {}
    return [
        Step(
            "kernels --check",
            py() + ["bench/kernels.py", "--check", *cpu],
            env,
            timeout=240,
            needs_gpus=1,
        ),
        Step("kernels", py() + ["bench/kernels.py", *cpu], env, timeout=330, needs_gpus=1),
        Step("cross_entropy", py() + ["bench/cross_entropy.py"] + (["--cpu"] if args.cpu else []), env, timeout=200),
    ]


def kernels_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    check = last_match(log, r"^(ALL PASS|\d+ FAILED)$") or "no check line"
    bw = last_match(log, r"^(copy bandwidth: .*)$")
    return [("parity check", check)] + ([("bandwidth", bw)] if bw else [])


def tiers_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    argv = py() + ["bench/tiers.py"] + (["--cpu"] if args.cpu else ["--rows", "2000000"])
    env = {"CUDA_VISIBLE_DEVICES": "0"} if not args.cpu else {}
    return [Step("tiers", argv, env, timeout=300, needs_gpus=1)]


def tiers_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    found = re.findall(r"^\| (hbm|uvm|uvm_caching) \| (\S+) \| ([\d.]+) \|", log, re.M)
    text = ", ".join(f"{tier} {ids} {ms} ms" for tier, ids, ms in found)
    return [("ms/step by tier and ids", text or "no table (see tiers.log)")]


def profile_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    n = nproc(args, m)
    out = []
    for w in ["tiny"] if args.cpu else args.workloads.split(","):
        base = ["bench/baselines/torchrec_dmp.py", "--workload", w]
        if w == "hetero124":
            base += ["--hbm-gib", f"{args.torchrec_hbm_gib or m.gpu_gib:g}", "--force", "small-dp"]
        elif w == "overflow":
            base = ["bench/torchrec_more.py", "--workload", w, "--hbm-gib", "16"]
        mine = ["bench/embshard_dmp.py", "--workload", w, "--plan", "planner"] + (
            ["--hbm-gib", "16"] if w == "overflow" else []
        )
        for who, script in (("TorchRec", base), ("embshard", mine)):
            argv = torchrun(n) + ["bench/profile_step.py", *script, "--steps", "10"]
            out.append(Step(f"profile {who} {w}", argv, timeout=200, needs_gpus=n))
    return out


def profile_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    syncs = re.findall(r"^syncs: (.*)$", log, re.M)
    return [("host syncs per run", "; ".join(syncs) or "none printed")]


def interop_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """The interop tests (TorchRec's DMP on CPU processes, under this machine's torchrec), the three migration steps
    of examples/torchrec on the GPUs sharing one folder, then TorchRec's runtime on its own plan against TorchRec's
    runtime on embshard's plan (bench/torchrec_embshard_plan.py), interleaved pairs per workload."""
    out = [] if args.interop_no_tests else [Step("tests/interop", pytest("tests/interop"), timeout=300)]
    if args.interop_examples:
        for step in ("step1_plan", "step2_train", "step3_export"):
            argv = torchrun(2) + [f"examples/torchrec/{step}.py", "--out", INTEROP_DIR]
            out.append(Step(step, argv, timeout=240, needs_gpus=2))
    n = nproc(args, m)
    steps_ = str(args.steps or (5 if args.cpu else 100))
    hbm = args.torchrec_hbm_gib or m.gpu_gib or 16
    workloads = {"tiny": []} if args.cpu else {"hetero124": ["--hbm-gib", f"{hbm:g}"], "overflow": ["--hbm-gib", "16"]}
    for i in range(args.pairs or (1 if args.cpu else 3)):
        for w, size in workloads.items():
            for plan in ("torchrec", "embshard"):
                argv = torchrun(n) + ["bench/torchrec_embshard_plan.py", "--plan", plan, "--workload", w, *size]
                best = ["--force", "small-dp"] if plan == "torchrec" and w == "hetero124" else []
                argv += best + ["--steps", steps_] + (["--numa-bind"] if args.numa_bind else [])
                out.append(Step(f"{plan} plan {w} (pair {i + 1})", argv, timeout=300, needs_gpus=n))
    return out


def interop_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    timed: dict[str, dict[str, list[float]]] = {}
    predicted: dict[str, list[float]] = {}
    for label, text in step_blocks(log):
        plan = re.match(r"(torchrec|embshard) plan (\S+) \(pair", label)
        if plan:
            ms = [float(r["ms_per_step"]) for r in results(text) if r.get("framework") == "torchrec"]
            if ms:
                timed.setdefault(plan[2], {}).setdefault(plan[1], []).append(ms[-1])
            predicted.setdefault(plan[2], []).extend(float(x) for x in re.findall(r"predicted ([\d.]+) ms/step", text))
            continue
        found = re.findall(r"^((?:TorchRec trained|embshard trained|held-out loss).*)$", text, re.M) or re.findall(
            PYTEST_LINE, text, re.M
        )
        rows.append((label, found[-1] if found else "see interop.log"))
    for workload, by_plan in timed.items():
        own, ours = by_plan.get("torchrec", []), by_plan.get("embshard", [])
        text = f"TorchRec's plan {report.fmt_ms(own)} ms, embshard's plan {report.fmt_ms(ours)} ms"
        ratios = [a / b for a, b in zip(own, ours)]
        if ratios:
            text += f"; embshard's plan faster by {report.fmt_ratio(ratios).replace('**', '')}"
        if predicted.get(workload):
            text += f"; embshard predicted {statistics.median(predicted[workload]):.2f} ms (its own runtime)"
        rows.append((f"TorchRec runtime, {workload}", text))
    return rows


def bandwidth_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    if args.cpu:
        argv = py() + ["-m", "embshard.cli", "calibrate", "--out", TOPOLOGY_FILE, "--iters", "3", "--no-kernels"]
        return [Step("bandwidth (embshard calibrate, CPU)", argv, timeout=150)]
    return bandwidth_step(argparse.Namespace(**{**vars(args), "no_bandwidth": False}))


def bandwidth_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for name, pattern in report.BANDWIDTH_LINES.items():
        found = pattern.findall(log)
        if found:
            rows.append((report.BANDWIDTH_NAMES[name], f"{float(found[-1]):,.1f} GB/s"))
    return rows or [("bandwidth", "no bandwidth line (see bandwidth.log)")]


# ---- build: building the module, UVM first touch on the GPU or on host threads -------------------------------------
def build_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """bench/uvm_fill.py (one GPU: FBGEMM's fill of a managed buffer against host threads), then hetero124's build
    (`--build-only`) with FBGEMM's fill and with the host first touch (EMBSHARD_UVM_FIRST_TOUCH), interleaved."""
    n = nproc(args, m)
    workload = ["--workload", "tiny"] if args.cpu else ["--workload", "hetero124", "--plan", "planner"]
    out = [] if args.cpu else [Step("uvm_fill (one GPU)", py() + ["bench/uvm_fill.py", "--gib", "16"], timeout=300)]
    for i in range(args.pairs or 2):
        for way in ("fbgemm", "host"):
            env = dict(cuda_env(args), EMBSHARD_UVM_FIRST_TOUCH=way)
            argv = torchrun(n) + ["bench/embshard_dmp.py", *workload, "--build-only"]
            out.append(Step(f"build, first touch {way} (pair {i + 1})", argv, env, timeout=300, needs_gpus=n))
    return out


def build_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for label, text in step_blocks(log):
        found = re.findall(r"^(plan [\d.]+ s, build .*?); plan:", text, re.M) or re.findall(r"^(.*GB/s.*)$", text, re.M)
        rows.append((label, "; ".join(found[-3:]) if found else "see build.log"))
    return rows


# ---- hier: table-row-wise's hierarchical exchange, 4 GPUs as 2 hosts x 2 ------------------------------------------
def hier_steps(args: argparse.Namespace, m: Machine) -> list[Step]:
    """bench/hier_exchange.py (flat against hierarchical exchange, 4 ranks as 2 hosts x 2), then the world-4 parity
    tests of tests/sharding/test_sharding_types.py and 100 world-4 fuzz cases with the hierarchical scenario."""
    gpus = 4
    bench = torchrun(4) + ["bench/hier_exchange.py"] + (["--smoke"] if args.cpu else [])
    tests = pytest("tests/sharding/test_sharding_types.py", "-k")
    tests.append("world4")
    fuzz = pytest("tests/test_fuzz.py", "-k", "parity or hierarchical")
    fuzz_env = dict(cuda_env(args), EMBSHARD_FUZZ_WORLDS="4", EMBSHARD_FUZZ_CASES="20" if args.cpu else "100")
    return [
        Step("hier_exchange, 4 ranks as 2 hosts x 2", bench, timeout=300, needs_gpus=gpus),
        Step("world-4 parity tests (2 hosts x 2)", tests, cuda_env(args), timeout=400, needs_gpus=gpus),
        Step("world-4 fuzz cases", fuzz, fuzz_env, timeout=400, needs_gpus=gpus),
    ]


def hier_summary(log: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    rows = []
    for r in results(log):
        if r.get("bench") == "hier_exchange":
            text = (f"{r['intra_mib']} MiB inside hosts, {r['cross_mib']} between (planner {r['planner_intra_mib']}, "
                    f"{r['planner_cross_mib']}); exchange {r['exchange_ms']} ms (predicted "
                    f"{r['predicted_exchange_ms']}, one machine {r['predicted_exchange_ms_one_machine']}); step "
                    f"{r['step_ms']} ms (predicted {r['predicted_step_ms']})")  # fmt: skip
            rows.append((f"{r['exchange']} exchange", text))
    for label, block in step_blocks(log):
        if label.startswith("world-4"):
            rows.append((label, last_match(block, PYTEST_LINE) or "no pytest summary line"))
    return rows or [("hier", "no RESULT line (see hier.log)")]


SUITES = {
    s.name: s
    for s in [
        Suite("tests", "the test suite on the GPUs (NCCL); junit XML and the 30 slowest tests", "1-2", "4-9 min",
              tests_steps, tests_summary),
        Suite("fuzz", "the parity fuzzer: random tables, plans and batches against the reference, per world size",
              "2", "4-8 min", fuzz_steps, fuzz_summary),
        Suite("e2e", "MLPerf DLRM-DCNv2 training against TorchRec's TrainPipelineSparseDist, fp32 and bf16, "
              "interleaved pairs", "2", "6-9 min", e2e_steps, compare_summary),
        Suite("emb", "the embedding step alone against TorchRec's DistributedModelParallel (uniform26, hetero124, "
              "overflow), interleaved pairs, predicted beside measured", "2", "6-9 min", emb_steps, compare_summary),
        Suite("soak", "5,000 steps of uniform26: allocated GPU memory at step 100 and 5,000", "2", "1-2 min",
              soak_steps, soak_summary),
        Suite("retrieval", "full softmax over 1M items row-sharded on 2 GPUs: peak memory against materialized logits",
              "2", "1-2 min", retrieval_steps, retrieval_summary),
        Suite("ckpt", "checkpoint save and load (hetero124 at 1/10 of its rows) on 2 ranks, then tests/checkpoint",
              "2", "3-5 min", ckpt_steps, ckpt_summary),
        Suite("loader", "the Parquet data loader with 0-32 worker processes beside TorchRec's Criteo reader",
              "0", "3-6 min", loader_steps, loader_summary),
        Suite("kernels", "embshard's Triton kernels against FBGEMM: parity check, timings, fused cross-entropy",
              "1", "3-5 min", kernels_steps, kernels_summary),
        Suite("tiers", "one GPU: step time per memory tier (hbm, uvm, uvm_caching) and UVM-cache hit rates", "1",
              "2-3 min", tiers_steps, tiers_summary),
        Suite("profile", "torch.profiler of one step, embshard and TorchRec: top kernels and host syncs", "2",
              "2-4 min", profile_steps, profile_summary),
        Suite("interop", "embshard.interop: tests/interop under this torchrec, examples/torchrec's three migration "
              "steps on 2 GPUs (--interop-examples), then TorchRec's runtime on its own plan against embshard's plan "
              "(hetero124, overflow), interleaved pairs", "2", "11-12 min", interop_steps, interop_summary),
        Suite("bandwidth", "measured GPU memory, GPU link and host link bandwidths (`embshard calibrate`)", "1-2",
              "1 min", bandwidth_steps, bandwidth_summary),
        Suite("rawids", "raw-id tables: tests/rawids on the GPUs, then uniform26 with every table ids: raw against "
              "static, interleaved (ids within the rows; 10 x rows ids, evicting), and TorchRec's managed-collision "
              "tables against its static ones on the same workloads", "1-2", "6-9 min (estimate)",
              rawids_steps, rawids_summary),
        Suite("build", "building the module: hetero124 with FBGEMM's UVM first touch against host threads "
              "(EMBSHARD_UVM_FIRST_TOUCH), interleaved pairs, and bench/uvm_fill.py", "1-2", "3-5 min (estimate)",
              build_steps, build_summary),
        Suite("scaling", "weak scaling of the MLPerf model at 8192 samples per GPU: embshard at 1 (tables at half "
              "their rows), 2 and 4 GPUs, TorchRec at 4 GPUs in interleaved pairs", "4", "6-8 min",
              scaling_steps, scaling_summary),
        Suite("hier", "table-row-wise's hierarchical against flat exchange, 4 GPUs as 2 hosts x 2: bytes per level, "
              "ms, the planner's predictions; then the world-4 parity tests and fuzz cases", "4",
              "3-6 min (estimate)", hier_steps, hier_summary),
    ]
}  # fmt: skip
