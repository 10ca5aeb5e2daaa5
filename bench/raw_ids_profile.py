"""Where a raw-id table's training step spends its time, on the CPU in one process (world 1, no torchrun).

The uniform26 shape of bench/embshard_dmp.py scaled down: T tables (default 13, what one of 2 ranks holds) of R
rows x D dims, every table `ids: raw` (capacity = rows) and, for comparison, the same tables static; batch B, bag
lengths uniform in [0, 2 x 10], ids uniform in [0, id_space x R). After warm-up steps (the map fills: with
--id-space 1 every id is resident after the first pass over the --batches batches), it times static and raw steps
(forward, backward with row-wise Adagrad) interleaved, then runs torch.profiler over --steps raw steps and prints:
    - ms per step, static and raw (median of the rounds);
    - the top operators by self CPU time;
    - per phase of the id -> row map (`IdMap` methods, wrapped in record_function here): CPU ms per step and ops
      per step (an op: the innermost aten/fbgemm call that does work, so ~ one kernel launch on a GPU; views, empty
      and other metadata calls are not counted), and the largest tensor element counts the phase's ops touch;
    - ops per step of the whole raw step and of the static step.
Sizes: --scale small (rows 100k, batch 1024) or large (rows 400k, batch 4096), or --rows / --batch.

    python bench/raw_ids_profile.py --scale small
    python bench/raw_ids_profile.py --scale large --steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCALES = {"small": (100_000, 1024), "large": (400_000, 4096)}
PHASES = (
    "forward", "remap", "_train", "_unique", "_find", "_insert", "_place", "_victims", "_compact", "_reorder",
    "_count", "_resets", "reset", "_reset_rows", "_reset_all",
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


def _wrap_phases() -> None:
    """Wrap the IdMap methods named in PHASES in record_function('idmap.<name>')."""
    from embshard.rawids import idmap

    for name in PHASES:
        fn = getattr(idmap.IdMap, name, None)
        if fn is None:
            continue

        def wrapped(self, *a, _fn=fn, _label=f"idmap.{name}", **k):
            with torch.profiler.record_function(_label):
                return _fn(self, *a, **k)

        setattr(idmap.IdMap, name, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=SCALES, default="small", help="rows per table and batch (small: 100k, 1024)")
    ap.add_argument("--rows", type=int, default=0, help="rows per table (overrides --scale)")
    ap.add_argument("--batch", type=int, default=0, help="samples per step (overrides --scale)")
    ap.add_argument("--tables", type=int, default=13, help="tables (13: one rank's half of uniform26)")
    ap.add_argument("--dim", type=int, default=32, help="embedding dim")
    ap.add_argument("--id-space", type=float, default=1.0, help="ids drawn from this many x rows distinct values")
    ap.add_argument("--eviction", choices=("lru", "lfu"), default="lru")
    ap.add_argument("--batches", type=int, default=0, help="distinct batches cycled (0: 4, or 20 with --id-space > 1)")
    ap.add_argument("--warmup", type=int, default=0, help="warm-up steps per collection (0: 2 x --batches)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds of --steps steps")
    ap.add_argument("--steps", type=int, default=4, help="steps per timing round and under the profiler")
    ap.add_argument("--top", type=int, default=25, help="operators listed")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    rows, batch = SCALES[args.scale]
    rows, batch = args.rows or rows, args.batch or batch
    args.batches = args.batches or (4 if args.id_space <= 1 else 20)
    if args.threads:
        torch.set_num_threads(args.threads)

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard.distributed import init_distributed
    from embshard.optim import FusedOptimizerConfig
    from embshard.planner import simple_plan
    from embshard.sharded import ShardedEmbeddingBagCollection
    from embshard.tables import TableConfig

    dev = init_distributed()
    mean = 10
    tables = [TableConfig(f"t{i}", rows, args.dim, (f"f{i}",), ids_per_bag=mean) for i in range(args.tables)]
    raw_tables = [dataclasses.replace(t, ids="raw", eviction=args.eviction) for t in tables]
    plan = simple_plan(raw_tables, 1, tier="host")
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
    ebcs = {k: ShardedEmbeddingBagCollection(t, plan, opt, device=dev, seed=0)
            for k, t in (("static", tables), ("raw", raw_tables))}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.batches):
        lengths = [torch.randint(0, 2 * mean + 1, (batch,), generator=gen, dtype=torch.int32) for _ in tables]
        values = [
            torch.randint(0, max(1, int(rows * args.id_space)), (int(le.sum()),), generator=gen) for le in lengths
        ]
        raw = torch.cat(values)
        static = torch.cat([v % rows for v in values])
        keys = [f"f{i}" for i in range(len(tables))]
        batches.append({k: KeyedJaggedTensor.from_lengths_sync(keys=keys, values=v, lengths=torch.cat(lengths))
                        for k, v in (("static", static), ("raw", raw))})  # fmt: skip
    n_ids = sum(int(b["raw"].values().numel()) for b in batches) / len(batches)
    print(f"{args.tables} tables x {rows:,} rows x dim {args.dim}, batch {batch}, {n_ids:,.0f} ids per step, "
          f"id space {args.id_space:g} x rows, {args.eviction}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)  # fmt: skip

    taken = dict.fromkeys(ebcs, 0)

    def step(kind: str, _: int = 0) -> None:
        """One training step on the collection's next batch (the batches cycle)."""
        ebcs[kind](batches[taken[kind] % len(batches)][kind]).values().sum().backward()
        taken[kind] += 1

    t0 = time.time()
    for kind in ebcs:
        for i in range(args.warmup or 2 * args.batches):
            step(kind, i)
    print(f"warm-up {time.time() - t0:.1f} s", flush=True)
    times: dict[str, list[float]] = {k: [] for k in ebcs}
    for _ in range(args.rounds):
        for kind in ebcs:
            t0 = time.perf_counter()
            for i in range(args.steps):
                step(kind, i)
            times[kind].append((time.perf_counter() - t0) / args.steps * 1e3)
    ms = {k: statistics.median(v) for k, v in times.items()}
    ebcs["raw"].reset_raw_id_stats()
    step("raw")
    last = ebcs["raw"].raw_id_stats()
    per_step = {k: sum(v[k] for v in last.values()) for k in ("admitted", "evicted")}
    print(f"raw-id tables now: {sum(v['resident'] for v in last.values()):,} ids resident of "
          f"{sum(v['capacity'] for v in last.values()):,}; one step admits {per_step['admitted']:,}, evicts "
          f"{per_step['evicted']:,}")  # fmt: skip
    for k, v in times.items():
        print(f"{k:6s} {ms[k]:8.1f} ms/step (rounds: {', '.join(f'{t:.1f}' for t in v)})")
    print(f"raw / static: {ms['raw'] / ms['static']:.2f}x, raw - static: {ms['raw'] - ms['static']:.1f} ms/step")

    _wrap_phases()
    from torch.profiler import ProfilerActivity, profile

    per_kind = {}
    for kind in ebcs:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for i in range(args.steps):
                step(kind, i)
        per_kind[kind] = prof
    events = per_kind["raw"].events()
    roots = [e for e in events if e.cpu_parent is None]
    ops_step = {k: sum(_ops(e) for e in p.events() if e.cpu_parent is None) / args.steps for k, p in per_kind.items()}
    print(f"\ntop operators of the raw step by self CPU time ({args.steps} steps):")
    print(per_kind["raw"].key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                               max_name_column_width=48))  # fmt: skip
    phase_ms: dict[str, float] = defaultdict(float)
    phase_ops: dict[str, int] = defaultdict(int)
    phase_calls: dict[str, int] = defaultdict(int)
    phase_big: dict[str, int] = defaultdict(int)

    def visit(e) -> None:
        if e.name.startswith("idmap."):
            phase_ms[e.name] += e.cpu_time_total / 1e3
            phase_ops[e.name] += _ops(e)
            phase_calls[e.name] += 1
            acc: list[int] = []
            _largest(e, acc)
            phase_big[e.name] = max(phase_big[e.name], max(acc, default=0))
        for c in e.cpu_children:
            visit(c)

    for e in roots:
        visit(e)
    print("phases of the id -> row map (inclusive; nested phases are inside their callers):")
    print(f"  {'phase':22s} {'ms/step':>9s} {'calls/step':>10s} {'ops/step':>9s} {'largest tensor':>15s}")
    for name in sorted(phase_ms, key=lambda k: -phase_ms[k]):
        print(f"  {name:22s} {phase_ms[name] / args.steps:9.1f} {phase_calls[name] / args.steps:10.1f} "
              f"{phase_ops[name] / args.steps:9.0f} {phase_big[name]:15,d}")  # fmt: skip
    remap_ops = phase_ops.get("idmap.remap", 0) / args.steps
    print(f"ops per step: static {ops_step['static']:.0f}, raw {ops_step['raw']:.0f} (the map: "
          f"{phase_ops.get('idmap.forward', 0) / args.steps:.0f}, of which remap {remap_ops:.0f}: the same ops run "
          "on a GPU; the reset's torch ops here run in blocks of rows, on a GPU it is an index_fill_ and a Triton "
          "launch per storage)")  # fmt: skip
    print(f"RESULT bench=raw_ids_profile tables={args.tables} rows={rows} batch={batch} dim={args.dim} "
          f"id_space={args.id_space:g} eviction={args.eviction} static_ms={ms['static']:.1f} raw_ms={ms['raw']:.1f} "
          f"map_ms={phase_ms.get('idmap.forward', 0) / args.steps:.1f} static_ops={ops_step['static']:.0f} "
          f"raw_ops={ops_step['raw']:.0f} map_ops={phase_ops.get('idmap.forward', 0) / args.steps:.0f} "
          f"remap_ops={remap_ops:.0f}")  # fmt: skip
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
