"""The machine the plan is for: ranks, hosts, memory per rank and the speeds the cost model divides by.

Ranks are assumed identical (one GPU model, one host-memory share per rank). Numbers come from, in order of
trust: `embshard calibrate` (measured on the machine, saved as YAML and loaded with `Topology.load`), the devices
themselves (`Topology.detect`: memory sizes read from torch, speeds from the preset of the detected GPU), or a
named preset (`Topology.preset`, for planning on a machine without the GPUs: "dry runs").

Units in code: bytes, bytes/s and seconds. Units in YAML: GiB, GB/s (1e9 bytes/s) and microseconds.
Bandwidths count the bytes a kernel moves (a copy of N bytes moves 2N: read + write), so `hbm_bw` is what a
device-to-device copy of N bytes reports as 2N / time.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from embshard.tables import ConfigError

GIB = 1 << 30
GB = 1e9
US = 1e-6


@dataclass(frozen=True)
class Topology:
    """Ranks, memory per rank and bandwidths/latencies of one (homogeneous) cluster."""

    world_size: int
    """Number of ranks (one GPU, or one CPU process, each)."""
    local_world_size: int
    """Ranks per host; ranks r and s share a host when r // local_world_size == s // local_world_size."""
    compute_device: str = "cuda"
    """'cuda' (tiers hbm, uvm, uvm_caching) or 'cpu' (tier host)."""
    device_name: str = "h100"
    """GPU model (a preset name or the name torch reports), or 'cpu'."""
    hbm_bytes: int = 0
    """GPU memory per rank (bytes; 0 on CPU)."""
    ddr_bytes: int = 256 * GIB
    """Host memory available to one rank (bytes): the host's memory divided by its ranks."""
    hbm_bw: float = 3.0e12
    """GPU memory bandwidth (bytes/s, read + write counted)."""
    uvm_bw: float = 40e9
    """GPU reads/writes of host memory over the host link, PCIe or C2C, row-sized random access (bytes/s)."""
    ddr_bw: float = 20e9
    """Host memory bandwidth one rank's CPU lookups get (bytes/s); used for tier 'host'."""
    intra_host_bw: float = 350e9
    """All-to-all bandwidth per rank between ranks of one host (bytes/s each way; NVLink, or shared memory)."""
    inter_host_bw: float = 45e9
    """All-to-all / all-reduce bandwidth per rank between hosts (bytes/s each way; the rank's NIC share)."""
    collective_latency_s: float = 20 * US
    """Fixed cost of one collective within a host (seconds)."""
    inter_collective_latency_s: float = 40 * US
    """Fixed cost of one collective spanning hosts (seconds)."""
    kernel_s: float = 10 * US
    """Fixed cost of one lookup kernel launch in forward (seconds); backward counts 3 of these."""
    host_sync_s: float = 30 * US
    """Cost of one device-to-host synchronisation (the sparse exchange's split sizes), seconds."""
    routed_id_s: float = 0.5e-9
    """Seconds per id a model-parallel shard receives, beyond its bytes (routing permutes, fused backward per id)."""
    lookup_id_s: float = 0.0
    """Seconds per id looked up (forward + backward), beyond its bytes; dominant on CPUs."""
    source: str = "preset"
    """Where the numbers come from (preset NAME, detected, calibrated ...)."""
    measured: tuple[str, ...] = ()
    """Fields measured on the machine by `embshard calibrate`; the others are preset values."""

    def __post_init__(self) -> None:
        ws, lws = self.world_size, self.local_world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise ConfigError(f"topology: world_size={ws!r} is invalid: it must be an integer >= 1")
        if isinstance(lws, bool) or not isinstance(lws, int) or lws < 1 or ws % lws:
            raise ConfigError(
                f"topology: local_world_size={lws!r} is invalid with world_size={ws}: it must be >= 1 and divide "
                "world_size (ranks per host, e.g. 8 for 8-GPU hosts)"
            )
        if self.compute_device not in ("cuda", "cpu"):
            raise ConfigError(f"topology: compute_device={self.compute_device!r} is invalid: use 'cuda' or 'cpu'")
        if self.compute_device == "cuda" and self.hbm_bytes <= 0:
            raise ConfigError("topology: a cuda topology needs hbm_bytes > 0 (GPU memory per rank)")
        for f in ("hbm_bw", "uvm_bw", "ddr_bw", "intra_host_bw", "inter_host_bw"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"topology: {f}={getattr(self, f)!r} is invalid: bandwidths must be > 0")
        if self.ddr_bytes < 0:
            raise ConfigError(f"topology: ddr_bytes={self.ddr_bytes} is invalid: it must be >= 0")
        object.__setattr__(self, "measured", tuple(self.measured))

    # ---- derived ------------------------------------------------------------------------------------------
    @property
    def num_hosts(self) -> int:
        """Number of hosts."""
        return self.world_size // self.local_world_size

    @property
    def is_gpu(self) -> bool:
        """Whether ranks compute on GPUs."""
        return self.compute_device == "cuda"

    def host_of(self, rank: int) -> int:
        """The host a rank sits on."""
        return rank // self.local_world_size

    def with_sizes(
        self,
        world_size: int | None = None,
        local_world_size: int | None = None,
        hbm_gib: float | None = None,
        ddr_gib: float | None = None,
    ) -> Topology:
        """A copy with other rank counts or memory sizes (None keeps the current value)."""
        ws = world_size if world_size is not None else self.world_size
        lws = local_world_size if local_world_size is not None else min(self.local_world_size, ws)
        kw: dict[str, Any] = {"world_size": ws, "local_world_size": lws}
        if hbm_gib is not None:
            kw["hbm_bytes"] = int(hbm_gib * GIB)
        if ddr_gib is not None:
            kw["ddr_bytes"] = int(ddr_gib * GIB)
        return replace(self, **kw)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def preset(
        cls,
        name: str,
        world_size: int,
        local_world_size: int | None = None,
        hbm_gib: float | None = None,
        ddr_gib: float | None = None,
    ) -> Topology:
        """A topology from a named preset (see PRESETS) for planning without the hardware."""
        key = name.lower().replace("-", "_")
        key = ALIASES.get(key, key)
        if key not in PRESETS:
            raise ConfigError(
                f"unknown device preset {name!r}: choose one of {sorted(PRESETS)} (or measure the machine with "
                "`embshard calibrate` and pass the file with --topology)"
            )
        lws = local_world_size or min(world_size, 8 if key != "cpu" else world_size)
        base = cls(world_size=world_size, local_world_size=lws, source=f"preset {key}", **PRESETS[key])
        return base.with_sizes(hbm_gib=hbm_gib, ddr_gib=ddr_gib)

    @classmethod
    def detect(cls, world_size: int | None = None, local_world_size: int | None = None) -> Topology:
        """Read the local machine: GPU model and memory (torch.cuda), host memory (/proc/meminfo). Speeds come
        from the matching preset. Rank counts default to torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE, else one rank
        per local GPU (on CPUs: all ranks on this host)."""
        import torch

        env_ws, env_lws = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
        if torch.cuda.is_available():
            n_local = torch.cuda.device_count()
            props = [torch.cuda.get_device_properties(i) for i in range(n_local)]
            hbm = min(p.total_memory for p in props)
            key = preset_for_gpu(props[0].name, hbm)
            lws = local_world_size or int(env_lws or n_local)
        else:  # CPU ranks are processes of this host unless told otherwise
            key, hbm, lws = "cpu", 0, local_world_size or int(env_lws or world_size or env_ws or 1)
        ws = world_size or int(env_ws or lws)
        lws = min(lws, ws)
        topo = cls.preset(key, ws, lws)
        host_mem = host_memory_bytes()
        kw: dict[str, Any] = {"source": f"detected ({key} speeds from preset)"}
        if hbm:
            kw["hbm_bytes"] = int(hbm)
        if host_mem:
            kw["ddr_bytes"] = int(host_mem // lws)
        return replace(topo, **kw)

    # ---- YAML ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Human units: GiB, GB/s and microseconds."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            unit = _UNITS.get(f.name)
            if unit is not None:
                out[unit[0]] = round(value / unit[1], 4)
            else:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "topology") -> Topology:
        """Inverse of to_dict; unknown keys are an error naming `where` and the key."""
        by_yaml = {unit[0]: (name, unit[1]) for name, unit in _UNITS.items()}
        plain = {f.name for f in fields(cls)} - set(_UNITS)
        kw: dict[str, Any] = {}
        for key, value in data.items():
            if key in by_yaml:
                name, scale = by_yaml[key]
                if not isinstance(value, int | float) or isinstance(value, bool):
                    raise ConfigError(f"{where}: {key}={value!r} is invalid: expected a number")
                kw[name] = int(value * scale) if name.endswith("_bytes") else float(value * scale)
            elif key in plain:
                kw[key] = tuple(value) if key == "measured" else value
            else:
                raise ConfigError(f"{where}: unknown key {key!r}; known keys: {sorted(set(by_yaml) | plain)}")
        missing = {"world_size", "local_world_size"} - set(kw)
        if missing:
            raise ConfigError(f"{where}: missing {sorted(missing)}")
        return cls(**kw)

    def save(self, path: str | Path) -> None:
        """Write as YAML."""
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        """Read a file written by save() or `embshard calibrate`."""
        import yaml

        data = yaml.safe_load(Path(path).read_text())
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of topology fields")
        return cls.from_dict(data, where=str(path))

    def describe(self) -> str:
        """One line for reports."""
        mem = f"{self.hbm_bytes / GIB:.1f} GiB HBM, " if self.is_gpu else ""
        return (
            f"{self.world_size} x {self.device_name} ({self.num_hosts} host(s) x {self.local_world_size}), "
            f"{mem}{self.ddr_bytes / GIB:.1f} GiB host memory per rank; source: {self.source}"
        )


