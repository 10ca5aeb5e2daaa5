"""Where each feature's rows live and where its pooled sums go: the layout the small-table kernels read.

Tables are grouped by width. The tables of one width form one `[rows, D]` block (`WidthGroup`): table after table,
so a feature's id `i` is row `row0 + i` of its group's block. The pooled output `[B, sum of feature widths]` has
the features side by side in lookup order, feature `f` at columns `cols[f] : cols[f] + D`. Ids arrive
feature-major: offsets of length F*B+1, feature `f`'s bags are offsets[f*B : (f+1)*B + 1].

The same layout describes FBGEMM's dense TBE (data-parallel tables ordered by width: one flat weight tensor whose
width blocks are these groups), so the data-parallel scheme can hand its flat weights to the kernels as views.
Device copies of the per-feature tables are made once per device (`on`, `feature_tables`); with `all_weighted` they
mark every feature weighted (a padded batch's lookups pool every id with its weight: `every_id_weighted`), made
once per device as well, so the kernels see the same flags either way, only their values differ.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of the small-table kernels (None: the heuristics of `_pool_triton.tiles_for` (forward) and
    `_grad_triton.backward_tiles` (atomic backward))."""

    bags: int | None = None
    """Bags pooled by one program."""
    block_n: int | None = None
    """Ids of a bag gathered per step."""
    num_warps: int = 4
    """Warps per program of the pooling kernels."""
    block_r: int | None = None
    """Rows per program of the update kernel (default: 512 elements' worth, 32 rows of 16)."""
    sorted_block_n: int = 64
    """Sorted ids per tile of the deterministic backward (rows up to 32 wide; fewer for wider rows)."""
    dedup: bool = True
    """Atomic backward: sum the repeats of a row within a bag's chunk of `block_n` ids before adding (a sort in
    registers): a hot row costs one atomic add per bag chunk instead of one per id. False: one add per id."""
    interleave: int | None = None
    """Atomic backward: features of a width group whose programs run side by side, so the chains of adds into
    their hottest rows overlap (None: as many as their tables fit in 16 MB of L2; 1: one feature after another)."""


class FeatureTables(NamedTuple):
    """Per lookup feature, on one device (`PoolLayout.feature_tables`)."""

    key0: torch.Tensor
    """First row of the feature's table counted over all groups in order (int64)."""
    cols: torch.Tensor
    """First output column (int64)."""
    weighted: torch.Tensor
    """Whether the feature's ids are weighted (int32)."""


@dataclass(frozen=True)
class WidthGroup:
    """The tables of one width: one `[rows, dim]` block, and the features that pool from it."""

    dim: int
    """Row width of every table of the group (elements)."""
    rows: int
    """Rows of the block: the sum of its tables' rows."""
    features: tuple[int, ...]
    """Lookup feature indices that read the group, in lookup order."""
    row0: tuple[int, ...]
    """Per feature (same order): first row of its table in the block."""
    cols: tuple[int, ...]
    """Per feature: first column of its pooled sums in the output."""
    weighted: tuple[bool, ...]
    """Per feature: multiply each row by the id's per-sample weight."""
    table_rows: tuple[int, ...] = ()
    """Per feature: rows of its table (for error messages and the bounds of the reference path)."""


@dataclass
class DeviceGroup:
    """A WidthGroup's per-feature tables on one device (int64 / int32 tensors)."""

    group: WidthGroup
    features: torch.Tensor
    row0: torch.Tensor
    cols: torch.Tensor
    weighted: torch.Tensor
    any_weighted: bool


