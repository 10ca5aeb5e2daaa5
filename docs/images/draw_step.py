"""Draws docs/images/step.png: one training step of embshard, from the plan to the dense model.

    python docs/images/draw_step.py [--out docs/images/step.png]

The picture in README.md and docs/architecture.md; rerun this after changing the step's stages.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

PLAN, EXCHANGE, COMPUTE = "#fde9c8", "#cfe3f7", "#d9efd3"  # the plan; collectives between ranks; work on a rank
EDGE = "#444444"

# (title, detail, colour) of the step's stages, left to right
STAGES = [
    ("local batch", "KeyedJaggedTensor:\nids of every feature", COMPUTE),
    ("id exchange", "all-to-all: each id\nto its shard's rank", EXCHANGE),
    ("lookup", "FBGEMM TBE, or the\nTriton small-table\nkernel: pooled rows", COMPUTE),
    ("pooled exchange", "all-to-all: pooled\nrows back to the\nsamples' ranks", EXCHANGE),
    ("regroup", "feature groups\nthe model asks for", COMPUTE),
    ("dense model", "any nn.Module under\nDDP, then the loss", COMPUTE),
]


def box(ax, x: float, y: float, w: float, h: float, title: str, detail: str, colour: str) -> None:
    ax.add_patch(
        FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=colour, ec=EDGE, lw=1.2, zorder=2)
    )
    ax.text(x + w / 2, y + h - 0.2, title, ha="center", va="top", fontsize=10.5, weight="bold", zorder=3)
    ax.text(x + w / 2, y + h - 0.52, detail, ha="center", va="top", fontsize=8.5, color="#222222", zorder=3)


def arrow(ax, start: tuple[float, float], end: tuple[float, float], **kw) -> None:
    style = {"arrowstyle": "-|>", "mutation_scale": 14, "lw": 1.4, "color": EDGE, "zorder": 1} | kw
    ax.add_patch(FancyArrowPatch(start, end, **style))


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(14, 4.6), dpi=110)
    ax.set_xlim(0, 14)
    ax.set_ylim(0, 4.6)
    ax.axis("off")

    # the plan, made once before training (on a CPU, no torch needed)
    box(
        ax,
        0.2,
        3.2,
        3.6,
        1.25,
        "planner",
        "cost model on a CPU, once per job:\nsharding type, ranks, memory tier,\nkernel per table",
        PLAN,
    )
    ax.text(
        4.0,
        3.85,
        "ShardingPlan: which rank holds which rows\n(every rank builds its shards from it)",
        fontsize=9,
        va="center",
    )

    w, h, gap, y = 2.1, 1.55, 0.24, 1.3
    xs = [0.2 + i * (w + gap) for i in range(len(STAGES))]
    for x, (title, detail, colour) in zip(xs, STAGES):
        box(ax, x, y, w, h, title, detail, colour)
    for a, b in zip(xs, xs[1:]):
        arrow(ax, (a + w, y + h / 2), (b, y + h / 2))
    for x in (xs[1], xs[2]):  # the plan decides where ids go and which shards a rank looks up
        arrow(ax, (2.0, 3.2), (x + w / 2, y + h), linestyle="--", color="#a0701c", connectionstyle="arc3,rad=-0.1")

    # the backward: the same path in reverse, the sparse optimizer inside the lookup's backward
    arrow(ax, (xs[-1] + w / 2, y), (xs[2] + w / 2, y), connectionstyle="arc3,rad=-0.2", color="#8a2b2b")
    ax.text(
        (xs[2] + xs[-1] + w) / 2,
        0.12,
        "backward: gradients return through the pooled exchange; the fused optimizer updates the touched rows\n"
        "inside the lookup's backward. The whole step can be replayed as one CUDA graph (training.cuda_graph).",
        ha="center",
        fontsize=8.5,
        color="#8a2b2b",
    )

    legend = [("the plan", PLAN), ("collective between ranks", EXCHANGE), ("work on each rank", COMPUTE)]
    for i, (label, colour) in enumerate(legend):
        lx = 9.4 + (i % 2) * 2.2
        ly = 4.1 - (i // 2) * 0.38
        ax.add_patch(FancyBboxPatch((lx, ly), 0.3, 0.22, boxstyle="round,pad=0.01", fc=colour, ec=EDGE))
        ax.text(lx + 0.4, ly + 0.11, label, va="center", fontsize=9)

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight", facecolor="white")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("step.png"))
    draw(p.parse_args(argv).out)


if __name__ == "__main__":
    main()
