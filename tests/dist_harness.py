"""Run a function on N local processes (gloo on CPU; NCCL when EMBSHARD_TEST_DEVICE=cuda) and collect results."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def device_kind() -> str:
    """'cpu' (default) or 'cuda', from EMBSHARD_TEST_DEVICE."""
    return os.environ.get("EMBSHARD_TEST_DEVICE", "cpu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple, pg_timeout_s: float) -> None:
    device = device_kind()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s))
    try:
        result = fn(rank, world_size, torch.device(device, rank) if device == "cuda" else torch.device("cpu"), *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, pg_timeout_s: float = 300.0) -> list[Any]:
    """Call fn(rank, world_size, device, *args) on `world_size` processes; return each rank's result.
    `pg_timeout_s`: the process group's timeout (a hung collective fails the test after it)."""
    if device_kind() == "cuda" and world_size > torch.cuda.device_count():
        import pytest

        pytest.skip(f"needs {world_size} GPUs, {torch.cuda.device_count()} visible (one process per GPU)")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        try:
            mp.start_processes(
                _entry,
                args=(world_size, port, out_dir, fn, args, pg_timeout_s),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback is read below
        paths = [os.path.join(out_dir, f"{r}.pt") for r in range(world_size)]
        loaded = [torch.load(p, weights_only=False) if os.path.exists(p) else None for p in paths]
        for r, res in enumerate(loaded):
            if res is not None and "error" in res:
                raise RuntimeError(f"rank {r} failed:\n{res['error']}")
        for r, res in enumerate(loaded):
            if res is None:
                raise RuntimeError(f"rank {r} produced no result (crashed or was killed)")
        return [res["ok"] for res in loaded]
