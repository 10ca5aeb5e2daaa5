"""A benchmark run's results as bench/report.py and the suites read them: the RESULT lines (and the baselines' own
result lines) parsed into runs, the bandwidths measured, a run's folder loaded (its summary.md, or the raw logs of
a run's output folder), and the runs grouped into rows of interleaved TorchRec / embshard pairs."""

from __future__ import annotations

import re
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RAW = RESULTS / "raw"  # the raw logs of the runs (git ignores them)
BANDWIDTH_LINES = {
    "hbm": re.compile(r"(?:GPU memory copy|copy bandwidth): ([\d.]+) GB/s"),
    "link": re.compile(r"all-to-all over \d+ GPUs \(NCCL\): ([\d.]+) GB/s"),
    "h2d": re.compile(r"host->GPU ([\d.]+) GB/s"),
    "uvm": re.compile(r"UVM row reads \(512 MiB tables\):.*bytes / ([\d.]+) GB/s per row"),
}
BANDWIDTH_NAMES = {
    "hbm": "GPU memory copy (read + write)",
    "link": "all-to-all bus bandwidth per GPU",
    "h2d": "pinned host-to-GPU copy",
    "uvm": "GPU row reads from host memory",
}
TORCHREC_DMP = re.compile(
    r"^torchrec DMP (\S+) world=(\d+) hbm_gib=(\S+) force=(\S+): ([\d.]+) ms/step, ([\d,]+) samples/s"
    r"(?:; peak GPU memory ([\d.]+) GB)?"
)


def parse_line(line: str) -> dict[str, str] | None:
    """A run's fields from a RESULT line or TorchRec's DMP line; None for other lines."""
    if line.startswith("RESULT ") and "=" in line:
        try:
            return dict(kv.split("=", 1) for kv in shlex.split(line[7:]) if "=" in kv)
        except ValueError:
            return None
    m = TORCHREC_DMP.match(line)
    if m:
        workload, world, hbm, force, ms, sps, peak = m.groups()
        out = {"framework": "torchrec", "bench": "emb", "workload": workload, "world": world, "hbm_gib": hbm}
        out.update(force=force, ms_per_step=ms, samples_per_s=sps.replace(",", ""))
        return out | ({"peak_gb": peak} if peak else {})
    return None


def bench_of(r: dict[str, str]) -> str:
    return r.get("bench") or ("e2e" if "pipeline" in r else "?")


def rows_fraction(r: dict[str, str]) -> float:
    """The fraction of every table's rows an e2e run kept (TorchRec's --scale divides the rows, embshard's
    multiplies them)."""
    scale = float(r.get("scale", "1") or 1)
    return 1 / scale if r.get("framework") == "torchrec" else scale


def dense_graph(r: dict[str, str]) -> bool:
    """Whether an e2e run replayed its dense step as a CUDA graph."""
    return r.get("cuda_graph", "0") == "1"


def whole_graph(r: dict[str, str]) -> bool:
    """Whether an e2e run replayed its whole step as a CUDA graph (embshard/training/step_graph.py)."""
    return r.get("whole_step", "0") == "1"


def graph_label(r: dict[str, str], short: bool = False) -> str:
    """How an e2e run used CUDA graphs, for the tables ("" without them)."""
    if whole_graph(r):
        return ", whole step as a CUDA graph" if not short else ", whole-step graph"
    if dense_graph(r):
        return ", dense step as a CUDA graph" if not short else ", CUDA graph"
    return ""


def case_of(r: dict[str, str]) -> str:
    """What a TorchRec run and an embshard run must share to be compared."""
    if bench_of(r) == "e2e":
        precision = r.get("precision") or r.get("dtype") or "fp32"
        law = (r.get("ids", "uniform"), r.get("bags", "fixed"))  # logs from before the law was printed: the default
        suffix = "" if law == ("uniform", "fixed") else " " + "/".join(law)
        rows = rows_fraction(r)
        size = f" world {r.get('world', '2')}" + ("" if abs(rows - 1) < 1e-9 else f" rows x{rows:g}")
        return f"e2e {r.get('pipeline', 'sparse_dist')} {precision}{suffix}{size}"
    return f"{bench_of(r)} {r.get('workload') or r.get('layout') or '-'}"


def setting_of(r: dict[str, str]) -> str:
    """The run's setting within its case (a row of the table)."""
    if r.get("framework") != "embshard":
        return ""
    if bench_of(r) == "e2e":
        compiled = r.get("compile", "none")
        graph = graph_label(r)
        return f"pooled {r.get('pooled', 'fp32')}" + ("" if compiled == "none" else f", compile {compiled}") + graph
    graph = ", one CUDA graph a step" if r.get("graph") == "1" else ""
    budget = f", {r['hbm_gib']} GiB budget" if r.get("hbm_gib", "0") != "0" else ""
    return f"plan {r.get('plan', 'planner')}{budget}{graph}"


