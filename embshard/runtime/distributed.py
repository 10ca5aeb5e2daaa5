"""Process-group set-up: under torchrun (env vars present) or started locally with `spawn_local`; the intra-host and
cross-host sub-groups of a hierarchical exchange (`host_groups`)."""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from embshard.runtime import comm
from embshard.runtime.heap import preload_frozen
from embshard.spec.tables import ConfigError


def init_distributed(
    collective_timeout_s: float | None = 600.0, whole_step_graph: bool = False, cpu: bool = False
) -> torch.device:
    """Join the process group described by torchrun's environment (NCCL on GPUs, gloo on CPU); returns the
    device this rank computes on. Without torchrun's variables, a single-process group is created.

    `collective_timeout_s`: embshard's collectives raise `comm.CollectiveTimeout` (naming the step and the
    exchange) after this long; the process group's own timeout, for every other collective, is 60 s longer.
    `whole_step_graph`: the job replays its whole step as a CUDA graph holding the collectives of two communicators
    (the exchanges', the dense gradients'). NCCL's graph mixing support is then turned off (NCCL_GRAPH_MIXING_SUPPORT=0,
    unless the environment sets it): with it on, the captured dense all-reduce and pooled gradients' all-to-all
    waited on each other in the profiled step and the compute stream idled (2 x H100: busy 67% of the step with it,
    86% without).
    `comm.wait_for_graphs` keeps the rule that comes with it (no uncaptured collective beside a graph's launch).
    `cpu`: gloo on the CPU even where a GPU is visible."""
    cuda = torch.cuda.is_available() and not cpu
    nccl_settings(whole_step_graph, cuda)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        kwargs: dict[str, Any] = (
            {"timeout": timedelta(seconds=collective_timeout_s + 60)} if collective_timeout_s else {}
        )
        if cuda:  # the group's GPU, named: collectives without tensors (barrier, DCP's) use it instead of guessing
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        if os.environ.get(_HELD_STORE) == "1":  # spawn_local's parent holds the store: join it as a client
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            wait = timedelta(seconds=max(300.0, (collective_timeout_s or 0) + 60))
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, wait)
            kwargs.update(store=store, rank=rank, world_size=world)
        dist.init_process_group("nccl" if cuda else "gloo", **kwargs)
    comm.set_timeout(collective_timeout_s)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def nccl_settings(whole_step_graph: bool, cuda: bool) -> None:
    """NCCL's environment for the job, before its first communicator: graph mixing support off for a whole-step
    graph on GPUs (`init_distributed`), unless the environment sets it."""
    if whole_step_graph and cuda:
        os.environ.setdefault("NCCL_GRAPH_MIXING_SUPPORT", "0")


_HELD_STORE = "EMBSHARD_HELD_STORE"  # set by spawn_local: MASTER_PORT is a store its parent holds


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, nproc: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        **{_HELD_STORE: "1"},
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    if multiprocessing.get_start_method(allow_none=True) == "forkserver":
        # a fork server's forks would start their own processes (DataLoader workers) from it too, where the data
        # workers' objects do not arrive: the platform's default, as in any process (on Linux they fork from the rank)
        multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)
    fn(*args)


def start_method() -> str:
    """How `spawn_local` starts its processes: on machines without CUDA, forks of a fork server ("forkserver") that
    imported the ranks' modules once (a rank then starts in a fraction of a second instead of the seconds of CPU a
    Python process importing torch, torchrec and FBGEMM costs); with CUDA, new interpreters ("spawn": CUDA does not
    survive a fork). The fork server is a process of its own, started without threads, so its forks are safe where
    a fork of this process (which holds the group's store, a thread) might not be."""
    if not torch.cuda.is_available() and "forkserver" in multiprocessing.get_all_start_methods():
        return "forkserver"
    return "spawn"


