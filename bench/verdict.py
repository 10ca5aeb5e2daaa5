"""The end of a benchmark's checks: ALL PASS or how many failed, printed and written after the check's lines."""

from __future__ import annotations

from pathlib import Path


def finish(lines: list[str], failures: int, path: Path) -> int:
    """Append the verdict to `lines`, print it, write every line to `path` (its folder made); the exit code (1 if
    any check failed)."""
    lines.append("ALL PASS" if not failures else f"{failures} FAILED")
    print(lines[-1], flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return 1 if failures else 0
