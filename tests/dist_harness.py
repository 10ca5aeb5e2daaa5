"""Run a function on N local processes (gloo on CPU; NCCL when EMBSHARD_TEST_DEVICE=cuda) and collect results.

Starting a process costs about 4 s of CPU (a Python interpreter importing torch, torchrec, FBGEMM and embshard)
plus the process group's set-up, more than most tests' work. So on the CPU the processes of a world size are
started once and serve every later call of that world size (`_Pool`): each call sends the function and its
arguments to every rank, which runs it on the process group joined at start, with this process's environment
variables, import path and working directory, and the torch RNG reset to a fresh process's seed; a call may end
the process group (embshard.training.train.run does: the ranks then join a new one). A call that fails on some rank (an
exception, a crash, a hang the process group's timeout ends) ends that pool; the next call starts a new one.
Calls with another `pg_timeout_s` or `fresh=True` (a test that leaves a process in a state no other test should
inherit: a watchdog timeout set, a collective left pending) get processes of their own (EMBSHARD_TEST_POOL=0: never
reuse processes). On machines without CUDA the processes are forks of a server that imported those modules once
(EMBSHARD_TEST_START_METHOD=spawn: new interpreters); with CUDA they are new interpreters (CUDA does not survive a
fork), each bound to the GPU of its rank, whose peak-memory counters, cached blocks and TF32 flags are reset between
calls.
"""

from __future__ import annotations

import atexit
import itertools
import os
import pickle
import runpy
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton_interpret
import triton_lower

from embshard.runtime.heap import preload_frozen

# Here (imported by tests/suite_plugin.py and by the fork server): the Triton interpreter's launches set the language up
# once, in the tests' processes and in every process forked for them (tests/triton_interpret.py); with
# EMBSHARD_TRITON_RECORD set they are recorded for tests/kernels/test_kernels_lower.py (tests/triton_lower.py).
triton_interpret.install()
triton_lower.record_from_env()

DEFAULT_PG_TIMEOUT_S = 300.0
# What the pool's ranks keep from their start whatever the caller's environment says.
_RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def device_kind() -> str:
    """'cpu' (default) or 'cuda', from EMBSHARD_TEST_DEVICE."""
    return os.environ.get("EMBSHARD_TEST_DEVICE", "cpu")


_PORTS = itertools.count()


def _free_port() -> int:
    """A free port below Linux's ephemeral range (32768 and up), from a range of its own per pytest-xdist worker:
    neither the ports the kernel hands to other sockets (NCCL's, the command line's) nor another worker's groups can
    take it between this choice and the store's bind (a port from the ephemeral range could be, under load)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    base = 20000 + 500 * (int(worker) % 24 if worker.isdigit() else 0)
    for _ in range(500):
        port = base + next(_PORTS) % 500
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + 499}: close the processes holding them")


def _join_group(rank: int, world_size: int, port: int, pg_timeout_s: float) -> torch.device:
    # A fork server's children default to starting theirs from the fork server too: back to the platform's default,
    # as in any process (DataLoader workers fork from the rank, as under `embshard train`).
    mp.set_start_method(mp.get_all_start_methods()[0], force=True)
    device = device_kind()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    # The store's own timeout is generous: under a loaded machine (parallel test workers) a rank can take seconds to
    # reach it, which is no hang; a short pg_timeout_s is for the collectives.
    store = dist.TCPStore("127.0.0.1", port, world_size, rank == 0, timeout=timedelta(seconds=max(120, pg_timeout_s)))
    timeout = timedelta(seconds=pg_timeout_s)
    bound = {"device_id": torch.device("cuda", rank)} if device == "cuda" else {}  # as embshard's init_distributed
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **bound)
    return torch.device(device, rank) if device == "cuda" else torch.device("cpu")


def _entry(
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
    fn: Callable,
    args: tuple,
    pg_timeout_s: float,
    environ: dict,
) -> None:
    os.environ.clear()  # the caller's (a forked process has the fork server's)
    os.environ.update(environ)
    device = _join_group(rank, world_size, port, pg_timeout_s)
    try:
        result = fn(rank, world_size, device, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        if dist.is_initialized():  # fn may have ended it (embshard.training.train.run does)
            dist.destroy_process_group()


_FRESH_TF32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def _reset_after_call(rank: int, world_size: int, port: int, pg_timeout_s: float) -> None:
    """What a call may leave behind that the next must not inherit: an ended process group (embshard.training.train.run
    ends it: the ranks join a new one on `port`), embshard's watchdog timeout and its record of collectives."""
    if not dist.is_initialized():
        _join_group(rank, world_size, port, pg_timeout_s)
    comm = sys.modules.get("embshard.runtime.comm")
    if comm is not None:
        comm.set_timeout(None)
        comm._ISSUED.clear()
    if device_kind() == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # process-wide numerics a call may have set (training.precision tf32 does): back to a fresh process's
        torch.backends.cuda.matmul.allow_tf32 = _FRESH_TF32[0]
        torch.backends.cudnn.allow_tf32 = _FRESH_TF32[1]


