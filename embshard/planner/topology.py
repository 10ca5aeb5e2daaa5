"""The machine the plan is for: ranks, hosts, memory per rank and the speeds the cost model divides by.

Ranks are assumed identical (one GPU model, one host-memory share per rank). Numbers come from, in order of
trust: `embshard calibrate` (measured on the machine, saved as YAML and loaded with `Topology.load`), the devices
themselves (`Topology.detect`: memory sizes read from torch, speeds from the preset of the detected GPU model,
chosen by the name torch reports), or a named preset (`Topology.preset`, for planning on a machine without the
GPUs: "dry runs"). The H100 and H200 presets are files (presets/h100.yaml, presets/h200.yaml) written from
measurements: `bench/planner_predict.py --refit` refits them from benchmark logs. presets.py holds the presets
and reads their files; units.py the units of topology and preset files.

Units in code: bytes, bytes/s and seconds. Units in YAML: GiB, GB/s (1e9 bytes/s) and microseconds.
Bandwidths count the bytes a kernel moves (a copy of N bytes moves 2N: read + write), so `hbm_bw` is what a
device-to-device copy of N bytes reports as 2N / time.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from embshard.planner.kernel_model import KernelConstants
from embshard.planner.presets import ALIASES, PRESETS, host_memory_bytes, preset_for_gpu
from embshard.planner.units import (
    BANDWIDTHS,
    BY_YAML_KEY,
    COST_MODEL,
    GIB,
    MIB,
    NONNEGATIVE,
    PLAIN_FIELDS,
    UNITS,
    US,
    from_yaml_units,
    plain_value,
)
from embshard.spec.tables import ConfigError
from embshard.spec.yaml_file import read_yaml_file


@dataclass(frozen=True)
class Topology:
    """Ranks, memory per rank and bandwidths/latencies of one (homogeneous) cluster. Defaults: Hopper-class
    speeds as first fitted on 2 x H200 (kept for hand-written topologies); each GPU model's measured constants are
    in its preset (presets/NAME.yaml: `Topology.preset`, `Topology.detect`), each number with its source."""

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
    uvm_bw: float = 55e9
    """GPU reads/writes of host memory over the host link, PCIe or C2C, row-sized random access (bytes/s)."""
    ddr_bw: float = 50e9
    """Host memory bandwidth one rank's CPU lookups get (bytes/s); used for tier 'host'."""
    intra_host_bw: float = 290e9
    """All-to-all bandwidth per rank between ranks of one host (bytes/s each way; NVLink, or shared memory)."""
    inter_host_bw: float = 45e9
    """All-to-all / all-reduce bandwidth per rank between hosts (bytes/s each way; the rank's NIC share)."""
    collective_latency_s: float = 20 * US
    """Fixed cost of one collective within a host (seconds)."""
    inter_collective_latency_s: float = 40 * US
    """Fixed cost of one collective spanning hosts (seconds)."""
    kernel_s: float = 10 * US
    """Fixed cost of one kernel launch in a lookup group (seconds); the cost model counts the kernels per group."""
    host_sync_s: float = 630 * US
    """Cost of the input exchange's device-to-host synchronisation, once per step with model-parallel tables when
    the batch counts come from the device (PlannerSettings.batch_counts device; none with host counts) (seconds):
    the wait itself plus the GPU idling while the host issues the step's small kernels around it (launch-bound); a
    host cost, the same on every GPU model (presets: fitted to measured steps of both)."""
    step_overhead_s: float = 0.0
    """Fixed cost of every training step whatever the plan beyond host_sync_s (seconds): a per-GPU-model
    correction `bench/planner_predict.py --refit --steps` fits to measured steps; 0 in the presets."""
    host_step_s: float = 0.0
    """The host's time to issue one eager training step on a rank beyond its lookup groups (seconds): the batch
    agreement, the exchanges, the id check, the regroup and the autograd work of a step, in Python and the
    framework's operators. An eager step lasts at least the host's time (`host_group_s`, `host_dp_group_s`); a step
    replayed as one CUDA graph does not pay it; 0: not priced (presets: fitted to the eager steps of one machine
    model's hosts, docs/planner.md "The host's floor")."""
    host_group_s: float = 0.0
    """The host's time per lookup group on FBGEMM's TBE on a rank in an eager step (seconds): the lookup's forward,
    backward and fused update calls (a group: sharding type x tier x kernel, raw ids apart); groups on embshard's
    small-table kernel (a few Triton launches) are not charged."""
    host_dp_group_s: float = 0.0
    """The host's time per data-parallel lookup group on a rank in an eager step beyond host_group_s (seconds): the
    gradient all-reduce and the replicas' optimizer update, each a few operators."""
    batch_bag_s: float = 0.0
    """Cost of every bag (sample x feature) of a rank's own batch per training step whatever the plan (seconds):
    the per-segment work beyond the bytes of the kernels that walk the step's bags (the lookups' forward and
    backward, the exchange's lengths and offsets, the permutes, the id check, the regroup), bound by the GPU's
    memory latency; fitted to measured steps of workloads with 16, 26 and 124 features (docs/planner.md
    "Constants")."""
    l2_bytes: int = 50 * MIB
    """GPU L2 cache (bytes): rows of shards smaller than this are read from L2, not HBM, during their lookups."""
    fwd_id_s: float = 18e-12
    """Forward lookup time per id beyond the bytes it moves (seconds): index arithmetic and issue, fitted."""
    fwd_byte_s: float = 0.0
    """Forward time per byte of each row looked up beyond memory traffic (seconds per byte): arithmetic per
    element, which bounds CPU kernels (about 0 on GPUs, where the bytes over hbm_bw explain wide rows)."""
    bwd_id_s: float = 35e-12
    """Backward time per id beyond its bytes (seconds): linearising, radix-sorting and segmenting the ids."""
    bwd_byte_s: float = 0.0
    """Backward time per byte of each id's row beyond memory traffic (seconds per byte), as fwd_byte_s."""
    bwd_row_s: float = 300e-12
    """Backward time per distinct row touched beyond its bytes (seconds): the fused optimizer's row update (or the
    dense gradient row of data-parallel), a latency-bound chain of dependent loads."""
    routed_id_s: float = 20e-12
    """Time per id a model-parallel shard receives (seconds): the receiver's permute and the id check."""
    bag_s: float = 0.2e-9
    """Time per bag per segment-wise pass (seconds): FBGEMM's permutes, the id check and the output regroup work
    per (feature, sample) segment; the cost model counts the passes."""
    uvm_row_s: float = 1.5e-9
    """Latency part of one row access over the host link (seconds), on top of gather(row, 64 B) / uvm_bw."""
    uvm_page_s: float = 0.35e-9
    """Extra time per host-memory row access when the shard is much larger than the GPU's translation reach for
    host memory (seconds; scaled by the share of accesses that miss, see cost.py)."""
    uvm_bwd_row_s: float = 0.0
    """Backward time per row of a UVM shard beyond a forward read of it (seconds): the fused optimizer reads the row
    over the host link, updates it and writes it back, one dependent chain per touched row (presets: fitted to the
    UVM lookup kernels of a profiled step; `embshard calibrate` keeps the preset's)."""
    small_fwd_id_s: float = KernelConstants.fwd_id_s
    """Small-table kernel (embshard/planner/kernel_model.py): forward time per id beyond its bytes (seconds)."""
    small_atomic_sector_s: float = KernelConstants.atomic_sector_s
    """Small-table kernel: backward time per 32-byte sector of an id's atomic adds into L2 (seconds)."""
    small_same_row_s: float = KernelConstants.same_row_s
    """Small-table kernel: time per id of the hottest row's atomic adds to one address, in sequence (seconds)."""
    small_sorted_id_s: float = KernelConstants.sorted_id_s
    """Small-table kernel, deterministic backward: time per id beyond its bytes (seconds; sort, segmented scan)."""
    regroup_efficiency: float = KernelConstants.regroup_efficiency
    """Share of hbm_bw the Triton regroup of the pooled rows reaches (0-1]."""
    small_dense_sector_s: float = KernelConstants.dense_sector_s
    """Small-table kernel, data-parallel dense gradient: time per 32-byte sector of an id's atomic adds (seconds)."""
    source: str = "preset"
    """Where the numbers come from (preset NAME, detected, calibrated ...)."""
    measured: tuple[str, ...] = ()
    """Fields measured on the machine by `embshard calibrate`; the others are preset values."""
    cost_model: int = 2
    """Version of the cost model the constants are for (files without it are version 1)."""

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
        for f in BANDWIDTHS:
            if not getattr(self, f) > 0:
                raise ConfigError(f"topology: {f}={getattr(self, f)!r} is invalid: bandwidths must be > 0")
        for f in NONNEGATIVE:
            if not getattr(self, f) >= 0:
                raise ConfigError(f"topology: {f}={getattr(self, f)!r} is invalid: it must be >= 0")
        if not 0 < self.regroup_efficiency <= 1:
            raise ConfigError(
                f"topology: regroup_efficiency={self.regroup_efficiency!r} is invalid: it must be in (0, 1]"
            )
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

    @property
    def kernel_constants(self) -> KernelConstants:
        """The small-table kernel's and the regroup's constants, as embshard/planner/kernel_model.py takes them."""
        return KernelConstants(
            self.small_fwd_id_s,
            self.small_atomic_sector_s,
            self.small_same_row_s,
            self.small_sorted_id_s,
            self.regroup_efficiency,
            self.small_dense_sector_s,
        )

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
    def detect(
        cls, world_size: int | None = None, local_world_size: int | None = None, device_type: str | None = None
    ) -> Topology:
        """Read the local machine: GPU model, memory and L2 size (torch.cuda), host memory (/proc/meminfo). Speeds
        come from the matching preset. Rank counts default to torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE, else one rank
        per local GPU (on CPUs: all ranks on this host). `device_type` ('cuda' or 'cpu'): where the ranks compute
        (default: the GPUs if there are any); 'cpu' reads the host even on a machine with GPUs. Needs torch: without
        it, ConfigError saying how to plan with a preset or a topology file instead."""
        try:
            import torch
        except ImportError:
            raise ConfigError(
                "reading this machine's devices (Topology.detect: `embshard plan` of a training config without "
                "--device or --topology, or with --detect) needs torch, which is not installed: plan with a preset "
                "(--device h100, h200, a100 or cpu) or a topology file (--topology FILE from `embshard calibrate`), "
                "or install the GPU packages (pip install 'embshard[gpu]')"
            ) from None

        env_ws, env_lws = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
        l2 = 0
        if torch.cuda.is_available() and device_type != "cpu":
            n_local = torch.cuda.device_count()
            props = [torch.cuda.get_device_properties(i) for i in range(n_local)]
            hbm = min(p.total_memory for p in props)
            l2 = int(getattr(props[0], "L2_cache_size", 0) or 0)
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
        if l2:
            kw["l2_bytes"] = l2
        if host_mem:
            kw["ddr_bytes"] = int(host_mem // lws)
        return replace(topo, **kw)

    # ---- YAML ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Human units: GiB, GB/s and microseconds."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            unit = UNITS.get(f.name)
            if unit is not None:
                out[unit[0]] = round(value / unit[1], 4)
            else:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "topology") -> Topology:
        """Inverse of to_dict; unknown keys are an error naming `where` and the key.

        Fields the mapping lacks take the values of the preset named by `device_name` (when it names one), so a
        hand-written file needs only what differs. Files of cost model 1 (written before `cost_model: 2`, with
        `lookup_id_ns`) load with a warning: their measured bandwidths are kept, but their per-id constants
        (`lookup_id_ns`, `routed_id_ns`, `host_sync_us`: fitted to older formulas) are replaced by the preset's
        and their 128-byte-row `uvm_gbps` becomes uvm_row_s + 128 B / uvm_bw with the preset's uvm_row_s."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping of topology fields, not {type(data).__name__} {data!r}")
        version = data.get("cost_model", 1 if "lookup_id_ns" in data else COST_MODEL)
        if version not in (1, COST_MODEL):
            raise ConfigError(f"{where}: cost_model={version!r} is not known: this embshard reads 1 and {COST_MODEL}")
        old = {"lookup_id_ns", "routed_id_ns", "host_sync_us"} if version == 1 else set()
        kw: dict[str, Any] = {}
        for key, value in data.items():
            if key in old:
                continue
            if key in BY_YAML_KEY:
                name, scale = BY_YAML_KEY[key]
                if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                    raise ConfigError(f"{where}: {key}={value!r} is invalid: expected a finite number")
                if name in BANDWIDTHS and value <= 0:
                    raise ConfigError(f"{where}: {key}={value!r} is invalid: bandwidths must be > 0 (GB/s)")
                if not math.isfinite(value * scale):
                    raise ConfigError(f"{where}: {key}={value!r} is invalid: it is out of range")
                kw[name] = from_yaml_units(name, value, scale)
            elif key in PLAIN_FIELDS:
                _check_plain(key, value, where)
                kw[key] = plain_value(key, value)
            else:
                raise ConfigError(f"{where}: unknown key {key!r}; known keys: {sorted({*BY_YAML_KEY, *PLAIN_FIELDS})}")
        missing = {"world_size", "local_world_size"} - set(kw)
        if missing:
            raise ConfigError(f"{where}: missing {sorted(missing)}")
        key = ALIASES.get(str(kw.get("device_name", "")).lower(), str(kw.get("device_name", "")).lower())
        preset = PRESETS.get(key, {})
        for name, value in preset.items():
            if name not in kw and name != "hbm_bytes":
                kw[name] = value
        if version == 1:
            # Version 1 measured uvm_bw as 128-byte row reads: keep that time per row, now uvm_row_s + 128 / uvm_bw.
            t128 = 128.0 / kw["uvm_bw"] if "uvm_gbps" in data else 0.0
            if t128 > kw.get("uvm_row_s", 0.0) > 0.0:
                kw["uvm_bw"] = 128.0 / (t128 - kw["uvm_row_s"])
            kw["cost_model"] = COST_MODEL
            kw["measured"] = tuple(m for m in kw.get("measured", ()) if m not in ("lookup_id_s", "routed_id_s"))
            warnings.warn(
                f"{where}: written for cost model 1 (lookup_id_ns): its measured bandwidths are used, its per-id "
                f"constants replaced by preset {key or 'defaults'!r}; run `embshard calibrate` again to measure "
                "them (fwd_id_ns, bwd_id_ns, bwd_row_ns, uvm_row_ns)",
                stacklevel=2,
            )
        try:
            return cls(**kw)
        except ConfigError as e:
            if where == "topology":
                raise
            raise ConfigError(f"{where}: {e}") from None

    def save(self, path: str | Path) -> None:
        """Write as YAML."""
        import yaml

        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        """Read a file written by save() or `embshard calibrate`; a file that cannot be read or parsed, or holds
        another structure, is a ConfigError naming the file (and the field)."""
        return cls.from_dict(read_yaml_file(path, "topology"), where=str(path))

    def describe(self) -> str:
        """One line for reports."""
        mem = f"{self.hbm_bytes / GIB:.1f} GiB HBM, " if self.is_gpu else ""
        return (
            f"{self.world_size} x {self.device_name} ({self.num_hosts} host(s) x {self.local_world_size}), "
            f"{mem}{self.ddr_bytes / GIB:.1f} GiB host memory per rank; source: {self.source}"
        )


def _check_plain(key: str, value: Any, where: str) -> None:
    """ConfigError naming `where` and the key unless a topology file's field without a unit has its type."""
    if key in ("device_name", "source", "compute_device"):
        ok, want = isinstance(value, str), "a string"
    elif key == "measured":
        ok, want = isinstance(value, list) and all(isinstance(v, str) for v in value), "a list of field names"
    elif key == "regroup_efficiency":
        ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1
        want = "a number in (0, 1]"
    else:  # world_size, local_world_size, cost_model
        ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an integer >= 1"
    if not ok:
        raise ConfigError(f"{where}: {key}={value!r} is invalid: expected {want}")
