"""One piece of a file -> numpy arrays for the model: labels, dense features, and per sparse feature its bag
lengths, table rows and per-id weights. Vectorized throughout (pyarrow compute, numpy); no Python loop per value.

    Parquet row group (read_row_group) | CSV chunk (its byte range, pyarrow's CSV reader)
      -> Arrow columns -> label (threshold or 0/1 check), dense (fill, min, transform), bags (lists, separator
         text or single values) -> rows (hash, vocab or identity) or raw ids (raw) -> bad rows -> Chunk

Raw (tables with ids: raw): integer values are their own ids, text that is a decimal integer (up to 18 digits) is
that integer, other text is its embshard-hash-v1 as a signed 64-bit id (no modulo): every distinct value keeps its
own id, and the table's id -> row map gives it a row on the device (docs/raw_ids.md).

Missing values (hash, vocab and raw): a null or empty value is dropped from its bag and a bag left empty becomes one
id of row 0 (raw: the id RAW_MISSING). Identity: nulls are dropped and a bag may stay empty. A bad row (wrong field count, a number that
does not parse, a missing or out-of-range label, an infinite dense value, an id out of range, weights that do not
match the ids) raises a ConfigError naming file, line or row, column, value and the rule (on_bad_row: error) or
is dropped and counted (on_bad_row: skip).

The specs and the chunk are in chunk.py, bad rows and number parsing in parse.py.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embshard.data.chunk import Chunk, FeatureSpec, ReadSpec
from embshard.data.hashing import as_text, hash_rows, hash_values
from embshard.data.layout import Layout, Piece
from embshard.data.parse import BadRows, column_array, numbers, to_float
from embshard.spec.tables import ConfigError

MISSING_ROW = 0
RAW_MISSING = -(1 << 63)
"""mapping raw: the id of a missing value (a null or empty value; a bag left empty gets one)."""
RAW_INT_RE = r"^-?[0-9]{1,18}$"
PACKED_KEY = b"embshard.packed"  # field metadata of a fixed_size_binary column of packed little-endian ids


class Reader:
    """Reads pieces of one split's files into Chunks (one per process; keeps the Parquet footers)."""

    def __init__(self, spec: ReadSpec, layout: Layout, vocab: dict | None = None) -> None:
        self.spec, self.layout, self.vocab = spec, layout, vocab or {}
        self._meta: dict[int, object] = {}  # Parquet footers by file
        need = spec.columns()
        for f, cols in zip(layout.files, layout.columns):
            missing = [c for c in need if c not in cols]
            if missing:
                raise ConfigError(
                    f"{spec.where}: {f} has no column(s) {missing}; its columns: {cols}"
                    + (" (a headerless file needs column_names)" if spec.fmt != "parquet" and spec.header else "")
                )

    # ---- reading Arrow tables ----

    def _parquet(self, piece: Piece) -> pa.Table:
        import pyarrow.parquet as pq

        g = piece.group
        path = self.layout.files[g.file]
        meta = self._meta.get(g.file)
        if meta is None:
            if len(self._meta) >= 64:
                self._meta.clear()
            meta = self._meta[g.file] = pq.ParquetFile(path).metadata
        # memory-mapped for this read: Arrow decodes from the file's pages in the page cache instead of reading them
        # into new buffers first (whose page faults cost more than the decompression); unmapped when the table's
        # buffers are gone (Arrow's buffers of uncompressed pages may point into the mapping)
        with pa.memory_map(path) as source:
            pf = pq.ParquetFile(source, metadata=meta, page_checksum_verification=True)
            try:
                table = pf.read_row_group(g.index, columns=self.spec.columns(), use_threads=False)
            except (OSError, pa.ArrowException) as e:  # a page whose checksum does not match, a damaged page
                raise ConfigError(
                    f"{path}: row group {g.index} cannot be read ({e}): the file is damaged; write it again (e.g. "
                    "`embshard preprocess ... --overwrite`)"
                ) from None
        if piece.start or piece.stop < g.rows:
            table = table.slice(piece.start, piece.rows)
        return table

    def _csv(self, piece: Piece, as_text: bool) -> tuple[pa.Table, list[tuple[int, str]]]:
        """The group's rows as a table, and its rows of the wrong width as (row number, message)."""
        import pyarrow.csv as pacsv

        g, spec = piece.group, self.spec
        path = self.layout.files[g.file]
        with open(path, "rb") as f:
            f.seek(g.byte_start)
            data = f.read(g.byte_end - g.byte_start)
        names = self.layout.columns[g.file]
        invalid: list[tuple[int, str]] = []

        def handler(row) -> str:
            invalid.append((row.number, f"{row.actual_columns} fields, expected {row.expected_columns}"))
            return "skip"

        types: dict[str, pa.DataType] = {c: pa.string() for c in spec.columns()}
        if not as_text:  # typed reading; a column that is also categorical stays text (numbers are parsed from it)
            categorical = {f.column for f in spec.features} | {f.weights for f in spec.features}
            for c in [spec.label, *(d.column for d in spec.dense)]:
                if c not in categorical:
                    types[c] = pa.float64()
            for f in spec.features:
                if spec.mapping == "identity" and f.separator is None and types[f.column] == pa.string():
                    types[f.column] = pa.int64()
        table = pacsv.read_csv(
            pa.BufferReader(data),
            read_options=pacsv.ReadOptions(column_names=names, use_threads=False, block_size=len(data) + 1),
            parse_options=pacsv.ParseOptions(delimiter=spec.delimiter, invalid_row_handler=handler),
            convert_options=pacsv.ConvertOptions(
                include_columns=spec.columns(),
                column_types=types,
                null_values=[""],
                strings_can_be_null=True,
                quoted_strings_can_be_null=True,
            ),
        )
        if table.num_rows + len(invalid) != g.rows:
            raise ConfigError(
                f"{path}:{g.first_line}: the CSV reader found {table.num_rows + len(invalid)} rows in lines "
                f"{g.first_line}.. where the line index counted {g.rows}: lines must end in \\n or \\r\\n and quoted "
                "fields must not contain line breaks"
            )
        return table, invalid

    def line_of(self, piece: Piece, number: int) -> str:
        """'path:line' of the group's number-th non-blank line (1-based); 'path, row r' for Parquet."""
        g = piece.group
        path = self.layout.files[g.file]
        if self.layout.fmt == "parquet":
            return f"{path}, row {g.first_row + piece.start + number - 1} (counting from 0)"
        if not g.blank_lines:
            return f"{path}:{g.first_line + number - 1}"
        with open(path, "rb") as f:
            f.seek(g.byte_start)
            lines = f.read(g.byte_end - g.byte_start).split(b"\n")
        nonblank = [i for i, line in enumerate(lines) if line.strip(b"\r")]
        return f"{path}:{g.first_line + nonblank[number - 1]}"

    # ---- one piece ----

    def table(self, piece: Piece, text: bool = False) -> tuple[pa.Table, np.ndarray, list[tuple[int, str]]]:
        """The piece's rows as an Arrow table, each row's number in its group (1-based), and the CSV rows of the
        wrong width as (number, message). text: read every CSV column as text."""
        if self.layout.fmt == "parquet":
            table = self._parquet(piece)
            return table, np.arange(1, table.num_rows + 1), []
        try:
            table, invalid = self._csv(piece, as_text=text)
        except pa.ArrowInvalid:  # a value that is not a number: read the numbers as text to find the rows
            table, invalid = self._csv(piece, as_text=True)
        bad_numbers = np.array([n for n, _ in invalid], dtype=np.int64)
        row_numbers = np.setdiff1d(np.arange(1, piece.group.rows + 1), bad_numbers)
        inside = (row_numbers > piece.start) & (row_numbers <= piece.stop)
        if not inside.all():
            table = table.filter(pa.array(inside))
            row_numbers = row_numbers[inside]
        return table, row_numbers, [(n, m) for n, m in invalid if piece.start < n <= piece.stop]

    def read(self, piece: Piece) -> tuple[Chunk, int, str | None]:
        """The piece's rows, the number of bad rows skipped and the first one's description."""
        spec = self.spec
        table, row_numbers, invalid = self.table(piece)
        bad = BadRows(table.num_rows)
        chunk = self.convert(table, bad)
        events = [(int(row_numbers[bad.first[0]]), bad.first[1])] if bad.first else []
        events += invalid[:1]
        skipped = bad.count + len(invalid)
        if not skipped:
            return chunk, 0, None
        number, what = min(events)
        message = f"{self.line_of(piece, number)}: {what}"
        if spec.on_bad_row == "error":
            raise ConfigError(
                f"{message} (bad row; {spec.where}: fix the data, or set data.on_bad_row: skip to drop such rows "
                "and count them)"
            )
        return chunk.keep(~bad.mask), skipped, message

    def raw(self, piece: Piece) -> dict[str, pa.Array]:
        """Per categorical column, its present values as text (for counting a vocabulary)."""
        table, _, _ = self.table(piece, text=True)
        out = {}
        for f in self.spec.features:
            if f.column in out:
                continue
            _, flat, _ = self.split(table, f.column, f.separator)
            text = as_text(flat)
            out[f.column] = text.filter(pc.fill_null(pc.greater(pc.binary_length(text), 0), False))
        return out

    def convert(self, table: pa.Table, bad: BadRows) -> Chunk:
        spec = self.spec
        n = table.num_rows
        label = to_float(numbers(column_array(table, spec.label), spec.label, spec.where, bad))
        if spec.label_threshold is not None:
            bad.add(np.isnan(label), spec.label, None, "the label is missing")
            label = (label >= spec.label_threshold).astype(np.float32)
        elif n and not (label.min() >= 0 and label.max() <= 1):  # NaN fails both comparisons
            bad.add(np.isnan(label), spec.label, None, "the label is missing")
            with np.errstate(invalid="ignore"):
                out = (label < 0) | (label > 1)
            bad.add(out, spec.label, label, "a label must be in [0, 1] (set label_threshold to binarize)")
        dense = np.empty((n, len(spec.dense)), dtype=np.float32)
        for j, d in enumerate(spec.dense):
            x = to_float(numbers(column_array(table, d.column), d.column, spec.where, bad))
            if not np.isfinite(x).all():
                bad.add(np.isinf(x), d.column, x, "a dense value must be finite")
                x = np.where(np.isfinite(x), x, d.fill)
            if d.min is not None:
                x = np.maximum(x, d.min)
            if d.transform == "log1p":
                if n and x.min() <= -1:
                    bad.add(x <= -1, d.column, x, "log1p needs values > -1 (set min)")
                    x = np.where(x > -1, x, 0.0)
                x = np.log1p(x)
            dense[:, j] = x
        lengths, values, weights, fixed = [], [], ([] if spec.weighted else None), []
        for f in spec.features:
            lens, ids, w, size = self.bags(table, f, bad)
            lengths.append(lens.astype(np.int32, copy=False))
            values.append(ids)
            fixed.append(size)
            if weights is not None:
                weights.append(w if w is not None else np.ones(len(ids), dtype=np.float32))
        return Chunk(label.astype(np.float32, copy=False), dense, lengths, values, weights, fixed)

    def split(self, table: pa.Table, column: str, separator: str | None) -> tuple[np.ndarray, pa.Array, int | None]:
        """A column as bags: lengths [n] (int32), the flat values (nulls kept) and the size of every bag when it
        is one size by construction; for lists, separator text, packed fixed-width ids or single values."""
        col = column_array(table, column)
        t = col.type
        n = len(col)
        if separator is not None:
            if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
                raise ConfigError(f"{self.spec.where}: column {column!r} has type {t}; a separator needs text values")
            col = pc.split_pattern(col, separator)
            t = col.type
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            lengths = np.asarray(pc.fill_null(pc.list_value_length(col), 0)).astype(np.int32, copy=False)
            k = t.list_size if pa.types.is_fixed_size_list(t) and not col.null_count else None
            return lengths, pc.list_flatten(col), k
        meta = table.schema.field(column).metadata or {}
        if pa.types.is_fixed_size_binary(t) and PACKED_KEY in meta:
            width = np.dtype(meta[PACKED_KEY].decode()).itemsize
            k = t.byte_width // width
            flat = np.frombuffer(col.buffers()[1], dtype="<" + meta[PACKED_KEY].decode()[0] + str(width))
            flat = flat[col.offset * k : (col.offset + n) * k]
            if col.null_count:
                valid = np.asarray(col.is_valid())
                lengths = np.where(valid, k, 0).astype(np.int32)
                return lengths, pa.array(flat[np.repeat(valid, k)]), None
            return _constant(n, k), pa.array(flat), k
        return _constant(n, 1), col, 1

    def bags(self, table: pa.Table, f: FeatureSpec, bad: BadRows) -> tuple:
        """One feature's bag lengths [n] (int32), table rows, per-id weights (float32 or None), and the size of
        every bag when it is one size by construction (else None)."""
        spec = self.spec
        lengths, flat, size = self.split(table, f.column, f.separator)
        values_bad = BadRows(len(flat))
        if spec.mapping == "raw":
            ids, keep = raw_ids(flat, spec.where, f.column)
        elif spec.mapping == "identity":
            native = flat.type in (pa.int32(), pa.int64())  # kept as they are (widened when a batch is gathered)
            ids_arr = flat if native else numbers(flat, f.column, spec.where, values_bad, integer=True)
            if ids_arr.null_count:
                keep = np.asarray(ids_arr.is_valid())
                ids_arr = ids_arr.fill_null(0)
            else:
                keep = None
            ids = ids_arr.to_numpy(zero_copy_only=False)
            if len(ids) and _out_of_range(ids, f.rows):
                out = (ids < 0) | (ids >= f.rows)
                values_bad.add(
                    out if keep is None else out & keep,
                    f.column,
                    ids,
                    f"an id must be in [0, {f.rows}) (table {f.table!r} has {f.rows} rows)",
                )
        else:
            try:
                text = as_text(flat)
            except TypeError as e:
                raise ConfigError(f"{spec.where}: column {f.column!r}: {e}") from None
            keep = np.asarray(pc.fill_null(pc.greater(pc.binary_length(text), 0), False))
            keep = None if keep.all() else keep
            hashed = hash_values(text)
            ids = self.vocab[f.name](hashed) if spec.mapping == "vocab" else hash_rows(hashed, f.rows)
        weights = None
        if f.weights is not None:
            weights = self.weights(table, f, lengths, values_bad, bad)
        if values_bad.first is not None:
            _to_rows(values_bad, bad, np.repeat(np.arange(len(lengths)), lengths))
        missing = RAW_MISSING if spec.mapping == "raw" else MISSING_ROW
        bags = _finish_bags(lengths, ids, weights, keep, spec.mapping != "identity", missing)
        return (*bags, size if bags[0] is lengths else None)

    def weights(
        self, table: pa.Table, f: FeatureSpec, lengths: np.ndarray, values_bad: BadRows, bad: BadRows
    ) -> np.ndarray:
        """Per-id weights aligned with the ids; a row whose weights do not match its ids is bad (weights 1)."""
        wlens, wflat, _ = self.split(table, f.weights, f.separator)
        w = to_float(numbers(wflat, f.weights, self.spec.where, BadRows(len(wflat))))
        match = wlens == lengths
        out = np.ones(int(lengths.sum()), dtype=np.float32)
        out[np.repeat(match, lengths)] = w[np.repeat(match, wlens)]
        bad_w = ~np.isfinite(out)
        values_bad.add(bad_w, f.weights, out, "a weight must be a finite number")
        out[bad_w] = 1.0
        if not match.all():
            i = int(np.argmax(~match))
            rule = f"{int(wlens[i])} weights for {int(lengths[i])} ids of column {f.column!r}"
            bad.add(~match, f.weights, None, rule)
        return out


