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
    On CUDA a training step of a group replays a CUDA graph of the whole map step (remap, LRU order, reset: graph.py)
    where it applies: the map's step and reset on their Triton kernels, LRU eviction only, no admission counting
    (admit_min_count 1 for every table of the group), weights in the table's own type. Other groups, evaluation,
    steps of no ids and EMBSHARD_RAWID_GRAPH=0 run the eager step.

The map of one lookup group (`IdMap`, idmap.py; state.py, index.py, eviction.py, reset.py), T shards, on the device
    rows        the shards' rows concatenated (R = sum of rows); per row: `row_key` (its id), `row_last` (the
                map's clock when last used; -1: holds no id), `row_freq` (times used), `row_slot` (its index slot).
                The LAST row of every shard is its zero row: never given to an id, reset to zeros before every
                lookup; ids that have no row (not admitted yet, no row could be freed this step, unknown ids at
                evaluation) look it up, so they add zeros to their bag and train nothing. A shard of C rows holds
                up to C - 1 ids.
    index       an open-addressing hash table in two tensors, `slot_key` / `slot_row` (-1: empty), of buckets of
                P = 16 slots, 2 slots per row, per shard its own range of buckets. Each id has two candidate
                buckets (two hashes); a lookup reads both buckets (2P slots, a fixed probe count: two rows of the
                `[buckets, P]` view) and matches the key; an insert takes a free slot of the emptier bucket.
                Removing a key empties its slot (found through `row_slot`; lookups read every slot of both
                buckets, so no tombstones are needed). Slot -> row and row -> slot are int32 while they fit.
    LRU order   `order`: per shard a permutation of its usable rows, least recently used first (unused rows
                lead); the rows used in a step move to the segment's end after it (a stable partition: one
                cumsum and one scatter over the rows, O(rows)). So the rows used in the previous step are the
                segment's tail, and victims (the first evictable rows of the segment) lie in its first
                min(ids of the shard this step, usable rows) positions, the window: an evictable row past the
                window means the tail starts past it, so every non-evictable row of the window is a hit of this
                step, and hits + new ids <= ids. Only the window is read (O(ids), not O(rows)).
    LFU         victims are the evictable rows sorted by (uses, last use, row) (a sort over the group's rows).
    evictable   a row not used in this step or the previous one (`row_last < clock - 1`).
    admission   with admit_min_count > 1, a count-min sketch (2 x rows counters per shard, halved when the
                shard has added 10 x its width) estimates how often a new id was seen; it is admitted once the
                estimate reaches the count.

One training step of a group (`IdMap.remap`), fixed-size outputs throughout (n = the group's ids this step):
    1. sort the ids (stable): equal (shard, id) pairs become runs; run starts (a scatter of each run's first
       position) give the unique ids (n slots, the first `n_unique` valid: a device scalar, never read on the
       host) and their counts (differences of the starts);
    2. look up the unique ids in the index (2P slots each); hits update `row_last` / `row_freq`;
    3. new ids (misses) pass admission; each shard's admitted ids, ranked in batch order, take the shard's
       victims in order (`victims[rank]`); ids past the shard's evictable rows get no row this step;
    4. evicted ids leave the index (their slot from `row_slot`); admitted ids are inserted (two rounds: emptier
       bucket, then the other; an id that finds no free slot gets no row and its row is left unused); rows get
       their new id, clock, count and slot;
    5. the LRU order is updated; per id the row: its hit, its new row, or the shard's zero row;
    6. the reset list: per position of the batch the local row given to a new id there (re-initialised:
       `lookup.shards.init_rows_at`'s values for the row, so a table whose ids never exceed its rows trains
       exactly like a static table fed the same rows), else -1; `IdMap.reset` writes it per storage (one Triton
       launch per storage on CUDA, whose programs skip entries without a row) and zeroes the zero rows.
All of it is torch ops that run on the CPU and CUDA without a host sync: sort, cumsum, gather, index_select,
scatter, index_fill, where, searchsorted, remainder and integer hashing; no `.item()`, `.tolist()`, `nonzero`,
`unique` or boolean-mask indexing (`IdMap._train`, ~220 ops). On CUDA the step runs on fused Triton kernels instead
(rawids/step.py, embshard/kernels/_step_triton.py; ~25 launches), with the torch ops' results and no sort of the
ids: one kernel probes every id in the index and updates the hits (their rows, last use, mark, one use per copy);
the misses find their unique pairs and first positions through a claim table of 2n entries; the number of misses and
of admitted ids stay on the device, and every kernel of the miss path (the claims, the LRU window's victims,
eviction, the inserts, the rows' new state, the statistics) reads its count and returns at once when it is 0, so a
step whose ids are all resident does no work for misses. Inserts rank the ids of a bucket without a sort (each
pushes itself on its bucket's list, then counts the ids of smaller key: the sort's rank). The step lists the
positions given a row compactly (count on the device), and the reset kernels walk that list. The LRU order's
partition runs on two Triton passes (embshard/kernels/_idmap_triton.py) reading the step's marks of its used rows (a
byte per row). The only host values are sizes the host already knows (the ids per shard from the step's counts,
hence the windows) and the map's clock (a Python int `clock`, mirrored on the device in `clock_t`: the kernels read
it through a pointer and the Triton step advances it in its stream, so no clock is baked into a launch). Two GPU
rules: masked-off entries write to a trash slot only with plain stores, never atomic adds (atomics on one address
serialise: per-shard sums go through a cumsum over batch positions, the hits' use counts through a scatter, one id
per row; the Triton step adds a program's per-shard sums once, and its atomics on per-row or per-claim addresses
meet only copies of one id); and no cummax or cummin (CUDA scans a 1-d tensor with them in a single thread block).
Evaluation (no grad) only looks up.

The graphed step (graph.py): ~50 launches a step cost far more host time than their GPU work, so a qualifying
training step replays a graph captured for a capacity of N >= n ids (10% over the step's, a multiple of 64; captured
again for a step over it). The ids are padded to N (key INT64_MAX, shard T: the kernels leave out every position
from n on) and every count the kernels follow is read on the device: n = bounds[T], the misses (a count the probe
adds to), the admitted ids from their cumsum, the LRU window's end wb[T] under the fixed bound min(N, usable rows);
pads are never looked up, admitted, counted or reset (their rows are 0). The LRU partition writes a new order, so
the map keeps two order buffers and one graph per direction. The host copies the ids and one pinned tensor of host
values (bounds, window bounds, stream keys) in, replays, and copies the rows out.

Cost per step and group (Triton): one read of a 16-slot bucket per id (the second bucket for misses), writing every
id's row, and one O(rows) pass pair for the LRU order (LFU: a sort of the rows, torch ops); per new id its victim,
two bucket reads, its row and state. Memory per row: `map_bytes_per_row` (about 78 bytes under LRU with its two
order buffers, 61 under LFU, 102 with admission counting); the planner counts it.

Checkpoints (checkpoint/raw_ids.py): per table the logical tensors `ids`, `id_last`, `id_count` `[rows]` ride
with `weight` and the optimizer state, with the map's index slots, LRU order, clock and admission sketch
(`IdMap.exact_state`); a load under the same row blocks reads them straight into place and restores the index,
order, clock and sketch as saved (an exact resume); under other blocks (N -> M ranks, table-wise <-> row-wise) every rank scans the saved pairs in
chunks, keeps those its blocks own by the routing rule, and writes them (weights and state along) into fresh rows.
"""

from __future__ import annotations

from embshard.rawids.hashing import route_rows
from embshard.rawids.idmap import IdMap, map_bytes_per_row

__all__ = ["IdMap", "map_bytes_per_row", "route_rows"]
