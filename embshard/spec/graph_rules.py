"""What a training step replayed as one CUDA graph can hold, read from the tables, the plan and the options alone
(no torch): the rules that the whole-step graph (embshard/training/step_graph.py), the collection's step graph
(embshard/collection/emb_graph.py) and the step mode of `embshard train` (embshard/training/mode.py) share.

Each rule gives a `Refusal`: the reason (what the graph cannot hold, naming the table, feature or option) and the
setting that would allow the graph (`fix`, empty where no setting does)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embshard.spec.optim import FusedOptimizerConfig, OptimizerKind
from embshard.spec.options import BoundsCheck
from embshard.spec.plan import GRAPH_SHARDING_TYPES, MemoryTier, ShardingPlan
from embshard.spec.tables import Pooling, TableConfig

__all__ = ["Refusal", "padding_refusal", "plan_refusal", "tables_refusal"]


@dataclass(frozen=True)
class Refusal:
    """Why a step cannot be captured as one graph (`reason`), and the setting that would allow it (`fix`)."""

    reason: str
    fix: str = ""

    def __str__(self) -> str:
        return self.reason


def plan_refusal(
    tables: Sequence[TableConfig], plan: ShardingPlan, bounds_check: BoundsCheck | str = BoundsCheck.ERROR
) -> Refusal | None:
    """Why a step of `tables` under `plan` cannot be captured with its exchanges sized from the host's counts, or
    None if it can: only table-wise, column-wise and data-parallel tables (`GRAPH_SHARDING_TYPES`: each table or
    column block on one rank that receives every id of its features; row-wise bucketing sizes its exchange on the
    device),
    no UVM-caching tier (its prefetch runs on the host's schedule), and `tables_refusal`'s rules."""
    graph_types = {t.value for t in GRAPH_SHARDING_TYPES}
    other = [tp for tp in plan.tables if tp.sharding_type.value not in graph_types]
    if other:
        kinds = sorted({tp.sharding_type.value for tp in other})
        first = other[0]
        names = [tp.table for tp in other]
        return Refusal(
            f"the plan has {kinds} tables, whose exchanges are sized on the device (table_wise, column_wise and "
            f"data_parallel only): table {first.table!r} is {first.sharding_type.value}"
            + (f" ({len(other) - 1} more)" if len(other) > 1 else ""),
            f"planner.constraints.{first.table}.sharding_types=[table_wise]"
            + (f" (and the same for {names[1:4]}{' ...' if len(names) > 4 else ''})" if len(names) > 1 else "")
            + ", or let the planner choose (no plan_file, no such constraints)",
        )
    tier_of = {tp.table: tp.tier for tp in plan.tables}
    cached = [t.name for t in tables if tier_of.get(t.name) is MemoryTier.UVM_CACHING]
    if cached:
        return Refusal(
            f"UVM-caching tables {cached[:3]} prefetch their rows on the host's schedule",
            f"planner.constraints.{cached[0]}.tiers=[hbm] (or [uvm])",
        )
    return tables_refusal(tables, bounds_check)


def tables_refusal(
    tables: Sequence[TableConfig], bounds_check: BoundsCheck | str = BoundsCheck.ERROR
) -> Refusal | None:
    """`plan_refusal`'s rules that need no plan: no raw-id tables (their ids are admitted with host-side
    bookkeeping), out-of-range ids as an error (`bounds_check` drop removes ids on the device)."""
    raw = [t.name for t in tables if t.raw_ids]
    if raw:
        return Refusal(f"raw-id tables {raw[:3]} admit ids with host-side bookkeeping")
    if BoundsCheck(bounds_check) is BoundsCheck.DROP:
        return Refusal(
            "lookup.bounds_check drop removes ids on the device (the exchange's sizes change)",
            "lookup.bounds_check=error",
        )
    return None


def padding_refusal(tables: Sequence[TableConfig], optimizer: FusedOptimizerConfig) -> Refusal | None:
    """Why batches of `tables` cannot be padded with filler ids of weight 0 (ragged bags captured at a capacity,
    embshard/collection/padding.py), or None if they can: a mean-pooled feature divides by its bag lengths (which
    fillers change), and adam or weight decay change rows whose gradient is zero."""
    mean = [f for t in tables if Pooling(t.pooling) is Pooling.MEAN for f in t.feature_names]
    if mean:
        return Refusal(
            f"mean-pooled features {mean[:3]} divide by their bag lengths, which the filler ids change",
            "sum pooling (model.tables[i].pooling=sum)",
        )
    if OptimizerKind(optimizer.kind) is OptimizerKind.ADAM or optimizer.weight_decay:
        return Refusal(
            f"the sparse optimizer ({OptimizerKind(optimizer.kind).value}, weight decay {optimizer.weight_decay:g}) "
            "changes rows with a zero gradient",
            "sparse_optimizer.kind sgd, adagrad or rowwise_adagrad without weight_decay",
        )
    return None
