"""The units of a topology's numbers: code units are bytes, bytes/s and seconds; topology and preset files write
GiB, GB/s (1e9 bytes/s), microseconds and nanoseconds, each field under its own key (`hbm_bw` as `hbm_gbps`).
Topology (topology.py) and the preset files (presets.py) convert with these tables."""

from __future__ import annotations

from typing import Any

GIB = 1 << 30
MIB = 1 << 20
GB = 1e9
US = 1e-6
COST_MODEL = 2
"""Version of the per-id constants (cost.py's formulas) written to topology files."""

KERNEL_FIELDS = (
    "small_fwd_id_s",
    "small_atomic_sector_s",
    "small_same_row_s",
    "small_sorted_id_s",
    "small_dense_sector_s",
)
"""The small-table kernel's constants (`embshard calibrate` measures them on GPUs; presets: estimates)."""
BANDWIDTHS = ("hbm_bw", "uvm_bw", "ddr_bw", "intra_host_bw", "inter_host_bw")  # bytes/s; YAML: GB/s (NAME_gbps)
LATENCIES = (  # seconds; YAML: us (NAME_us)
    "collective_latency_s",
    "inter_collective_latency_s",
    "kernel_s",
    "host_sync_s",
    "step_overhead_s",
    "host_step_s",
    "host_group_s",
    "host_dp_group_s",
)
PER_ITEM = (  # seconds per id, row, byte or bag; YAML: ns (NAME_ns)
    "fwd_id_s",
    "fwd_byte_s",
    "bwd_id_s",
    "bwd_byte_s",
    "bwd_row_s",
    "routed_id_s",
    "bag_s",
    "batch_bag_s",
    "uvm_row_s",
    "uvm_page_s",
    "uvm_bwd_row_s",
    *KERNEL_FIELDS,
)
NONNEGATIVE = (*LATENCIES, "l2_bytes", *PER_ITEM)
UNITS: dict[str, tuple[str, float]] = {  # field -> (YAML key, its unit in code units)
    "hbm_bytes": ("hbm_gib", GIB),
    "ddr_bytes": ("ddr_gib", GIB),
    "l2_bytes": ("l2_mib", MIB),
    **{f: (f.removesuffix("_bw") + "_gbps", GB) for f in BANDWIDTHS},
    **{f: (f.removesuffix("_s") + "_us", US) for f in LATENCIES},
    **{f: (f.removesuffix("_s") + "_ns", 1e-9) for f in PER_ITEM},
}
PLAIN_FIELDS = (
    "world_size",
    "local_world_size",
    "compute_device",
    "device_name",
    "regroup_efficiency",
    "source",
    "measured",
    "cost_model",
)
"""Topology fields without a unit, written as they are; every other field is in UNITS."""
BY_YAML_KEY: dict[str, tuple[str, float]] = {key: (name, scale) for name, (key, scale) in UNITS.items()}
"""YAML key -> (field, its unit in code units)."""


def from_yaml_units(name: str, value: float, scale: float) -> int | float:
    """A number of a topology file in code units: `value * scale`, an int for byte sizes."""
    return int(value * scale) if name.endswith("_bytes") else float(value * scale)


def plain_value(name: str, value: Any) -> Any:
    """A field without a unit as Topology holds it (`measured`: a tuple)."""
    return tuple(value) if name == "measured" else value
