"""`proxyshift diagnose`'s node side on real iptables and nftables rules: counters after real connections.

A namespace of the test's own with only a loopback device: endpoint addresses 198.18.200.1-3 and a
client address on lo, a route for the ClusterIP 198.19.200.10 into lo (nothing leaves the namespace),
real listeners that answer with their own address, and a hand-made kube-proxy rule set
(KUBE-SERVICES -> KUBE-SVC- -> KUBE-SEP- DNAT, comments as kube-proxy writes them). The agent's
reader (iptables-save -c, conntrack -L, inside the namespace) must count exactly what the client saw.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxyshift.agent.conntrack import parse_flows
from proxyshift.agent.diagnostics import ConntrackCounts, Readers, conntrack_queries, count_flows, read_service, serve
from proxyshift.api.diagnostics import DiagnosePort, DiagnoseRequest, DiagnoseService
from proxyshift.commands import Result, stop_child
from proxyshift.planner.diagnosis import diagnose
from proxyshift.planner.services import EndpointView, ServicePortView, ServiceView
from tests.support.ps_netns import Netns

pytestmark = pytest.mark.dataplane

CLUSTER_IP = "198.19.200.10"
CLIENT = "198.18.200.100"
ENDPOINTS = ["198.18.200.1", "198.18.200.2", "198.18.200.3"]
KEY = "ps-diag/web"

SERVER = """
import socket, sys, threading
def serve(address):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((address, 8080))
    s.listen(128)
    while True:
        c, _ = s.accept()
        c.sendall(address.encode() + b"\\n")  # kept open: the client decides when a connection ends
        threading.Thread(target=lambda c=c: (c.recv(1), c.close()), daemon=True).start()
