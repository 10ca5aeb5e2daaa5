"""Bad rows and number parsing of one table read from a piece: `BadRows` (a mask and the first bad row's
description), `numbers` (a numeric or text column as float64 or int64, unparsable text marking bad rows) and the
column helpers the reader shares."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embshard.spec.tables import ConfigError

FLOAT_RE = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$|^[+-]?(nan|inf|infinity)$"
INT_RE = r"^[+-]?\d+$"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class BadRows:
    """Bad rows of one table read from a piece: a mask, and the first one's description."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._mask: np.ndarray | None = None  # made at the first bad row (most pieces have none)
        self.first: tuple[int, str] | None = None  # (row index, "column ...: rule")

    @property
    def mask(self) -> np.ndarray:
        if self._mask is None:
            self._mask = np.zeros(self.n, dtype=bool)
        return self._mask

    @property
    def count(self) -> int:
        return 0 if self._mask is None else int(self._mask.sum())

    def add(self, mask: np.ndarray, column: str, values: pa.Array | np.ndarray | None, rule: str) -> None:
        if not mask.any():
            return
        i = int(np.argmax(mask))
        self.mask[:] |= mask
        if self.first is None or i < self.first[0]:
            shown = "" if values is None else f"={_show(values[i])}"
            self.first = (i, f"column {column!r}{shown}: {rule}")


def _show(v: object) -> str:
    if isinstance(v, pa.Scalar):
        v = v.as_py()
    if isinstance(v, np.generic):
        v = v.item()
    return repr(v)


def text_to_numbers(arr: pa.Array, integer: bool) -> tuple[pa.Array, np.ndarray]:
    """Parse text values as numbers: (float64 or int64 array with nulls where missing or bad, bad mask)."""
    ok = pc.match_substring_regex(arr, INT_RE if integer else FLOAT_RE, ignore_case=True)
    bad = np.asarray(pc.fill_null(pc.invert(ok), False))
    kept = pc.if_else(pc.fill_null(ok, False), arr, pa.nulls(len(arr), arr.type))
    try:
        return pc.cast(kept, pa.int64() if integer else pa.float64()), bad
    except pa.ArrowInvalid:  # the regex let through something the cast refuses: find it value by value
        parse = int if integer else float
        out, bad = [], bad.copy()
        for i, v in enumerate(kept.to_pylist()):
            try:
                x = None if v is None else parse(v)
            except ValueError:
                x = None
                bad[i] = True
            if integer and x is not None and not INT64_MIN <= x <= INT64_MAX:  # no int64: a bad value too
                x = None
                bad[i] = True
            out.append(x)
        return pa.array(out, pa.int64() if integer else pa.float64()), bad


def numbers(arr: pa.Array, column: str, where: str, bad: BadRows, integer: bool = False) -> pa.Array:
    """A numeric or text column as float64 (int64 if integer), nulls kept; unparsable text marks bad rows."""
    t = arr.type
    if pa.types.is_dictionary(t):
        arr, t = arr.dictionary_decode(), t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        parsed, is_bad = text_to_numbers(arr, integer)
        bad.add(is_bad, column, arr, "not an integer in the int64 range [-2^63, 2^63)" if integer else "not a number")
        return parsed
    if integer and pa.types.is_integer(t):
        if pa.types.is_unsigned_integer(t) and t.bit_width == 64:  # values above int64 are bad, the rest cast
            over = pc.fill_null(pc.greater(arr, pa.scalar(INT64_MAX, pa.uint64())), False)
            bad.add(np.asarray(over), column, arr, "an integer above the int64 range [-2^63, 2^63)")
            arr = pc.if_else(over, pa.nulls(len(arr), t), arr)
        return arr.cast(pa.int64())
    if not integer and (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        return arr.cast(pa.float64())
    raise ConfigError(
        f"{where}: column {column!r} has type {t}; expected {'integers' if integer else 'numbers'} (or text of them)"
    )


def column_array(table: pa.Table, name: str) -> pa.Array:
    """One column as a single array (without a copy when it is one chunk, as a row group read gives it)."""
    col = table.column(name)
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


def to_float(arr: pa.Array) -> np.ndarray:
    """A numeric array as float64 numpy (nulls as NaN)."""
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=np.float64)
