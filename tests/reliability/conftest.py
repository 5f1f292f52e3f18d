"""Fixtures for the reliability tests: the same operator harness as tests/e2e (one definition, imported)."""

from __future__ import annotations

from tests.support.operator_harness import harness, operator_process, proxyshift_installed

__all__ = ["harness", "operator_process", "proxyshift_installed"]
