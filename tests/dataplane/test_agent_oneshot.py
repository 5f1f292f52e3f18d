"""`proxyshift agent inventory|preflight|cleanup|probe` as a person runs them on a node (in a namespace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.kp_rules import iptables_mode_rules, kubelet_rules, nftables_mode_ruleset
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.dataplane
OPERATOR = Path(__file__).resolve().parents[2] / "operator"


def body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#")]


def agent(ns: Netns, *args: str) -> tuple[int, dict]:
    out = subprocess.run(["ip", "netns", "exec", ns.name, sys.executable, "-m", "proxyshift.cli", "agent", *args],
                         capture_output=True, text=True, timeout=120,
                         env={"PATH": os.environ["PATH"], "PYTHONPATH": str(OPERATOR)})
    return out.returncode, json.loads(out.stdout)


def test_inventory_dry_run_cleanup_and_probe_from_the_command_line(netns: Netns) -> None:
    netns.restore(kubelet_rules())
    netns.restore(iptables_mode_rules(50))
    netns.run(["nft", "-f", "-"], input=nftables_mode_ruleset(5))
    before = netns.save()

    code, inv = agent(netns, "inventory", "--observed-mode", "nftables")
    assert code == 0 and inv["leftovers"] == ["iptables"]

    code, dry = agent(netns, "cleanup", "--remove", "iptables", "--target", "nftables", "--dry-run")
    assert code == 0 and "dry run" in dry["message"]
    assert dry["steps"][0]["removed"]["chains"] > 150
    assert body(netns.save()) == body(before)       # a dry run changes nothing

    code, done = agent(netns, "cleanup", "--remove", "iptables", "--target", "nftables")
    assert code == 0 and done["ok"]
    code, inv = agent(netns, "inventory", "--observed-mode", "nftables")
    assert inv["leftovers"] == [] and [o["mode"] for o in inv["objects"]] == ["nftables"]

    code, pre = agent(netns, "preflight", "--mode", "nftables")
    assert code == 0 and pre["ok"]

    code, probe = agent(netns, "probe", "--metrics-address", "127.0.0.1:1", "--health-address", "127.0.0.1:1")
    assert code == 1 and probe["kubeProxy"]["error"]
