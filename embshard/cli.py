"""`embshard` command line: one sub-command per module, each with its own `main(argv)`."""

from __future__ import annotations

import importlib
import sys

from embshard.runtime.heap import collector_paused, skip_teardown

COMMANDS = {
    "train": ("embshard.training.train", "train a YAML-configured model (torchrun, or --nproc N local processes)"),
    "plan": ("embshard.tools.plan", "plan a model's sharding without GPUs and print or save the plan"),
    "calibrate": ("embshard.tools.calibrate", "measure this machine's bandwidths into a topology file"),
    "preprocess": ("embshard.data.preprocess", "convert raw data files (Criteo TSV, CSV, Parquet) to training Parquet"),
    "checkpoint": ("embshard.tools.checkpoint", "inspect a checkpoint, or export its tables as safetensors files"),
    "export": ("embshard.tools.export", "export serving: a checkpoint as a quantized serving artifact"),
    "predict": ("embshard.tools.predict", "score data files with a serving artifact into a Parquet file"),
    "serve": ("embshard.tools.serve", "score JSON requests over HTTP with a serving artifact"),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:10s} {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: embshard COMMAND [args]\n\ncommands:\n" + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}", file=sys.stderr)
            sys.exit(2)
        return
    with collector_paused():  # torch and the libraries: imported once, then left out of Python's collections
        module = importlib.import_module(COMMANDS[argv[0]][0])
    module.main(argv[1:])


def run() -> None:
    """The `embshard` program (and `python -m embshard.cli`): `main`, then the process ends with its status without
    tearing torch's modules down (runtime/heap.py `skip_teardown`: about 1 s of CPU saved a process, every rank's
    under torchrun included). An exception that escapes ends it as any process (the traceback, status 1)."""
    skip_teardown()  # before the command's imports: its handler runs after theirs
    try:
        main()
    except SystemExit as e:
        skip_teardown(e.code if isinstance(e.code, int) else 0 if e.code is None else 1)
        raise
    skip_teardown(0)


if __name__ == "__main__":
    run()
