"""The id -> row map of a raw-id table's shard, in sizes: its index's buckets and slots, the widths of its row and
slot numbers, and its bytes per row. One rule for the map's buffers (embshard/rawids/state.py) and the planner's
price of the map (embshard/planner/cost.py); the design is in embshard/rawids/__init__.py."""

from __future__ import annotations

from embshard.spec.tables import Eviction

P = 16
"""Slots per index bucket (a lookup reads two buckets: 2P slots)."""
SLOTS_PER_ROW = 2
"""Index slots per usable row (load factor 1/2)."""
SKETCH_DEPTH = 2
"""Rows of the count-min sketch that admission counting keeps (admit_min_count > 1)."""


def map_buckets(usable: int) -> int:
    """Index buckets of a shard with `usable` rows for ids (SLOTS_PER_ROW slots per row, P per bucket)."""
    return max(1, -(-usable * SLOTS_PER_ROW // P))


def index_bytes(rows: int, slots: int) -> int:
    """Bytes of a slot -> row or row -> slot number for a map of `rows` rows and `slots` slots: 4 (int32) while
    both fit, else 8."""
    return 4 if max(rows, slots) + 1 < 2**31 else 8


def map_bytes_per_row(rows: int, eviction: Eviction | str = Eviction.LRU, admit_min_count: int = 1) -> float:
    """Bytes the id -> row map keeps per row of a raw-id shard of `rows` rows (the planner's price of the map):
    index slots (id and row, 2 per row), the row's id, last use, use count and slot, its segment and (LRU) its
    place in the LRU order, and (admit_min_count > 1) the sketch's counters."""
    usable = max(rows - 1, 1)
    slots = map_buckets(usable) * P
    idx = index_bytes(rows, slots)
    total = slots * (8 + idx) + rows * (24 + idx) + usable * 8 + slots // P * 8  # the last: the buckets' list heads
    if Eviction(eviction) is Eviction.LRU:
        total += 2 * usable * 8 + rows  # the order and the one a step writes (rawids/graph.py keeps both), used marks
    if admit_min_count > 1:
        total += (SKETCH_DEPTH + 1) * max(usable, 16) * 8  # the counters and each column's shard
    return total / rows
