"""Property, on the guest's real IPVS: whatever a user's virtual servers, real servers, sets and
addresses are, the ipvs flush leaves them exactly as `ipvsadm -Sn`, `ipset save` and `ip addr` showed them.

Like tests/dataplane/test_agent_flush_property.py for iptables. Each example
gets a fresh namespace: the user's objects first (snapshot), then a kube-proxy
ipvs-mode state (kube-ipvs0 with ClusterIPs, their virtual servers and a
NodePort one on the node address, the KUBE-* sets, the ipvs-mode chains),
then the flush for nftables; every snapshot must come back byte for byte.
8 examples: about 20 s each under emulation.
"""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxyshift.agent.flush import flush
from proxyshift.agent.flush.iptables import IptablesTool
from proxyshift.agent.ownership import is_kube_proxy_ipset
from tests.support.kp_rules import ipvs_mode_ipsets, ipvs_mode_rules
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.vm_guest

NODE_IP = "198.18.0.11"
KUBE_NODEPORT = 30080  # in ipvs_mode_ipsets()' KUBE-NODE-PORT-TCP
KUBE_SERVICES = 5
SCHEDULERS = ["rr", "wrr", "lc", "wlc", "sh", "mh", "dh", "sed", "nq"]
# A user's virtual server on a local address with a port in kube-proxy's NodePort set is, by the
# evidence the flush goes by, a NodePort kube-proxy made (docs/agent.md); users avoid it, so do we.
PORT = st.integers(1, 65535).filter(lambda p: p != KUBE_NODEPORT)
USER_HOST = st.integers(0, 1023).map(lambda i: str(ipaddress.IPv4Address("198.18.200.0") + i))
SET_NAME = st.from_regex(r"(user|KUBE-MY|KUBE-ALLOWED|KUBE-CLUSTER-IP|KUBE-NODE-PORT-TCP)[A-Z0-9-]{0,6}",
                         fullmatch=True).filter(lambda n: not is_kube_proxy_ipset(n))


@st.composite
def virtual_server(draw: st.DrawFn) -> list[str]:
    kind = draw(st.sampled_from(["-t", "-u", "-f", "node"]))
    if kind == "-f":
        service = f"-f {draw(st.integers(1, 10000))}"
    elif kind == "node":
        service = f"-t {NODE_IP}:{draw(PORT)}"
    else:
        service = f"{kind} {draw(USER_HOST)}:{draw(PORT)}"
    line = f"-A {service} -s {draw(st.sampled_from(SCHEDULERS))}"
    if draw(st.booleans()):
        line += f" -p {draw(st.integers(1, 3600))}"
    lines = [line]
    for host in draw(st.lists(st.integers(1, 250), max_size=3, unique=True)):
        port = "" if kind == "-f" else f":{draw(st.integers(1, 65535))}"
        lines.append(f"-a {service} -r 198.18.17.{host}{port} -m -w {draw(st.integers(0, 100))}")
    return lines


@st.composite
def user_objects(draw: st.DrawFn) -> tuple[list[list[str]], list[str], list[str]]:
    services = draw(st.lists(virtual_server(), max_size=5, unique_by=lambda vs: vs[0].split(" -s ")[0]))
    sets: list[str] = []
    for name in draw(st.lists(SET_NAME, max_size=3, unique=True)):
        if draw(st.booleans()):
            sets.append(f"create {name} hash:ip family inet hashsize 1024 maxelem 65536")
            sets += [f"add {name} {h}" for h in draw(st.lists(USER_HOST, max_size=3, unique=True))]
        else:
            sets.append(f"create {name} hash:net family inet hashsize 1024 maxelem 65536")
            sets += [f"add {name} 198.18.{o}.0/24" for o in draw(st.lists(st.integers(100, 199), max_size=3,
                                                                                unique=True))]
    addrs = [f"{h}/{p}" for h, p in draw(st.lists(st.tuples(USER_HOST, st.sampled_from([32, 24])), max_size=3,
                                                  unique_by=lambda t: t[0]))]
    return services, sets, addrs


def kube_proxy_state(ns: Netns) -> None:
    ns.run(["ip", "link", "add", "kube-ipvs0", "type", "dummy"])
    script = []
    for i in range(KUBE_SERVICES):
        ip = str(ipaddress.IPv4Address("198.19.0.10") + i)
        ns.run(["ip", "addr", "add", f"{ip}/32", "dev", "kube-ipvs0"])
        script += [f"-A -t {ip}:80 -s rr", f"-a -t {ip}:80 -r 198.18.16.{i + 1}:8080 -m -w 1"]
    script += [f"-A -t {NODE_IP}:{KUBE_NODEPORT} -s rr", f"-a -t {NODE_IP}:{KUBE_NODEPORT} -r 198.18.16.1:8080 -m -w 1"]
    ns.run(["ipvsadm", "-R"], input="\n".join(script) + "\n")
    ns.run(["ipset", "restore"], input=ipvs_mode_ipsets(services=KUBE_SERVICES))
    ns.restore(ipvs_mode_rules())


BUILTIN = (":INPUT ", ":FORWARD ", ":OUTPUT ", ":PREROUTING ", ":POSTROUTING ")


def view(ns: Netns) -> dict[str, str]:
    # iptables: every rule and non-built-in chain. A table the flush emptied stays as an empty
    # skeleton, which is not an object of anyone's.
    rules = [line for line in ns.save().splitlines() if line.startswith("-A")
             or (line.startswith(":") and not line.startswith(BUILTIN))]
    return {"ipvs": ns.run(["ipvsadm", "-Sn"]).stdout, "ipsets": ns.run(["ipset", "save"]).stdout,
            "user0": ns.run(["ip", "addr", "show", "dev", "user0"]).stdout, "iptables": "\n".join(rules)}


@settings(max_examples=8, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(user_objects())
def test_random_user_ipvs_objects_survive_the_flush_byte_for_byte(
        objects: tuple[list[list[str]], list[str], list[str]]) -> None:
    services, sets, addrs = objects
    ns = Netns()
    try:
        ns.run(["ip", "link", "set", "lo", "up"])
        ns.run(["ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo"])
        ns.run(["ip", "link", "add", "user0", "type", "dummy"])
        for addr in addrs:
            ns.run(["ip", "addr", "add", addr, "dev", "user0"])
        if services:
            ns.run(["ipvsadm", "-R"], input="".join(f"{line}\n" for vs in services for line in vs))
        if sets:
            ns.run(["ipset", "restore"], input="".join(f"{line}\n" for line in sets))
        before = view(ns)
        kube_proxy_state(ns)
        assert view(ns) != before

        report = flush(["iptables", "ipvs"], "nftables", runner=ns.run, iptables_tools=[IptablesTool("ipv4", "nft")])

        assert report.ok, report.message()
        ipvs_step = next(s for s in report.steps if s.tool == "ipvs")
        assert ipvs_step.removed.get("virtual servers") == KUBE_SERVICES + 1
        assert view(ns) == before
    finally:
        ns.delete()
