"""End-to-end training throughput of a YAML-configured model: the training pipeline of `embshard train`, timed.

    python -m bench.train_e2e --config configs/dlrm_dcnv2_mlperf.yaml --nproc 2 --steps 60 [--scale F] [key=value ...]

Starts --nproc local processes (one per GPU with CUDA, gloo on the CPU otherwise; under torchrun it joins
torchrun's job instead). Each rank: plans (rank 0, broadcast) and builds the model (timed: plan+build), then trains
through `embshard.training.pipeline.TrainPipeline` on the config's data source (synthetic: drawn by
data.synthetic.workers worker processes, or --workers; pinned): --warmup untimed steps, synchronize + barrier, --steps timed steps, synchronize. ms/step is the
slowest rank's wall time / steps; samples/s = world x batch / that. Then, optionally, the held-out AUC (--eval) and a
short torch.profiler window (--profile-steps K): the share of the window the GPU runs kernels (all kernels, and
without NCCL's, which also spin while waiting for a peer), kernel time per step by kind, and a Chrome trace
(--trace FILE; bench/timeline.py draws it).

--scale F multiplies every table's rows by F (at least min(rows, 16) rows), so the MLPerf config runs on the CPU
(F = 1e-5: 40M-row tables keep 400). On the CPU the batch is --batch-size (default 64 per rank), and the defaults
are 5 steps after 2 of warm-up.

Prints the plan summary once, per rank peak memory, the data path's waits, one line
`RESULT framework=embshard ... ms_per_step=... samples_per_s=... floor_hbm_gb=...` (the floor fields: bytes each rank
moves per step and the dense model's work, bench/floors.py) and, last, `samples_per_s=<global samples/s>`.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from bench import floors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="training config (YAML)")
    ap.add_argument("--nproc", type=int, default=1, help="local processes (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 60; CPU 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 20; CPU 2)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every table's rows by this (CPU: 1e-5)")
    ap.add_argument("--batch-size", type=int, default=None, help="per-rank batch (default: the config's; CPU 64)")
    ap.add_argument("--pipeline", choices=["none", "sparse_dist", "semi_sync"], default=None)
    ap.add_argument("--precision", choices=["fp32", "tf32", "bf16"], default=None)
    ap.add_argument(
        "--compile", choices=["none", "default", "max-autotune-no-cudagraphs", "reduce-overhead"], default=None
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="synthetic data worker processes per rank (default: data.synthetic.workers; CPU: 0)",
    )
    ap.add_argument("--eval", action="store_true", help="held-out loss and AUC before and after training")
    ap.add_argument("--profile-steps", type=int, default=0, help="profile this many more steps (GPU busy share)")
    ap.add_argument("--profile-top", type=int, default=12, help="kernels listed per rank in the profile (most time)")
    ap.add_argument("--trace", default=None, help="write the profiled window's Chrome trace here (rank 0)")
    ap.add_argument(
        "--host-profile", type=int, default=0, help="print the Python functions taking the host's time: cProfile of "
        "the timed steps on rank 0, this many lines (sorted by own time and by cumulative time)"
    )  # fmt: skip
    ap.add_argument("--tag", default="", help="a label echoed in the RESULT line")
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides, as for `embshard train`")
    return ap.parse_intermixed_args(argv)


def overrides_for(args: argparse.Namespace, cfg, cuda: bool) -> list[str]:
    """The command line's config overrides, the scaled tables, batch, pipeline and precision."""
    out = list(args.overrides)
    if args.scale != 1.0:
        for i, t in enumerate(cfg.model.tables):
            rows = max(min(t.num_embeddings, 16), math.ceil(t.num_embeddings * args.scale))
            out.append(f"model.tables[{i}].num_embeddings={rows}")
    batch = args.batch_size or (None if cuda else 64)
    if batch:
        out.append(f"schedule.batch_size={batch}")
    if args.pipeline:
        out.append(f"training.pipeline={args.pipeline}")
    if args.precision:
        out.append(f"training.precision={args.precision}")
    if args.compile:
        out.append(f"training.compile={args.compile}")
    return out


def plan_summary(plan, predicted: str) -> str:
    kinds = collections.Counter(f"{t.sharding_type.value}/{t.tier.value}" for t in plan.tables)
    return f"plan: {', '.join(f'{k} x{n}' for k, n in sorted(kinds.items()))}; {predicted or 'no prediction'}"