for a in sys.argv[1:]:
    threading.Thread(target=serve, args=(a,), daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""

CLIENT_SCRIPT = """
import collections, json, socket, sys
n, held = int(sys.argv[1]), int(sys.argv[2])
seen, kept = collections.Counter(), []
for i in range(n + held):
    c = socket.create_connection((sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 80), timeout=3)
    seen[c.makefile().readline().strip()] += 1
    (kept.append(c) if i >= n else c.close())
print(json.dumps(seen), flush=True)
sys.stdin.read()
"""


def rules(*, affinity: bool, endpoints: list[str]) -> str:
    """kube-proxy's iptables-mode chains for one Service port, with its comments.

    The choice between endpoints is `statistic --mode nth` rather than kube-proxy's `--mode random`:
    the counters are what this test checks, and a deterministic split makes "balanced" a fact, not a
    1-in-100 chance of a false alarm.
    """
    seps = [f"KUBE-SEP-DIAGTEST00000{i}" for i in range(len(endpoints))]
    lines = ["*nat", ":KUBE-SERVICES - [0:0]", ":KUBE-SVC-DIAGTEST0000000 - [0:0]", *[f":{s} - [0:0]" for s in seps],
             '-A OUTPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES',
             f'-A KUBE-SERVICES -d {CLUSTER_IP}/32 -p tcp -m comment --comment "{KEY}:http cluster IP" '
             "-m tcp --dport 80 -j KUBE-SVC-DIAGTEST0000000"]
    if affinity:
        lines += [f'-A KUBE-SVC-DIAGTEST0000000 -m comment --comment "{KEY}:http -> {ep}:8080" -m recent '
                  f"--name {sep} --rcheck --seconds 10800 --reap -j {sep}" for ep, sep in zip(endpoints, seps,
                                                                                              strict=True)]
    for i, (ep, sep) in enumerate(zip(endpoints, seps, strict=True)):
        left = len(endpoints) - i
        pick = f"-m statistic --mode nth --every {left} --packet 0 " if left > 1 else ""
        lines.append(f'-A KUBE-SVC-DIAGTEST0000000 -m comment --comment "{KEY}:http -> {ep}:8080" {pick}-j {sep}')
    for ep, sep in zip(endpoints, seps, strict=True):
        remember = f"-m recent --set --name {sep} --mask 255.255.255.255 --rsource " if affinity else ""
        lines.append(f'-A {sep} -p tcp -m comment --comment "{KEY}:http" {remember}-m tcp '
                     f"-j DNAT --to-destination {ep}:8080")
    return "\n".join([*lines, "COMMIT", ""])


@pytest.fixture
def node(netns: Netns) -> Iterator[Netns]:
    netns.run(["ip", "link", "set", "lo", "up"])
    for address in [*ENDPOINTS, CLIENT]:
        netns.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"])
    netns.run(["ip", "route", "add", f"{CLUSTER_IP}/32", "dev", "lo", "src", CLIENT])
    server = subprocess.Popen(["ip", "netns", "exec", netns.name, sys.executable, "-c", SERVER, *ENDPOINTS],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield netns
    finally:
        stop_child(server, grace=5)


def connect(netns: Netns, n: int, held: int, target: str = CLUSTER_IP,
            port: int = 80) -> tuple[dict[str, int], subprocess.Popen[str]]:
    """n connections closed at once, then `held` kept open (long-lived) until the returned client is stopped."""
    client = subprocess.Popen(["ip", "netns", "exec", netns.name, sys.executable, "-c", CLIENT_SCRIPT, str(n),
                               str(held), target, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert client.stdout is not None
    line = client.stdout.readline()
    assert line, "the client failed to connect through the rules"
    return json.loads(line), client


# populate_by_name: pydantic takes the field's name; mypy knows only its alias, clusterIPs.
SERVICE = DiagnoseService(namespace="ps-diag", name="web", cluster_ips=[CLUSTER_IP],  # type: ignore[call-arg]
                          ports=[DiagnosePort(name="http", port=80)], endpoints=ENDPOINTS)


def view(**kw: Any) -> ServiceView:
    return ServiceView(namespace="ps-diag", name="web", cluster_ips=(CLUSTER_IP,),
                       ports=(ServicePortView(name="http", protocol="TCP", port=80),), **kw)


def test_rule_counters_after_real_connections_are_each_endpoints_flows(node: Netns) -> None:
    node.restore(rules(affinity=False, endpoints=ENDPOINTS))
    seen, client = connect(node, 90, 3)
    try:
        counters = read_service(SERVICE, "iptables", Readers(runner=node.run))
    finally:
        stop_child(client, grace=5)
    assert counters.source == "iptables" and not counters.errors, counters
    flows = {e.address: e.flows for e in counters.endpoints}
    assert flows == {ep: seen.get(ep, 0) for ep in ENDPOINTS} and sum(f or 0 for f in flows.values()) == 93
    assert sorted(counters.rules) == sorted(["KUBE-SVC-DIAGTEST0000000 (3 rules)"]
                                            + [f"KUBE-SEP-DIAGTEST00000{i} (1 rules)" for i in range(3)])
    # The three held connections are ESTABLISHED in the namespace's conntrack table, the closed ones are not.
    assert sum(e.conntrack_established for e in counters.endpoints) == 3
    assert sum(e.conntrack_entries for e in counters.endpoints) == 93
    slices = [EndpointView(service=KEY, address=ep, ready=True) for ep in ENDPOINTS]
    d = diagnose(view(), slices, "ps-test", counters, "iptables")
    assert d.verdict == "balanced" and not d.causes, d
    print(f"\nflows per endpoint {flows}, verdict {d.verdict} (p={d.p_value:.2f})")


def test_affinity_and_a_not_ready_endpoint_are_named_from_real_counters(node: Netns) -> None:
    # kube-proxy writes no rule for a not-ready endpoint: the Service's rules list only the two ready ones.
    node.restore(rules(affinity=True, endpoints=ENDPOINTS[:2]))
    seen, client = connect(node, 40, 0)
    stop_child(client, grace=5)
    assert len(seen) == 1, f"ClientIP affinity sent one client to {seen}"
    counters = read_service(SERVICE, "iptables", Readers(runner=node.run))
    slices = [EndpointView(service=KEY, address=ep, ready=ep != ENDPOINTS[2]) for ep in ENDPOINTS]
    d = diagnose(view(session_affinity="ClientIP", affinity_timeout_seconds=10800), slices, "ps-test", counters,
                 "iptables")
    assert d.verdict == "uneven"
    assert {c.name for c in d.causes} == {"ClientIPAffinity", "EndpointNotReady"}, d.causes
    print("\n" + "\n".join(f"{c.name}: {c.message}" for c in d.causes))


def nft_rules(endpoints: list[str]) -> str:
    """kube-proxy 1.37's nftables shape for one Service port (one dnat over a numgen map, no counters).

    `numgen inc` where kube-proxy has `numgen random`, for the same reason as the iptables rules' nth.
    """
    elements = ", ".join(f"{i} : {ep} . 8080" for i, ep in enumerate(endpoints))
    return f"""table ip kube-proxy {{
	chain service-DIAGTEST-ps-diag/web/tcp/http {{
		meta l4proto tcp dnat ip to numgen inc mod {len(endpoints)} map {{ {elements} }}
	}}
	chain nat-output {{
		type nat hook output priority -100; policy accept;
		ip daddr {CLUSTER_IP} tcp dport 80 goto service-DIAGTEST-ps-diag/web/tcp/http
	}}
}}
"""


def test_nftables_mode_counts_conntrack_entries_by_endpoint(node: Netns) -> None:
    node.run(["nft", "-f", "-"], input=nft_rules(ENDPOINTS))
    seen, client = connect(node, 60, 2)  # 53 flows are the floor of "balanced" over three endpoints
    try:
        counters = read_service(SERVICE, "nftables", Readers(runner=node.run))
    finally:
        stop_child(client, grace=5)
    assert counters.source == "conntrack" and not counters.errors, counters
    # Closed connections stay in conntrack (TIME_WAIT) for minutes: every flow is still there.
    assert {e.address: e.conntrack_entries for e in counters.endpoints} == {ep: seen.get(ep, 0) for ep in ENDPOINTS}
    assert sum(e.conntrack_established for e in counters.endpoints) == 2
    slices = [EndpointView(service=KEY, address=ep, ready=True) for ep in ENDPOINTS]
    d = diagnose(view(), slices, "ps-test", counters, "nftables")
    assert d.basis == "conntrack entries" and d.verdict == "balanced", d


OTHER_IP = "198.19.200.11"  # a second Service on the same port 80: only the address tells their flows apart
NODE_PORT = 30080


def two_services_nft() -> str:
    """web (ClusterIP and NodePort 30080 on the client address) over all endpoints, api over the third alone."""
    elements = ", ".join(f"{i} : {ep} . 8080" for i, ep in enumerate(ENDPOINTS[:2]))
    return f"""table ip kube-proxy {{
	chain service-web {{
		meta l4proto tcp dnat ip to numgen inc mod 2 map {{ {elements} }}
	}}
	chain service-api {{
		meta l4proto tcp dnat ip to {ENDPOINTS[2]}:8080
	}}
	chain nat-output {{
		type nat hook output priority -100; policy accept;
		ip daddr {CLUSTER_IP} tcp dport 80 goto service-web
		ip daddr {CLIENT} tcp dport {NODE_PORT} goto service-web
		ip daddr {OTHER_IP} tcp dport 80 goto service-api
	}}
}}
"""


def kernel_filtered(node: Netns, service: DiagnoseService) -> dict[str, tuple[int, int]]:
    """(entries, established) per endpoint ip, one kernel-filtered `conntrack -L` per look-up."""
    counts = ConntrackCounts()
    for query in conntrack_queries(service):
        count_flows(parse_flows(node.run(query.argv()).stdout)[0], counts)
    out: dict[str, tuple[int, int]] = {ep: (0, 0) for ep in service.endpoints}
    for endpoint, n in counts.entries.items():
        ip = endpoint.rsplit(":", 1)[0]
        entries, established = out.get(ip, (0, 0))
        out[ip] = (entries + n, established + counts.established.get(endpoint, 0))
    return out


def test_one_dump_answers_every_service_of_a_request_with_its_own_flows(node: Netns, tmp_path: Path) -> None:
    node.run(["ip", "route", "add", f"{OTHER_IP}/32", "dev", "lo", "src", CLIENT])
    node.run(["nft", "-f", "-"], input=two_services_nft())
    web = SERVICE.model_copy(update={"endpoints": ENDPOINTS[:2],
                                     "ports": [DiagnosePort(name="http", port=80, node_port=NODE_PORT)]})
    # populate_by_name, as SERVICE above.
    api = DiagnoseService(namespace="ps-diag", name="api", cluster_ips=[OTHER_IP],  # type: ignore[call-arg]
                          ports=[DiagnosePort(name="http", port=80)], endpoints=ENDPOINTS[2:])
    calls: list[list[str]] = []

    def runner(argv: list[str], timeout: float) -> Result:
        calls.append(argv)
        return node.run(argv, timeout=timeout)

    clients = []
    try:
        seen_web, c = connect(node, 20, 1)
        clients.append(c)
        seen_node_port, c = connect(node, 6, 1, CLIENT, NODE_PORT)
        clients.append(c)
        seen_api, c = connect(node, 9, 2, OTHER_IP)
        clients.append(c)
        # The table's size as the agent reads it, from the namespace the tools run in (not this process's).
        count = tmp_path / "sys" / "net" / "netfilter" / "nf_conntrack_count"
        count.parent.mkdir(parents=True)
        count.write_text(node.run(["cat", "/proc/sys/net/netfilter/nf_conntrack_count"]).stdout)
        answer = serve(DiagnoseRequest(id="d", services=[web, api]), "nftables",
                       Readers(runner=runner, proc_root=tmp_path))
        # The kernel's own filter, one `conntrack -L` per Service port (the path before), on the same flows.
        filtered = [kernel_filtered(node, s) for s in (web, api)]
    finally:
        for c in clients:
            stop_child(c, grace=5)
    assert [c for c in calls if c[0] == "conntrack"] == [["conntrack", "-L", "-f", "ipv4", "-p", "tcp", "-o", "xml"]]
    counted = {s.service: {e.address: (e.conntrack_entries, e.conntrack_established) for e in s.endpoints}
               for s in answer.services}
    expected_web = {ep: seen_web.get(ep, 0) + seen_node_port.get(ep, 0) for ep in ENDPOINTS[:2]}
    assert {a: n for a, (n, _) in counted[KEY].items()} == expected_web
    assert sum(est for _, est in counted[KEY].values()) == 2
    assert seen_api == {ENDPOINTS[2]: 11} and counted["ps-diag/api"] == {ENDPOINTS[2]: (11, 2)}
    assert not any(s.errors or s.truncated for s in answer.services), answer
    assert filtered == [{e.address: (e.conntrack_entries, e.conntrack_established) for e in s.endpoints}
                        for s in answer.services]
