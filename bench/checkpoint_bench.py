"""Sharded checkpoints of hetero124 on GPUs: save throughput beside `dd`, host memory, async blocking time, the
checksums' cost (a verify pass; a reload with and without them checked), and a reload into a 1-GPU plan with
UVM-caching. Run by `python -m bench.run ckpt` (torchrun, one process per GPU):

    torchrun --nproc-per-node=2 -m bench.checkpoint_bench --scale 0.1 --dir /tmp/embshard_ckpt_bench

hetero124 (bench/embshard_dmp.py) is 4 x 100M x 128 + 20 x 5M x 64 + 100 x 10k x 16 fp32 rows: 205 GB of weights,
more than a GPU machine's local disk, so --scale multiplies the row counts of the large and medium tables (0.1:
4 x 10M x 128 + 20 x 500k x 64, about 23 GB with the row-wise Adagrad state). Plan: tables of <= 10k rows
data-parallel, the others table-wise in HBM (bench/embshard_dmp.py --plan small-dp). Steps of batch 8192 per rank
with uniform ids make the optimizer state non-zero. Phases, on every rank:
  dd        the same bytes as this rank's share of the checkpoint, written with dd (conv=fdatasync), all ranks at once
  sync      Checkpointer(async_save=False).save: chunks copied to the host and written one at a time
  async #1  Checkpointer(async_save=True).save: blocking = the copy into (newly allocated) pinned host buffers
  async #2  the same with the buffers reused; one training step runs while it writes; its time is reported
  crc32     zlib.crc32 over a 256 MiB buffer in memory, one thread (the checksum's CPU speed on this host)
  verify    rank 0: `embshard checkpoint inspect --verify`'s pass over async #2's checkpoint (every file read and
            its CRC-32 compared with COMMIT's, --verify-threads files at once), first with the files dropped from
            the page cache (posix_fadvise DONTNEED: read from the disk), then again (from the page cache)
  reload    rank 0 alone: a 1-GPU plan with every table uvm_caching loads async #2's checkpoint and pools a fixed
            batch: compared with what the 2-GPU model pooled for it just before async #2; loaded twice, each time
            from the disk (page cache dropped): with the checksums checked as chunks are read (the default), and
            without (load_checkpoint(verify=False)): the difference is what checking costs a load
Peak RSS per rank (ru_maxrss) after each phase shows the host memory: the sync save and the load stay within a
few chunks of the baseline; the async saves hold one copy of the rank's shards (pinned).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import time

import torch
import torch.distributed as dist

BIG, MID, SMALL = (100_000_000, 128, 1), (5_000_000, 64, 5), (10_000, 16, 30)


def rss_gib() -> tuple[float, float]:
    """(current, peak) resident set size of this process, GiB."""
    current = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                current = int(line.split()[1]) / 2**20
    return current, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def drop_page_cache(folder: str) -> None:
    """Ask the kernel to drop the folder's files from the page cache (clean pages: the save fsynced them)."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def crc32_gb_per_s() -> float:
    """zlib.crc32 over 256 MiB in memory, one thread."""
    import zlib

    buf = os.urandom(256 << 20)
    zlib.crc32(buf)
    t = time.perf_counter()
    for _ in range(4):
        zlib.crc32(buf)
    return 4 * len(buf) / 1e9 / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=float, default=0.1, help="row-count factor of the large and medium tables")
    ap.add_argument("--dir", default="/tmp/embshard_ckpt_bench", help="checkpoint folder (removed at the end)")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--chunk-mib", type=float, default=64.0)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--verify-threads", type=int, default=8, help="files read at once by the verify pass")
    args = ap.parse_args()

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from embshard.checkpoint import Checkpointer, TrainState, latest, load_checkpoint
    from embshard.checkpoint.integrity import verify_folder
    from embshard.checkpoint.storage import checksums
    from embshard.collection.sharded import ShardedEmbeddingBagCollection
    from embshard.planner import simple_plan
    from embshard.runtime.distributed import init_distributed
    from embshard.spec.optim import FusedOptimizerConfig
    from embshard.spec.plan import MemoryTier, ShardingType
    from embshard.spec.tables import TableConfig

    dev = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = dev.type == "cuda"  # on the CPU (a smoke test at a tiny --scale): host tier, no pinned memory
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    os.makedirs(args.dir, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    scale = args.scale
    while scale > 1e-4 and 2.2 * sum(4 * (int(r * scale) * (d + 1)) for r, d, _ in [BIG] * 4 + [MID] * 20) > free:
        scale /= 2  # two checkpoints exist at once (keep_last=1, while the next one is written)
    if scale != args.scale and rank == 0:
        print(f"--scale {args.scale} does not fit twice in {free / 1e9:.0f} GB free at {args.dir}: using {scale}")
    spec = [(int(r * scale), d, m) for r, d, m in [BIG] * 4 + [MID] * 20] + [SMALL] * 100
    tables = [TableConfig(f"t{i}", r, d, (f"f{i}",), ids_per_bag=m) for i, (r, d, m) in enumerate(spec)]
    opt = FusedOptimizerConfig("rowwise_adagrad", lr=0.01)
    dp = {t.name: ShardingType.DATA_PARALLEL for t in tables if t.num_embeddings <= 10_000}
    plan = simple_plan(tables, world, sharding_types=dp, tier=MemoryTier.HBM if cuda else MemoryTier.HOST)
    t0 = time.time()
    ebc = ShardedEmbeddingBagCollection(tables, plan, opt, device=dev, seed=None)
    build_s = time.time() - t0
    gen = torch.Generator(device=dev).manual_seed(rank)

    def batch(g: torch.Generator) -> KeyedJaggedTensor:
        lengths, values = [], []
        for r, _, mean in spec:
            le = torch.randint(0, 2 * mean + 1, (args.batch,), device=dev, generator=g, dtype=torch.int32)
            lengths.append(le)
            values.append(torch.randint(0, r, (int(le.sum()),), device=dev, generator=g))
        keys = [f"f{i}" for i in range(len(spec))]
        return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))

    def train(n: int) -> float:
        sync()
        t = time.time()
        for _ in range(n):
            ebc(batch(gen)).values().sum().backward()
        sync()
        return (time.time() - t) / n

    rows: list[tuple] = []  # (phase, GB, seconds, note) on rank 0
    rss: dict[str, list] = {}

    def note_rss(phase: str) -> None:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, rss_gib())
        rss[phase] = everyone

    step_s = train(3)
    note_rss("trained")
    state = TrainState({"ebc": ebc})
    chunk = int(args.chunk_mib * 2**20)
    saved = [w for n, _, w in ebc.local_shards() if rank == 0 or n not in dp]  # replicas: rank 0's is saved
    saved += [v for n, _, st in ebc.local_optimizer_states() if rank == 0 or n not in dp for v in st.values()]
    mine = sum(t.numel() * t.element_size() for t in saved)
    total = torch.tensor([float(mine)], device=dev)
    dist.all_reduce(total)
    total_gb = total.item() / 1e9
    if rank == 0:
        usage = shutil.disk_usage(args.dir)
        print(
            f"checkpoint of {total_gb:.1f} GB in {args.dir}: {usage.free / 1e9:.0f} GB free of {usage.total / 1e9:.0f}"
        )
        print(f"built in {build_s:.1f} s; {step_s * 1e3:.1f} ms/step; plan: {len(dp)} tables data-parallel, "
              f"{len(tables) - len(dp)} table-wise in {plan[tables[0].name].tier.value}", flush=True)  # fmt: skip

    # dd: this rank's bytes, all ranks at once
    dd_file = os.path.join(args.dir, f"dd_{rank}.bin")
    count = max(1, mine // (64 << 20))
    dist.barrier()
    t = time.time()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={dd_file}", "bs=64M", f"count={count}", "conv=fdatasync", "status=none"], check=True
    )
    dist.barrier()
    dd_s = time.time() - t
    os.remove(dd_file)
    rows.append(("dd (same bytes, a stream per rank)", world * count * 64 * 2**20 / 1e9, dd_s, ""))

    def timed_save(ckpt: Checkpointer, step: int) -> tuple[float, float]:
        """(seconds the caller waited, seconds until every rank's save was committed)."""
        dist.barrier()
        t = time.time()
        ckpt.save(step)
        blocking = time.time() - t
        ckpt.wait()
        dist.barrier()
        return blocking, time.time() - t

    plain = Checkpointer(state, args.dir, keep_last=1, async_save=False, chunk_bytes=chunk, io_threads=args.io_threads)
    blocking, _ = timed_save(plain, 3)
    rows.append(("sync save", total_gb, blocking, "the loop waits for the write"))
    note_rss("sync save")

    ckpt = Checkpointer(state, args.dir, keep_last=1, async_save=True, chunk_bytes=chunk, io_threads=args.io_threads)
    train(1)
    blocking, wall = timed_save(ckpt, 4)
    rows.append(("async save #1: blocking", total_gb, blocking, "copy into new pinned buffers"))
    rows.append(("async save #1: until committed", total_gb, wall, ""))
    note_rss("async #1")

    train(1)
    probe = batch(torch.Generator(device=dev).manual_seed(1234))  # the same batch on every rank
    with torch.no_grad():
        before = ebc(probe).values().float().cpu()
    dist.barrier()
    t = time.time()
    stats = ckpt.save(6)
    blocking = time.time() - t
    during = train(1)  # trains while the checkpoint is written: must not change what is written
    ckpt.wait()
    dist.barrier()
    wall = time.time() - t
    rows.append(("async save #2: blocking", total_gb, blocking, "buffers reused"))
    rows.append(("async save #2: until committed", total_gb, wall, f"a step during the write: {during * 1e3:.0f} ms"))
    note_rss("async #2")
    ckpt.close()
    plain.close()
    del ckpt, plain  # their host buffers
    if cuda and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # pinned blocks back to the system

    # checksums: their CPU speed, a verify pass from the disk and from the page cache (rank 0 alone)
    one = dist.new_group([0])
    path = latest(args.dir)
    if rank == 0:
        rows.append(("crc32 in memory (1 thread)", 1.0737, 1.0737 / crc32_gb_per_s(), "zlib.crc32, 256 MiB x 4"))
        for how in ("from disk", "page cache"):
            if how == "from disk":
                drop_page_cache(str(path))
            v = verify_folder(path, checksums(path), args.verify_threads)
            note = f"{v.files} files, {args.verify_threads} threads, " + ("intact" if not v.problems else "DAMAGED")
            rows.append((f"verify ({how})", v.bytes / 1e9, v.seconds, note))

    # reload into one GPU, every table uvm_caching (rank 0 alone), with and without the checksums checked
    if rank == 0:
        plan1 = simple_plan(tables, 1, tier=MemoryTier.UVM_CACHING if cuda else MemoryTier.HOST)
        uvm = ShardedEmbeddingBagCollection(tables, plan1, opt, device=dev, seed=None, group=one)
        drop_page_cache(str(path))
        t = time.time()
        load_checkpoint(path, TrainState({"ebc": uvm}), chunk_bytes=chunk, verify=False)
        sync()
        rows.append(("reload, checksums not checked", total_gb, time.time() - t, "from disk"))
        drop_page_cache(str(path))
        t = time.time()
        load_checkpoint(path, TrainState({"ebc": uvm}), chunk_bytes=chunk)
        sync()
        load_s = time.time() - t
        with torch.no_grad():
            after = uvm(probe).values().float().cpu()
        diff = float((after - before).abs().max())
        magnitude = float(before.abs().max())
        ok = "parity OK" if diff <= 1e-5 * max(1.0, magnitude) else "PARITY FAILED"
        tier = "uvm_caching" if cuda else "host"
        rows.append(
            (
                f"reload: 1 rank, all {tier}",
                total_gb,
                load_s,
                f"checksums checked, from disk; {ok}: max |diff| {diff:.2e} of {magnitude:.2f}",
            )
        )
    dist.barrier()
    note_rss("reload")
    device_name = torch.cuda.get_device_name() if cuda else "cpu"
    if rank == 0:
        print(f"\nhetero124 x{scale} on {world} x {device_name}: {total_gb:.1f} GB of weights + "
              f"row-wise Adagrad state; step {stats.step} checkpoint at {path}")  # fmt: skip
        print(f"{'phase':34s} {'GB':>6s} {'seconds':>8s} {'GB/s':>6s}  note (blocking rows: GB/s of the copy)")
        for phase, gb, s, note in rows:
            print(f"{phase:34s} {gb:6.1f} {s:8.2f} {gb / s:6.2f}  {note}")
        print("\npeak RSS per rank (GiB; current / peak since start):")
        for phase, values in rss.items():
            print(f"  {phase:12s} " + "   ".join(f"rank {r}: {c:.1f} / {p:.1f}" for r, (c, p) in enumerate(values)))
        speed = {phase: (gb / sec if sec > 0 else float("nan")) for phase, gb, sec, _ in rows}
        seconds = {phase: sec for phase, _, sec, _ in rows}
        reload = next((r for r in rows if r[0].startswith("reload:")), None)
        first = {
            key: next((speed[r[0]] for r in rows if r[0].startswith(key)), float("nan"))
            for key in ("verify", "reload,")
        }
        print(
            f"RESULT framework=embshard bench=ckpt world={world} scale={scale:g} gb={total_gb:.2f} "
            f"dd_gbs={speed[rows[0][0]]:.2f} sync_save_gbs={speed['sync save']:.2f} "
            f"async1_blocking_s={seconds['async save #1: blocking']:.2f} "
            f"async2_blocking_s={seconds['async save #2: blocking']:.2f} "
            f"async2_commit_gbs={speed['async save #2: until committed']:.2f} verify_gbs={first['verify']:.2f} "
            f"reload_gbs={speed[reload[0]] if reload else float('nan'):.2f} "
            f"reload_unchecked_gbs={first['reload,']:.2f} "
            f"reload_parity={'ok' if reload and 'parity OK' in reload[3] else 'failed'} "
            f"peak_rss_gib={max(p for values in rss.values() for _, p in values):.2f}"
        )
    dist.barrier()
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