@dataclass
class Folder:
    """One results folder: its META fields, commands, runs in order (with their file) and measured bandwidths."""

    path: Path
    meta: dict[str, str] = field(default_factory=dict)
    commands: list[tuple[str, str]] = field(default_factory=list)
    """(file, command) in order."""
    notes: list[str] = field(default_factory=list)
    runs: list[dict[str, str]] = field(default_factory=list)
    bandwidth: dict[str, float] = field(default_factory=dict)

    @property
    def gpu(self) -> str:
        return self.meta.get("gpu", "unknown GPU")

    @property
    def date(self) -> str:
        return self.meta.get("date", self.path.name[:10])

    @property
    def when(self) -> tuple[str, str, str]:
        """Sort key: date, then time of day where the logs give it (a folder without one counts as earlier)."""
        return self.date, self.meta.get("time", ""), self.path.name


def reads_file(name: str) -> bool:
    """Whether a run's file counts in the table: the suites' *.log and the notes' *.txt, not interop* (TorchRec's
    runtime on two plans is no framework comparison; docs/benchmarks.md has its own section)."""
    return name.endswith((".log", ".txt")) and not name.startswith("interop")


SUMMARY_MARK = "Generated by `python -m bench.summarize`"  # the first words of a summary's preamble
SECTION = re.compile(r"^### (\S+)\n+```(\w*)\n(.*?)^```$", re.M | re.S)


def sections(path: Path) -> list[tuple[str, str]]:
    """(file, text) of a run's files that count, in the order they are read (name order, meta.txt last): the
    `log` blocks of its summary.md (python -m bench.summarize), or the raw files of a run's output folder."""
    summary = path / "summary.md"
    if summary.exists() and SUMMARY_MARK in summary.read_text():
        found = [(f, body) for f, tag, body in SECTION.findall(summary.read_text()) if tag == "log"]
    else:
        found = [(p.name, p.read_text(errors="replace")) for p in path.iterdir() if p.is_file() and reads_file(p.name)]
    return sorted(found, key=lambda x: (x[0] == "meta.txt", x[0]))


def load(path: Path) -> Folder:
    folder = Folder(path)
    seen: dict[str, list[float]] = {}
    for name, text in sections(path):
        for line in text.splitlines():
            if line.startswith("META "):
                for k, v in (kv.split("=", 1) for kv in shlex.split(line[5:]) if "=" in kv):
                    if k == "command":
                        folder.commands.append((name, v))
                    elif k == "note":
                        folder.notes.append(v)
                    else:
                        folder.meta[k] = v
                continue
            r = parse_line(line)
            if r is not None:
                folder.runs.append(r | {"_file": name})
                continue
            for kind, pattern in BANDWIDTH_LINES.items():
                m = pattern.search(line)
                if m:
                    seen.setdefault(kind, []).append(float(m.group(1)))
    folder.bandwidth = {k: statistics.median(v) * 1e9 for k, v in seen.items()}
    return folder


@dataclass
class Row:
    """One table row: a case and embshard setting, with its runs and the ratios of its pairs."""

    case: str
    setting: str
    folder: Folder
    theirs: str = ""
    """TorchRec's setting beyond its precision (torchrec_setting; "" for its plain run)."""
    base: list[dict[str, str]] = field(default_factory=list)
    emb: list[dict[str, str]] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)


def torchrec_setting(r: dict[str, str]) -> str:
    """TorchRec's speed knobs of an end-to-end run beyond its precision ("" for the plain run): at its best
    `--qcomm bf16 --emb-output bf16 --compile-dense` (bench/baselines/torchrec_dlrm_train.py)."""
    knobs = []
    if r.get("qcomm", "none") != "none":
        knobs.append(f"qcomm {r['qcomm']}")
    if r.get("emb_output", "fp32") != "fp32":
        knobs.append(f"emb output {r['emb_output']}")
    if r.get("compile_dense", "0") == "1":
        knobs.append("compiled dense")
    return ", ".join(knobs)


def rows_of(folder: Folder) -> dict[tuple[str, str, str], Row]:
    """The folder's e2e and emb runs grouped into rows, each embshard run paired with its case's latest TorchRec
    run(s) of the same file (or of the same explicit pair=K), once per TorchRec setting of the case (plain, at its
    best): one row per (case, embshard setting, TorchRec setting)."""
    pairs: dict[tuple, list[dict[str, str]]] = {}
    latest: dict[tuple[str, str], dict[str, tuple]] = {}
    rows: dict[tuple[str, str, str], Row] = {}
    base_of: dict[tuple[str, str], list[dict[str, str]]] = {}
    for r in folder.runs:
        if bench_of(r) not in ("e2e", "emb") or "ms_per_step" not in r:
            continue
        case = case_of(r)
        explicit = (r["_file"], case, "pair", r["pair"]) if "pair" in r else None
        if r.get("framework") == "torchrec":
            theirs = torchrec_setting(r)
            key = explicit or (r["_file"], case, "run", len(pairs))
            pairs.setdefault(key, []).append(r)
            latest.setdefault((r["_file"], case), {})[theirs] = key
            base_of.setdefault((case, theirs), []).append(r)
            continue
        keys = {"": explicit} if explicit else latest.get((r["_file"], case)) or {"": None}
        for theirs, key in keys.items():
            row = rows.setdefault((case, setting_of(r), theirs), Row(case, setting_of(r), folder, theirs=theirs))
            row.emb.append(r)
            for b in pairs.get(key, []) if key else []:
                row.ratios.append(float(b["ms_per_step"]) / float(r["ms_per_step"]))
    for row in rows.values():
        row.base = base_of.get((row.case, row.theirs), [])
    return rows
