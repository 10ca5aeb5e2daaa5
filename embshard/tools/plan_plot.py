"""A PNG of a PlanReport: memory per rank (by tier and kind, against the budget) and predicted time per rank
(by phase, against the step time). Needs matplotlib, imported only when a plot is drawn."""

from __future__ import annotations

from pathlib import Path

from embshard.planner.loads import PHASES
from embshard.planner.report import PlanReport
from embshard.planner.topology import GIB
from embshard.spec.tables import ConfigError


def plot_report(report: PlanReport, path: str | Path) -> Path:
    """Write the figure to `path` (PNG) and return the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(
            "--plot needs matplotlib: `pip install matplotlib` (pinned in requirements/cpu.txt)"
        ) from None
    ranks = [r.rank for r in report.ranks]
    gpu = report.topology.is_gpu
    fig, axes = plt.subplots(3 if gpu else 2, 1, figsize=(max(8, 0.25 * len(ranks) + 4), 10 if gpu else 7))
    ax_i = 0
    if gpu:
        ax = axes[ax_i]
        ax_i += 1
        parts = [
            ("weights + optimizer", [float(r.storage.hbm_weights + r.storage.hbm_state) / GIB for r in report.ranks]),
            ("UVM cache", [float(r.storage.hbm_cache) / GIB for r in report.ranks]),
            ("lookup buffers", [float(r.storage.hbm_buffers) / GIB for r in report.ranks]),
            ("batch buffers", [r.batch_buffers / GIB for r in report.ranks]),
        ]
        _stacked(ax, ranks, parts)
        r0 = report.ranks[0]
        ax.axhline((r0.hbm_budget + r0.batch_buffers) / GIB, color="red", ls="--", lw=1, label="capacity - reserve")
        ax.set_ylabel("GPU memory (GiB)")
        ax.legend(fontsize=7, loc="upper right")
    ax = axes[ax_i]
    ax_i += 1
    parts = [
        ("weights + optimizer", [float(r.storage.ddr_weights + r.storage.ddr_state) / GIB for r in report.ranks]),
        ("buffers", [float(r.storage.ddr_buffers) / GIB for r in report.ranks]),
    ]
    _stacked(ax, ranks, parts)
    ax.axhline(report.ranks[0].ddr_budget / GIB, color="red", ls="--", lw=1, label="embedding budget")
    ax.set_ylabel("host memory (GiB)")
    ax.legend(fontsize=7, loc="upper right")
    ax = axes[ax_i]
    parts = [(name, [r.phase_s[p] * 1e3 for r in report.ranks]) for p, name in enumerate(PHASES)]
    _stacked(ax, ranks, [p for p in parts if max(p[1]) > 0])
    ax.axhline(report.step_time_s * 1e3, color="black", ls="--", lw=1, label="predicted step time")
    ax.set_ylabel("predicted time (ms)")
    ax.set_xlabel("rank")
    ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(
        f"{len(report.tables)} tables on {report.topology.world_size} x {report.topology.device_name}: "
        f"predicted {report.step_time_s * 1e3:.3f} ms/step",
        fontsize=10,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _stacked(ax, ranks: list[int], parts: list[tuple[str, list[float]]]) -> None:
    bottom = [0.0] * len(ranks)
    for label, values in parts:
        ax.bar(ranks, values, bottom=bottom, label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlim(-0.6, len(ranks) - 0.4)
    if len(ranks) <= 32:
        ax.set_xticks(ranks)
