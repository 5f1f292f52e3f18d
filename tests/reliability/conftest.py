"""Fixtures for the reliability tests: the same operator harness as tests/e2e (one definition, imported)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "e2e"))

from operator_harness import harness, operator_process, proxyshift_installed

__all__ = ["harness", "operator_process", "proxyshift_installed"]
