"""Refit the planner's per-GPU-model constants to benchmark logs (`bench/planner_predict.py --refit`, one command
after a benchmark run): the small-table kernel's constants from `bench/kernels.py`'s output, the fixed cost of a
training step from measured steps against the model's predictions of the same plans.

Kernel log (`python -m bench.kernels > kernels.log`): its markdown table, one row per (kernel, case,
implementation) with the milliseconds, and its header (`small tables: T x R rows x D fp32, batch B, L ids per bag`).
For every case with uniform ids the model (embshard/planner/kernel_model.py, bytes over the topology's hbm_bw) is exact
with
  small_fwd_id_s         = (forward - its bytes) / ids                       ("atomic fwd")
  small_atomic_sector_s  = (forward + backward - forward - its bytes) / (atomic adds x sectors)
                                                                              ("atomic fwd+bwd", the fused update)
  small_dense_sector_s   = as above for the data-parallel dense gradient      (dense "kernel atomic fwd+bwd")
averaged over the optimizers the log has (rowwise_adagrad and sgd differ only in the update's bytes).

Steps: bench/embshard_dmp.py's `RESULT ... bench=emb` lines (bench/run.py emb's log, or transcribed summaries in
the same format) with the plan each run printed (`PLAN` lines; a log without them is re-planned with the
preset); step_overhead_s is the constant that, added to every prediction, minimises the squared relative errors
(>= 0): sum((p + c - m) / m^2) = 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from embshard.planner import kernel_model as kcost
from embshard.planner.access import distinct_rows
from embshard.planner.topology import Topology

_SHAPE = re.compile(
    r"small tables: (\d+) x (\d+) rows x (\d+) fp32, batch (\d+), (\d+) ids per bag"
)  # bench/kernels.py's header
_ROW = re.compile(r"^\|\s*(small|dense)\s*\|([^|]+)\|([^|]+)\|\s*([0-9.]+)\s*\|")


@dataclass(frozen=True)
class KernelLog:
    """What a bench/kernels.py log says about the small-table kernel."""

    tables: int
    rows: int
    dim: int
    batch: int
    ids_per_bag: int
    times: dict[tuple[str, str, str], float]
    """(kernel, case, implementation) -> seconds; case e.g. 'uniform rowwise_adagrad (10000 rows/table)'."""
    device: str = ""
    """The GPU the log names ('NVIDIA H200'), or ''."""

    def distinct(self, case: str) -> float:
        """Distinct rows per table the case's ids touched (the log prints them)."""
        m = re.search(r"\((\d+) rows/table\)", case)
        return float(m.group(1)) if m else float(distinct_rows(self.batch * self.ids_per_bag, self.rows, 0.0))


def parse_kernel_log(text: str, where: str = "kernels log") -> KernelLog:
    """The shape and the timings of a bench/kernels.py log."""
    shape = _SHAPE.search(text)
    if shape is None:
        raise ValueError(
            f"{where}: no 'small tables: T x R rows x D fp32, batch B, L ids per bag' line: is it bench/kernels.py's "
            "output (run with the small and dense kernels)?"
        )
    times: dict[tuple[str, str, str], float] = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m:
            times[(m.group(1), m.group(2).strip(), m.group(3).strip())] = float(m.group(4)) / 1e3
    if not times:
        raise ValueError(f"{where}: no result table rows ('| small | ... |'): the run did not finish?")
    device = re.search(r"^device ([^;\n]+)", text, re.MULTILINE)
    return KernelLog(*(int(x) for x in shape.groups()), times=times, device=device.group(1).strip() if device else "")


def gpu_of_log(text: str) -> str:
    """The GPU a benchmark log names (bench/run.py's `META ... gpu="NAME"`, bench/kernels.py's `device NAME;`), or
    ''."""
    m = re.search(r"^META .*?gpu=[\"']([^\"']+)[\"']", text, re.MULTILINE) or re.search(
        r"^device ([^;\n]+)", text, re.MULTILINE
    )
    return m.group(1).strip() if m else ""


