"""UVM-cache statistics of one TBE, per table, from FBGEMM's counters (pure functions, testable without a GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from embshard.lookup.settings import TBESettings


def summarize_cache_stats(
    settings: TBESettings,
    requested_F: Sequence[int],
    misses_F: Sequence[int],
    tbe_counters: Sequence[int],
    cached_rows_T: Sequence[int],
    occupied_base: int,
    cache_slots: int,
) -> dict[str, dict[str, Any]]:
    """Per-table statistics of one UVM-caching TBE, from counters accumulated since the last reset.

    `requested_F` / `misses_F`: ids looked up and unique cache misses (rows fetched from UVM) per feature;
    `tbe_counters`: FBGEMM's six TBE-wide counters (calls, requested, unique, unique misses, conflict unique
    misses, conflict misses); `cached_rows_T`: each shard's rows now in the cache; `occupied_base`: slots
    occupied at the last reset; `cache_slots`: rows the cache holds. Evictions are TBE-wide (the cache is
    shared): rows inserted minus slots newly filled, exact for LRU, None for LFU (FBGEMM counts no insertions).
    """
    T = len(settings.tables)
    req_T, miss_T = [0] * T, [0] * T
    for f, t in enumerate(settings.feature_table_map):
        req_T[t] += int(requested_F[f])
        miss_T[t] += int(misses_F[f])
    lru = settings.cache_algorithm == "LRU"
    inserted = int(tbe_counters[3]) - int(tbe_counters[4]) if lru else None
    occupied = sum(int(c) for c in cached_rows_T)
    evictions = inserted - (occupied - occupied_base) if inserted is not None else None
    out: dict[str, dict[str, Any]] = {}
    for t, name in enumerate(settings.tables):
        out[name] = {
            "requested": req_T[t],
            "unique_misses": miss_T[t],
            "hit_rate": 1.0 - miss_T[t] / req_T[t] if req_T[t] else None,
            "cached_rows": int(cached_rows_T[t]),
            "rows": settings.rows[t],
            "cache_group": list(settings.tables),
            "group_cache_slots": cache_slots,
            "group_evictions": evictions,
        }
    return out


def format_cache_stats(stats: dict[str, dict[str, Any]]) -> str:
    """One line per table, for logs."""
    lines = []
    for name, s in stats.items():
        hit = "n/a" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
        ev = "n/a" if s["group_evictions"] is None else str(s["group_evictions"])
        lines.append(
            f"cache {name}: hit {hit} ({s['unique_misses']} misses / {s['requested']} ids), "
            f"{s['cached_rows']} of {s['rows']} rows cached, group evictions {ev}"
        )
    return "\n".join(lines)
