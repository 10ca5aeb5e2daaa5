"""The sharded embedding-bag collection (`ShardedEmbeddingBagCollection`) and what only it uses.

- `sharded`: the collection: input dist, lookups, output dist, mean pooling, regroup, stage by stage.
- `shard_state`: its weights and optimizer state as shards (checkpoints, full weights).
- `bounds`: out-of-range ids (error or drop), checked on the host counts.
- `regroup`, `regroup_kernel`: pooled blocks into the model's feature groups (FBGEMM's permute, or the Triton one).
- `padding`, `emb_graph`: fixed-capacity batches and the collection's CUDA graph.
- `sequence`: `ShardedEmbeddingCollection`, the sequence tables' collection (one row per id, JaggedTensors out).
"""
