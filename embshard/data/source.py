"""The file source (data.source: table, and the criteo and movielens presets): one rank's training and held-out
batches from Parquet, CSV or TSV files.

    config + tables -> ReadSpec (columns, mapping, transforms) -> Layout of the files (groups)
      -> split: the last eval_fraction of the rows, or eval_files -> rank r's contiguous rows: every rank gets
         floor(rows / world_size) of each split (the remainder is not read), so all ranks take the same steps
      -> StreamPlans -> streams in worker processes (torch DataLoader, IterableDataset) or in this process
      -> Batch(dense [B, D], KeyedJaggedTensor, labels [B], position), pinned when CUDA is available

`train_batches(position)` resumes exactly: position is None (the start), a step count (its cursors computed from
row counts; exact unless bad rows were skipped) or the `Batch.position` dict of the last batch trained on.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence

import torch

from embshard.config.data import DataConfig, TableSourceConfig, check_table_features
from embshard.config.schema import FieldError
from embshard.data.chunk import FeatureSpec, ReadSpec
from embshard.data.common import Batch
from embshard.data.decode import Reader
from embshard.data.layout import Layout, detect_format, file_columns, resolve_files, scan
from embshard.data.slots import Slots, SlotWriter, fresh_shared_arrays, load, take_arrays
from embshard.data.stream import StreamPlan, eval_stream, train_stream
from embshard.data.vocab import Counter, VocabLookup, read_vocab
from embshard.spec.tables import ConfigError, TableConfig

POSITION_VERSION = 1


def read_spec(cfg: TableSourceConfig, tables: Sequence[TableConfig], fmt: str, on_bad_row: str, where: str) -> ReadSpec:
    """The reader's view of a table config: columns, per-feature table sizes, weights (features in table order)."""
    table_of = {f: t for t in tables for f in t.feature_names}
    weighted = {f for f, t in table_of.items() if t.weighted}
    try:
        check_table_features(cfg, list(table_of), weighted)
    except FieldError as e:
        raise ConfigError(f"{where}.{e}") from None
    col = {c.feature_name: c for c in cfg.categorical}
    features = tuple(
        FeatureSpec(f, col[f].column, t.num_embeddings, t.name, col[f].separator, col[f].weights)
        for f, t in table_of.items()
    )
    need = {"hash": 2, "vocab": 3, "identity": 1, "raw": 1}[cfg.mapping]
    if cfg.mapping == "raw":
        index = sorted({t.name for t in tables if not t.raw_ids and any(f in table_of for f in t.feature_names)})
        if index:
            raise ConfigError(
                f"{where}: mapping raw passes the values' raw 64-bit ids through, but tables {index} take row "
                "numbers (ids: index): set ids: raw on them (model.tables[...].ids), or use mapping hash or vocab"
            )
    for f in features:
        if f.rows < need:
            raise ConfigError(
                f"{where}: table {f.table!r} (feature {f.name!r}) has num_embeddings={f.rows}; mapping {cfg.mapping} "
                f"needs at least {need} rows (row 0 is the missing value{', row 1 out of vocabulary' if need == 3 else ''})"
            )
    delimiter = cfg.delimiter or ("\t" if fmt == "tsv" else ",")
    return ReadSpec(
        where, fmt, cfg.header, cfg.column_names, delimiter, cfg.label, cfg.label_threshold, cfg.dense, features,
        cfg.mapping, any(t.weighted for t in tables), on_bad_row, cfg.chunk_rows,
    )  # fmt: skip


def check_files(cfg: TableSourceConfig, data: DataConfig, tables: Sequence[TableConfig], where: str) -> None:
    """What a TableSource checks of its files before reading rows (they exist, their format, the columns the
    tables and the config name), without reading the rows: run before the ranks start."""
    files = resolve_files(cfg.files, f"{where}.files")
    fmt = detect_format(files, cfg.format, where)
    spec = read_spec(cfg, tables, fmt, data.on_bad_row, where)
    groups = [files]
    if cfg.eval_files is not None:
        groups.append(resolve_files(cfg.eval_files, f"{where}.eval_files"))
    for found in groups:
        Reader(spec, file_columns(found, fmt, cfg.header, cfg.column_names, spec.delimiter))  # checks the columns


