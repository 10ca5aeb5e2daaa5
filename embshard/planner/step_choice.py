"""The whole-step CUDA graph or the eager step, chosen by predicted step time (`planner.settings.whole_step_graph:
auto`, what `training.cuda_graph: auto` asks for on GPUs).

A plan the whole-step graph holds has only table-wise, column-wise and data-parallel tables (GRAPH_SHARDING_TYPES)
and no UVM caching; without row-wise blocks a hot table's rank may carry more than a balanced rank's lookups. The
graph takes the host away: its step is priced by the GPUs' time alone (no host floor, no per-bag host work: cost.py,
predict.host_times), while an eager step lasts at least the host's time to issue it. Both run the dense part after
the embedding step (given its GPU time, the dense model's compute and all-reduce: planner/dense.py): inside the
graph it adds to the GPUs' time; the eager step runs it as the dense-step graph's one replay, which the GPUs run
while the host issues the next operators, so it adds nothing where the host's time exceeds the GPUs' by as much
(`PlanReport.step_with_dense_s`). `search_plan` (policy.py) plans both ways and keeps the faster; the `GraphChoice`
it puts in the report says which, with both predictions, and the training job's step line repeats it
(embshard/training/mode.py). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GraphChoice"]


@dataclass(frozen=True)
class GraphChoice:
    """The planner's choice between the plan for the whole-step CUDA graph and the plan for the eager step."""

    graph: bool
    """Whether the plan taken is run as one CUDA graph replay a step."""
    graph_step_s: float | None
    """Predicted step of the graph's plan (s), priced as one replay; None: no plan the graph holds fits."""
    eager_step_s: float | None
    """Predicted step of the best plan with every option (s), priced as an eager step; None: none fits."""
    same_plan: bool = False
    """The best plan with every option holds the graph too (and replayed it is faster than the plan found among
    the graph's options): one plan, priced both ways."""
    why_no_graph: str = ""
    """Why no plan the graph holds fits (with graph_step_s None)."""
    dense_step_s: float = 0.0
    """The dense part's GPU time a step (s), its compute and gradient all-reduce, that both predictions include
    (0: the embedding step alone)."""

    def reason(self) -> str:
        """Why this choice, with the predicted step of both (ms)."""
        if self.graph_step_s is None:
            return f"no plan the whole-step CUDA graph holds fits ({self.why_no_graph})"
        graph = f"{self.graph_step_s * 1e3:.2f} ms"
        dense = f" (with the dense part's {self.dense_step_s * 1e3:.2f} ms)" if self.dense_step_s > 0 else ""
        if self.eager_step_s is None:
            return f"predicted {graph} a step with the whole-step CUDA graph{dense}; no plan for the eager step fits"
        eager = f"{self.eager_step_s * 1e3:.2f} ms"
        if self.same_plan:
            return (
                f"predicted {graph} a step with the whole-step CUDA graph against {eager} eager (the same plan){dense}"
            )
        if self.graph:
            return f"predicted {graph} a step with the whole-step CUDA graph's plan against {eager} eager{dense}"
        return f"predicted {eager} a step eager against {graph} with the whole-step CUDA graph's plan{dense}"

    def force(self) -> str:
        """The setting that asks for the other step (empty where no graph plan fits)."""
        if self.graph:
            return "training.cuda_graph=false"
        return "" if self.graph_step_s is None else "training.cuda_graph=true"

    def line(self) -> str:
        """The report's line (PlanReport.summary)."""
        taken = "the whole-step CUDA graph" if self.graph else "the eager step"
        force = self.force()
        other = f"; {force} plans for the other" if force else ""
        return f"  step choice (training.cuda_graph auto): {taken}, {self.reason()}{other}"

    def to_dict(self) -> dict:
        """Plain data (PlanReport.to_dict)."""
        return {
            "graph": self.graph,
            "graph_step_ms": None if self.graph_step_s is None else self.graph_step_s * 1e3,
            "eager_step_ms": None if self.eager_step_s is None else self.eager_step_s * 1e3,
            "same_plan": self.same_plan,
            "why_no_graph": self.why_no_graph,
            "dense_step_ms": self.dense_step_s * 1e3,
        }
