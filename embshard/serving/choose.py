"""`--dtype auto`: a type per table so that the tables fit a memory budget, losing the least precision where it
matters most.

Every table starts in its trained type (fp32 or fp16). While the tables' bytes exceed the budget, the table whose
next step down the ladder fp32 -> fp16 -> int8 -> int4 saves the most bytes per id looked up steps down: bytes
from the planner's pricing of a table (`planner.memory.TableStats`: rows, dim, features, ids per bag) at the
stored row size of each type (quantized rows carry 4 bytes of scale and bias); ids looked up per sample =
features x ids_per_bag. So big tables that few ids read (cold rows) are quantized first, small hot ones last.
Pure arithmetic, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embshard.planner.memory import TableStats
from embshard.spec.tables import ConfigError, TableConfig

LADDER = ("fp32", "fp16", "int8", "int4")
_BITS = {"fp32": 32, "fp16": 16, "int8": 8, "int4": 4}
GIB = float(1 << 30)


def stored_row_bytes(dim: int, dtype: str) -> int:
    """Bytes of one stored row (the same rule as quantize.row_bytes, without torch)."""
    data = -(-dim * _BITS[dtype] // 8)
    return data + (4 if dtype in ("int8", "int4") else 0)


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


@dataclass(frozen=True)
class Choice:
    table: str
    dtype: str
    bytes: int
    why: str


def choose_dtypes(tables: Sequence[TableConfig], budget_bytes: float) -> list[Choice]:
    """A type per table (in table order) whose stored bytes sum to at most `budget_bytes`, with the reason;
    ConfigError if even int4 everywhere does not fit."""
    stats = TableStats.of(tables)
    rows = [int(r) for r in stats.rows]
    dims = [int(d) for d in stats.dim]
    reads = [float(f * i) for f, i in zip(stats.features, stats.ids_per_bag)]  # ids looked up per sample
    level = [LADDER.index(t.data_type.value) for t in tables]

    def size(i: int) -> int:
        return rows[i] * stored_row_bytes(dims[i], LADDER[level[i]])

    total = sum(size(i) for i in range(len(tables)))
    floor = sum(r * stored_row_bytes(d, "int4") for r, d in zip(rows, dims))
    if floor > budget_bytes:
        raise ConfigError(
            f"--memory-gib {budget_bytes / GIB:.3g}: the tables need {size_text(floor)} even all in int4; give a "
            "larger budget (or shard the tables over several GPUs)"
        )
    while total > budget_bytes:

        def saving(i: int) -> float:
            if level[i] == len(LADDER) - 1:
                return -1.0
            smaller = rows[i] * stored_row_bytes(dims[i], LADDER[level[i] + 1])
            return (size(i) - smaller) / max(reads[i], 1e-9)

        best = max(range(len(tables)), key=saving)
        total -= size(best)
        level[best] += 1
        total += size(best)
    out = []
    for i, t in enumerate(tables):
        dtype = LADDER[level[i]]
        full = rows[i] * stored_row_bytes(dims[i], t.data_type.value)
        per_row = reads[i] / rows[i]
        if dtype == t.data_type.value:
            why = f"kept as trained ({dtype}); {per_row:.3g} ids per row per sample"
        else:
            why = (f"{t.data_type.value} {size_text(full)} -> {dtype} {size_text(size(i))} to fit the budget; "
                   f"{per_row:.3g} ids per row per sample ({reads[i]:.3g} ids per sample)")  # fmt: skip
        out.append(Choice(t.name, dtype, size(i), why))
    return out