@dataclass
class PoolLayout:
    """Width groups of one lookup, its feature count and output width."""

    groups: list[WidthGroup]
    num_features: int
    out_cols: int
    _device: dict[str, list] = field(default_factory=dict, repr=False)

    def on(self, device: torch.device, all_weighted: bool = False) -> list[DeviceGroup]:
        """Device copies of the groups' tables, made once per device. `all_weighted`: every feature marked
        weighted (`DeviceGroup.weighted` all ones, `any_weighted` True), whatever its table says."""
        key = str(device)
        if key not in self._device:
            self._device[key] = [
                DeviceGroup(
                    g,
                    torch.tensor(g.features, dtype=torch.int32, device=device),
                    torch.tensor(g.row0, dtype=torch.int64, device=device),
                    torch.tensor(g.cols, dtype=torch.int64, device=device),
                    torch.tensor([int(w) for w in g.weighted], dtype=torch.int32, device=device),
                    any(g.weighted),
                )
                for g in self.groups
            ]
        if not all_weighted:
            return self._device[key]
        key_all = f"all_weighted:{device}"
        if key_all not in self._device:
            self._device[key_all] = [
                DeviceGroup(dg.group, dg.features, dg.row0, dg.cols, torch.ones_like(dg.weighted), True)
                for dg in self._device[key]
            ]
        return self._device[key_all]

    def feature_tables(self, device: torch.device, all_weighted: bool = False) -> FeatureTables:
        """Per lookup feature, on `device` (made once): first row of its table counted over all groups in order,
        first output column, weighted (all ones with `all_weighted`)."""
        key = f"features:{device}"
        if key not in self._device:
            key0, cols, weighted = [0] * self.num_features, [0] * self.num_features, [0] * self.num_features
            base = 0
            for g in self.groups:
                for f, r0, c, w in zip(g.features, g.row0, g.cols, g.weighted):
                    key0[f], cols[f], weighted[f] = base + r0, c, int(w)
                base += g.rows
            self._device[key] = [
                torch.tensor(key0, dtype=torch.int64, device=device),
                torch.tensor(cols, dtype=torch.int64, device=device),
                torch.tensor(weighted, dtype=torch.int32, device=device),
            ]
        key0_F, cols_F, weighted_F = self._device[key]
        if not all_weighted:
            return FeatureTables(key0_F, cols_F, weighted_F)
        key_all = f"features_all_weighted:{device}"
        if key_all not in self._device:
            self._device[key_all] = [torch.ones_like(weighted_F)]
        return FeatureTables(key0_F, cols_F, self._device[key_all][0])


def build_layout(
    table_rows: Sequence[int],
    table_dims: Sequence[int],
    table_features: Sequence[Sequence[int]],
    table_weighted: Sequence[bool],
    feature_dims: Sequence[int],
    group_keys: Sequence[Hashable] | None = None,
) -> tuple[PoolLayout, list[tuple[int, int]]]:
    """Layout of tables (rows, width, the lookup features that read them, weighted) grouped by width in
    first-seen order, tables in their order within a group. Features are numbered in lookup order; their output
    columns follow that order (`feature_dims[f]` wide). `group_keys` (per table, default its width) splits groups
    further: tables with equal keys (and so equal widths) share a block. Returns the layout and, per table,
    (group index, first row in the group's block)."""
    if len(feature_dims) != sum(len(f) for f in table_features):
        raise ValueError(
            f"build_layout: {len(feature_dims)} feature widths for {sum(len(f) for f in table_features)} features"
        )
    col0 = [0]
    for d in feature_dims:
        col0.append(col0[-1] + d)
    keys = list(group_keys) if group_keys is not None else list(table_dims)
    order: dict[Hashable, list[int]] = {}
    for t, key in enumerate(keys):
        order.setdefault(key, []).append(t)
    groups: list[WidthGroup] = []
    place: list[tuple[int, int]] = [(0, 0)] * len(table_dims)
    for gi, tables in enumerate(order.values()):
        dim = table_dims[tables[0]]
        if any(table_dims[t] != dim for t in tables):
            raise ValueError(f"build_layout: tables {tables} share a group key but not a width")
        per_feature: list[tuple[int, int, int, bool, int]] = []
        row = 0
        for t in tables:
            place[t] = (gi, row)
            for f in table_features[t]:
                if feature_dims[f] != dim:
                    raise ValueError(f"feature {f} is {feature_dims[f]} wide but its table is {dim} wide")
                per_feature.append((f, row, col0[f], bool(table_weighted[t]), table_rows[t]))
            row += table_rows[t]
        per_feature.sort()
        groups.append(
            WidthGroup(
                dim=dim,
                rows=row,
                features=tuple(p[0] for p in per_feature),
                row0=tuple(p[1] for p in per_feature),
                cols=tuple(p[2] for p in per_feature),
                weighted=tuple(p[3] for p in per_feature),
                table_rows=tuple(p[4] for p in per_feature),
            )
        )
    return PoolLayout(groups, len(feature_dims), col0[-1]), place
