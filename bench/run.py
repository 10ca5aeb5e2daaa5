"""One way into bench/: named suites of benchmarks and GPU checks, run in order, each into one log.

    python -m bench.run SUITE [SUITE ...] --out DIR [options]      # e.g. bench/run.py tests fuzz --out /tmp/r1
    python -m bench.run --list                                      # the suites (bench/README.md has the table)
    python -m bench.run e2e emb --out DIR --dry-run                 # print the commands only

Every process it starts gets NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (no NVLink
multicast), PYTHONUNBUFFERED=1 and the repository first on PYTHONPATH (the caller's entries kept, e.g. where
fbgemm-gpu and torchrec are installed). Output, in DIR: SUITE.log per suite (META lines for the machine, date,
versions and commands, then every command's output; bench/report.py reads them), tests_junit.xml for `tests`,
loss_curves.png/.json for `e2e --loss-steps`, timeline_fp32.png/timeline_bf16.png for `e2e --timeline`, and
summary.md, the table printed at the end. A suite stops starting new commands when its --suite-minutes are used
up and stops a command that would run past them, so each suite ends within them. --cpu runs the suites that can
at tiny sizes on CPU processes (gloo): a smoke test of the commands, timings meaningless.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.suites import SUITES, Machine, Step

ROOT = Path(__file__).resolve().parent.parent
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NOISE = (  # library warnings and their source lines, dropped from the logs (counted at the end of each log)
    "_fbgemm_torch_compat_table",
    "cannot determine compatibility with PyTorch",
    "is_fx_tracing will return true",
    "return func(*args, **kwargs)",
    "return Variable._execution_engine.run_backward",
    "device_type=_get_pg_default_device",
    "else HeuristicalStorageReservation(",
    "Setting OMP_NUM_THREADS environment variable",
    "*****************************************",
)
REPEATS = re.compile(r"warn", re.I)  # a warning line seen before in the same command (digits aside) is dropped


class LogFilter:
    """Keeps a command's output readable: drops the NOISE lines, blank and colour-code lines, and any warning line
    already seen in the same command with other numbers (e.g. one per table)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.dropped = 0

    def keep(self, line: str) -> bool:
        text = line.strip()
        drop = not text or text in ("WARNING:root:", "\x1b[0m", "\x1b[33m") or any(n in line for n in NOISE)
        if not drop and REPEATS.search(line):
            key = re.sub(r"\d+", "#", text)
            drop = key in self.seen
            self.seen.add(key)
        self.dropped += drop
        return not drop


PROBE = """
import json, os, platform, importlib.metadata as md
info = {"cpus": os.cpu_count(), "python": platform.python_version()}
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
for name in ("torch", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchrec", "triton"):
    info[name] = version(name)
try:
    import torch
    info["torch"] = torch.__version__
    n = torch.cuda.device_count()
    info["gpus"] = n
    if n:
        p = torch.cuda.get_device_properties(0)
        info["gpu"], info["gpu_mib"] = p.name, p.total_memory // 2**20
except Exception as e:
    info["error"] = repr(e)
print(json.dumps(info))
"""


def environment() -> dict[str, str]:
    """The environment of every command: the caller's, no NVLink multicast, the repository first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, **NO_MULTICAST, PYTHONUNBUFFERED="1", PYTHONPATH=path)


def step_environment(step: Step) -> dict[str, str]:
    """environment() with the step's variables; a step's PYTHONPATH entries go before the repository's."""
    env = environment()
    extra = dict(step.env)
    if "PYTHONPATH" in extra:
        extra["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH"], env["PYTHONPATH"]])
    return env | extra