def _pool_entry(rank: int, world_size: int, port: int, conn, pg_timeout_s: float) -> None:
    """A pooled rank: join the group, then run every call received on `conn` until an empty message or EOF."""
    device = _join_group(rank, world_size, port, pg_timeout_s)
    fresh_seed = torch.initial_seed()
    try:
        while True:
            try:
                msg = conn.recv_bytes()
            except EOFError:
                return
            if not msg:
                return
            environ, path, cwd, next_port, out_dir, payload = pickle.loads(msg)
            own_env = {k: os.environ[k] for k in _RANK_ENV}
            os.environ.clear()
            os.environ.update(environ, **own_env)
            sys.path[:] = path
            os.chdir(cwd)
            torch.manual_seed(fresh_seed)
            try:
                fn, args = pickle.loads(payload)  # imports fn's module (with the caller's sys.path)
                result = {"ok": fn(rank, world_size, device, *args)}
            except BaseException:
                result = {"error": traceback.format_exc()}
            torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
            if "error" not in result:
                _reset_after_call(rank, world_size, next_port, pg_timeout_s)
            conn.send_bytes(b"error" if "error" in result else b"ok")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Where the processes come from: on machines without CUDA, forks of a server process that imported torch, torchrec,
# FBGEMM and embshard once (a rank then starts in a fraction of a second instead of seconds); elsewhere new
# interpreters (CUDA does not survive a fork).
_PRELOAD = ["torch", "torch.distributed", "torchrec", "fbgemm_gpu", "embshard.collection.sharded", "dist_harness"]
_PRELOAD += [
    "embshard.training.train",
    "embshard.checkpoint",
    "embshard.data",
    "embshard.models.build",
    "embshard.training.pipeline",
    "torchmetrics.classification",  # a training run's evaluation (its AUC): 0.7 s of imports a rank
    "torch.utils.tensorboard",
]


def _start_method() -> str:
    default = "forkserver" if device_kind() == "cpu" and not torch.cuda.is_available() else "spawn"
    method = os.environ.get("EMBSHARD_TEST_START_METHOD") or default
    if method == "forkserver":  # imported with Python's collector paused, then frozen (embshard/runtime/heap.py)
        preload_frozen(mp, _PRELOAD)
    return method