def _constant(n: int, k: int) -> np.ndarray:
    """Bag lengths that are all k: a read-only view of one value (nothing to allocate or fill per column)."""
    return np.broadcast_to(np.int32(k), (n,))


def _out_of_range(ids: np.ndarray, rows: int) -> bool:
    """Whether some id is outside [0, rows): one pass over the ids read as unsigned integers, where a negative id is
    at least 2^(bits - 1) (so above any table that signed ids of that width can address)."""
    if ids.dtype.kind == "i" and rows <= 1 << (8 * ids.itemsize - 1):
        return int(ids.view(np.dtype(ids.dtype.str.replace("i", "u"))).max()) >= rows
    return bool(ids.min() < 0 or ids.max() >= rows)


def _to_rows(values_bad: BadRows, bad: BadRows, parent: np.ndarray) -> None:
    """Move value-level bad marks to their rows (parent: the row of every value)."""
    rows = np.zeros(bad.n, dtype=bool)
    rows[parent[values_bad.mask]] = True
    i, what = values_bad.first
    if bad.first is None or parent[i] < bad.first[0]:
        bad.first = (int(parent[i]), what)
    bad.mask[:] |= rows


def raw_ids(flat: pa.Array, where: str, column: str) -> tuple[np.ndarray, np.ndarray | None]:
    """mapping raw: (int64 ids of the values, which values are present or None if all are): integers as they
    are, decimal-integer text as its integer, other text as its embshard-hash-v1 (module docstring)."""
    t = flat.type
    if pa.types.is_dictionary(t):
        return raw_ids(flat.dictionary_decode(), where, column)
    if pa.types.is_integer(t):
        if pa.types.is_unsigned_integer(t) and t.bit_width == 64:
            ids = flat.fill_null(0).to_numpy(zero_copy_only=False).view(np.int64)
        else:
            ids = pc.cast(flat.fill_null(0), pa.int64()).to_numpy(zero_copy_only=False)
        return ids, np.asarray(flat.is_valid()) if flat.null_count else None
    try:
        text = as_text(flat)
    except TypeError as e:
        raise ConfigError(f"{where}: column {column!r}: {e}") from None
    keep = np.asarray(pc.fill_null(pc.greater(pc.binary_length(text), 0), False))
    ids = hash_values(text).view(np.int64).copy()
    numeric = np.asarray(pc.fill_null(pc.match_substring_regex(text, RAW_INT_RE), False))
    if numeric.any():
        ids[numeric] = pc.cast(pc.filter(text, pa.array(numeric)), pa.int64()).to_numpy(zero_copy_only=False)
    return ids, None if keep.all() else keep


