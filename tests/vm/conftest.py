"""The vm layer: tests that need a kernel with IPVS run inside the QEMU guest.

On the host, `pytest -m vm` runs tests/vm/test_in_guest.py, which boots ONE
guest (localcluster.vm) and runs every test marked `vm_guest`
(tests/vm/guest/) inside it with the host's own checkout and Python, then
reports each guest test as a host test, with the guest's failure text.

The guest tests themselves are deselected on the host (they would meet a
kernel without IPVS here); inside the guest PROXYSHIFT_IN_VM=1 is set and only
they are selected (`-m vm_guest`). They are never skipped: they run, in the guest.
The guest tests share the dataplane's helpers through tests/support (ps_netns,
kube_proxy_runner, kp_rules, fake_apiserver); the guest runs pytest in the same
checkout, so the same `pythonpath` setting finds them.
"""

from __future__ import annotations

import pytest
from vm_layer import VM_E2E_SUMMARY_KEY, VM_SUMMARY_KEY, VM_USER_IPVS_SUMMARY_KEY, in_guest

# The operator fixtures of tests/e2e for the staged rollout with a node in the guest
# (test_vm_staged_rollout.py, on the host); the guest's own pytest has no cluster and skips the import.
if not in_guest():
    from tests.support.operator_harness import harness, operator_process, proxyshift_installed

    __all__ = ["harness", "operator_process", "proxyshift_installed"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if in_guest():
        return
    guest_items = [item for item in items if item.get_closest_marker("vm_guest")]
    if guest_items:
        # Not skipped: test_in_guest.py runs each of them inside the guest and reports it.
        items[:] = [item for item in items if not item.get_closest_marker("vm_guest")]
        config.hook.pytest_deselected(items=guest_items)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    stashed = [config.stash.get(key, None) for key in (VM_SUMMARY_KEY, VM_E2E_SUMMARY_KEY, VM_USER_IPVS_SUMMARY_KEY)]
    lines = [line for line in stashed if line]
    if lines:
        terminalreporter.write_sep("-", "vm layer")
        for line in lines:
            terminalreporter.write_line(line)
