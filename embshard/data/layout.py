"""Where the rows are: files found from paths and globs, cut into groups (Parquet row groups, CSV chunks of lines),
the train / held-out split, and each rank's contiguous part of a split as pieces of groups.

    patterns -> files (sorted per pattern) -> groups (rows each, from Parquet metadata or one scan of CSV bytes)
             -> the split's rows [lo, hi) in file order -> rank r's rows [lo + r*q, lo + (r+1)*q), q = (hi - lo) // W
             -> pieces (group, start, stop): what a reader reads

A CSV/TSV file is indexed once by counting newlines in 16 MiB blocks (numpy): every `chunk_rows` non-empty lines
make a group with its byte range and first line number, so a group is read by seeking to its bytes (no scan from
the start of the file) and bad rows are reported by line. Blank lines are skipped, as the CSV reader does.
Quoted fields must not contain newlines.
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embshard.spec.tables import ConfigError

PARQUET_EXT = (".parquet", ".pq")
CSV_EXT = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv"}
_BLOCK = 1 << 24


@dataclass(frozen=True)
class Group:
    """A unit of reading: a Parquet row group, or a CSV chunk of lines (byte range, first line number)."""

    file: int
    index: int
    rows: int
    first_row: int  # data rows of the file before this group
    byte_start: int = 0
    byte_end: int = 0
    first_line: int = 0  # CSV: 1-based line number of the group's first line
    blank_lines: int = 0  # CSV: blank lines inside the byte range


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one group."""

    group: Group
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def resolve_files(patterns: tuple[str, ...] | list[str], key: str) -> list[str]:
    """Paths and glob patterns to existing files, in the order given (each pattern's matches sorted)."""
    files: list[str] = []
    for p in patterns:
        if any(ch in p for ch in "*?["):
            found = sorted(f for f in glob.glob(p) if os.path.isfile(f))
            if not found:
                raise ConfigError(f"{key}: the pattern {p!r} matches no file (paths are relative to {Path.cwd()})")
            files.extend(found)
        elif not os.path.isfile(p):
            raise ConfigError(f"{key}: file {p!r} does not exist (paths are relative to {Path.cwd()})")
        else:
            files.append(p)
    dup = sorted({f for f in files if files.count(f) > 1})
    if dup:
        raise ConfigError(f"{key}: files {dup} are listed more than once")
    return files


def detect_format(files: list[str], fmt: str, key: str) -> str:
    """'parquet', 'csv' or 'tsv': as configured, or by the extension shared by all files."""
    if fmt != "auto":
        return fmt
    found = set()
    for f in files:
        ext = os.path.splitext(f)[1].lower()
        if ext in PARQUET_EXT:
            found.add("parquet")
        elif ext in CSV_EXT:
            found.add(CSV_EXT[ext])
        else:
            raise ConfigError(
                f"{key}: cannot tell the format of {f!r} from its extension: set format: parquet, csv or tsv"
            )
    if len(found) > 1:
        raise ConfigError(f"{key}: the files mix formats {sorted(found)}: give one format per data set")
    return found.pop()


def index_csv(path: str, header: bool, chunk_rows: int) -> tuple[list[Group], bytes]:
    """The groups of one CSV/TSV file (file index 0; rows, byte range, first line, blank lines) and its header line."""
    groups: list[Group] = []
    header_line = b""
    with open(path, "rb") as f:
        if header:
            header_line = f.readline()
        pos = len(header_line)  # file offset of the block being read
        line_no = 2 if header else 1  # number of the next line to finish
        g_start, g_line, g_rows, g_lines = pos, line_no, 0, 0  # the open group: first byte, first line, counts
        line_start, last_byte = pos, 10
        while block := f.read(_BLOCK):
            buf = np.frombuffer(block, dtype=np.uint8)
            nl = np.flatnonzero(buf == 10)
            if len(nl):
                starts = np.concatenate([[line_start - pos], nl[:-1] + 1])  # relative to the block (may be < 0)
                lengths = nl - starts
                blank = lengths == 0
                one = lengths == 1  # blank if that one byte is '\r'
                if one.any():
                    first = np.where(starts >= 0, buf[np.maximum(starts, 0)], last_byte)
                    blank |= one & (first == 13)
                counts = g_rows + np.cumsum(~blank)
                for k in np.flatnonzero(~blank & (counts % chunk_rows == 0) & (counts > 0)):
                    lines = g_lines + int(k) + 1
                    end = pos + int(nl[k]) + 1
                    groups.append(Group(0, len(groups), chunk_rows, 0, g_start, end, g_line, lines - chunk_rows))
                    g_start, g_line, g_lines = end, line_no + int(k) + 1, -int(k) - 1
                g_rows = int(counts[-1]) % chunk_rows
                g_lines += len(nl)
                line_no += len(nl)
                line_start = pos + int(nl[-1]) + 1
            last_byte = int(buf[-1])
            pos += len(block)
        if pos > line_start:  # a last line without a newline
            f.seek(line_start)
            if f.read(pos - line_start).strip(b"\r"):
                g_rows += 1
            g_lines += 1
        if g_rows:
            groups.append(Group(0, len(groups), g_rows, 0, g_start, pos, g_line, g_lines - g_rows))
    return groups, header_line