def build_vocab(cfg: TableSourceConfig, spec: ReadSpec, layout: Layout, lo: int, hi: int) -> dict[str, VocabLookup]:
    """Per feature, its vocabulary lookup: from cfg.vocab_dir, else counted over the training rows [lo, hi)."""
    columns = list(dict.fromkeys(f.column for f in spec.features))
    if cfg.vocab_dir is not None:
        vocabs = {c: read_vocab(cfg.vocab_dir, c) for c in columns}
    else:
        counters = {c: Counter() for c in columns}
        reader = Reader(spec, layout)
        for piece in layout.pieces(lo, hi):
            for c, values in reader.raw(piece).items():
                counters[c].add(values)
        vocabs = {c: counters[c].sorted_table() for c in columns}
    return {f.name: VocabLookup(vocabs[f.column], f.rows, cfg.vocab_min_count, f.name) for f in spec.features}


def check_not_empty(layout: Layout, key: str) -> None:
    """ConfigError naming the files when none of them holds a data row."""
    if layout.rows == 0:
        what = (
            f"{layout.files[0]}: the file is empty"
            if len(layout.files) == 1
            else f"{layout.files}: the files are empty"
        )
        raise ConfigError(f"{key}: {what} (no data rows): give files with rows")


def even_parts(lo: int, hi: int, batch_size: int, streams: int) -> tuple[tuple[int, int], ...]:
    """[lo, hi) cut into `streams` contiguous parts of whole batches (the last batch may be short)."""
    nb = -(-(hi - lo) // batch_size)
    cuts = [lo + min((j * nb // streams) * batch_size, hi - lo) for j in range(streams)] + [hi]
    return tuple((cuts[j], cuts[j + 1]) for j in range(streams))


class TableSource:
    """One rank's training and held-out batches from files (see the module docstring)."""

    def __init__(
        self,
        cfg: TableSourceConfig,
        data: DataConfig,
        tables: Sequence[TableConfig],
        batch_size: int,
        seed: int,
        rank: int,
        world_size: int,
        where: str = "data.table",
    ) -> None:
        self.where, self.batch_size, self.rank = where, batch_size, rank
        files = resolve_files(cfg.files, f"{where}.files")
        fmt = detect_format(files, cfg.format, where)
        self.spec = spec = read_spec(cfg, tables, fmt, data.on_bad_row, where)
        self.keys = [f.name for f in spec.features]
        self.num_dense = len(cfg.dense)
        train = scan(files, fmt, cfg.header, cfg.column_names, spec.delimiter, spec.chunk_rows)
        check_not_empty(train, f"{where}.files")
        frac = cfg.held_out_fraction
        if cfg.eval_files is not None:
            eval_files = resolve_files(cfg.eval_files, f"{where}.eval_files")
            held = scan(eval_files, fmt, cfg.header, cfg.column_names, spec.delimiter, spec.chunk_rows)
            check_not_empty(held, f"{where}.eval_files")
            train_range = (0, train.rows)
            eval_range = (0, held.rows if frac >= 1 else max(1, round(held.rows * frac)))
        else:
            held = train
            n_eval = max(1, round(train.rows * frac))
            train_range, eval_range = (0, train.rows - n_eval), (train.rows - n_eval, train.rows)
        for layout in (train, held):
            Reader(spec, layout)  # checks now that every file has the columns
        q_train = (train_range[1] - train_range[0]) // world_size
        q_eval = (eval_range[1] - eval_range[0]) // world_size
        self.steps_per_epoch = q_train // batch_size
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"{where}: each rank has {q_train} training rows ({train_range[1] - train_range[0]} over {world_size} "
                f"ranks), fewer than schedule.batch_size={batch_size}: lower the batch size, use fewer ranks or more data"
            )
        if q_eval < 1:
            raise ConfigError(
                f"{where}: {eval_range[1] - eval_range[0]} held-out rows for {world_size} ranks leave none to some "
                "rank: raise eval_fraction, add eval_files or use fewer ranks"
            )
        vocab = build_vocab(cfg, spec, train, *train_range) if cfg.mapping == "vocab" else None
        t_lo = train_range[0] + rank * q_train
        pieces = tuple(train.pieces(t_lo, t_lo + q_train))
        e_lo = eval_range[0] + rank * q_eval
        eval_streams = max(1, min(data.workers, -(-q_eval // batch_size)))
        common = dict(batch_size=batch_size, shuffle_rows=data.shuffle_rows, seed=seed, rank=rank, vocab=vocab)
        self.train_plan = StreamPlan(
            spec, train, pieces=pieces, parts=(), streams=max(1, min(data.workers, len(pieces))),
            shuffle=data.shuffle, **common,
        )  # fmt: skip
        self.eval_plan = StreamPlan(
            spec, held, pieces=(), parts=even_parts(e_lo, e_lo + q_eval, batch_size, eval_streams),
            streams=eval_streams, shuffle=False, **common,
        )  # fmt: skip
        self.workers = data.workers
        self.prefetch = data.prefetch
        self.pin = data.pin_memory and torch.cuda.is_available()
        self.check = {
            "rank": rank,
            "world_size": world_size,
            "streams": self.train_plan.streams,
            "batch_size": batch_size,
            "seed": seed,
            "shuffle": data.shuffle,
            "shuffle_rows": data.shuffle_rows,
            "data": train.fingerprint(),
        }
        self.skipped_rows: dict[str, int] = {}

    # ---- positions ----

    def position_at(self, batches: int) -> dict:
        """The position after `batches` training batches, from row counts (exact when no bad row was skipped)."""
        n, B = self.train_plan.streams, self.batch_size
        cursors = [self.train_plan.cursor_after(j, ((batches - j + n - 1) // n) * B) for j in range(n)]
        return self._position(batches, cursors)

    def _position(self, batches: int, cursors: list) -> dict:
        return {
            "version": POSITION_VERSION,
            "batches": batches,
            "streams": [list(c) for c in cursors],
            "check": dict(self.check),
        }

    def _start(self, position: dict | int | None) -> tuple[int, list]:
        if position is None:
            position = 0
        if isinstance(position, int):
            p = self.position_at(position)
            return p["batches"], [tuple(c) for c in p["streams"]]
        if position.get("version") != POSITION_VERSION:
            raise ConfigError(f"{self.where}: a data position of version {position.get('version')}, expected 1")
        saved = position.get("check", {})
        diff = {k: (saved.get(k), v) for k, v in self.check.items() if saved.get(k) != v}
        if diff:
            shown = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ConfigError(
                f"{self.where}: the saved data position does not fit this run ({shown}); resume with the saved "
                "settings (data.workers sets the streams), or resume from a step count to start the data anew"
            )
        return int(position["batches"]), [tuple(c) for c in position["streams"]]

    # ---- batches ----

    def train_batches(self, position: dict | int | None = None) -> Iterator[Batch]:
        """Training batches from `position` on (endless); each carries the position after it."""
        batches, cursors = self._start(position)
        make = lambda slots: _Train(self.train_plan, batches, list(cursors), slots)  # noqa: E731
        for d in self._load(make, self.train_plan.streams):
            if "error" in d:
                raise ConfigError(d["error"])
            cursors[d["stream"]] = d["cursor"]
            batches += 1
            yield self._batch(d, self._position(batches, cursors))

    def eval_batches(self) -> Iterator[Batch]:
        """Every held-out row of this rank once (the same number of batches on every rank)."""
        for d in self._load(lambda slots: _Eval(self.eval_plan, slots), self.eval_plan.streams):
            yield self._batch(d, None)

    def _load(self, make, streams: int) -> Iterator[dict]:
        """Batch dicts of the dataset `make(slots)`: read here (workers 0) or by `streams` worker processes, whose
        batches arrive in reused shared-memory slots (data/slots.py): copied into pinned memory by the DataLoader's
        pin thread (CUDA), or lent to the caller as they are (CPU) and freed once it drops them."""
        if self.workers == 0:
            yield from make(None)
            return
        yield from load(make, streams, self.prefetch, self.pin)

    def _batch(self, d: dict, position: dict | None) -> Batch:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        if "error" in d:
            raise ConfigError(d["error"])
        for path, (count, message) in d["skipped"].items():
            if path not in self.skipped_rows:
                print(
                    f"warning: rank {self.rank}: {self.where}: skipped bad rows in {path} (first: {message}); "
                    "on_bad_row: skip counts them per file (TableSource.skipped_rows)",
                    file=sys.stderr,
                    flush=True,
                )
            self.skipped_rows[path] = self.skipped_rows.get(path, 0) + count
        take_arrays(d)  # from a worker: views of its shared-memory slot (copied out already when pinned)
        # taken out of d, which the caller's loop keeps until the next batch: a lent slot is freed once the Batch goes
        t = {k: torch.as_tensor(d.pop(k)) for k in ("labels", "dense", "lengths", "values")}
        weights = d.pop("weights", None)
        weights = None if weights is None else torch.as_tensor(weights)
        kjt = KeyedJaggedTensor(
            keys=self.keys,
            values=t["values"],
            lengths=t["lengths"],
            weights=weights,
            stride=int(d["size"]),
            length_per_key=list(d["length_per_key"]),
        )
        batch = Batch(t["dense"], kjt, t["labels"], position)
        return batch.pin_memory() if self.pin and self.workers == 0 else batch


def _writer(slots: Slots | None, worker: int):
    """How a worker makes a batch's arrays: in its shared-memory slots, or fresh shared memory per batch."""
    return fresh_shared_arrays if slots is None else SlotWriter(slots, worker)


def _guard(items: Iterator[dict]) -> Iterator[dict]:
    """A ConfigError inside a worker travels to the training process as data (its message intact)."""
    try:
        yield from items
    except ConfigError as e:
        yield {"error": str(e)}


class _Train(torch.utils.data.IterableDataset):
    """Worker i of N serves stream (batches + i) mod N, so the round robin continues where the position left it."""

    def __init__(self, plan: StreamPlan, batches: int, cursors: list, slots: Slots | None = None) -> None:
        self.plan, self.batches, self.cursors, self.slots = plan, batches, cursors, slots

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        n = self.plan.streams
        if info is not None:
            j = (self.batches + info.id) % n
            yield from _guard(train_stream(self.plan, j, self.cursors[j], _writer(self.slots, info.id)))
            return
        its = [_guard(train_stream(self.plan, j, self.cursors[j])) for j in range(n)]
        k = self.batches
        while True:  # in this process: the same round robin
            yield next(its[k % n])
            k += 1


class _Eval(torch.utils.data.IterableDataset):
    def __init__(self, plan: StreamPlan, slots: Slots | None = None) -> None:
        self.plan, self.slots = plan, slots

    def __iter__(self) -> Iterator[dict]:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            yield from _guard(eval_stream(self.plan, info.id, _writer(self.slots, info.id)))
            return
        its = [_guard(eval_stream(self.plan, j)) for j in range(self.plan.streams)]
        active = list(range(len(its)))
        while active:  # round robin over the streams until all are done, as the DataLoader does
            for j in list(active):
                try:
                    yield next(its[j])
                except StopIteration:
                    active.remove(j)