def fit_kernel_log(log: KernelLog, topo: Topology) -> tuple[dict[str, float], list[str]]:
    """Fitted {field: seconds} (only what the log measures) and one report line per case used."""
    T, R, D, B, L = log.tables, log.rows, log.dim, log.batch, log.ids_per_bag
    n, b = float(B * L), float(B)
    zero = kcost.KernelConstants(0.0, 0.0, 0.0, 0.0, topo.regroup_efficiency, 0.0)
    bw, l2 = topo.hbm_bw, float(topo.l2_bytes)
    sectors = float(np.ceil(4.0 * D / kcost.SECTOR))
    fwd_fits, atomic_fits, dense_fits, lines = [], [], [], []
    for (kernel, case, impl), seconds in sorted(log.times.items()):
        if kernel != "small" or impl != "atomic fwd" or not case.startswith("uniform"):
            continue
        u = log.distinct(case)
        fwd0 = T * float(kcost.small_table_forward(n, b, R, D, u, 0, bw, l2, zero))
        fwd_id = max(0.0, (seconds - fwd0) / (T * n))
        fwd_fits.append(fwd_id)
        lines.append(f"  small forward, {case}: {seconds * 1e3:.3f} ms -> {fwd_id * 1e12:.1f} ps per id")
        adds = float(kcost.atomic_adds(n, b, R, D, 0.0)[0])
        sb = 4.0 if "rowwise_adagrad" in case else 0.0
        both = log.times.get(("small", case, "atomic fwd+bwd"))
        if both is not None:
            bwd0 = T * float(kcost.small_table_backward(n, b, R, D, u, 0, sb, 0.0, bw, zero)[0])
            atomic = max(0.0, (both - seconds - bwd0) / (T * adds * sectors))
            atomic_fits.append(atomic)
            lines.append(
                f"  small backward + update, {case}: {(both - seconds) * 1e3:.3f} ms -> {atomic * 1e12:.1f} ps per sector"
            )
        dense = next((v for (k, c, i), v in log.times.items() if k == "dense" and c.startswith("uniform")
                      and i == "kernel atomic fwd+bwd"), None)  # fmt: skip
        if dense is not None and not dense_fits:
            dcase = next(c for (k, c, _i) in log.times if k == "dense" and c.startswith("uniform"))
            du = log.distinct(dcase)
            dfwd = T * float(kcost.small_table_forward(n, b, R, D, du, 0, bw, l2, zero)) + T * n * fwd_id
            dense0 = T * float(kcost.small_table_backward(n, b, R, D, du, 0, 0.0, 0.0, bw, zero, "dense")[0])
            per = max(0.0, (dense - dfwd - dense0) / (T * adds * sectors))
            dense_fits.append(per)
            lines.append(
                f"  data-parallel dense gradient, {dcase}: {(dense - dfwd) * 1e3:.3f} ms after the forward -> "
                f"{per * 1e12:.1f} ps per sector"
            )
    out: dict[str, float] = {}
    if fwd_fits:
        out["small_fwd_id_s"] = float(np.mean(fwd_fits))
    if atomic_fits:
        out["small_atomic_sector_s"] = float(np.mean(atomic_fits))
    if dense_fits:
        out["small_dense_sector_s"] = float(np.mean(dense_fits))
    if not out:
        raise ValueError("kernels log: no uniform-id 'atomic fwd' rows of the small-table kernel to fit")
    return out, lines


def fit_step_overhead(predicted_s: Sequence[float], measured_s: Sequence[float]) -> float:
    """The constant (>= 0, seconds) that, added to every predicted step, minimises the squared relative errors
    against the measured steps."""
    p, m = np.asarray(predicted_s, dtype=float), np.asarray(measured_s, dtype=float)
    if not len(p):
        raise ValueError("no measured steps to fit the step overhead to")
    return max(0.0, float(np.sum((m - p) / m**2) / np.sum(1.0 / m**2)))


def parse_step_log(text: str) -> list[dict[str, Any]]:
    """Every embedding-step run of embshard in a benchmark log (bench/embshard_dmp.py's `RESULT framework=embshard
    bench=emb ...` lines, also in transcribed summaries), in log order: its fields, the measured seconds
    (`seconds`) and the plan it ran (`plan_json`: the `PLAN workload=W json=...` line printed before it, or None
    when the log has none)."""
    import json
    import shlex

    out: list[dict[str, Any]] = []
    plan_json: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("PLAN ") and " json=" in line:
            head, _, body = line.partition(" json=")
            fields = dict(kv.split("=", 1) for kv in head[5:].split() if "=" in kv)
            plan_json[fields.get("workload", "")] = body
            continue
        if not line.startswith("RESULT ") or "framework=embshard" not in line:
            continue
        try:
            fields = dict(kv.split("=", 1) for kv in shlex.split(line[7:]) if "=" in kv)
        except ValueError:
            continue
        if fields.get("bench") != "emb" or "ms_per_step" not in fields:
            continue
        workload = fields.get("workload", "")
        run: dict[str, Any] = dict(fields)
        run["seconds"] = float(fields["ms_per_step"]) / 1e3
        run["plan_json"] = plan_json.pop(workload, None)
        if run["plan_json"] is not None:
            json.loads(run["plan_json"])  # a broken line is an error here, not a wrong fit later
        out.append(run)
    return out


def read_preset_text(path) -> tuple[str, dict[str, str]]:
    """(header comment without '# ', {YAML key: its end-of-line note}) of a preset file."""
    from pathlib import Path

    header, notes = [], {}
    for line in Path(path).read_text().splitlines():
        if line.startswith("#") and not notes:
            header.append(line[2:] if line.startswith("# ") else line[1:])
        elif ":" in line and not line.startswith("#"):
            key, _, rest = line.partition(":")
            _, _, note = rest.partition("  # ")
            notes[key.strip()] = note.strip()
    return "\n".join(header), notes


def rewrite_preset(path, updates: dict[str, float], why: dict[str, str], out=None) -> None:
    """Rewrite a preset file with new values for some fields (Topology fields in code units) and their notes,
    keeping every other value, note and the header."""
    from embshard.planner.presets import load_preset_file, write_preset_file
    from embshard.planner.units import UNITS

    values = load_preset_file(path)
    header, notes_by_key = read_preset_text(path)
    notes = {}
    for name in values:
        key = UNITS[name][0] if name in UNITS else name
        notes[name] = notes_by_key.get(key, "")
    for name, value in updates.items():
        values[name] = value
        notes[name] = why.get(name, notes.get(name, ""))
    write_preset_file(out or path, values, notes, header)
