"""Access statistics of a shard's ids: distinct rows touched and cache hit rates under uniform or Zipf ids, and the
bytes a random row read moves (whole memory sectors). Pure numpy, vectorised over candidate shards."""

from __future__ import annotations

import numpy as np


def _zipf_mass(n, a):
    """H(n, a) = integral of x^-a over [0.5, n + 0.5] (unnormalised mass of the n most popular rows)."""
    near1 = np.abs(a - 1.0) < 1e-6
    safe = np.where(near1, 0.5, 1.0 - a)
    power = ((n + 0.5) ** safe - 0.5**safe) / safe
    return np.where(near1, np.log(2 * n + 1.0), power)


def zipf_hit_rate(cache_rows, rows, alpha):
    """Share of accesses that hit a cache of the `cache_rows` most popular of `rows` rows, ids ~ Zipf(alpha)."""
    cache_rows = np.minimum(cache_rows, rows)
    a = np.asarray(alpha, dtype=float)
    return np.clip(_zipf_mass(cache_rows, a) / _zipf_mass(rows, a), 0.0, 1.0)


_QUAD = np.linspace(0.0, 1.0, 97)


def distinct_rows(n, rows, alpha):
    """Expected distinct rows among n ids drawn from `rows` rows ~ Zipf(alpha): rows * (1 - exp(-n / rows)) for
    uniform ids (alpha 0), else the integral of 1 - exp(-n p(x)) over the rows with p(x) = x^-alpha / H(rows)
    (trapezoid rule on a log scale, 97 points: within a few % of the exact sum)."""
    uniform = rows * -np.expm1(-n / np.maximum(rows, 1.0))
    if not np.any(np.asarray(alpha) > 0):
        return uniform
    shape = np.broadcast(n, rows, alpha).shape
    n, rows, a = (np.ravel(np.broadcast_to(np.asarray(x, dtype=float), shape)) for x in (n, rows, alpha))
    uniform = np.ravel(np.broadcast_to(uniform, shape)).copy()
    skewed = a > 0
    ns, rs, al = n[skewed], rows[skewed], a[skewed]
    span = np.log(2 * rs + 1.0)[:, None]
    x = 0.5 * np.exp(_QUAD[None, :] * span)
    f = -np.expm1(-ns[:, None] * x ** -al[:, None] / _zipf_mass(rs, al)[:, None]) * x * span
    uniform[skewed] = np.minimum(np.trapezoid(f, _QUAD, axis=1), uniform[skewed])
    return uniform.reshape(shape)


def gather(row_bytes, sector: int):
    """Bytes moved to fetch one row at a random address: whole sectors; a row that is not a multiple of the sector
    straddles half a sector more on average (rows that are are aligned to it)."""
    whole = np.ceil(row_bytes / sector) * sector
    return whole + np.where(whole > row_bytes, sector / 2, 0.0)
