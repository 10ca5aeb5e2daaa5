"""Where a raw-id table's training step spends its time, in one process (world 1, no torchrun), on the CPU or a GPU.

The uniform26 shape of bench/embshard_dmp.py: T tables (default 13, what one of 2 ranks holds) of R rows x D dims,
every table `ids: raw` (capacity = rows) and, for comparison, the same tables static; batch B, bag lengths uniform
in [0, 2 x 10], ids uniform in [0, id_space x R). After warm-up steps (the map fills: with --id-space 1 every id is
resident after the first pass over the --batches batches), it times static and raw steps (forward, backward with
row-wise Adagrad) interleaved, then runs torch.profiler over --steps steps of each and prints:
    - ms per step, static and raw (median of the rounds; on a GPU synchronized around each round), and the map's
      step alone (`IdMap.forward`, and `remap` without the reset; synchronized);
    - the top operators by self CPU time (CPU) or by device time (GPU);
    - per phase of the id -> row map (`IdMap` methods, wrapped in record_function here): host ms, ops (an op: the
      innermost aten/fbgemm call that does work, ~ one kernel launch on a GPU; views, empty and other metadata calls
      are not counted) and, on a GPU, kernel launches and kernel ms per step, and the largest tensor element count;
GPU only (--device cuda):
    - the top CUDA kernels by total device time: ms and launches per step, and the phase that launches them;
    - host syncs per step (CUDA's sync debug mode, "warn"), static and raw, and where in the code they happen;
    - per step: wall ms vs kernel ms (the sum) and GPU busy ms (their union): a step far above its busy time waits
      on the host (launches, syncs), one close to it waits on its kernels.
Sizes: --scale small (rows 100k, batch 1024, dim 32) or large (rows 400k, batch 4096), --uniform26 (rows 1M, dim 128,
batch 16384: what one of 2 ranks looks up in `torchrun --nproc-per-node=2 -m bench.embshard_dmp --workload
uniform26`, table-wise: its 13 tables over the global batch of 2 x 8192; ids drawn per step as that run draws
them, seed None), or --rows / --batch / --dim. --out FILE also writes the report to FILE (--trace: and the
profiled steps' chrome traces beside it).

    python -m bench.raw_ids_profile --scale small
    python -m bench.raw_ids_profile --scale large --steps 3
    python -m bench.raw_ids_profile --device cuda --uniform26 --trace --out prof/uniform26.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
import time
import warnings
from collections import Counter, defaultdict

import torch

from bench.timing import interleaved_ms, timed_ms

SCALES = {"small": (100_000, 1024, 32), "large": (400_000, 4096, 32), "uniform26": (1_000_000, 16_384, 128)}
PHASES = (
    "forward", "remap", "_train", "_train_triton", "_find", "_insert", "_place", "_victims", "_lru_victims", "_lfu_victims",
    "_compact", "_reorder", "_count", "reset",
)  # fmt: skip
"""IdMap methods timed as phases (those the class has)."""
META = {
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::as_strided", "aten::reshape",
    "aten::_reshape_alias", "aten::resize_", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::slice",
    "aten::select", "aten::t", "aten::transpose", "aten::permute", "aten::detach", "aten::detach_", "aten::alias",
    "aten::lift_fresh", "aten::_unsafe_view", "aten::unbind", "aten::split", "aten::narrow", "aten::result_type",
    "aten::set_", "aten::lift", "aten::_nested_tensor_from_mask_left_aligned", "aten::view_as", "aten::split_with_sizes",
    "aten::chunk", "aten::flatten", "aten::unflatten", "aten::contiguous", "aten::clone_", "aten::is_pinned",
    "aten::pin_memory", "aten::resolve_conj", "aten::resolve_neg", "aten::_has_compatible_shallow_copy_type",
    "aten::record_stream", "aten::dim", "aten::size", "aten::stride", "aten::numel", "aten::is_nonzero",
}  # fmt: skip
"""Calls that move no data (no kernel on a GPU)."""
OUTSIDE = "(outside the map)"
_phase_stack: list[str] = []
"""The phases running now (innermost last): where a host sync is attributed."""


class _Tee:
    """stdout, copied to a file."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file, self.out = open(path, "w"), sys.stdout

    def write(self, s: str) -> int:
        self.file.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.file.flush()
        self.out.flush()


def _ops(e) -> int:
    """Innermost working ops under (and including) the profiler event `e`."""
    below = sum(_ops(c) for c in e.cpu_children)
    if below:
        return below
    name = e.name
    return int("::" in name and name not in META and not name.startswith("idmap."))