def _finish_bags(
    lengths: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray | None,
    keep: np.ndarray | None,
    fill_missing: bool,
    missing: int = MISSING_ROW,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Drop the values not kept; with fill_missing, a bag left empty gets one id `missing` (weight 1)."""
    n = len(lengths)
    if keep is None and (not fill_missing or n == 0 or lengths.min() > 0):
        return lengths, ids, weights
    keep = np.ones(len(ids), dtype=bool) if keep is None else keep
    parent = np.repeat(np.arange(n), lengths)[keep]
    counts = np.bincount(parent, minlength=n).astype(np.int32)
    ids, weights = ids[keep], None if weights is None else weights[keep]
    if not fill_missing or counts.min(initial=1) > 0:
        return counts, ids, weights
    new_lengths = np.maximum(counts, 1)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(new_lengths[:-1], out=starts[1:])
    kept_starts = np.zeros(n, dtype=np.int64)
    np.cumsum(counts[:-1], out=kept_starts[1:])
    pos = starts[parent] + np.arange(len(ids)) - kept_starts[parent]
    out = np.full(int(new_lengths.sum()), missing, dtype=np.int64)
    out[pos] = ids
    w_out = None
    if weights is not None:
        w_out = np.ones(len(out), dtype=np.float32)
        w_out[pos] = weights
    return new_lengths, out, w_out
