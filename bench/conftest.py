"""Benchmarks (`make bench`): speed targets live here, never in the test suite."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]  # the `harness` package
