"""Helpers that several test folders and the benchmarks share (ps_netns, kp_rules, kube_proxy_runner, ...).

Imported as `tests.support.<module>`: pytest puts the repository root on sys.path (`pythonpath` in
pyproject.toml), and a benchmark runs as `python3 -m bench.<name>` from the root. A helper that runs as
its own process (fake_apiserver) is started as `python -m tests.support.<module>` with REPO as its
working directory, so that process finds the package the same way.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
