"""torch and NCCL/gloo helpers that know nothing about embeddings.

- `comm`: collectives with explicit handles (`.wait()`), the autograd all-to-all, the CPU (gloo) group.
- `distributed`: process-group set-up for torchrun and local processes.
- `ops`: small device ops (cached index tensors, segment sums, FBGEMM's permutes).
- `graphs`: CUDA-graph capture (warm up on a side stream, then capture), shared by every graphed part.
- `guard`: checks that ranks agree before a collective.
- `notices`: known library notices silenced once, at import.
- `heap`: imports with Python's cyclic collector paused, then frozen out of its collections (torch-free).
- `preload`: what `spawn_local`'s fork server imports before its first fork (through `heap`).
"""
