"""`down` cleans up after an `up` that failed half-way (the case state.json exists for)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from localcluster import build, controlplane, paths, state

pytestmark = pytest.mark.e2e


def _ports_free() -> bool:
    addresses = ["127.0.0.1"]
    if controlplane.can_bind(paths.BRIDGE_ADDRESS, 0):
        addresses.append(paths.BRIDGE_ADDRESS)
    ports = (paths.ETCD_CLIENT_PORT, paths.ETCD_PEER_PORT, paths.APISERVER_PORT)
    return all(controlplane.can_bind(a, p) for a in addresses for p in ports)


@pytest.mark.needs_free_ports
def test_failed_up_is_fully_removed_by_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("PROXYSHIFT_EXTERNAL_CLUSTER") == "1":
        pytest.skip("needs the local binaries")
    if not _ports_free():
        pytest.skip("a local cluster holds the control-plane ports (this test needs them for a moment)")
    bin_dir = build.build()
    real_argv = controlplane._apiserver_argv
    # An apiserver that refuses to start, after etcd is already running.
    monkeypatch.setattr(controlplane, "_apiserver_argv",
                        lambda *args: [*real_argv(*args), "--no-such-flag"])
    state_dir = tmp_path / "cluster"
    with pytest.raises(controlplane.ControlPlaneError, match="kube-apiserver exited"):
        controlplane.up_controlplane(state_dir, bin_dir=bin_dir)
    records = state.read_state(state_dir)["processes"]
    etcd = next(r for r in records if r["name"] == "etcd")
    assert state.is_alive(etcd), "etcd should still run after the failed up (down's job)"

    assert "etcd" in controlplane.down(state_dir)
    assert not any(state.is_alive(r) for r in records)
    assert not state_dir.exists()
    assert _ports_free()
    controlplane.down(state_dir)  # and again: idempotent