def _largest(e, acc: list[int]) -> None:
    for shapes in e.input_shapes or []:
        if isinstance(shapes, list) and shapes and all(isinstance(x, int) for x in shapes):
            n = 1
            for x in shapes:
                n *= x
            acc.append(n)
    for c in e.cpu_children:
        _largest(c, acc)


def _kernels(e) -> list:
    """The kernels (and memcpy/memset) `e` itself launched (not the device mirrors of record_function ranges)."""
    return [k for k in getattr(e, "kernels", []) if k.name != "step" and not k.name.startswith("idmap.")]


def _launches(e) -> tuple[int, float]:
    """(kernels launched by `e` and the ops below it, their device us)."""
    ks = _kernels(e)
    n, us = len(ks), sum(k.duration for k in ks)
    for c in e.cpu_children:
        cn, cus = _launches(c)
        n, us = n + cn, us + cus
    return n, us


def _wrap_phases() -> None:
    """Wrap the IdMap methods named in PHASES in record_function('idmap.<name>')."""
    from embshard.rawids import idmap

    for name in PHASES:
        fn = getattr(idmap.IdMap, name, None)
        if fn is None:
            continue

        def wrapped(self, *a, _fn=fn, _label=f"idmap.{name}", **k):
            _phase_stack.append(_label)
            try:
                with torch.profiler.record_function(_label):
                    return _fn(self, *a, **k)
            finally:
                _phase_stack.pop()

        setattr(idmap.IdMap, name, wrapped)


def _short(name: str, width: int = 96) -> str:
    """A kernel's name without `void`, its argument list and namespaces' noise, cut to `width`."""
    name = re.sub(r"\(anonymous namespace\)::|at::native::|at_cuda_detail::|c10::", "", name.removeprefix("void "))
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # drop the argument list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0 and i > 0:
            cut = i
            break
    name = name[:cut]
    return name if len(name) <= width else name[: width - 3] + "..."


