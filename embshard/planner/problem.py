"""What the search works on, in one place: the cost model (topology, batch, optimizer, settings), the tables, the
memory budgets per rank, the items with their choices (choices.py), which choices of each item fit a rank
(`usable`), the choice each item is placed with first (`chosen`) and the notes kept for the report and explain.

The lists are parallel, one entry per item: `items[i]`, `usable[i]`, `chosen[i]`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from embshard.planner.choices import Choice, ChoiceTable, Item
from embshard.planner.cost import CostModel
from embshard.planner.predict import Budgets
from embshard.planner.settings import PlannerSettings
from embshard.planner.topology import Topology
from embshard.spec.tables import TableConfig


@dataclass
class Problem:
    """One planning problem and the search's running decisions about it."""

    model: CostModel
    """Topology, batch size, optimizer and settings (cost.py)."""
    tables: Sequence[TableConfig]
    """The tables, in the caller's order (items index into it)."""
    budgets: Budgets
    """Memory per rank embeddings may use."""
    items: list[Item]
    """Tables, or co-located tables, with their choices."""
    table: ChoiceTable | None = None
    """Every choice's numbers as flat arrays (choices.py); choice c of item i at `items[i].base + c`."""
    usable: list[list[int]] = field(default_factory=list)
    """Per item: the indices of the choices whose largest shard fits a rank's budget."""
    chosen: list[int] = field(default_factory=list)
    """Per item: the choice it is placed with first (the cheapest, then moved to fit the memory totals)."""
    notes: dict[str, list[str]] = field(default_factory=dict)
    """Per table name: why the planner placed it so, in order."""

    @property
    def topology(self) -> Topology:
        """The machine planned for."""
        return self.model.topo

    @property
    def settings(self) -> PlannerSettings:
        """Planner settings."""
        return self.model.settings

    def names(self, item: Item) -> list[str]:
        """The item's table names."""
        return [self.tables[i].name for i in item.tables]

    def choice(self, i: int) -> Choice:
        """Item i's chosen choice."""
        return self.items[i].choices[self.chosen[i]]

    def note(self, item: Item, text: str) -> None:
        """Record a reason for the item's tables (shown by the report and explain)."""
        for name in self.names(item):
            self.notes.setdefault(name, []).append(text)
