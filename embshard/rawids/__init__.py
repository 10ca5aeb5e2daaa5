"""Raw 64-bit ids: tables whose ids are not row numbers (`TableConfig(ids="raw")`), mapped to rows on the device.

Design
======

A raw-id table of `num_embeddings` rows (its capacity) takes any int64 ids. Every shard of it keeps an id -> row
map of the ids it owns; a new id is admitted into a free row, else into the row of an id the eviction policy
gives up (that row's weights are re-initialised and its optimizer state zeroed). Nothing is built before
training and the set of ids may grow without end: the table keeps the ids the policy ranks highest.

Ownership and routing (one rule everywhere: training, checkpoint resharding, export)
    virtual row v(id) = splitmix64(id * golden + ROUTE_SALT) mod num_embeddings          (`hashing.route_rows`)
    the id belongs to the row block holding row v(id), i.e. block v // bs under the plan's row blocks of size bs.
Table-wise: one block, the owning rank holds the whole map. Row-wise: the sender computes v(id) and lets FBGEMM's
`block_bucketize_sparse_features` route it like a static id (sharding/raw_row_wise.py); the raw id itself rides
along (put back in bucket order through the op's `unbucketize_permute`). Blocks own ids in proportion to their
rows, and N -> M resharding re-routes each (id, row) pair by the same rule with the new blocks.

Where the remapping runs
    On the owning rank, in the scheme's `lookup` (sharding/routed.py), right before the lookup kernel: the ids of
    each lookup group (raw-id shards are grouped apart: `LocalShard.group_key`) go through that group's `IdMap`,
    which returns local rows and resets the rows it (re)assigned. Running there (not at the input exchange) means
    every earlier batch's backward has updated its rows before a row changes hands under the sparse-dist
    pipeline; under semi-sync (this batch's lookup before the previous batch's backward) rows used in the
    previous step are never evicted (below), so a late gradient never lands on a row given to a new id.

The map of one lookup group (`IdMap`, idmap.py), T shards, all tensors on the compute device
    rows        the shards' rows concatenated (R = sum of rows); per row: `row_key` (its id), `row_last` (the
                map's clock when last used; -1: holds no id), `row_freq` (times used). The LAST row of every shard
                is its zero row: never given to an id, reset to zeros before every lookup; ids that have no row
                (not admitted yet, no row could be freed this step, unknown ids at evaluation) look it up, so they
                add zeros to their bag and train nothing. A shard of C rows holds up to C - 1 ids.
    index       an open-addressing hash table in two tensors, `slot_key` / `slot_row` (-1: empty), of buckets of
                P = 16 slots, 2 slots per row, per shard its own range of buckets. Each id has two candidate
                buckets (two hashes); a lookup reads both buckets (2P slots, a fixed probe count) and matches the
                key; an insert takes a free slot of the emptier bucket. Removing a key empties its slot (lookups
                read every slot of both buckets, so no tombstones are needed).
    LRU order   `order`: per shard a permutation of its usable rows, least recently used first (unused rows
                lead). Victims are the first evictable rows of a shard's segment; after the step the rows used in
                it move to the segment's end (a stable partition by cumsum + scatter: O(rows), no sort).
    LFU         victims are the evictable rows sorted by (uses, last use, row) (a sort over the group's rows).
    evictable   a row not used in this step or the previous one (`row_last < clock - 1`).
    admission   with admit_min_count > 1, a count-min sketch (2 x rows counters per shard, halved when the
                shard has added 10 x its width) estimates how often a new id was seen; it is admitted once the
                estimate reaches the count.

One training step of a group (`IdMap.remap`), fixed-size outputs throughout (n = the group's ids this step):
    1. sort the ids (stable): equal (shard, id) pairs become runs; run starts give the unique ids (n slots,
       the first `n_unique` valid: a device scalar, never read on the host) and their counts;
    2. look up the unique ids in the index (2P slots each); hits update `row_last` / `row_freq`;
    3. new ids (misses) pass admission; each shard's admitted ids, ranked in batch order, take the shard's
       victims in order (`victims[rank]`); ids past the shard's evictable rows get no row this step;
    4. evicted ids leave the index; admitted ids are inserted (two rounds: emptier bucket, then the other; an id
       that finds no free slot gets no row and its row is left unused); rows get their new id, clock, count;
    5. the LRU order is updated; per id the row: its hit, its new row, or the shard's zero row;
    6. reset list per shard: the rows given to new ids (re-initialised: `lookup.shards.init_rows_at`, the same
       values `init_rows` drew for the row, so a table whose ids never exceed its rows trains exactly like a
       static table fed the same rows) and the zero row; padded with the zero row to the shard's ids.
All of it is torch ops that run on the CPU and CUDA without a host sync: sort, cumsum, cummax, gather, scatter,
scatter_add/index_add, scatter_reduce(amin), where, remainder and integer hashing; no `.item()`, `.tolist()`,
`nonzero`, `unique` or boolean-mask indexing. The only host values are sizes the host already knows (the ids
per feature from the step's counts) and the map's clock (a Python int). Evaluation (no grad) only looks up.

Cost per step and group: ~2 sorts of n ids, 2 x 2P slot reads per unique id, O(rows) elementwise passes for
LRU (LFU: a sort of the rows), and writing one row per id of the reset list (re-initialised values or zeros).
Memory per row: `map_bytes_per_row` (about 72 bytes, 96 with admission counting); the planner counts it.

Checkpoints (checkpoint/raw_ids.py): per table the logical tensors `ids`, `id_last`, `id_count` `[rows]` ride
with `weight` and the optimizer state; a load under the same row blocks reads them straight into place and
rebuilds the index; under other blocks (N -> M ranks, table-wise <-> row-wise) every rank scans the saved pairs in
chunks, keeps those its blocks own by the routing rule, and writes them (weights and state along) into fresh rows.
"""

from __future__ import annotations

from embshard.rawids.hashing import route_rows
from embshard.rawids.idmap import IdMap, map_bytes_per_row

__all__ = ["IdMap", "map_bytes_per_row", "route_rows"]