def _stop_fork_server() -> None:
    """End the fork server (its CPU time, and its forks', then counts in this process's children)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


class _Pool:
    """`world_size` processes joined in one process group, running calls one after another."""

    def __init__(self, world_size: int, pg_timeout_s: float) -> None:
        ctx = mp.get_context(_start_method())
        port = _free_port()
        self.world_size = world_size
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_pool_entry, args=(rank, world_size, port, child, pg_timeout_s), daemon=False)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def call(self, fn: Callable, args: tuple, out_dir: str) -> bool:
        """Run fn on every rank; True if every rank returned, False at the first rank that raised or died."""
        # The function and arguments as a separate pickle: the ranks load it after taking this process's sys.path.
        payload = pickle.dumps((fn, args))
        msg = pickle.dumps((dict(os.environ), list(sys.path), os.getcwd(), _free_port(), out_dir, payload))
        for conn in self.conns:
            conn.send_bytes(msg)
        pending = set(range(self.world_size))
        while pending:
            waitables = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            for ready in wait(list(waitables)):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                try:
                    status = self.conns[rank].recv_bytes() if ready is self.conns[rank] else b"died"
                except EOFError:
                    status = b"died"
                if status != b"ok":
                    return False
                pending.discard(rank)
        return True

    def close(self, kill: bool = False) -> None:
        for conn in self.conns:
            if not kill:
                try:
                    conn.send_bytes(b"")
                except OSError:
                    kill = True
        for proc in self.procs:
            if kill:
                proc.kill()
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


_POOLS: dict[int, _Pool] = {}


def close_pools(kill: bool = False) -> None:
    """End every pooled process (tests may call it to start from fresh processes); `kill`: without waiting for
    them to leave their process groups (at exit: nothing of theirs is read any more)."""
    while _POOLS:
        _POOLS.popitem()[1].close(kill)
    _stop_fork_server()


atexit.register(close_pools, kill=True)


def _pooling() -> bool:
    return os.environ.get("EMBSHARD_TEST_POOL") != "0"


def _load(path: str) -> dict | None:
    try:  # a rank killed while it saved leaves a partial file: read as no result
        return torch.load(path, weights_only=False) if os.path.exists(path) else None
    except Exception:
        return None


def _collect(out_dir: str, world_size: int) -> list[Any]:
    paths = [os.path.join(out_dir, f"{r}.pt") for r in range(world_size)]
    loaded = [_load(p) for p in paths]
    for r, res in enumerate(loaded):
        if res is not None and "error" in res:
            raise RuntimeError(f"rank {r} failed:\n{res['error']}")
    for r, res in enumerate(loaded):
        if res is None:
            raise RuntimeError(f"rank {r} produced no result (crashed or was killed)")
    return [res["ok"] for res in loaded]


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
    fresh: bool = False,
) -> list[Any]:
    """Call fn(rank, world_size, device, *args) on `world_size` processes; return each rank's result.
    `pg_timeout_s`: the process group's timeout (a hung collective fails the test after it). `fresh`: on processes
    started for this call alone (else, on the CPU, on the pool of this world size: see the module's docstring)."""
    if device_kind() == "cuda" and world_size > torch.cuda.device_count():
        import pytest

        pytest.skip(f"needs {world_size} GPUs, {torch.cuda.device_count()} visible (one process per GPU)")
    with tempfile.TemporaryDirectory() as out_dir:
        if fresh or pg_timeout_s != DEFAULT_PG_TIMEOUT_S or not _pooling():
            try:
                mp.start_processes(
                    _entry,
                    args=(world_size, _free_port(), out_dir, fn, args, pg_timeout_s, dict(os.environ)),
                    nprocs=world_size,
                    join=True,
                    start_method=_start_method(),
                )
            except mp.ProcessRaisedException:
                pass  # the rank's own traceback is read below
            return _collect(out_dir, world_size)
        if world_size not in _POOLS:
            _POOLS[world_size] = _Pool(world_size, pg_timeout_s)
        pool = _POOLS[world_size]
        ok = False
        try:
            ok = pool.call(fn, args, out_dir)
        finally:
            if not ok:  # a rank raised, died or the call was interrupted: the others may wait in a collective
                _POOLS.pop(world_size, None)
                pool.close(kill=True)
        return _collect(out_dir, world_size)


# ---- Python scripts as a reader runs them (`python SCRIPT ARGS`), in forks of the server -----------------------
def _script_entry(script: str, argv: list[str], environ: dict, cwd: str, out_path: str, err_path: str) -> None:
    """`python SCRIPT ARGV` in a fork of the server: its environment, working directory, sys.argv and sys.path (the
    script's folder, PYTHONPATH, the interpreter's own), stdout and stderr into files; exits with its status."""
    mp.set_start_method(mp.get_all_start_methods()[0], force=True)  # as in any process (see _join_group)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    own = [p for p in sys.path if p.startswith((sys.prefix, sys.base_prefix))]  # the standard library, site-packages
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra, *own]
    sys.argv = [script, *argv]
    with open(out_path, "w") as out, open(err_path, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # no exit handlers: they belong to the server's modules


class ScriptRun:
    """A started `python SCRIPT ARGV` (start_script): its pid, poll() / wait() for its status, and once it ended
    what it printed (`stdout`, `stderr`)."""

    def __init__(self, script: str, argv: list[str], env: dict, cwd: str, tmp: str) -> None:
        self.script = script
        self.stdout = self.stderr = ""
        if _start_method() != "forkserver":
            self._proc = subprocess.Popen([sys.executable, script, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)  # fmt: skip
            self.pid = self._proc.pid
            return
        fd, self._out = tempfile.mkstemp(dir=tmp, suffix=".out")
        os.close(fd)
        self._err = self._out[:-4] + ".err"
        ctx = mp.get_context("forkserver")
        self._proc = ctx.Process(
            target=_script_entry, args=(script, list(argv), dict(env), str(cwd), self._out, self._err)
        )
        self._proc.start()
        self.pid = self._proc.pid

    def poll(self) -> int | None:
        if isinstance(self._proc, subprocess.Popen):
            return self._proc.poll()
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Its status (a killed one's is minus the signal), once it ended; TimeoutError after `timeout` s."""
        if isinstance(self._proc, subprocess.Popen):
            try:
                self.stdout, self.stderr = self._proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired as e:
                raise TimeoutError(f"python {self.script} ran past {timeout} s") from e
            return self._proc.returncode
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise TimeoutError(f"python {self.script} ran past {timeout} s")
        with open(self._out) as o:
            self.stdout = o.read()
        if os.path.exists(self._err):
            with open(self._err) as e:
                self.stderr = e.read()
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()


def start_script(script: str, argv: list[str], env: dict, cwd: str, tmp: str) -> ScriptRun:
    """Start `python SCRIPT ARGV` with environment `env` from `cwd` (its output kept in folder `tmp` till it ends):
    on machines without CUDA in a fork of the server that imported torch, torchrec, FBGEMM and embshard once (a new
    interpreter costs seconds of CPU: the script's imports of them then cost nothing), elsewhere in a new
    interpreter."""
    return ScriptRun(script, argv, env, cwd, tmp)


def run_scripts(runs: list[tuple[str, list[str], dict]], cwd: str, timeout: float = 180) -> list:
    """Run every `python SCRIPT ARGV` with its environment at the same time, from `cwd` (start_script); returns a
    subprocess.CompletedProcess each (returncode, stdout, stderr)."""
    with tempfile.TemporaryDirectory() as tmp:
        started = [start_script(script, argv, env, cwd, tmp) for script, argv, env in runs]
        deadline = time.monotonic() + timeout
        done = []
        try:
            for run in started:
                code = run.wait(max(0.0, deadline - time.monotonic()))
                done.append(subprocess.CompletedProcess(["python", run.script], code, run.stdout, run.stderr))
        finally:
            for run in started:
                if run.poll() is None:
                    run.kill()
                    run.wait()
        return done
