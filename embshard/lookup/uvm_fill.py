"""The first touch of a TBE's UVM buffers, on host threads instead of through GPU page faults.

FBGEMM allocates every UVM buffer of a TBE (tiers uvm and uvm_caching: the weights, and for adagrad or adam their
per-element state) with `new_unified_tensor`: cudaMallocManaged, preferred location the host, accessed by the GPU.
Its `apply_split_helper` then zeroes the buffer with a GPU kernel (`torch.zeros(..., out=...)`). That kernel is the
buffer's first touch, through GPU page faults. The driver (nvidia-uvm) serves a first-touch fault at the preferred
location by populating the whole 2 MB block (zeroed host pages, mapped for the GPU too), but it serves a GPU's
faults on one thread, a batch at a time: a few GB/s. A 2-GPU plan with two 100M x 128 fp32 UVM-caching tables
(102 GB) on one rank (bench/embshard_dmp.py --workload hetero124 --plan planner) took 37-49 s to build: that first
touch, then a second pass over the same 102 GB over PCIe when the lookup wrote the initial weights. A CPU fault is
served on the faulting thread, the same way (whole 2 MB block, locked per block), so host threads populate many
blocks at once.

While `uvm_first_touch()` is active (TBELookup builds UVM TBEs inside it), FBGEMM's helper allocates the same
buffer (FBGEMM's own `new_unified_tensor`, same memory advice) without its GPU fill; host threads zero it through
its host view (`uvm_to_cpu`) in pieces of PIECE_BYTES, which populates the pages on the host, many pieces at once.
`wait(view)` returns once the pieces under `view` are zero, so the caller writes the initial weights from the GPU
right behind the threads (population and the writes over PCIe overlap). On exit every piece is done: each buffer
holds zeros, as FBGEMM's own fill leaves it. Any other FBGEMM version or argument (HBM-enforced, host-mapped
buffers) goes through FBGEMM's helper unchanged.

EMBSHARD_UVM_FIRST_TOUCH=host turns it on; the default, fbgemm, keeps FBGEMM's GPU fill until the host way has been
timed on GPUs (bench/uvm_fill.py, and the hetero124 build with each). EMBSHARD_UVM_THREADS sets the thread count
(default: this process's CPUs / LOCAL_WORLD_SIZE, at most 32). bench/uvm_fill.py times both ways on one GPU.
"""

from __future__ import annotations

import ctypes
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

_TRAINING = "fbgemm_gpu.split_table_batched_embeddings_ops_training"
DEFAULT_WAY = "fbgemm"  # EMBSHARD_UVM_FIRST_TOUCH's default: host once measured on GPUs (module docstring)
PIECE_BYTES = 256 << 20  # a host thread zeroes this much at a time; `wait` waits for whole pieces
MAX_THREADS = 32


def default_threads() -> int:
    """Host threads for the first touch: EMBSHARD_UVM_THREADS, else the CPUs this process may run on shared by the
    node's ranks (LOCAL_WORLD_SIZE), between 1 and MAX_THREADS."""
    env = os.environ.get("EMBSHARD_UVM_THREADS")
    if env:
        if not env.strip().isdigit() or int(env) < 1:
            raise ValueError(f"EMBSHARD_UVM_THREADS={env!r} must be a whole number >= 1: set it so, or unset it")
        return int(env)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


