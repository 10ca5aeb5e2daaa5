"""`ShardState`: a sharded collection's state, as its shards on this rank and assembled over all ranks.

Data flow. Every lookup of every scheme holds some shards (`lookup.shards`) and hands out their live tensors
(`shard_weights()`, `shard_optimizer_states()`); `local_shards` / `local_optimizer_states` list them as
(table name, Shard, tensor) items, the form checkpoints save and load. `full_weights` all-gathers every rank's
items (`all_gather_object`, a collective), keeps each (table, row offset, column offset) block once (replicas are
taken from the first rank that has them) and writes the blocks into one CPU tensor per table. `optimizer_step`
and `drop_caches` reach every lookup the same way.

A mixin of `ShardedEmbeddingBagCollection` (sharded.py): it reads the collection's `schemes`, `tables`,
`world_size` and `group`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from embshard.spec.plan import Shard
from embshard.spec.tables import TableConfig


class ShardState:
    """The state methods of a sharded collection (the data flow is in the module docstring)."""

    schemes: Sequence[Any]
    tables: Sequence[TableConfig]
    world_size: int
    group: dist.ProcessGroup | None

    def _per_shard(self, of_lookup: Callable[[Any], list]) -> list[tuple[str, Shard, Any]]:
        """(table name, Shard, x) for every shard on this rank, x from `of_lookup(lookup)`: one per lookup shard."""
        return [
            (s.table.name, s.shard, x)
            for scheme in self.schemes
            for lookup in scheme.lookups
            for s, x in zip(lookup.shards, of_lookup(lookup))
        ]

    def local_shards(self) -> list[tuple[str, Shard, torch.Tensor]]:
        """(table name, Shard, weights) for every shard on this rank (the weights are the live tensors: writing
        into them changes the model; UVM-caching lookups flush their caches first)."""
        return self._per_shard(lambda lookup: lookup.shard_weights())

    def local_optimizer_states(self) -> list[tuple[str, Shard, dict[str, torch.Tensor]]]:
        """(table name, Shard, {state name: tensor}) for every shard on this rank, the fused optimizer's state
        named as `embshard.lookup.updates.optimizer_state` ('m': adagrad `[rows, D]`, rowwise_adagrad `[rows]`, adam's
        first moment; 'v': adam's second moment; {} for sgd). Live tensors, like `local_shards`."""
        return self._per_shard(lambda lookup: lookup.shard_optimizer_states())

    @property
    def optimizer_step(self) -> int:
        """Steps the fused optimizer has taken on this rank (Adam's bias-correction count): the largest count of
        its lookups, which step together (0 for optimizers that keep none, or a rank without lookups). Setting it
        sets every lookup's count (resuming from a checkpoint)."""
        return max((int(lk.optimizer_step) for s in self.schemes for lk in s.lookups), default=0)

    @optimizer_step.setter
    def optimizer_step(self, step: int) -> None:
        for scheme in self.schemes:
            for lookup in scheme.lookups:
                lookup.optimizer_step = int(step)

    def drop_caches(self) -> None:
        """Write every UVM-cached row back and empty the caches (no-op for other tiers). Call it BEFORE writing
        into the weights that `local_shards()` returned (loading a checkpoint): FBGEMM's flush keeps rows cached,
        and a flush after the write would put those old rows back over the new values."""
        for scheme in self.schemes:
            for lookup in scheme.lookups:
                lookup.drop_cache()

    # ---- raw-id tables: their id -> row maps (embshard/rawids) ---------------------------------------------
    def _id_maps(self) -> list[tuple[Any, int]]:
        """(IdMap, shard index in it) for every raw-id shard of this rank."""
        return [
            (idmap, i)
            for scheme in self.schemes
            for idmap in getattr(scheme, "idmaps", {}).values()
            for i in range(len(idmap.shards))
        ]

    def local_id_maps(self) -> list[tuple[str, Shard, dict[str, torch.Tensor]]]:
        """(table name, Shard, {'ids', 'id_last', 'id_count'}) for every raw-id shard on this rank: live `[rows]`
        views of the id each row holds, the map's clock at its last use (-1: no id) and its uses. After writing
        into them call `rebuild_id_maps()`."""
        return [(m.shards[i].table.name, m.shards[i].shard, m.shard_state(i)) for m, i in self._id_maps()]

    def id_map_seed(self, table: str) -> int:
        """The seed of the id map that holds raw-id table `table` on this rank (its rows' initial values)."""
        return next(m.seed for m, _ in self._id_maps() if any(s.table.name == table for s in m.shards))

    def id_map_shards(self) -> list[tuple[str, Shard, Any, int]]:
        """(table name, Shard, IdMap, the shard's index in it) for every raw-id shard on this rank: the map's
        `exact_state(i)` and `stage_exact_state(i, ...)` carry what a checkpoint needs for an exact resume."""
        return [(m.shards[i].table.name, m.shards[i].shard, m, i) for m, i in self._id_maps()]

    def rebuild_id_maps(self) -> int:
        """Rebuild every map's index and LRU order from its rows (after a load); returns ids dropped for want of
        an index slot (normally 0)."""
        maps = {id(m): m for m, _ in self._id_maps()}
        return sum(m.rebuild() for m in maps.values())

    def raw_id_stats(self, gather: bool = False) -> dict[str, dict[str, int]]:
        """Per raw-id table of this rank (gather=True: of every rank, summed over its blocks; collective): ids
        admitted and evicted since the last `reset_raw_id_stats()`, ids resident now, capacity (ids it can hold).
        Reads device counters (a host sync): for logging every N steps."""
        stats: dict[str, dict[str, int]] = {}
        maps = {id(m): m for m, _ in self._id_maps()}
        for m in maps.values():
            for s, st in zip(m.shards, m.stats()):
                acc = stats.setdefault(s.table.name, dict.fromkeys(st, 0))
                for k, v in st.items():
                    acc[k] += v
        if gather and self.world_size > 1:
            everyone: list = [None] * self.world_size
            dist.all_gather_object(everyone, stats, group=self.group)
            stats = {}
            for rank_stats in everyone:
                for name, st in rank_stats.items():
                    acc = stats.setdefault(name, dict.fromkeys(st, 0))
                    for k, v in st.items():
                        acc[k] += v
        return stats

    def reset_raw_id_stats(self) -> None:
        """Start counting admissions and evictions afresh (every map of this rank)."""
        for m in {id(m): m for m, _ in self._id_maps()}.values():
            m.reset_stats()

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every table's full weights (fp32, CPU), assembled on every rank (collective; for tests and small
        models: it holds every table on every rank). Replicated tables are taken from their first replica."""
        out = {t.name: torch.zeros(t.num_embeddings, t.embedding_dim) for t in self.tables}
        raw = {t.name for t in self.tables if t.raw_ids}
        for name, s, w in self._gather([(n, s, w.detach().float().cpu()) for n, s, w in self.local_shards()]):
            out[name][s.row_offset : s.row_offset + s.num_rows, s.col_offset : s.col_offset + s.num_cols] = w
            if name in raw:  # a raw-id block's zero row (its last): zeros, whatever its gradients left there
                out[name][s.row_offset + s.num_rows - 1, s.col_offset : s.col_offset + s.num_cols] = 0
        return out

    def _gather(self, items: list) -> list:
        """Every rank's (table, Shard, payload) items, each (table, row offset, column offset) once (collective)."""
        gathered: list = [None] * self.world_size
        if self.world_size > 1:
            dist.all_gather_object(gathered, items, group=self.group)
        else:
            gathered = [items]
        done: set = set()
        out = []
        for rank_items in gathered:
            for name, s, payload in rank_items:
                key = (name, s.row_offset, s.col_offset)
                if key not in done:
                    done.add(key)
                    out.append((name, s, payload))
        return out
