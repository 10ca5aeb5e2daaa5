"""The search state: per-rank loads and free memory, and the moves the search makes on them (place an item's
choice on ranks, take it back), with the fast evaluation of where a choice would go best.

Fixed costs per lookup group (sharding type x tier x kernel) on a rank: its launches, paid while the group has a
block there, and for small-kernel groups the longest hot-row chain of its blocks (`hot_max`, with each rank's
chains kept in `hot` to find the next longest when one leaves)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from embshard.planner import loads, rank_pick
from embshard.planner.choices import Choice, Item
from embshard.planner.cost import CostModel
from embshard.planner.host_stats import HostStats
from embshard.spec.plan import LookupKernel, ShardingType

_UNSET = object()


class State:
    """Loads [NROWS, W] (fixed costs included), free HBM / host memory per rank, and what sits where."""

    def __init__(self, model: CostModel, hbm_budget: float, ddr_budget: float, base: np.ndarray | None = None) -> None:
        """`base` [NROWS]: what every rank does whatever the plan (CostModel.batch_loads)."""
        topo = model.topo
        self.model = model
        self.W, self.lws, self.H = topo.world_size, topo.local_world_size, topo.num_hosts
        self.loads = np.zeros((loads.NROWS, self.W))
        if base is not None:
            self.loads += np.asarray(base, dtype=float)[:, None]
        self.version = 0  # bumped whenever the loads change (invalidates the statistics of _fresh)
        self._stats_key: tuple | None = None
        self._stats: dict = {}
        self.hbm_free = np.full(self.W, float(hbm_budget))
        self.ddr_free = np.full(self.W, float(ddr_budget))
        self.group_count: dict[tuple, np.ndarray] = {}
        self.scheme_count: dict[ShardingType, list[int]] = {}  # [items, weighted items]
        self._scheme_sig: tuple = ()  # scheme_count with counts capped at 2: all the schemes' fixed costs depend on
        self._schemes: dict[tuple, object] = {}  # _scheme_delta / _scheme_join per signature
        self.placed: dict[int, tuple[int, tuple[int, ...]]] = {}  # item -> (choice index, ranks)
        self.hot: dict[tuple, list[list[float]]] = {}  # small-kernel group -> per rank, its blocks' hot chains
        self.hot_max: dict[tuple, np.ndarray] = {}  # small-kernel group -> [W] longest chain per rank
        self._buf_own = np.empty((loads.NROWS, self.W))  # scratch of _best_single
        self._launches: dict[tuple, np.ndarray | None] = {}  # group -> [NROWS, W] its launches where it is absent
        self._absent: dict[tuple, int] = {}  # group -> how many ranks it is absent from (while _launches has it)
        self._launch_rows: dict[tuple, list[int]] = {}  # group -> the rows its launches load
        self._buf_new = np.empty((loads.NROWS, self.W))
        self._hosts = HostStats(self.H, self.lws)  # per-host statistics of the loads (until they change)
        self._host_first = np.arange(self.H)[None, :] * self.lws  # [1, H]: each host's first rank

    # ---- fixed costs --------------------------------------------------------------------------------------
    def _group(self, ch: Choice) -> tuple:
        return ch.group

    def _hot_change(self, ch: Choice, ranks: Sequence[int], sign: int) -> np.ndarray:
        """[W]: change of each rank's longest hot chain in the choice's group if it joins (+1) or leaves (-1)."""
        out = np.zeros(self.W)
        key = self._group(ch)
        top = self.hot_max.get(key, out)
        r = np.asarray(ranks)
        hot = ch.hot[: len(r)]
        if sign > 0:
            out[r] = np.maximum(hot - top[r], 0.0)
            return out
        for b in np.flatnonzero(hot >= top[r]).tolist():  # it held the longest chain there: the next longest
            rest = list(self.hot[key][r[b]])
            rest.remove(float(hot[b]))
            out[r[b]] = max(rest, default=0.0) - top[r[b]]
        return out

    def _track_hot(self, ch: Choice, ranks: Sequence[int], sign: int) -> None:
        key = self._group(ch)
        if key not in self.hot:
            self.hot[key] = [[] for _ in range(self.W)]
            self.hot_max[key] = np.zeros(self.W)
        lists, top = self.hot[key], self.hot_max[key]
        r = np.asarray(ranks)
        hot = ch.hot[: len(r)]
        for b, q in enumerate(r.tolist()):
            if sign > 0:
                lists[q].append(float(hot[b]))
            else:
                lists[q].remove(float(hot[b]))
        if sign > 0:
            top[r] = np.maximum(top[r], hot)
        else:
            for q in r[hot >= top[r]].tolist():
                top[q] = max(lists[q], default=0.0)

    def fixed_freed(self, item: Item, ch: Choice, rows: Sequence[int]) -> float:
        """The largest of `rows` of the collective latencies and the step's host sync that removing the placed
        item would save (nonzero when it is the last table of its sharding scheme, or its last weighted one)."""
        if self.scheme_count.get(ch.option.sharding, (0, 0))[0] > 1 and not item.weighted:
            return 0.0
        return float(-self._scheme_delta(item, ch, -1)[rows].min())

    def _scheme_delta(self, item: Item, ch: Choice, sign: int) -> np.ndarray:
        """Change of the scheme's collective latencies (all ranks) if the item joins (+1) or leaves (-1), and of
        the once-per-step host sync (device counts) when the plan gains its first or loses its last model-parallel
        table. Kept per `_scheme_sig` (what the change depends on)."""
        key = ("scheme", ch.option.sharding, item.weighted, sign, self._scheme_sig)
        got = self._schemes.get(key)
        if got is None:
            got = self._schemes[key] = self._scheme_change(item, ch, sign)
        return got

    def _scheme_added(self, item: Item, ch: Choice, sign: int) -> np.ndarray | None:
        """`_scheme_delta`, or None where it is zero on every rank (kept per `_scheme_sig` too)."""
        key = ("added", ch.option.sharding, item.weighted, sign, self._scheme_sig)
        got = self._schemes.get(key, _UNSET)
        if got is _UNSET:
            scheme = self._scheme_delta(item, ch, sign)
            got = self._schemes[key] = scheme if scheme.any() else None
        return got

    def _signature(self) -> tuple:
        """The scheme counts as far as the fixed costs of a join or a leave tell them apart: each scheme's items
        and weighted items, capped at 2 (a change matters only where a count reaches or leaves 0)."""
        return tuple((s, min(n, 2), min(nw, 2)) for s, (n, nw) in self.scheme_count.items())

    def _scheme_change(self, item: Item, ch: Choice, sign: int) -> np.ndarray:
        st = ch.option.sharding
        n, nw = self.scheme_count.get(st, [0, 0])
        before = self.model.scheme_fixed(st, nw > 0) if n else np.zeros(loads.NROWS)
        n2, nw2 = n + sign, nw + sign * int(item.weighted)
        after = self.model.scheme_fixed(st, nw2 > 0) if n2 else np.zeros(loads.NROWS)
        if st is not ShardingType.DATA_PARALLEL:
            others = any(
                c[0] > 0 for s, c in self.scheme_count.items() if s is not st and s is not ShardingType.DATA_PARALLEL
            )
            if not others and (n > 0) != (n2 > 0):
                step = self.model.step_fixed()
                return after - before + (step if n2 > 0 else -step)
        return after - before

    # ---- moves --------------------------------------------------------------------------------------------
    def delta(self, item: Item, ch: Choice, ranks: Sequence[int], sign: int = 1) -> np.ndarray:
        """Loads [NROWS, W] that placing (+1) or removing (-1) the choice on `ranks` adds."""
        group = self._group(ch)
        counts = self.group_count.get(group)
        if ch.blocks == 1:  # one block: its rank, its host's other ranks, the other hosts' ranks
            q = int(ranks[0])
            h0 = q // self.lws * self.lws
            d = np.empty((loads.NROWS, self.W))
            if sign > 0:
                d[:] = ch.other[0][:, None]
                d[:, h0 : h0 + self.lws] = ch.same[0][:, None]
                d[:, q] = ch.owner[0]
            else:
                d[:] = -ch.other[0][:, None]
                d[:, h0 : h0 + self.lws] = -ch.same[0][:, None]
                d[:, q] = -ch.owner[0]
            n = 0 if counts is None else int(counts[q])
            if (n > 0) != (n + sign > 0):  # the group's first block on q arrives, or its last leaves
                fixed = self.model.group_fixed(*group)
                d[:, q] += fixed if sign > 0 else -fixed
        else:
            ranks_a = np.asarray(ranks)
            d = self._dense(ch, ranks_a) * sign
            counts = counts if counts is not None else np.zeros(self.W, dtype=int)
            per_rank = np.bincount(ranks_a, minlength=self.W)
            new = counts + sign * per_rank
            changed = (counts > 0) != (new > 0)
            d[:, changed] += np.outer(self.model.group_fixed(*group), np.where(new[changed] > 0, 1.0, -1.0))
        scheme = self._scheme_added(item, ch, sign)
        if scheme is not None:
            d += scheme[:, None]
        if ch.option.kernel is LookupKernel.SMALL:
            d[loads.BWD] += self._hot_change(ch, ranks, sign)
        return d

    def _dense(self, ch: Choice, ranks: np.ndarray) -> np.ndarray:
        key = tuple(ranks.tolist())
        cached = ch.dense.get(key)
        if cached is None:
            cached = loads.spread(ranks, ch.owner, ch.same, ch.other, self.W, self.lws)
            if len(ch.dense) < 16:
                ch.dense[key] = cached
        return cached.copy()

    def apply(self, i: int, item: Item, c: int, ranks: Sequence[int]) -> None:
        """Place choice c of item i on `ranks` (one per block)."""
        ch = item.choices[c]
        self._add_loads(self.delta(item, ch, ranks, +1), ranks)
        key = self._group(ch)
        if key not in self.group_count:
            self.group_count[key] = np.zeros(self.W, dtype=int)
        counts = self.group_count[key]
        if len(ranks) == 1:
            q = ranks[0]
            self.hbm_free[q] -= ch.hbm[0]
            self.ddr_free[q] -= ch.ddr[0]
            counts[q] += 1
            self._launches_at(key, q, counts[q], +1)
        else:
            np.subtract.at(self.hbm_free, np.asarray(ranks), ch.hbm)
            np.subtract.at(self.ddr_free, np.asarray(ranks), ch.ddr)
            np.add.at(counts, list(ranks), 1)
            self._launches.pop(key, None)
        sc = self.scheme_count.get(ch.option.sharding)
        first = sc is None
        if first:
            sc = self.scheme_count[ch.option.sharding] = [0, 0]
        sc[0] += 1
        sc[1] += int(item.weighted)
        if first or sc[0] <= 2 or (item.weighted and sc[1] <= 2):  # a capped count changed
            self._scheme_sig = self._signature()
        self.placed[i] = (c, tuple(int(r) for r in ranks))
        if ch.option.kernel is LookupKernel.SMALL:
            self._track_hot(ch, self.placed[i][1], +1)

    def remove(self, i: int, item: Item) -> tuple[int, tuple[int, ...]]:
        """Take item i off its ranks; returns where it was."""
        c, ranks = self.placed.pop(i)
        ch = item.choices[c]
        self._add_loads(self.delta(item, ch, ranks, -1), ranks)
        key = self._group(ch)
        if len(ranks) == 1:
            q = ranks[0]
            self.hbm_free[q] += ch.hbm[0]
            self.ddr_free[q] += ch.ddr[0]
            self.group_count[key][q] -= 1
            self._launches_at(key, q, self.group_count[key][q], -1)
        else:
            np.add.at(self.hbm_free, np.asarray(ranks), ch.hbm)
            np.add.at(self.ddr_free, np.asarray(ranks), ch.ddr)
            np.subtract.at(self.group_count[key], list(ranks), 1)
            self._launches.pop(key, None)
        sc = self.scheme_count[ch.option.sharding]
        sc[0] -= 1
        sc[1] -= int(item.weighted)
        if sc[0] <= 1 or (item.weighted and sc[1] <= 1):  # a capped count changed
            self._scheme_sig = self._signature()
        if ch.option.kernel is LookupKernel.SMALL:
            self._track_hot(ch, ranks, -1)
        return c, ranks

    def _launches_at(self, group: tuple, q: int, count: int, sign: int) -> None:
        """Keep the group's launches where it is absent (`_own_extra`) after a block placed (+1) or removed (-1)."""
        launches = self._launches.get(group)
        if launches is None:
            self._launches.pop(group, None)  # none absent before (or not made): made again when asked for
        elif count == 0:
            launches[:, q] = self.model.group_fixed(*group)
            self._absent[group] += 1
        elif count == 1 and sign > 0:
            launches[:, q] = 0.0
            self._absent[group] -= 1
            if not self._absent[group]:  # on every rank now
                self._launches[group] = None

    def _add_loads(self, d: np.ndarray, ranks: Sequence[int]) -> None:
        """Add a move's loads `d` [NROWS, W] (the per-host statistics are made again when next asked for)."""
        self.loads += d
        self.version += 1

    def objective(self) -> float:
        """Predicted step time of the current loads (s)."""
        return loads.step_time(self.loads)

    # ---- where would a choice go best -----------------------------------------------------------------------
    def floor(self, item: Item, ch: Choice) -> float:
        """A floor under the step time of every placement of the item's choice on the current loads: each phase
        lasts at least as long as its busiest rank now, as the choice's busiest block on its own rank (a placement
        only adds loads), and as each of its rows' mean over the ranks after the placement (the choice's blocks and
        the scheme's fixed costs it adds; launches only add)."""
        cache = self._fresh()
        sums = cache.get("sums")
        if sums is None:
            sums = cache["sums"] = self.loads.sum(axis=1)
        mean = (sums + ch.total(self.W, self.lws)) / self.W + self._scheme_delta(item, ch, +1)
        per_phase = np.maximum(np.maximum(self._busiest(), ch.owner_peak), np.maximum.reduceat(mean, loads.PHASE_START))
        return float(per_phase.sum())

    def _busiest(self) -> np.ndarray:
        """[phases]: each phase's time now (its busiest rank's), cached until the loads change."""
        cache = self._fresh()
        busiest = cache.get("phases")
        if busiest is None:
            busiest = cache["phases"] = np.maximum.reduceat(self._row_max(), loads.PHASE_START)
        return busiest

    def best_ranks(self, item: Item, ch: Choice) -> tuple[float, tuple[int, ...]] | None:
        """(step time, ranks) of the best placement of the choice, or None if no placement fits in memory."""
        st = ch.option.sharding
        if st in (ShardingType.ROW_WISE, ShardingType.DATA_PARALLEL):
            return self._try_dense(item, ch, np.arange(ch.blocks))
        if st is ShardingType.TABLE_ROW_WISE:
            best = None
            for h in range(self.H):
                ranks = np.arange(h * self.lws, h * self.lws + ch.blocks)
                if item.pinned and not set(ranks.tolist()) <= set(item.pinned):
                    continue
                got = self._try_dense(item, ch, ranks)
                if got is not None and (best is None or got[0] < best[0] - 1e-12):
                    best = got
            return best
        if ch.blocks == 1:
            got = self._best_single(item, ch, 0, ())
            return None if got is None else (got[0], (got[1],))
        # Column-wise: blocks one by one onto distinct ranks, each seeing the ones before; then undo.
        saved = (self.loads.copy(), self.hbm_free.copy(), self.ddr_free.copy())
        ranks: list[int] = []
        result = None
        for b in range(ch.blocks):
            got = self._best_single(item, ch, b, tuple(ranks))
            if got is None:
                break
            r = got[1]
            ranks.append(r)
            self.loads += self._block_delta(item, ch, b, r, first=b == 0, ranks_so_far=ranks[:-1])
            self.version += 1
            self.hbm_free[r] -= ch.hbm[b]
            self.ddr_free[r] -= ch.ddr[b]
        else:
            result = (self.objective(), tuple(ranks))
        self.loads, self.hbm_free, self.ddr_free = saved
        self.version += 1
        return result

    def _block_delta(self, item: Item, ch: Choice, b: int, r: int, first: bool, ranks_so_far: list[int]) -> np.ndarray:
        d = self._single_spread(ch, b, r)
        counts = self.group_count.get(self._group(ch), np.zeros(self.W, dtype=int))
        if counts[r] == 0 and r not in ranks_so_far:
            d[:, r] += self.model.group_fixed(*self._group(ch))
        if ch.option.kernel is LookupKernel.SMALL:  # column blocks go to distinct ranks
            top = self.hot_max.get(self._group(ch))
            d[loads.BWD, r] += max(float(ch.hot[b]) - (top[r] if top is not None else 0.0), 0.0)
        if first:
            d += self._scheme_delta(item, ch, +1)[:, None]
        return d

    def _single_spread(self, ch: Choice, b: int, r: int) -> np.ndarray:
        """Loads [NROWS, W] of block b alone on rank r: the numbers loads.spread gives for one block (its host's
        ranks get `(same + other) - other`, as there), without its scatter-adds."""
        o, a, x = ch.owner[b], ch.same[b], ch.other[b]
        on_host = (a + x) - x
        h0 = r // self.lws * self.lws
        d = np.empty((loads.NROWS, self.W))
        d[:] = x[:, None]
        d[:, h0 : h0 + self.lws] = on_host[:, None]
        d[:, r] = on_host + (o - a)
        return d

    def _try_dense(self, item: Item, ch: Choice, ranks: np.ndarray) -> tuple[float, tuple[int, ...]] | None:
        if np.any(self.hbm_free[ranks] < ch.hbm - 0.5) or np.any(self.ddr_free[ranks] < ch.ddr - 0.5):
            return None
        return loads.step_time(self.loads + self.delta(item, ch, ranks)), tuple(int(r) for r in ranks)

    def _best_single(self, item: Item, ch: Choice, b: int, exclude: tuple[int, ...]) -> tuple[float, int] | None:
        """Best rank for block b alone: (step time, rank), vectorised over ranks, exact for this model.

        On rank q (host h) the block adds `owner` to q, `same` to q's host peers and `other` to the ranks of
        other hosts. A row's new maximum is the largest of: q's new value; the top of host h's other ranks plus
        `same`; the top of the other hosts plus `other`. Loads only grow, so where `same` and `other` are zero
        (the rows a block loads on its own rank only) that is the larger of q's new value and the row's current
        maximum; the per-host tops are needed only for the rows the block loads on other ranks (`_host_stats`,
        kept until the loads change). Computed for every rank at once; ranks without room score infinity.
        """
        blocked = self.hbm_free < ch.hbm[b] - 0.5  # ranks without room
        blocked |= self.ddr_free < ch.ddr[b] - 0.5
        if item.pinned:
            outside = np.ones(self.W, dtype=bool)
            outside[list(item.pinned)] = False
            blocked |= outside
        if exclude:
            blocked[list(exclude)] = True
        o, a, x = ch.owner[b], ch.same[b], ch.other[b]
        launches, grow = self._own_extra(ch, b, ch.group)
        own = np.add(self.loads, o[:, None], out=self._buf_own)
        if launches is not None:  # its other rows are zero
            for k in self._launch_rows[ch.group]:
                own[k] += launches[k]
        if isinstance(grow, np.ndarray) and grow.any():
            own[loads.BWD] += grow
        rows = self._peer_rows(ch, b)
        scheme, phase_add = self._scheme_join(item, ch) if b == 0 else (None, None)
        row_max = self._row_max()
        own_all = None
        if scheme is None and self.W > 1:  # the rank first by the lower bound, when its step meets the bound
            got = rank_pick.bound_pick(own, self._busiest(), phase_add, blocked, self.hbm_free)
            if got is None:
                return None
            q, least, own_all = got
            stats = None if rows is None else rank_pick.others(self.loads, rows, q, self.lws, row_max)
            step = rank_pick.column_step(rank_pick.column(own[:, q], row_max, rows, a, x, stats), phase_add)
            ns = step * 1e9
            if abs(ns - least) <= 0.5 and round(ns) == least:  # np.rint's number (both round half to even)
                return step, q
        elif blocked.all():
            return None
        new = np.maximum(own, row_max[:, None], out=self._buf_new)
        if rows is not None:
            self._add_peers(new, own, rows, a, x)
        if scheme is not None:
            new += scheme[:, None]
        J = loads.phase_max_sum(new, phase_add)
        J[blocked] = np.inf
        rounded = np.rint(J * 1e9)  # np.round's numbers (decimals 0), without its wrappers
        ties = (rounded == np.minimum.reduce(rounded)).nonzero()[0]
        if len(ties) > 1:
            # Ties (to 1 ns) go to the rank left least busy, then with most free GPU memory, then the lowest rank.
            own_t = own_all[ties] if own_all is not None else loads.phase_max_sum(own[:, ties])
            ties = ties[own_t == np.minimum.reduce(own_t)]
            if len(ties) > 1:
                free = self.hbm_free[ties]
                ties = ties[free == np.maximum.reduce(free)]
        k = int(ties[0])
        return float(J[k]), k

    def _peer_rows(self, ch: Choice, b: int) -> np.ndarray | None:
        """The rows block b of the choice loads on ranks other than its own (None: none), kept on the choice."""
        key = (b, self.H > 1)
        if key not in ch.peers:
            a, x = ch.same[b], ch.other[b]
            peers = (a != 0) | (x != 0) if self.H > 1 else a != 0
            ch.peers[key] = np.flatnonzero(peers) if peers.any() else None
        return ch.peers[key]

    def _scheme_join(self, item: Item, ch: Choice) -> tuple[np.ndarray | None, np.ndarray | None]:
        """What the item's first block adds to the scheme's fixed costs on every rank, as (per row, or None where
        it is one value per phase or nothing, per phase or None), kept per `_scheme_sig`."""
        key = ("join", ch.option.sharding, item.weighted, self._scheme_sig)
        got = self._schemes.get(key)
        if got is None:
            scheme, phase_add = self._scheme_delta(item, ch, +1), None
            if scheme.any():
                phase_add = loads.per_phase(scheme)
            got = self._schemes[key] = (scheme if phase_add is None and scheme.any() else None, phase_add)
        return got

    def _own_extra(self, ch: Choice, b: int, group: tuple) -> tuple[np.ndarray | None, np.ndarray | float]:
        """What block b of the choice adds on its rank beyond its own loads: ([NROWS, W] the group's launches on
        the ranks where the group has no block yet, or None; [W] the growth of the group's longest hot-row chain
        (small-table kernel), or 0)."""
        if group not in self._launches:
            counts = self.group_count.get(group)
            absent = None if counts is None else counts == 0
            launches = None
            if absent is None or absent.any():
                fixed = self.model.group_fixed(*group)
                launches = np.outer(fixed, np.ones(self.W) if absent is None else absent)
                self._absent[group] = self.W if absent is None else int(np.count_nonzero(absent))
                self._launch_rows[group] = np.flatnonzero(fixed).tolist()
            self._launches[group] = launches
        launches = self._launches[group]
        grow: np.ndarray | float = 0.0
        if ch.option.kernel is LookupKernel.SMALL:
            top = self.hot_max.get(group)
            grow = np.maximum(float(ch.hot[b]) - (top if top is not None else 0.0), 0.0)
        return launches, grow

    def _fresh(self) -> dict:
        """The cache of statistics of the current loads (emptied when they change)."""
        key = (id(self.loads), self.version)
        if self._stats_key != key:
            self._stats_key, self._stats = key, {}
        return self._stats

    def _row_max(self) -> np.ndarray:
        """[NROWS]: each row's largest load over the ranks (cached until the loads change)."""
        cache = self._fresh()
        if "max" not in cache:
            key = (id(self.loads), self.version)
            if self.H > 1 and self._hosts.valid(key):  # the hosts' tops: the same numbers, fewer to read
                cache["max"] = np.maximum.reduce(self._hosts.get(self.loads, key)[0], axis=1)
            else:
                cache["max"] = np.maximum.reduce(self.loads, axis=1)
        return cache["max"]

    def _add_peers(self, new: np.ndarray, own: np.ndarray, rows: np.ndarray, a: np.ndarray, x: np.ndarray) -> None:
        """Raise `new` [NROWS, W] in `rows` by what the block loads on the other ranks (rank_pick.add_peers)."""
        rank_pick.add_peers(new, own, rows, a, x, self._host_stats(rows), self._row_max(), self.H, self.lws)

    def _host_stats(self, rows: np.ndarray) -> tuple:
        """For the rows `rows`, per host ([m, H] each): its busiest rank's load, the largest load of its other
        ranks (-inf alone on its host), the largest load on the other hosts (None on one host), and a busiest
        rank (its index in the rank order; host_stats.py). Cached until the loads change."""
        cache = self._fresh()
        key = tuple(rows.tolist())
        got = cache.get(key)
        if got is not None:
            return got
        H = self.H
        if H > 1:  # every row's, for this state of the loads
            top, second, arg = self._hosts.get(self.loads, (id(self.loads), self.version))
            host_top, second, arg = top[rows], second[rows], arg[rows]
        else:  # one host: the rows asked for alone
            host_top, second, arg = self._hosts.of(self.loads[rows])
        other_top = None
        if H > 1:
            part = np.partition(host_top, H - 2, axis=1)
            first, second_h = part[:, -1:], part[:, -2:-1]
            other_top = np.where(host_top == first, second_h, first)  # a tie between hosts: second equals first
        top_pos = arg + self._host_first
        cache[key] = (host_top, second, other_top, top_pos)
        return cache[key]