_UNITS: dict[str, tuple[str, float]] = {
    "hbm_bytes": ("hbm_gib", GIB),
    "ddr_bytes": ("ddr_gib", GIB),
    "hbm_bw": ("hbm_gbps", GB),
    "uvm_bw": ("uvm_gbps", GB),
    "ddr_bw": ("ddr_gbps", GB),
    "intra_host_bw": ("intra_host_gbps", GB),
    "inter_host_bw": ("inter_host_gbps", GB),
    "collective_latency_s": ("collective_latency_us", US),
    "inter_collective_latency_s": ("inter_collective_latency_us", US),
    "kernel_s": ("kernel_us", US),
    "host_sync_s": ("host_sync_us", US),
    "routed_id_s": ("routed_id_ns", 1e-9),
    "lookup_id_s": ("lookup_id_ns", 1e-9),
}

# Per-GPU-model defaults. HBM sizes are what torch reports as total_memory. hbm_bw: device-to-device copy,
# read + write counted (measured here: H100 ~3.0 TB/s, H200 ~4.3 TB/s; A100 80GB ~1.7 TB/s). uvm_bw: row
# gathers from host memory over PCIe gen5 (H100/H200) or gen4 (A100), well below the link's copy speed.
# intra_host_bw: NCCL all-to-all bus bandwidth over NVLink4 (NVLink3 for A100); inter_host_bw: one 400 Gb/s
# (200 Gb/s for A100) NIC per GPU. ddr_bytes: 2 TiB hosts with 8 GPUs. The per-id overheads are fitted to
# TorchRec 1.6 on 2 H200 with the hetero124 model: routed_id_s = 0.5 ns (table-wise took 12.3 ms more per step
# than data-parallel for 24.6M routed ids per rank) and lookup_id_s = 0.17 ns (the byte model alone predicted
# 4.3 ms less than measured for ~25M ids per rank in both placements); `embshard calibrate` measures
# lookup_id_s on the machine.
PRESETS: dict[str, dict[str, Any]] = {
    "h100": dict(
        device_name="h100",
        compute_device="cuda",
        hbm_bytes=int(79.2 * GIB),
        ddr_bytes=256 * GIB,
        hbm_bw=3.0e12,
        uvm_bw=40e9,
        ddr_bw=50e9,
        intra_host_bw=350e9,
        inter_host_bw=45e9,
        lookup_id_s=0.17e-9,
    ),
    "h200": dict(
        device_name="h200",
        compute_device="cuda",
        hbm_bytes=int(139.8 * GIB),
        ddr_bytes=256 * GIB,
        hbm_bw=4.3e12,
        uvm_bw=40e9,
        ddr_bw=50e9,
        intra_host_bw=350e9,
        inter_host_bw=45e9,
        lookup_id_s=0.17e-9,
    ),
    "a100": dict(
        device_name="a100",
        compute_device="cuda",
        hbm_bytes=int(79.2 * GIB),
        ddr_bytes=256 * GIB,
        hbm_bw=1.7e12,
        uvm_bw=20e9,
        ddr_bw=40e9,
        intra_host_bw=230e9,
        inter_host_bw=22e9,
        lookup_id_s=0.17e-9,
    ),
    # CPU training: one process per rank on one host; gloo over shared memory / loopback TCP.
    "cpu": dict(
        device_name="cpu",
        compute_device="cpu",
        hbm_bytes=0,
        ddr_bytes=16 * GIB,
        hbm_bw=20e9,
        uvm_bw=20e9,
        ddr_bw=10e9,
        intra_host_bw=2e9,
        inter_host_bw=1e9,
        collective_latency_s=100 * US,
        inter_collective_latency_s=200 * US,
        kernel_s=20 * US,
        host_sync_s=0.0,
        routed_id_s=5e-9,
        lookup_id_s=20e-9,
    ),
}
ALIASES = {"h100_sxm": "h100", "h100_80gb": "h100", "h200_141gb": "h200", "a100_80gb": "a100"}


def preset_for_gpu(device_name: str, total_memory: int) -> str:
    """The preset whose speeds best match a GPU torch reports (by name; unknown GPUs get h100's speeds)."""
    name = device_name.upper()
    for key in ("H200", "H100", "A100"):
        if key in name:
            return key.lower()
    return "h100"


def host_memory_bytes() -> int:
    """Total host memory (bytes), or 0 if it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
