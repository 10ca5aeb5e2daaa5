"""Models built on a ShardedEmbeddingBagCollection."""