@dataclass
class Layout:
    """One split's files and their groups, in file order."""

    files: list[str]
    fmt: str
    groups: list[Group]
    columns: list[list[str]]  # per file: its column names

    @property
    def rows(self) -> int:
        return sum(g.rows for g in self.groups)

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        """Rows [lo, hi) of the files' rows (in file order), cut at group boundaries."""
        out, at = [], 0
        for g in self.groups:
            a, b = max(lo, at), min(hi, at + g.rows)
            if a < b:
                out.append(Piece(g, a - at, b - at))
            at += g.rows
            if at >= hi:
                break
        return out

    def fingerprint(self) -> str:
        """A short hash of the files and their group sizes (a resume position is only valid on the same data)."""
        h = hashlib.sha1()
        for f in self.files:
            h.update(os.path.basename(f).encode() + b"\0")
        h.update(np.array([(g.file, g.rows) for g in self.groups], dtype=np.int64).tobytes())
        return h.hexdigest()[:16]


def scan(
    files: list[str], fmt: str, header: bool, column_names: tuple[str, ...] | None, delimiter: str, chunk_rows: int
) -> Layout:
    """The groups of every file: Parquet row groups from the footers, CSV chunks from one scan of the bytes."""
    groups: list[Group] = []
    columns: list[list[str]] = []
    for i, path in enumerate(files):
        first_row = 0
        if fmt == "parquet":
            import pyarrow.parquet as pq

            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as e:
                raise ConfigError(f"{path}: cannot read it as Parquet ({e}); check data format") from None
            sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            file_groups = [Group(i, g, n, 0) for g, n in enumerate(sizes)]
            columns.append(list(meta.schema.to_arrow_schema().names))
        else:
            file_groups, header_line = index_csv(path, header, chunk_rows)
            columns.append(header_names(path, header_line, delimiter) if header else list(column_names or ()))
        for g in file_groups:
            if g.rows:
                groups.append(
                    Group(i, g.index, g.rows, first_row, g.byte_start, g.byte_end, g.first_line, g.blank_lines)
                )
            first_row += g.rows
    return Layout(files, fmt, groups, columns)


def file_columns(
    files: list[str], fmt: str, header: bool, column_names: tuple[str, ...] | None, delimiter: str
) -> Layout:
    """The files' column names without their rows (a Layout without groups): Parquet schemas from the footers,
    CSV header lines; what the ranks' readers check the columns of, read before any rank starts."""
    columns: list[list[str]] = []
    for path in files:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            try:
                schema = pq.ParquetFile(path).schema_arrow
            except Exception as e:
                raise ConfigError(f"{path}: cannot read it as Parquet ({e}); check data format") from None
            columns.append(list(schema.names))
        elif header:
            try:
                with open(path, "rb") as f:
                    line = f.readline()
            except OSError as e:
                raise ConfigError(f"{path}: cannot read the file ({e.strerror})") from None
            columns.append(header_names(path, line, delimiter))
        else:
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise ConfigError(f"{path}: cannot read the file ({e.strerror})") from None
            columns.append(list(column_names or ()))
    return Layout(files, fmt, [], columns)


def header_names(path: str, line: bytes, delimiter: str) -> list[str]:
    """Column names from a CSV header line (quoted names allowed)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    if not line.strip():
        raise ConfigError(f"{path}: the file is empty or its first line is blank; expected a header naming the columns")
    opts = pacsv.ReadOptions(use_threads=False)
    table = pacsv.read_csv(
        pa.BufferReader(line), read_options=opts, parse_options=pacsv.ParseOptions(delimiter=delimiter)
    )
    return list(table.column_names)