def _init(device: str) -> torch.device:
    """A one-process group; the device to compute on."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    from embshard.runtime.distributed import init_distributed

    return init_distributed(cpu=device != "cuda")


def _count_syncs(fn, steps: int) -> tuple[int, Counter]:
    """Host syncs over `steps` calls of fn (CUDA's sync debug mode), and their count per (phase, code line)."""
    where: Counter = Counter()
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            phase = _phase_stack[-1] if _phase_stack else OUTSIDE
            where[(phase, f"{os.path.relpath(filename)}:{lineno}")] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for i in range(steps):
                fn(i)
            torch.cuda.current_stream().synchronize()
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
    return sum(where.values()), where


def _annotation(e) -> bool:
    """Whether the device event `e` mirrors a record_function range (no kernel)."""
    return bool(getattr(e, "is_user_annotation", False)) or e.name == "step" or e.name.startswith("idmap.")


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The union of the intervals (us), in ms."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e3


def _time_map_alone(ebc, inputs: list, steps: int, sync) -> dict[str, float]:
    """Time the map's training step alone (no lookup kernel around it), synchronized: `IdMap.forward` (remap and
    reset) and `remap` alone, on the lookup's inputs of the batches (world 1: the batch's ids, feature-major)."""
    scheme = next(s for s in ebc.schemes if len(getattr(s, "idmaps", ())))
    key, idmap = next(iter(scheme.idmaps.items()))
    lookup = scheme.lookups[int(key)]
    ms = {}
    for what in ("forward", "remap"):
        fn = (lambda v, c: idmap(v, c, lookup)) if what == "forward" else (lambda v, c: idmap.remap(v, c, True))
        for i in range(2):  # warm
            fn(*inputs[i % len(inputs)])
        ms[what] = timed_ms(lambda i, fn=fn: fn(*inputs[i % len(inputs)]), steps, sync)
    print(f"the map alone (synchronized, {steps} steps): forward (remap + reset) {ms['forward']:.2f} ms/step, "
          f"remap {ms['remap']:.2f} ms/step", flush=True)  # fmt: skip
    return ms


def _gpu_report(per_kind, syncs, ms, wall, kern_phase, phase_gpu, S: int, top: int) -> str:
    """Print the GPU sections (top kernels, host syncs, wall vs kernels); the RESULT line's GPU fields."""
    from torch.autograd import DeviceType

    busy, kern, host = {}, {}, {}
    for kind, p in per_kind.items():
        steps = [e for e in p.events() if e.name == "step" and e.device_type == DeviceType.CPU]
        host[kind] = sum(e.cpu_time_total for e in steps) / 1e3 / S
        dev_ev = [e for e in p.events() if e.device_type == DeviceType.CUDA and not _annotation(e)]
        iv = [(e.time_range.start, e.time_range.end) for e in dev_ev]
        kern[kind] = sum(b - a for a, b in iv) / 1e3 / S
        busy[kind] = _busy_ms(iv) / S
        if kind == "raw":
            totals: dict[str, float] = defaultdict(float)
            calls: Counter = Counter()
            for e in dev_ev:
                totals[e.name] += e.time_range.elapsed_us()
                calls[e.name] += 1
    all_ms = sum(totals.values()) / 1e3 / S
    print(f"\ntop {top} CUDA kernels of the raw step by device time (of {all_ms:.2f} ms/step, "
          f"{sum(calls.values()) / S:.0f} launches/step):")  # fmt: skip
    print(f"  {'ms/step':>8s} {'%':>5s} {'calls/step':>10s} {'us/call':>8s}  {'launched in (most time)':24s} kernel")
    for name in sorted(totals, key=lambda k: -totals[k])[:top]:
        ph = kern_phase.get(name)
        top_phase = ph.most_common(1)[0][0] if ph else "?"
        print(f"  {totals[name] / 1e3 / S:8.3f} {100 * totals[name] / 1e3 / S / max(all_ms, 1e-9):5.1f} "
              f"{calls[name] / S:10.1f} {totals[name] / calls[name]:8.1f}  {top_phase:24s} "
              f"{_short(name)}")  # fmt: skip
    print("\nhost syncs per step (CUDA sync debug mode), and where (phase, code line: count per step):")
    for kind, (n, where_) in syncs.items():
        print(f"  {kind:6s} {n / S:6.1f}")
        for (ph, line), c in where_.most_common(12):
            print(f"      {c / S:6.1f}  {ph:22s} {line}")
    print("\nwall vs kernels per step (profiled steps; wall includes the profiler's overhead):")
    print("  (host ms: the step's time on the host, profiled; timed ms: unprofiled, synchronized; idle: timed - busy)")
    print(
        f"  {'':6s} {'wall ms':>8s} {'host ms':>8s} {'timed ms':>8s} {'kernel ms':>9s} {'GPU busy':>8s} {'idle':>6s}  verdict"
    )
    for kind in per_kind:
        idle = max(0.0, ms[kind] - busy[kind])
        verdict = "host-bound (launches/syncs)" if busy[kind] < 0.7 * ms[kind] else "kernel-bound"
        print(f"  {kind:6s} {wall[kind]:8.2f} {host[kind]:8.2f} {ms[kind]:8.2f} {kern[kind]:9.2f} {busy[kind]:8.2f} "
              f"{idle:6.2f}  {verdict}")  # fmt: skip
    fields = (
        f" static_kernel_ms={kern['static']:.2f} raw_kernel_ms={kern['raw']:.2f} static_busy_ms={busy['static']:.2f} "
        f"raw_busy_ms={busy['raw']:.2f} map_kernel_ms={phase_gpu.get('idmap.forward', 0) / S:.2f} "
        f"static_syncs={syncs['static'][0] / S:.1f} raw_syncs={syncs['raw'][0] / S:.1f}"
    )
    return fields


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the step runs")
    ap.add_argument("--scale", choices=SCALES, default="small", help="rows, batch, dim (small: 100k, 1024, 32)")
    ap.add_argument("--uniform26", action="store_true", help="--scale uniform26: one rank of 2 in embshard_dmp.py")
    ap.add_argument("--rows", type=int, default=0, help="rows per table (overrides --scale)")
    ap.add_argument("--batch", type=int, default=0, help="samples per step (overrides --scale)")
    ap.add_argument("--dim", type=int, default=0, help="embedding dim (overrides --scale)")
    ap.add_argument("--tables", type=int, default=13, help="tables (13: one rank's half of uniform26)")
    ap.add_argument("--id-space", type=float, default=1.0, help="ids drawn from this many x rows distinct values")
    ap.add_argument("--eviction", choices=("lru", "lfu"), default="lru")
    ap.add_argument("--batches", type=int, default=0, help="distinct batches cycled (0: 4, uniform26 8, or 20 with "
                    "--id-space > 1)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=0, help="warm-up steps per collection (0: 2 x --batches)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds of --steps steps")
    ap.add_argument("--steps", type=int, default=0, help="steps per timing round and under the profiler (0: 4)")
    ap.add_argument("--top", type=int, default=25, help="operators and kernels listed")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0, help="the collections' seed (-1: None, fresh values per reset)")
    ap.add_argument("--out", default="", help="also write the report to this file")
    ap.add_argument("--trace", action="store_true", help="with --out: also the profiled steps' chrome traces, "
                    "OUT.static.json and OUT.raw.json (open in chrome://tracing or ui.perfetto.dev)")  # fmt: skip
    args = ap.parse_args()
    if args.uniform26:
        args.scale = "uniform26"
    rows, batch, dim = SCALES[args.scale]
    rows, batch, dim = args.rows or rows, args.batch or batch, args.dim or dim
    args.batches = args.batches or (20 if args.id_space > 1 else 8 if args.scale == "uniform26" else 4)
    args.steps = args.steps or 4
    seed = None if args.seed < 0 or (args.scale == "uniform26" and args.seed == 0) else args.seed
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.out:
        sys.stdout = _Tee(args.out)

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.planner import simple_plan
    from embshard.spec.optim import FusedOptimizerConfig
    from embshard.spec.tables import TableConfig

    dev = _init(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mean = 10
    tables = [TableConfig(f"t{i}", rows, dim, (f"f{i}",), ids_per_bag=mean) for i in range(args.tables)]
    raw_tables = [dataclasses.replace(t, ids="raw", eviction=args.eviction) for t in tables]
    plan = simple_plan(raw_tables, 1, tier="hbm" if cuda else "host")
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
    t0 = time.time()
    ebcs = {k: ShardedEmbeddingBagCollection(t, plan, opt, device=dev, seed=seed)
            for k, t in (("static", tables), ("raw", raw_tables))}  # fmt: skip
    sync()
    build_s = time.time() - t0
    gen = torch.Generator().manual_seed(0)
    batches, map_inputs = [], []
    for _ in range(args.batches):
        lengths = [torch.randint(0, 2 * mean + 1, (batch,), generator=gen, dtype=torch.int32) for _ in tables]
        values = [
            torch.randint(0, max(1, int(rows * args.id_space)), (int(le.sum()),), generator=gen) for le in lengths
        ]
        raw = torch.cat(values)
        static = torch.cat([v % rows for v in values])
        keys = [f"f{i}" for i in range(len(tables))]
        map_inputs.append((raw.to(dev), [int(le.sum()) for le in lengths]))  # the map's ids: the lookup's input
        batches.append({k: KeyedJaggedTensor.from_lengths_sync(keys=keys, values=v.to(dev),
                                                               lengths=torch.cat(lengths).to(dev))
                        for k, v in (("static", static), ("raw", raw))})  # fmt: skip
    n_ids = sum(int(b["raw"].values().numel()) for b in batches) / len(batches)
    where = torch.cuda.get_device_name(dev) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"{args.tables} tables x {rows:,} rows x dim {dim}, batch {batch}, {n_ids:,.0f} ids per step, "
          f"id space {args.id_space:g} x rows, {args.eviction}, seed {seed}, torch {torch.__version__}, {where}; "
          f"build {build_s:.1f} s", flush=True)  # fmt: skip

    taken = dict.fromkeys(ebcs, 0)

    def step(kind: str, _: int = 0) -> None:
        """One training step on the collection's next batch (the batches cycle)."""
        ebcs[kind](batches[taken[kind] % len(batches)][kind]).values().sum().backward()
        taken[kind] += 1

    t0 = time.time()
    for kind in ebcs:
        for i in range(args.warmup or 2 * args.batches):
            step(kind, i)
    sync()
    print(f"warm-up {time.time() - t0:.1f} s", flush=True)
    times = interleaved_ms(ebcs, args.rounds, args.steps, step, sync)
    ms = {k: statistics.median(v) for k, v in times.items()}
    ebcs["raw"].reset_raw_id_stats()
    step("raw")
    last = ebcs["raw"].raw_id_stats()
    per_step = {k: sum(v[k] for v in last.values()) for k in ("admitted", "evicted")}
    print(f"raw-id tables now: {sum(v['resident'] for v in last.values()):,} ids resident of "
          f"{sum(v['capacity'] for v in last.values()):,}; one step admits {per_step['admitted']:,}, evicts "
          f"{per_step['evicted']:,}")  # fmt: skip
    for k, v in times.items():
        print(f"{k:6s} {ms[k]:8.2f} ms/step (rounds: {', '.join(f'{t:.2f}' for t in v)})")
    print(f"raw / static: {ms['raw'] / ms['static']:.2f}x, raw - static: {ms['raw'] - ms['static']:.2f} ms/step")

    alone = _time_map_alone(ebcs["raw"], map_inputs, args.steps, sync)
    _wrap_phases()
    syncs = {}
    if cuda:
        for kind in ebcs:
            syncs[kind] = _count_syncs(lambda i, kind=kind: step(kind, i), args.steps)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    per_kind, wall = {}, {}
    for kind in ebcs:

        def marked(i: int, kind: str = kind) -> None:
            with torch.profiler.record_function("step"):
                step(kind, i)

        with profile(activities=activities, record_shapes=True) as prof:
            wall[kind] = timed_ms(marked, args.steps, sync)
        per_kind[kind] = prof
        if args.trace and args.out:
            prof.export_chrome_trace(f"{os.path.splitext(args.out)[0]}.{kind}.json")
    events = per_kind["raw"].events()
    roots = [e for e in events if e.cpu_parent is None]
    ops_step = {k: sum(_ops(e) for e in p.events() if e.cpu_parent is None) / args.steps for k, p in per_kind.items()}
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"\ntop operators of the raw step by {sort_by} ({args.steps} steps):")
    try:
        table = per_kind["raw"].key_averages().table(sort_by=sort_by, row_limit=args.top, max_name_column_width=48)
    except (AttributeError, KeyError):  # torch without the device_* names
        table = per_kind["raw"].key_averages().table(sort_by=sort_by.replace("device", "cuda"), row_limit=args.top)
    print(table)
    phase_ms: dict[str, float] = defaultdict(float)
    phase_gpu: dict[str, float] = defaultdict(float)
    phase_launch: dict[str, int] = defaultdict(int)
    phase_ops: dict[str, int] = defaultdict(int)
    phase_calls: dict[str, int] = defaultdict(int)
    phase_big: dict[str, int] = defaultdict(int)
    kern_phase: dict[str, Counter] = defaultdict(Counter)

    def visit(e, phase: str) -> None:
        if e.name.startswith("idmap."):
            phase = e.name
            phase_ms[e.name] += e.cpu_time_total / 1e3
            launched, us = _launches(e)
            phase_gpu[e.name] += us / 1e3
            phase_launch[e.name] += launched
            phase_ops[e.name] += _ops(e)
            phase_calls[e.name] += 1
            acc: list[int] = []
            _largest(e, acc)
            phase_big[e.name] = max(phase_big[e.name], max(acc, default=0))
        for k in _kernels(e):
            kern_phase[k.name][phase] += k.duration
        for c in e.cpu_children:
            visit(c, phase)

    for e in roots:
        visit(e, OUTSIDE)
    S = args.steps
    print("phases of the id -> row map (inclusive; nested phases are inside their callers):")
    head = f"  {'phase':22s} {'host ms':>8s} {'calls':>6s} {'ops':>5s}"
    if cuda:
        head += f" {'launches':>8s} {'kernel ms':>9s}"
    print(head + f" {'largest tensor':>15s}   (per step)")
    for name in sorted(phase_ms, key=lambda k: -phase_ms[k]):
        line = f"  {name:22s} {phase_ms[name] / S:8.2f} {phase_calls[name] / S:6.1f} {phase_ops[name] / S:5.0f}"
        if cuda:
            line += f" {phase_launch[name] / S:8.0f} {phase_gpu[name] / S:9.3f}"
        print(line + f" {phase_big[name]:15,d}")
    remap_ops = phase_ops.get("idmap.remap", 0) / S
    print(f"ops per step: static {ops_step['static']:.0f}, raw {ops_step['raw']:.0f} (the map: "
          f"{phase_ops.get('idmap.forward', 0) / S:.0f}, of which remap {remap_ops:.0f})")  # fmt: skip
    fields = _gpu_report(per_kind, syncs, ms, wall, kern_phase, phase_gpu, S, args.top) if cuda else ""
    print(f"RESULT bench=raw_ids_profile device={dev.type} tables={args.tables} rows={rows} batch={batch} dim={dim} "
          f"id_space={args.id_space:g} eviction={args.eviction} static_ms={ms['static']:.2f} raw_ms={ms['raw']:.2f} "
          f"map_host_ms={phase_ms.get('idmap.forward', 0) / S:.2f} static_ops={ops_step['static']:.0f} "
          f"raw_ops={ops_step['raw']:.0f} map_ops={phase_ops.get('idmap.forward', 0) / S:.0f} "
          f"remap_ops={remap_ops:.0f} map_alone_ms={alone['forward']:.2f} remap_alone_ms={alone['remap']:.2f}"
          f"{fields}", flush=True)  # fmt: skip
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
