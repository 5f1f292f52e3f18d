"""Fixtures for the operator e2e tests: proxyshift installed, an operator process, a harness.

They live in operator_harness.py, shared with tests/reliability.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from operator_harness import harness, operator_process, proxyshift_installed

__all__ = ["harness", "operator_process", "proxyshift_installed"]