def probe() -> dict:
    try:
        out = subprocess.run(
            [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, env=environment()
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, json.JSONDecodeError, IndexError) as e:
        return {"error": repr(e), "cpus": os.cpu_count()}


def machine_of(info: dict) -> Machine:
    return Machine(info.get("gpus") or 0, info.get("gpu") or "", info.get("gpu_mib") or 0, info.get("cpus") or 1)


def meta_lines(info: dict, m: Machine) -> list[str]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    where = f"{m.gpus} x {m.gpu} ({m.gpu_mib:,} MiB)" if m.gpus else "no GPU"
    soft = ", ".join(
        f"{k} {info[k]}" for k in ("torch", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchrec", "triton") if info.get(k)
    )
    machine, software = f"{where}, {m.cpus} CPUs", f"Python {info.get('python')}, {soft}"
    q = shlex.quote
    return [
        f"META date={now[:10]} time={q(now)} gpu={json.dumps(m.gpu or 'cpu')} gpus={m.gpus}",
        f"META machine={q(machine)} software={q(software)} commit={q(code_commit())}",
    ]


def code_commit() -> str:
    """The repository's commit (with `+changes` when the work tree differs from it), or "unknown" without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def shown(argv: list[str], out: Path) -> str:
    """The command as the log shows it: the interpreter as `python`, the output folder as <out>."""
    text = shlex.join(["python" if a == sys.executable else a for a in argv])
    return text.replace(str(out), "<out>")


def descendants(root: int) -> list[int]:
    """Every process started (directly or not) by `root`, from /proc (Linux); empty where /proc is missing."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_step(step: Step, log, deadline: float) -> tuple[int | None, float, int, str]:
    """Run one step, its output into the log (noise dropped); (exit code or None if stopped, seconds, lines
    dropped, why it was stopped or ""). The step runs in its own process group so that a time limit stops its
    workers too."""
    limit = max(1.0, min(step.timeout, deadline - time.monotonic()))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        step.argv, cwd=ROOT, env=step_environment(step), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, errors="replace", start_new_session=True,
    )  # fmt: skip
    noise = LogFilter()
    stopped_why = ""  # why it was stopped

    def stop(why: str) -> None:
        nonlocal stopped_why
        stopped_why = stopped_why or why
        for pid in [proc.pid, *descendants(proc.pid)]:  # torchrun's workers may leave its process group
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    timer = threading.Timer(limit, stop, args=(f"time limit {limit:.0f} s",))
    timer.start()
    after_result: threading.Timer | None = None
    try:
        for line in proc.stdout:
            if noise.keep(line):
                log.write(line)
            if step.exit_after_result_s > 0 and after_result is None and line.startswith("RESULT "):
                why = f"not exited {step.exit_after_result_s:g} s after its RESULT line"
                after_result = threading.Timer(step.exit_after_result_s, stop, args=(why,))
                after_result.start()
        proc.wait()
    finally:
        timer.cancel()
        if after_result is not None:
            after_result.cancel()
    seconds = time.monotonic() - t0
    if stopped_why:
        log.write(f"!! stopped after {seconds:.0f} s ({stopped_why})\n")
        return None, seconds, noise.dropped, stopped_why
    return proc.returncode, seconds, noise.dropped, ""


def run_suite(name: str, args: argparse.Namespace, info: dict, m: Machine) -> list[tuple[str, str, str]]:
    """Run one suite into OUT/name.log; its summary rows (suite, item, result)."""
    suite = SUITES[name]
    steps = suite.steps(args, m)
    out = Path(args.out)
    status: list[tuple[str, str, str]] = []
    deadline = time.monotonic() + args.suite_minutes * 60
    with open(out / f"{name}.log", "w") as log:
        log.write("\n".join(meta_lines(info, m)) + "\n")
        for step in steps:
            log.write(f"META command={shlex.quote(shown(step.argv, out))}\n")
        dropped = 0
        for i, step in enumerate(steps, 1):
            env = " ".join(f"{k}={v}" for k, v in step.env.items())
            log.write(
                f"\n+ [{name} {i}/{len(steps)}] {step.label}: {env + ' ' if env else ''}{shown(step.argv, out)}\n"
            )
            log.flush()
            if not args.cpu and step.needs_gpus > m.gpus:
                note = f"skipped: needs {step.needs_gpus} GPUs, {m.gpus} visible"
            elif deadline - time.monotonic() < 20:
                note = f"skipped: the suite's {args.suite_minutes:g} minutes are used up"
            else:
                rc, seconds, n, why = run_step(step, log, deadline)
                dropped += n
                if step.epilogue is not None:
                    log.write(step.epilogue())
                stopped = "stopped at the time limit" if why.startswith("time limit") else f"stopped: {why}"
                note = f"{stopped if rc is None else f'rc {rc}'}, {seconds:.0f} s"
                if rc != 0:
                    status.append((name, step.label, note))
            log.write(f"= {step.label}: {note}\n")
            log.flush()
            print(f"[{name} {i}/{len(steps)}] {step.label}: {note}", flush=True)
            if note.startswith("skipped"):
                status.append((name, step.label, note))
        log.write(f"\n({dropped} lines of repeated library warnings left out of this log)\n")
    text = (out / f"{name}.log").read_text(errors="replace")
    return [(name, item, result) for item, result in suite.summary(text, args)] + status


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="suites: " + ", ".join(SUITES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("suites", nargs="*", help="suites to run, in this order")
    p.add_argument("--out", help="output folder (created); one log per suite and summary.md")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--cpu", action="store_true", help="tiny sizes on CPU processes (gloo): a smoke test")
    p.add_argument("--suite-minutes", type=float, default=9.5, help="time limit of each suite (minutes)")
    p.add_argument("--nproc", type=int, default=0, help="processes / GPUs for e2e, emb, soak, ckpt (default: 2)")
    g = p.add_argument_group("e2e and emb")
    g.add_argument("--pairs", type=int, default=0, help="interleaved TorchRec/embshard pairs (e2e 3, emb 2; CPU 1)")
    g.add_argument("--steps", type=int, default=0, help="timed steps (e2e 60, emb 100, soak 5000)")
    g.add_argument("--warmup", type=int, default=0, help="e2e: untimed steps first (20)")
    g.add_argument("--scale", type=float, default=0.0, help="e2e: keep this fraction of every table's rows (both)")
    g.add_argument("--precisions", default="fp32,bf16", help="e2e: dense precisions, a pair of each per round")
    g.add_argument(
        "--bf16-pooled",
        choices=["fp32", "bf16"],
        default="bf16",
        help="e2e: embshard's pooled dtype in bf16 (bf16: the default, lookup.output_dtype auto)",
    )
    g.add_argument("--variants", action="store_true", help="e2e: also semi_sync, tf32 (both) and pipeline none")
    g.add_argument("--profile", action="store_true", help="e2e: profile 3 steps of the last pair (GPU busy share)")
    g.add_argument(
        "--timeline", action="store_true", help="e2e: --profile, and the last 2 steps drawn as timeline_P.png"
    )
    g.add_argument(
        "--data-law",
        choices=("mlperf", "zipf-poisson"),
        default="mlperf",
        help="e2e: both frameworks' synthetic ids and bags (mlperf: uniform, fixed sizes; zipf-poisson: Zipf 1.05 "
        "ids, 1 + Poisson(size - 1) ids per bag)",
    )
    g.add_argument(
        "--no-torchrec-best",
        action="store_true",
        help="e2e: bf16 without TorchRec at its best (--qcomm bf16 --emb-output bf16 --compile-dense), only its plain "
        "--precision bf16",
    )
    g.add_argument("--compile", default="", help="e2e: embshard's training.compile mode (e.g. default)")
    g.add_argument(
        "--cuda-graph", choices=["also", "only"], default=None,
        help="e2e: embshard with training.cuda_graph=true in each pair, besides the plain run (also: the plain run is "
        "then the eager step, training.cuda_graph=false) or instead (only); unset: the plain run alone, with the "
        "defaults (bf16: the whole-step graph, bf16 pooled outputs, the compiled dense part where the plan allows)",
    )  # fmt: skip
    g.add_argument("--loss-steps", type=int, default=0, help="e2e: also both frameworks' loss curves, this many steps")
    g.add_argument(
        "--workloads",
        default="uniform26,overflow,hetero124",
        help="emb, profile: workloads (also: mlperf, the end-to-end model's 26 tables)",
    )
    g.add_argument("--torchrec-hbm-gib", type=float, default=0, help="emb: TorchRec's HBM for hetero124 (the card's)")
    g.add_argument(
        "--emb-graph", nargs="?", const="also", choices=["also", "only"], default=None,
        help="emb: embshard's step as one CUDA graph replay (embshard_dmp.py --graph, host counts), besides the eager "
        "step (also, the default) or instead of it (only)",
    )  # fmt: skip
    g.add_argument("--no-bandwidth", action="store_true", help="e2e, emb: skip the bandwidth measurement")
    g = p.add_argument_group("other suites")
    g.add_argument("--pytest-args", default="", help="tests: instead of `tests` (e.g. 'tests/sharding -x')")
    g.add_argument(
        "--test-workers",
        type=int,
        default=-1,
        help="tests: pytest-xdist workers where installed, tests spread over them (default: 8 with GPUs, 16+ CPUs)",
    )
    g.add_argument("--test-timeout", type=int, default=300, help="tests: per-test limit when pytest-timeout is there")
    g.add_argument(
        "--seq-dedup",
        choices=["both", "torchrec"],
        default="both",
        help="seq: dedup runs for both frameworks, or for TorchRec only (embshard's graphed step has no dedup)",
    )
    g.add_argument("--fuzz", default="", help="fuzz: WORLD:CASES list (default 2:300,1:100; CPU 2:20,1:10)")
    g.add_argument("--ckpt-scale", type=float, default=0.0, help="ckpt: row fraction of hetero124 (0.1)")
    g.add_argument("--interop-examples", action="store_true", help="interop: also examples/torchrec's three steps")
    g.add_argument(
        "--numa-bind", action="store_true", help="interop: every rank on its GPU's NUMA node's CPUs (bench/numa.py)"
    )
    g.add_argument(
        "--interop-no-tests", action="store_true", help="interop: skip tests/interop (the tests suite runs it too)"
    )
    g.add_argument(
        "--device", choices=["cpu", "cuda"], default="", help="serve: where the predictors run (default: cuda if any)"
    )
    g.add_argument("--loader-workers", default="", help="loader: worker counts (default 0,8,16[,32] up to the CPUs)")
    args = p.parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        p.error(f"unknown suite(s) {', '.join(unknown)}: choose from {', '.join(SUITES)}")
    if not args.list and not args.suites:
        p.error("name at least one suite (or --list)")
    if args.suites and not args.out:
        p.error("--out DIR is required: the folder the logs go to")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.list:
        for s in SUITES.values():
            print(f"{s.name:10s} {s.gpus:>4s} GPUs  {s.typical:>8s}  {s.what}")
        return
    out = Path(args.out).resolve()
    args.out = str(out)
    if args.dry_run:
        m = Machine(gpus=2, gpu="NVIDIA H100 80GB HBM3", gpu_mib=81559, cpus=32)  # the 2-GPU machine's view
        for name in args.suites:
            for step in SUITES[name].steps(args, m):
                env = " ".join(f"{k}={v}" for k, v in step.env.items())
                print(f"[{name}] {step.label}: {env + ' ' if env else ''}{shown(step.argv, out)}")
        return
    out.mkdir(parents=True, exist_ok=True)
    info = probe()
    m = machine_of(info)
    print("\n".join(meta_lines(info, m)), flush=True)
    rows: list[tuple[str, str, str]] = []
    for name in args.suites:
        rows += run_suite(name, args, info, m)
    table = ["| suite | what | result |", "| --- | --- | --- |"]
    table += [f"| {s} | {w} | {r.replace('|', '/')} |" for s, w, r in rows]
    text = "\n".join(table)
    (out / "summary.md").write_text("\n".join(meta_lines(info, m)) + "\n\n" + text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