def concurrent_managed_access(device: torch.device) -> bool:
    """Whether host threads may write managed memory while `device` runs kernels (CUDA on Linux, compute
    capability 6.0 or newer: concurrentManagedAccess)."""
    if device.type != "cuda" or not sys.platform.startswith("linux"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 6


def _memset_zero(keep_alive: torch.Tensor, address: int, nbytes: int) -> None:
    ctypes.memset(address, 0, nbytes)


class HostFirstTouch:
    """Zeroes buffers on host threads in pieces (`zero_async`); `wait(view)` for the pieces under a view."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self._pool: ThreadPoolExecutor | None = None
        self._pieces: list[tuple[int, int, Future]] = []  # (first byte, end byte, zeroing) in address order

    def zero_async(self, host: torch.Tensor, address: int | None = None) -> None:
        """Start zeroing the contiguous tensor `host` (a CPU tensor: for UVM, `uvm_to_cpu` of the buffer) piece by
        piece; `address`: where other views see its first byte (default: its own data_ptr). Each piece is one
        memset (ctypes: no GIL held, no intra-op threads started from the pool's threads)."""
        if not host.is_contiguous():
            raise ValueError("HostFirstTouch.zero_async needs a contiguous tensor")
        if host.device.type != "cpu":
            raise ValueError(f"HostFirstTouch.zero_async needs a CPU view of the memory, got a {host.device} tensor")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="embshard-uvm-fill")
        nbytes = host.numel() * host.element_size()
        ptr = host.data_ptr()
        base = ptr if address is None else address
        for off in range(0, nbytes, PIECE_BYTES):
            n = min(PIECE_BYTES, nbytes - off)
            done = self._pool.submit(_memset_zero, host, ptr + off, n)  # `host` rides along: kept alive
            self._pieces.append((base + off, base + off + n, done))

    def wait(self, view: torch.Tensor) -> None:
        """Return once every piece overlapping the bytes of `view` (a view of a buffer given to zero_async, any
        device) is zero; raises what a thread raised."""
        if not self._pieces or view.numel() == 0:
            return
        lo = view.data_ptr()
        hi = lo + (1 + sum((n - 1) * abs(s) for n, s in zip(view.shape, view.stride()))) * view.element_size()
        for first, end, done in self._pieces:
            if first < hi and lo < end:
                done.result()

    def close(self, cancel: bool = False) -> None:
        """Wait for every piece (raising what a thread raised) and stop the threads; `cancel`: drop the pieces not
        started yet instead (after an error: the buffers are being thrown away)."""
        try:
            if not cancel:
                for _, _, done in self._pieces:
                    done.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._pieces = None, []


def _new_managed(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A UVM buffer exactly as FBGEMM's helper allocates it (cudaMallocManaged, FBGEMM's memory advice)."""
    return torch.ops.fbgemm.new_unified_tensor(
        torch.zeros(1, device=device, dtype=dtype), [numel], is_host_mapped=False
    )


def _host_view(buffer: torch.Tensor) -> torch.Tensor:
    """The UVM buffer as a CPU tensor (same memory)."""
    return torch.ops.fbgemm.uvm_to_cpu(buffer)


def host_first_touch_helper(
    original: Callable[..., None],
    touch: HostFirstTouch,
    allocate: Callable[[torch.device, torch.dtype, int], torch.Tensor] = _new_managed,
    host_view: Callable[[torch.Tensor], torch.Tensor] = _host_view,
) -> Callable[..., None]:
    """FBGEMM's `apply_split_helper` (`original`) with the UVM buffer allocated by `allocate` (FBGEMM's
    `new_unified_tensor`) and zeroed by `touch` through `host_view` on host threads instead of by a GPU kernel;
    everything else is FBGEMM's own."""
    signature = inspect.signature(original)

    def helper(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        a = bound.arguments
        split = a["split"]
        if (
            split.uvm_size <= 0
            or a.get("use_cpu", False)
            or a.get("enforce_hbm", False)
            or a.get("uvm_host_mapped", False)
            or not hasattr(split, "_replace")
        ):
            return original(*args, **kwargs)
        a["split"] = split._replace(uvm_size=0)  # FBGEMM registers an empty UVM buffer: replaced below
        original(*bound.args, **bound.kwargs)
        name = f"{a['prefix']}_uvm"
        buffer = allocate(a["current_device"], a["dtype"], split.uvm_size)
        touch.zero_async(host_view(buffer), address=buffer.data_ptr())
        a["persistent_state_fn"](name, buffer)
        log = a.get("uvm_tensors_log")
        if log is not None:
            log.append(name)

    return helper


@contextmanager
def uvm_first_touch(threads: int | None = None) -> Iterator[HostFirstTouch | None]:
    """While active, FBGEMM's TBE constructor has its UVM buffers zeroed on host threads (module docstring). Yields
    the HostFirstTouch (call `wait(view)` before writing into a UVM buffer from the GPU), or None where FBGEMM's
    own fill stays (EMBSHARD_UVM_FIRST_TOUCH=fbgemm, the default, or an FBGEMM without `apply_split_helper`). On exit every
    buffer is zero and FBGEMM's helper is restored."""
    import importlib

    way = os.environ.get("EMBSHARD_UVM_FIRST_TOUCH", DEFAULT_WAY)
    if way not in ("host", "fbgemm"):
        raise ValueError(f"EMBSHARD_UVM_FIRST_TOUCH={way!r} is invalid: choose host or fbgemm (the default)")
    if way == "fbgemm":
        yield None
        return
    try:
        training = importlib.import_module(_TRAINING)
    except ImportError:
        yield None
        return
    original = getattr(training, "apply_split_helper", None)
    if original is None:
        yield None
        return
    touch = HostFirstTouch(threads)
    training.apply_split_helper = host_first_touch_helper(original, touch)
    try:
        yield touch
    except BaseException:
        touch.close(cancel=True)
        raise
    else:
        touch.close()
    finally:
        training.apply_split_helper = original
