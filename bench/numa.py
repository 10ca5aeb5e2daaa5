"""Where a rank's CPUs sit against its GPU's NUMA node, and binding them to it (Linux; GPU hosts with 2+ sockets).

A rank that runs on the far socket from its GPU finds its host memory there too (first touch): UVM and UVM-caching
tables then read rows across the socket link. `report()` prints, per rank, the GPU's PCI address and NUMA node and
the nodes of the CPUs the process may run on; `bind()` first restricts the process to its GPU's node's CPUs, so that
the host memory it touches afterwards is allocated there. Call it before the model is built.

    from bench.numa import numa_setup
    numa_setup(bind=args.numa_bind)   # prints one line per rank
"""

from __future__ import annotations

import os


def _cpus_of(cpulist: str) -> set[int]:
    cpus: set[int] = set()
    for part in cpulist.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_cpus() -> dict[int, set[int]]:
    """NUMA node -> its CPUs, from sysfs (empty where sysfs has no nodes)."""
    base = "/sys/devices/system/node"
    out: dict[int, set[int]] = {}
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        if name.startswith("node") and name[4:].isdigit():
            with open(os.path.join(base, name, "cpulist")) as f:
                out[int(name[4:])] = _cpus_of(f.read())
    return out


def gpu_node(index: int) -> tuple[str, int | None]:
    """(PCI address, NUMA node) of CUDA device `index`; node None where sysfs does not say (-1 or missing)."""
    import torch

    p = torch.cuda.get_device_properties(index)
    domain, bus, device = (getattr(p, f"pci_{k}_id", None) for k in ("domain", "bus", "device"))
    if bus is None:
        return "unknown", None
    addr = f"{domain or 0:04x}:{bus:02x}:{device or 0:02x}.0"
    try:
        with open(f"/sys/bus/pci/devices/{addr}/numa_node") as f:
            node = int(f.read())
    except OSError:
        return addr, None
    return addr, node if node >= 0 else None


def numa_setup(bind: bool = False) -> str:
    """Print (and return) this rank's NUMA placement; with `bind`, first restrict its CPUs to its GPU's node."""
    import torch

    if not torch.cuda.is_available():
        return ""
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)  # the rank's own GPU (as the benchmarks set it), so no context lands on GPU 0
    addr, node = gpu_node(local)
    nodes = node_cpus()
    bound = "no"
    if bind and node is not None and nodes.get(node):
        os.sched_setaffinity(0, nodes[node])
        bound = f"to node {node}"
    elif bind:
        bound = "not possible (the GPU's node is unknown)"
    mine = os.sched_getaffinity(0)
    on = sorted(n for n, cpus in nodes.items() if cpus & mine)
    line = (
        f"numa: rank {rank} GPU {local} at {addr} on node {node}; {len(nodes)} node(s) on this host; "
        f"process CPUs ({len(mine)}) on node(s) {on}; bound {bound}"
    )
    print(line, flush=True)
    return line