def spawn_local(fn: Callable[..., Any], nproc: int, *args: Any, preload: Sequence[str] = ()) -> None:
    """Run fn(*args) on `nproc` local processes with torchrun-style environment variables. This process holds the
    group's store on a port the kernel picks as it binds it (no other process can take the port between a choice
    and the bind, as with a port picked free first); the ranks join it as clients (`init_distributed`).

    The processes start as `start_method()` says; a fork server imports fn's module, torch.distributed and
    `preload` (modules the ranks import later: each then imports them once, in the server) before its first fork."""
    import torch.multiprocessing as mp

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"spawn_local: nproc={nproc!r} is invalid: the number of processes to start (>= 1)")
    method = start_method()
    if method == "forkserver":
        own = [fn.__module__] if fn.__module__ != "__main__" else []  # a script's: its forks import it themselves
        modules = ["torch", "torch.distributed", __name__, *own, *preload]
        preload_frozen(mp.get_context(method), modules)  # imported with Python's collector paused, then frozen
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False)
    try:
        mp.start_processes(_entry, args=(nproc, store.port, fn, args), nprocs=nproc, join=True, start_method=method)
    finally:
        del store


@dataclass(frozen=True)
class HostGroups:
    """The sub-groups a hierarchical exchange runs on, for one rank of a group of H hosts x L local ranks (rank
    h * L + j is local rank j of host h)."""

    intra: dist.ProcessGroup
    """This rank's host: its L ranks, in local-rank order (fast local links)."""
    peers: dist.ProcessGroup
    """The ranks of this rank's local index on every host, in host order (one rank per host: the links between
    hosts)."""


_HOST_GROUPS: dict[tuple, tuple[dist.ProcessGroup, HostGroups]] = {}  # (name, L) -> (the parent group, its groups)


def host_groups(group: dist.ProcessGroup | None, local_world_size: int) -> HostGroups:
    """The intra-host and cross-host peer sub-groups of `group` (None: the default group) for hosts of
    `local_world_size` ranks. Collective: every process of the job calls it, in the same order (torch's new_group
    rule); the groups are made once per (group, local_world_size) and reused by later callers, so every rank makes
    the same groups in the same order as long as every rank builds the same modules. `group` must span every
    process (ConfigError otherwise); its backend and timeout carry over."""
    parent = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(parent)
    W, L = len(ranks), local_world_size
    if L < 1 or W % L:
        raise ConfigError(f"host groups: local_world_size={L} does not divide the group's {W} ranks")
    if W != dist.get_world_size() or ranks != sorted(ranks):
        raise ConfigError(
            f"the hierarchical exchange makes sub-groups of the collection's process group, which every process of "
            f"the job must enter (torch.distributed.new_group), but the group has ranks {ranks} of "
            f"{dist.get_world_size()}: build the collection on a group of every process in rank order, or plan "
            "table_row_wise_exchange: flat"
        )
    key = (getattr(parent, "group_name", None) or id(parent), L)
    if key not in _HOST_GROUPS or _HOST_GROUPS[key][0] is not parent:  # a new default group may reuse a name
        backend = dist.get_backend(parent)
        kw = {"timeout": _group_timeout(parent)} if _group_timeout(parent) is not None else {}
        me = dist.get_rank()
        H = W // L
        intra = peers = None
        for h in range(H):  # every process creates every group, in this order
            g = dist.new_group([ranks[h * L + j] for j in range(L)], backend=backend, **kw)
            intra = g if me // L == h else intra
        for j in range(L):
            g = dist.new_group([ranks[h * L + j] for h in range(H)], backend=backend, **kw)
            peers = g if me % L == j else peers
        _HOST_GROUPS[key] = (parent, HostGroups(intra, peers))
    return _HOST_GROUPS[key][1]


def _group_timeout(group: dist.ProcessGroup) -> timedelta | None:
    """The timeout `group` was made with, where torch exposes it (gloo, NCCL), else None (torch's default)."""
    for device in ("cuda", "cpu"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 (no such backend on this group, or an older torch without the field)
            continue
    return None
