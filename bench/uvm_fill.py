"""How fast a UVM buffer (FBGEMM's managed memory, as UVM-caching tables use it) is populated and initialised on
one GPU: FBGEMM's own GPU zero fill (the first touch through GPU page faults) against embshard's host-thread first
touch (embshard/lookup/uvm_fill.py), each followed by the lookup's write of the initial weights from the GPU in
64 MiB blocks, as TBELookup does it. A fresh buffer per way (the first touch is what is timed).

    python -m bench.uvm_fill --gib 16 --threads 8,16
Prints one line per way: seconds and GB/s for populating (zeroing), for writing the weights, and in all; ways:
FBGEMM's fill then the writes (what builds did before), no fill (the writes make the first touch), and the host
threads (populate, then the writes; and both overlapped on a fresh buffer, as TBELookup runs them).
"""

from __future__ import annotations

import argparse
import time

import torch


def new_buffer(gib: float) -> torch.Tensor:
    """A managed fp32 buffer of `gib` GiB, allocated as FBGEMM allocates a UVM table (not touched yet)."""
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    n = int(gib * 2**30) // 4
    return torch.ops.fbgemm.new_unified_tensor(torch.zeros(1, device="cuda"), [n], is_host_mapped=False)


def write_weights(buf: torch.Tensor, touch=None) -> None:
    """The initial weights written from the GPU in 64 MiB blocks (uniform draws, as with seed=None)."""
    rows = buf.view(-1, 128)
    block = (64 << 20) // (4 * 128)
    for r0 in range(0, rows.shape[0], block):
        view = rows[r0 : r0 + block]
        init = torch.empty_like(view, memory_format=torch.contiguous_format).uniform_(-0.01, 0.01)
        if touch is not None:
            touch.wait(view)
        view.copy_(init)


def main() -> None:
    from embshard.lookup.uvm_fill import HostFirstTouch

    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=16.0, help="buffer size per way")
    ap.add_argument("--threads", default="8,16", help="host thread counts to try (comma-separated)")
    args = ap.parse_args()
    gb = args.gib * 2**30 / 1e9
    sync = torch.cuda.synchronize
    ways: list[tuple[str, int]] = [("fbgemm gpu fill", 0), ("no fill, first touch by the writes", -1)] + [
        (f"host first touch, {t} threads", int(t)) for t in args.threads.split(",")
    ]
    for name, threads in ways:
        sync()
        t0 = time.time()
        buf = new_buffer(args.gib)
        if threads == 0:  # FBGEMM's apply_split_helper: torch.zeros(..., out=new_unified_tensor(...))
            torch.zeros(buf.numel(), device="cuda", out=buf)
            sync()
            t1 = time.time()
            write_weights(buf)
        elif threads < 0:  # the weights' copies fault the pages in
            t1 = time.time()
            write_weights(buf)
        else:  # populate all, then the write pass (separately timed), then again overlapped on a fresh buffer
            touch = HostFirstTouch(threads)
            touch.zero_async(torch.ops.fbgemm.uvm_to_cpu(buf), address=buf.data_ptr())
            touch.close()
            t1 = time.time()
            write_weights(buf)
        sync()
        t2 = time.time()
        fill, write = max(t1 - t0, 1e-6), max(t2 - t1, 1e-6)
        line = (
            f"{name}: populate {fill:.2f} s ({gb / fill:.1f} GB/s), write {write:.2f} s ({gb / write:.1f} GB/s), "
            f"total {t2 - t0:.2f} s"
        )
        del buf
        if threads > 0:
            sync()
            t0 = time.time()
            buf = new_buffer(args.gib)
            touch = HostFirstTouch(threads)
            touch.zero_async(torch.ops.fbgemm.uvm_to_cpu(buf), address=buf.data_ptr())
            write_weights(buf, touch)
            touch.close()
            sync()
            line += f"; overlapped (as TBELookup) {time.time() - t0:.2f} s"
            del buf
        print(line, flush=True)


if __name__ == "__main__":
    main()
