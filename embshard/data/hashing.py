"""Stable 64-bit hashing of categorical values, vectorized over Arrow arrays (numpy; no Python loop per value).

embshard-hash-v1 of a value's bytes s (UTF-8 text; integers are hashed as their decimal text, so `235` and "235"
give the same id whether a file stores the column as text or as integers):

    L = len(s); s zero-padded to k = ceil(L / 8) little-endian uint64 words w_0 .. w_{k-1}
    h(s) = fmix64(L * K1 + sum_j fmix64(w_j + (j + 1) * K2))          (all arithmetic mod 2^64)

fmix64 is MurmurHash3's 64-bit finalizer (a bijection with full avalanche); K1 = 0x9E3779B97F4A7C15,
K2 = 0xC2B2AE3D27D4EB4F. The result depends only on the bytes: the same on every machine, run and Python version
(Python's salted hash() would remap every row at each start). A value's table row is then
    row = 1 + h mod (num_embeddings - 1)       (row 0 is the missing value)
`embshard preprocess` and the loader's on-the-fly mapping call the same functions, so they give the same rows.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

K1 = np.uint64(0x9E3779B97F4A7C15)
K2 = np.uint64(0xC2B2AE3D27D4EB4F)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def fmix64(k: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, element-wise on a uint64 array (returns a new array)."""
    k = k ^ (k >> _S33)
    k *= _M1
    k ^= k >> _S33
    k *= _M2
    k ^= k >> _S33
    return k


def as_text(arr: pa.Array) -> pa.Array:
    """The values as Arrow binary-like text: strings and binaries as they are, integers as decimal text."""
    t = arr.type
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        return arr
    if pa.types.is_integer(t):
        return pc.cast(arr, pa.string())
    if pa.types.is_dictionary(t):
        return as_text(arr.dictionary_decode())
    raise TypeError(f"cannot hash values of Arrow type {t}: categorical columns hold strings or integers")


def hash_values(arr: pa.Array) -> np.ndarray:
    """embshard-hash-v1 of every value (uint64 [len(arr)]); a null value hashes as the empty string."""
    arr = as_text(arr)
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset : arr.offset + n + 1]
    starts = offsets[:-1].astype(np.int64)
    lengths = (offsets[1:] - offsets[:-1]).astype(np.int64)
    if arr.null_count:
        lengths[~np.asarray(arr.is_valid())] = 0
    # every 8-byte window of the data, as an unaligned little-endian uint64 view (the data padded with 8 zeros)
    first, last = int(offsets[0]), int(offsets[-1])
    raw = np.frombuffer(bufs[2], dtype=np.uint8)[first:last] if bufs[2] is not None else np.zeros(0, dtype=np.uint8)
    starts -= first
    data = np.zeros(len(raw) + 8, dtype=np.uint8)
    data[: len(raw)] = raw
    windows = np.ndarray(shape=(len(raw) + 1,), dtype="<u8", buffer=data, strides=(1,))
    nwords = (lengths + 7) >> 3
    total = np.zeros(n, dtype=np.uint64)
    idx = None  # j >= 1: the values with more than j words
    for j in range(int(nwords.max())):
        if j == 0:
            sub_starts, sub_lengths = starts, lengths
        else:
            idx = np.flatnonzero(nwords > j) if idx is None else idx[nwords[idx] > j]
            sub_starts, sub_lengths = starts[idx] + 8 * j, lengths[idx] - 8 * j
        word = windows[sub_starts]
        if (sub_lengths < 8).any():
            word &= _MASKS[np.minimum(sub_lengths, 8)]
        mixed = fmix64(word + np.uint64(((j + 1) * int(K2)) & _ALL))
        if j == 0:
            mixed[sub_lengths == 0] = 0  # the empty string has no words
            total += mixed
        else:
            total[idx] += mixed
    return fmix64(lengths.astype(np.uint64) * K1 + total)


_ALL = (1 << 64) - 1
_MASKS = np.array([(1 << (8 * b)) - 1 for b in range(9)], dtype=np.uint64)


def hash_rows(hashes: np.ndarray, num_embeddings: int) -> np.ndarray:
    """Table rows of hashed values: 1 + h mod (num_embeddings - 1), int64 (row 0 stays the missing value)."""
    return (hashes % np.uint64(num_embeddings - 1)).astype(np.int64) + 1


def hash_strings(values: list[str]) -> np.ndarray:
    """embshard-hash-v1 of Python strings (for tests and small inputs)."""
    return hash_values(pa.array(values, type=pa.string()))
