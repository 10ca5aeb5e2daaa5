"""The presets: each GPU model's speeds (presets/NAME.yaml, package data; A100's derived from H200's) and the CPU's,
by name (`PRESETS`, `ALIASES`), the preset files' reader and writer, and which preset a detected GPU gets.
`Topology.preset` (topology.py) builds a topology from one."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from embshard.planner.units import (
    BY_YAML_KEY,
    GIB,
    PLAIN_FIELDS,
    UNITS,
    US,
    from_yaml_units,
    plain_value,
)
from embshard.spec.tables import ConfigError

# Per-GPU-model speeds live in presets/NAME.yaml (package data), one file per GPU model, in the units of topology
# files, each number with where it comes from; `bench/planner_predict.py --refit` rewrites a model's file from
# benchmark logs (docs/planner.md "Constants per GPU model"). HBM sizes are what torch reports as total_memory;
# ddr_bytes: 2 TiB hosts with 8 GPUs. A100's file holds its sizes and links only (the nominal links scaled by the
# H200's measured-to-nominal ratios): its other constants are the H200's, the per-id, per-row and per-bag ones scaled
# by 1.7 (108 SMs at 1.41 GHz against 132 at 1.98 GHz).
PRESET_DIR = Path(__file__).resolve().parent / "presets"
GPU_FILES = ("h100", "h200")
"""GPU models with a preset file of every constant (a100.yaml holds only what the A100 does not take from h200.yaml)."""
_A100_SCALE = 1.7
_A100_SCALED = ("fwd_id_s", "bwd_id_s", "bwd_row_s", "routed_id_s", "bag_s", "uvm_row_s")
_A100_SCALED += ("small_fwd_id_s", "small_atomic_sector_s", "small_same_row_s", "small_sorted_id_s")
_A100_SCALED += ("small_dense_sector_s", "batch_bag_s")


def preset_path(name: str) -> Path:
    """The preset file of a GPU model (presets/NAME.yaml)."""
    return PRESET_DIR / f"{name}.yaml"


def load_preset_file(path: str | Path) -> dict[str, Any]:
    """A preset file's values as Topology fields (code units). Unknown keys are an error naming the file."""
    import yaml

    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of topology fields")
    plain = set(PLAIN_FIELDS) - {"world_size", "local_world_size"}
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in BY_YAML_KEY:
            name, scale = BY_YAML_KEY[key]
            out[name] = from_yaml_units(name, value, scale)
        elif key in plain:
            out[key] = plain_value(key, value)
        else:
            raise ConfigError(f"{path}: unknown key {key!r}; known keys: {sorted(set(BY_YAML_KEY) | plain)}")
    return out


def write_preset_file(path: str | Path, values: Mapping[str, Any], notes: Mapping[str, str], header: str) -> None:
    """Write a preset file: `header` (comment lines), then one `key: value  # note` line per field of `values`
    (Topology fields in code units; written in the units of topology files)."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for name, value in values.items():
        unit = UNITS.get(name)
        key = unit[0] if unit else name
        if unit:
            text = repr(round(value / unit[1], 6))
        elif isinstance(value, tuple | list):
            text = "[" + ", ".join(str(v) for v in value) + "]"
        else:
            text = str(value)
        note = notes.get(name)
        lines.append(f"{key}: {text}" + (f"  # {note}" if note else ""))
    Path(path).write_text("\n".join(lines) + "\n")


def _gpu_preset(name: str) -> dict[str, Any]:
    values = load_preset_file(preset_path(name))
    values.pop("source", None)
    return values


def _a100() -> dict[str, Any]:
    h200 = _gpu_preset("h200")
    return {**h200, **{k: h200[k] * _A100_SCALE for k in _A100_SCALED}, **load_preset_file(preset_path("a100"))}


PRESETS: dict[str, dict[str, Any]] = {
    **{name: _gpu_preset(name) for name in GPU_FILES},
    "a100": _a100(),
    # CPU training: one process per rank on one host; gloo over shared memory / loopback TCP. Lookups are bound by
    # arithmetic: per id 7 ns + 0.17 ns per row byte forward, 13 ns + 0.25 ns per row byte backward (FBGEMM's CPU
    # kernels, `embshard calibrate` on a 2-core CI machine: 16-wide rows ~18 / ~29 ns, 128-wide ~94 / ~144 ns).
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
        l2_bytes=0,
        fwd_id_s=7e-9,
        fwd_byte_s=0.17e-9,
        bwd_id_s=13e-9,
        bwd_byte_s=0.25e-9,
        bwd_row_s=0.0,
        routed_id_s=5e-9,
        bag_s=0.0,
        uvm_row_s=0.0,
        uvm_page_s=0.0,
        uvm_bwd_row_s=0.0,
    ),
}
ALIASES = {"h100_sxm": "h100", "h100_80gb": "h100", "h200_141gb": "h200", "a100_80gb": "a100"}


def preset_for_gpu(device_name: str, total_memory: int) -> str:
    """The preset whose speeds best match a GPU torch reports, by its name ('NVIDIA H100 80GB HBM3' -> h100,
    'NVIDIA H200' and 'NVIDIA GH200 480GB' -> h200); other GPUs get h100's speeds, with a warning."""
    name = device_name.upper()
    for key in ("H200", "H100", "A100"):
        if key in name:
            return key.lower()
    warnings.warn(
        f"GPU {device_name!r} has no planner preset: planning with the h100 preset's speeds; measure this machine "
        "with `embshard calibrate` (it writes runs/topology.yaml) and plan with --topology runs/topology.yaml",
        stacklevel=2,
    )
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
