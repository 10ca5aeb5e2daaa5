"""Where things are, for tests in any folder of tests/: the repository root, tests/ (its helpers) and data/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = ROOT / "data"
