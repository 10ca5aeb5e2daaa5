"""Models built on a ShardedEmbeddingBagCollection: RecModel (build.py) and one file per model kind (dlrm.py,
dcn.py, two_tower.py), each registering its dense part and loss (registry.py)."""