def kernel_kind(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "embedding" in n or "tbe" in n or "split_" in n or "bounds_check" in n:
        return "embedding"
    if any(k in n for k in ("gemm", "cutlass", "sm90", "sm80", "wgmma", "xmma", "cublas")):
        return "matmul"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other"


def gpu_kernels(prof) -> list:
    """The profile's GPU kernels and copies: device events that are not user annotations (a `record_function`
    range shows on the GPU timeline too, spanning its kernels; counting it would count them twice)."""
    return [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and e.time_range.elapsed_us() > 0
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith("## ")
    ]


def top_kernels(kernels: list, steps: int, n: int = 12) -> list[tuple[str, float, float]]:
    """(name, ms per step, launches per step) of the n kernels (of `gpu_kernels`) with the most GPU time."""
    ms, calls = collections.Counter(), collections.Counter()
    for e in kernels:
        ms[e.name] += e.time_range.elapsed_us() / 1e3 / steps
        calls[e.name] += 1 / steps
    return [(k, v, calls[k]) for k, v in ms.most_common(n)]


def _union(items) -> float:
    """Length of the union of (start, end) spans."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(items):
        if cur_e is None or s > cur_e:
            total += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def kernel_streams(prof) -> list:
    """Each GPU kernel and copy of the profile with the stream it ran on (kineto's device resource id, which the
    FunctionEvents of `gpu_kernels` do not carry): objects with name, stream, start and end (microseconds)."""
    from types import SimpleNamespace

    spans = []
    for e in prof.profiler.kineto_results.events():
        cuda = e.device_type() == torch.autograd.DeviceType.CUDA
        if not cuda or e.duration_ns() <= 0 or e.is_user_annotation() or e.name().startswith("## "):
            continue
        start = e.start_ns() / 1e3
        spans.append(
            SimpleNamespace(
                name=e.name(), stream=e.device_resource_id(), start=start, end=start + e.duration_ns() / 1e3
            )
        )
    return spans


def stream_shares(spans: list) -> tuple[list[int], float, list[tuple[int, float]]]:
    """(the compute streams, the share of the window in which a kernel of theirs other than NCCL's runs, every
    stream's share, busiest first) of `kernel_streams`. The compute streams are those that run a kernel other than
    NCCL's and the copies: a step's loop, or a graph's replay, which spreads its chain of kernels over the stream it
    is launched on and the streams the driver gives its branches; NCCL and the batch's copies run on their own."""
    per_stream: dict[int, list] = collections.defaultdict(list)
    computing: dict[int, list] = collections.defaultdict(list)
    for e in spans:
        per_stream[e.stream].append((e.start, e.end))
        if kernel_kind(e.name) not in ("nccl", "copy"):
            computing[e.stream].append((e.start, e.end))
    if not per_stream:
        return [], float("nan"), []
    lo = min(s for v in per_stream.values() for s, _ in v)
    hi = max(e for v in per_stream.values() for _, e in v)
    shares = sorted(((k, _union(v) / (hi - lo)) for k, v in per_stream.items()), key=lambda kv: -kv[1])
    compute = sorted(computing, key=lambda k: -_union(computing[k]))
    own = [
        (e.start, e.end) for e in spans if e.stream in computing and kernel_kind(e.name) != "nccl"
    ]  # their copies (the dtype casts of a step) count; NCCL kernels, which wait as often as they move, do not
    return compute, _union(own) / (hi - lo), shares


def busy_share(kernels: list, steps: int) -> tuple[float, float, dict[str, float]]:
    """(share of the window with any kernel running, same without NCCL kernels, kernel ms per step by kind) of
    `gpu_kernels`."""
    spans, spans_compute, by_kind = [], [], collections.Counter()
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        kind = kernel_kind(e.name)
        by_kind[kind] += (end - start) / 1e3 / steps
        spans.append((start, end))
        if kind != "nccl":
            spans_compute.append((start, end))
    if not spans:
        return float("nan"), float("nan"), {}
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    return _union(spans) / (hi - lo), _union(spans_compute) / (hi - lo), dict(by_kind)


def run(args: argparse.Namespace) -> None:
    from embshard.config import load_config
    from embshard.data import build_source
    from embshard.runtime import comm
    from embshard.runtime.distributed import init_distributed
    from embshard.training.mode import resolve_step_mode
    from embshard.training.pipeline import TrainPipeline
    from embshard.training.train import build_model, evaluate, plan_job_and_choice

    cuda = torch.cuda.is_available()
    cfg = load_config(args.config, args.overrides)
    cfg = load_config(args.config, overrides_for(args, cfg, cuda))
    device = init_distributed(whole_step_graph=cfg.whole_step_graph)

    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    say = print if rank == 0 else (lambda *a, **k: None)
    steps = args.steps or (60 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (20 if cuda else 2)
    tables, batch = list(cfg.model.tables), cfg.schedule.batch_size
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: F401  (imports outside the build time)

    workers = args.workers if args.workers is not None else (None if cuda else 0)
    source = build_source(cfg.data, tables, batch, cfg.seed, rank, world, workers=workers)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    lines: list[str] = []
    dist.barrier()
    t0 = time.perf_counter()
    plan, choice = plan_job_and_choice(cfg, device, world, local_world, lines.append)
    plan_s = time.perf_counter() - t0
    mode = resolve_step_mode(cfg, device.type, plan, choice)  # as `embshard train`: the planner's graph or eager
    model, dense_opt, graphs, mode = build_model(cfg, plan, source.num_dense, device, world, lines.append, mode)
    cfg = mode.applied(cfg)  # the auto settings as the job runs them
    sync()
    dist.barrier()
    build_s = time.perf_counter() - t0
    predicted = next((ln.strip() for text in lines for ln in text.splitlines() if "predicted step time" in ln), "")
    say(plan_summary(plan, predicted))
    say(mode.line())
    say(f"plan+build {build_s:.1f} s (plan {plan_s:.1f} s); {sum(t.num_embeddings for t in tables):,} rows")
    if cuda:
        say(f"NCCL_GRAPH_MIXING_SUPPORT={os.environ.get('NCCL_GRAPH_MIXING_SUPPORT', 'unset (on)')}")

    tr = cfg.training
    pipe = TrainPipeline(
        model, dense_opt, tr.pipeline, precision=tr.precision, prefetch_batches=max(2, tr.prefetch_batches),
        ids_checked=getattr(source, "ids_in_range", False), graphs=graphs,
    )  # fmt: skip
    auc = auc_before = float("nan")
    if args.eval:
        m = evaluate(model, source, device, pipe.host_group)
        auc_before = m.get("auc", float("nan"))
        say(f"held-out before training: loss {m['loss']:.5f} auc {auc_before:.5f} ({m['samples']} samples)")
    batches = source.train_batches(0)
    first = None
    for i in range(warmup):
        done = pipe.progress(batches)
        if i == 0:
            first = float(done.output.loss.detach())
    sync()
    dist.barrier()
    profiler = None
    if args.host_profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    wait0, gather0, t0 = pipe.data_wait_s, pipe.gather_s, time.perf_counter()
    for _ in range(steps):
        done = pipe.progress(batches)
    host_ms = (time.perf_counter() - t0) / steps * 1e3  # the host's own pace: launches run ahead until a wait
    if profiler is not None:
        profiler.disable()
    sync()
    elapsed = time.perf_counter() - t0
    if profiler is not None:  # printed outside the timed window
        import pstats

        say(f"host profile of the {steps} timed steps (rank 0, cProfile; its own overhead included):")
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(args.host_profile)
        stats.sort_stats("cumulative").print_stats(args.host_profile)
    agree_ms = (pipe.gather_s - gather0) / steps * 1e3
    last = float(done.output.loss.detach())
    wait_ms = (pipe.data_wait_s - wait0) / steps * 1e3
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    stats = torch.tensor([elapsed, peak, wait_ms], dtype=torch.float64)
    table = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather_object(table, stats)
    g = torch.stack(table)
    ms = float(g[:, 0].max()) / steps * 1e3
    sps = world * batch / ms * 1e3
    say(f"per rank: peak GPU memory {[round(float(x), 2) for x in g[:, 1]]} GiB; waits for the data path "
        f"{[round(float(x), 3) for x in g[:, 2]]} ms/step")  # fmt: skip
    hosts: list = [None] * world
    dist.all_gather_object(hosts, (round(host_ms, 2), round(agree_ms, 3)))
    say(f"per rank: host loop {[h for h, _ in hosts]} ms/step (the host issuing the step, before the final sync), "
        f"waits for the ranks' agreement {[a for _, a in hosts]} ms/step")  # fmt: skip
    say(f"loss: first warm-up step {first:.4f}, last timed step {last:.4f}" if first is not None else "")
    if args.eval:
        m = evaluate(model, source, device, pipe.host_group)
        auc = m.get("auc", float("nan"))
        say(f"held-out after {warmup + steps} steps: loss {m['loss']:.5f} auc {auc:.5f} ({m['samples']} samples)")
    busy = busy_compute = busy_stream = float("nan")
    if args.profile_steps:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync()
        comm.barrier()  # the ranks' windows start together: a rank that starts first would profile its wait
        with profile(activities=acts) as prof:
            for _ in range(args.profile_steps):
                with torch.profiler.record_function("## train step ##"):
                    pipe.progress(batches)
            sync()
        if cuda:  # every rank profiled its own steps; rank 0 prints them all (a rank waiting shows in NCCL)
            kernels = gpu_kernels(prof)
            mine = (
                *busy_share(kernels, args.profile_steps),
                len(kernels) / args.profile_steps,
                top_kernels(kernels, args.profile_steps, args.profile_top),
                stream_shares(kernel_streams(prof)),
            )
            everyone: list = [None] * world
            dist.all_gather_object(everyone, mine)
            busy, busy_compute, busy_stream = mine[0], mine[1], mine[-1][1]
            for r, (r_busy, r_compute, kinds, launches, top, (stream, share, shares)) in enumerate(everyone):
                say(f"profile ({args.profile_steps} steps, rank {r}): GPU busy {r_busy:.1%} of the window "
                    f"({r_compute:.1%} without NCCL kernels); the compute streams ({', '.join(map(str, stream))}) busy "
                    f"{share:.1%}; "
                    "kernel ms/step "
                    + ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))  # fmt: skip
                say(f"profile (rank {r}): each stream busy (share of the window) "
                    + ", ".join(f"{k} {v:.1%}" for k, v in shares[:8]))  # fmt: skip
                say(f"profile (rank {r}): {launches:.0f} kernels and copies a step; the top ones (ms/step, launches):")
                for name, k_ms, k_calls in top:
                    say(f"  {k_ms:7.3f} {k_calls:6.1f}  {name[:110]}")
        if args.trace and rank == 0:
            prof.export_chrome_trace(args.trace)
            say(f"trace: {args.trace}")
    pipe.close()
    graph, whole = graphs.dense, graphs.whole
    if tr.cuda_graph:
        say(f"training.cuda_graph: {graph.replays if graph is not None else 0} replays of the dense step's graph")
        if whole is not None:
            why = f" (given up: {whole.given_up})" if whole.given_up else ""
            replays = f"{whole.replays} replays of the whole step's graph, {whole.captures} captures"
            say(f"training.cuda_graph: {replays}{why}")
    weights = sum(p.numel() for p in model.dense_parameters() if p.dim() >= 2)
    floor = floors.e2e_fields(
        tables, plan, batch, source.num_dense, weights, 4 if cfg.lookup.output_dtype.value == "fp32" else 2
    )
    say(
        f"RESULT framework=embshard tag={args.tag or '-'} pipeline={tr.pipeline} precision={tr.precision} "
        f"compile={tr.compile} cuda_graph={int(graph is not None and graph.replays > 0)} "
        f"whole_step={int(whole is not None and whole.replays > 0)} {data_law(cfg.data)} "
        f"pooled={cfg.lookup.output_dtype.value} world={world} batch_per_rank={batch} scale={args.scale:g} "
        f"ms_per_step={ms:.3f} samples_per_s={sps:.0f} build_s={build_s:.2f} peak_gib={float(g[:, 1].max()):.2f} "
        f"data_wait_ms={float(g[:, 2].max()):.3f} gpu_busy={busy:.3f} gpu_busy_compute={busy_compute:.3f} "
        f"compute_stream_busy={busy_stream:.3f} "
        f"auc={auc:.5f} auc_before={auc_before:.5f} loss_first={first:.4f} loss_last={last:.4f} {floor}"
    )
    graphs.release()  # before the process group goes: a live graph with an NCCL collective hangs its teardown
    dist.barrier()
    dist.destroy_process_group()
    say(f"samples_per_s={sps:.0f}")


def _rank_main(args: argparse.Namespace) -> None:
    run(args)


def data_law(data) -> str:
    """`ids=uniform|zipf bags=fixed|poisson` of a synthetic source, as the TorchRec baseline's RESULT line says them
    (bench/report.py compares only runs of the same law); empty for other sources."""
    syn = data.synthetic
    if data.source != "synthetic" or syn is None:
        return ""
    return f"ids={'zipf' if syn.zipf_exponent > 0 else 'uniform'} bags={syn.bag_lengths}"


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if "RANK" in os.environ or args.nproc <= 1:
        run(args)
        return
    if torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
        sys.exit(f"--nproc {args.nproc}: only {torch.cuda.device_count()} GPU(s) are visible")
    from embshard.runtime.distributed import spawn_local

    spawn_local(_rank_main, args.nproc, args)


if __name__ == "__main__":
    main()
