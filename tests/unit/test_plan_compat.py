"""`proxyshift plan -f`: the compatibility report after the stage table (no cluster needed)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxyshift.api.kubeproxy import KubeProxyConfiguration
from proxyshift.api.policy import ProxyPolicy
from proxyshift.controller import plan_view, snapshot
from proxyshift.planner import world as w
from proxyshift.planner.preview import BASELINE_SOURCE, compat_preview
from proxyshift.planner.services import ServiceView, endpoints_from_slice, service_view_from_k8s
from proxyshift.render.kubeproxyconfig import baseline_config

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "kubeadm"
CM = yaml.safe_load((FIXTURES / "kube-proxy-configmap.yaml").read_text())
DS = yaml.safe_load((FIXTURES / "kube-proxy-daemonset.yaml").read_text())



def _view(body: dict[str, Any]) -> ServiceView:
    """The Service's view; every Service below has one (a ClusterIP)."""
    view = service_view_from_k8s(body)
    assert view is not None
    return view


SERVICES = [_view(b) for b in [
    {"metadata": {"namespace": "default", "name": "web"},
     "spec": {"type": "NodePort", "clusterIP": "198.19.0.20", "ports": [{"port": 80, "nodePort": 30080}]}},
    {"metadata": {"namespace": "default", "name": "dns"},
     "spec": {"clusterIP": "198.19.0.53", "ports": [{"port": 53, "protocol": "UDP"}]}},
]]
ENDPOINTS = endpoints_from_slice({
    "metadata": {"namespace": "default", "labels": {"kubernetes.io/service-name": "web"}},
    "endpoints": [{"addresses": ["198.18.1.1"], "nodeName": "n1"}]})


def policy(**spec: Any) -> ProxyPolicy:
    return ProxyPolicy.model_validate({
        "metadata": {"name": "blue", "uid": "u-1", "generation": 1, "creationTimestamp": "2026-11-30T10:00:00Z"},
        "spec": {"nodeSelector": {"matchLabels": {"pool": "blue"}}, "mode": "nftables", **spec},
    })


def world(p: ProxyPolicy, labels: dict[str, dict[str, str]] | None = None,
          revisions: dict[str, w.RevisionView] | None = None) -> w.World:
    targets, errors = snapshot.current_revisions({"blue": p}, CM, DS)
    assert not errors
    nodes = {n: w.NodeView(n, {"pool": "blue", **(labels or {}).get(n, {})}) for n in ("n1", "n2", "n3")}
    return w.World(now=datetime.now(UTC), policies={"blue": p}, nodes=nodes, proxynodes={}, revisions=revisions or {},
                   kube_proxy_pods={}, current_revisions=targets)


def report(p: ProxyPolicy, world_: w.World, configs: dict[str, KubeProxyConfiguration | None] | None = None) -> str:
    return plan_view.compat_report(p, world_, SERVICES, ENDPOINTS, configs or {BASELINE_SOURCE: baseline_config(CM)})


def test_iptables_baseline_to_nftables_names_the_services_and_the_settings() -> None:
    p = policy()
    text = report(p, world(p))
    assert text.splitlines()[0] == ("compatibility: iptables -> nftables for 3 node(s) on the baseline kube-proxy "
                                    "(n1, n2, n3)")
    assert "LocalhostNodePorts   nftables mode serves no NodePorts on 127.0.0.1" in text
    assert "affects 1 Service(s): default/web" in text
    assert ("keep today's behaviour with nodePortAddresses: [0.0.0.0/0] (or [all]); or accept it with "
            "gate.behaviour.allowChanges: [NodePortAddresses]") in text
    assert "NodePortFirewall" in text and "no kube-proxy setting keeps today's behaviour" in text
    assert "ConntrackInvalid" in text and "conntrack.tcpBeLiberal: true" in text
    assert "ForeignIPVSFlush" in text


def test_settings_in_the_policy_show_as_preserved() -> None:
    p = policy(nodePortAddresses=["0.0.0.0/0", "localhost"], conntrack={"tcpBeLiberal": True},
               nftables={"localhostNodePorts": True})
    text = report(p, world(p))
    assert "NodePortAddresses    kept by nodePortAddresses:" in text
    assert "ConntrackInvalid     kept by conntrack.tcpBeLiberal: true:" in text
    assert "LocalhostNodePorts   kept by nftables.localhostNodePorts: true:" in text  # the only NodePort is TCP


def test_one_group_per_source_mode() -> None:
    p = policy()
    revisions = {"green-abc": w.RevisionView("green-abc", "green", "ipvs", "abc")}
    world_ = world(p, labels={"n3": {"proxyshift.io/revision": "green-abc"}}, revisions=revisions)
    groups = compat_preview(world_, "blue", {BASELINE_SOURCE: baseline_config(CM), "green-abc": None}, None,
                            SERVICES, ENDPOINTS)
    assert [(g.source, g.mode, g.nodes) for g in groups] == [("baseline", "iptables", ["n1", "n2"]),
                                                            ("green-abc", "ipvs", ["n3"])]
    text = plan_view.render_compat(p, groups)
    assert "compatibility: ipvs -> nftables for 1 node(s) on revision green-abc (n3)" in text
    assert "IPVSScheduler" in text and "rr (round robin)" in text


def test_nothing_to_move_says_so() -> None:
    p = policy()
    assert plan_view.render_compat(p, []) == "compatibility: no node would change mode or configuration"
    same = ProxyPolicy.model_validate({**p.model_dump(by_alias=True), "spec": {
        "nodeSelector": {"matchLabels": {"pool": "blue"}}, "mode": "iptables"}})
    text = report(same, world(same))
    assert "iptables -> iptables" in text and "no known behaviour difference" in text
