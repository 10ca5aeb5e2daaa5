"""`NoCache`: the cache methods of a lookup without a UVM cache (host and data-parallel lookups)."""

from __future__ import annotations


class NoCache:
    """No-op cache methods for lookups that have no HBM cache of UVM rows."""

    def prefetch(self, indices, offsets, forward_stream=None) -> None:
        """No cache: nothing to load ahead."""

    def drop_cache(self) -> None:
        """No cache: nothing to drop."""

    def cache_stats(self) -> dict[str, dict]:
        """No cache: no statistics."""
        return {}

    def reset_cache_stats(self) -> None:
        """No cache: nothing to reset."""
