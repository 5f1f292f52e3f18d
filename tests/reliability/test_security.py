"""Security (issue 8, item 3): least privilege, no shell, a flush that touches only kube-proxy's objects,
secrets never read.

Layers, by marker: `unit` (the RBAC manifests against docs/security.md, the AST scan), `dataplane` (root:
the agent under an exec audit hook in a network namespace; nftables flush fuzzing), `reliability` (the
local cluster: `kubectl auth can-i --list` against the documented set; a migration with the operator
logged in as its ServiceAccount while the API server's audit log watches for secrets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sec_checks as sec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from input_harness import scratch_dir

from tests.support.operator_harness import Harness, service_account_kubeconfig

OPERATOR_DIR = sec.ROOT / "operator"

# ================================================================ permissions


@pytest.mark.unit
def test_config_rbac_grants_exactly_the_documented_set() -> None:
    granted = sec.manifest_grants(sec.rbac_manifests())
    documented = sec.documented_grants()
    assert granted - documented == set(), "config/rbac grants what docs/security.md does not list"
    assert documented - granted == set(), "docs/security.md lists what config/rbac does not grant"
    # The walk must see both identities and both scopes, or it is not reading the manifests.
    assert {(g.who, g.where) for g in granted} == {("operator", "cluster"), ("operator", "kube-system"),
                                                   ("agent", "cluster")}


@pytest.mark.unit
def test_config_default_installs_config_rbac_and_no_other_roles() -> None:
    import yaml

    default = yaml.safe_load((sec.ROOT / "config" / "default" / "kustomization.yaml").read_text())
    assert "../rbac" in default["resources"]
    others = []
    for path in (sec.ROOT / "config").rglob("*.yaml"):
        if sec.RBAC_DIR in path.parents:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") in ("Role", "ClusterRole", "RoleBinding",
                                                             "ClusterRoleBinding"):
                others.append(f"{path.relative_to(sec.ROOT)}: {doc['kind']} {doc['metadata']['name']}")
    assert others == [], "RBAC outside config/rbac escapes the documented-set check"


@pytest.mark.unit
def test_rbac_has_no_secrets_wildcards_or_escalation() -> None:
    granted = sec.manifest_grants(sec.rbac_manifests())
    assert [g for g in granted if g.resource.split("/")[0] == "secrets"] == []
    assert [g for g in granted if "*" in (g.group, g.resource, g.verb)] == []
    assert [g for g in granted if g.verb in ("escalate", "bind", "impersonate", "approve", "sign")] == []
    assert [g for g in granted if g.group == "rbac.authorization.k8s.io"] == []
    assert [g for g in granted if g.resource == "pods" and g.verb not in ("get", "list", "watch")] == []


@pytest.mark.unit
def test_the_parsers_read_what_they_should() -> None:
    doc = textwrap.dedent("""\
        <!-- permissions:begin -->
        | who | where | apiGroup | resource | verbs | why |
        |---|---|---|---|---|---|
        | agent | cluster | proxyshift.io | proxynodes/status | get, patch | x |
        <!-- permissions:end -->
        """)
    assert sec.documented_grants(doc) == {sec.Grant("agent", "cluster", "proxyshift.io", "proxynodes/status", v)
                                          for v in ("get", "patch")}
    out = textwrap.dedent("""\
        Resources                                       Non-Resource URLs   Resource Names   Verbs
        selfsubjectreviews.authentication.k8s.io        []                  []               [create]
        pods/eviction                                   []                  []               [create]
                                                        [/healthz]          []               [get]
        configmaps                                      []                  [kube-proxy]     [get]
        """)
    assert sec.can_i_pairs(sec.parse_can_i_list(out)) == {
        ("selfsubjectreviews.authentication.k8s.io", "create"), ("pods/eviction", "create"), ("/healthz", "get"),
        ("configmaps[names=kube-proxy]", "get")}
    assert sec.Grant("o", "cluster", "apps", "daemonsets", "get").kubectl_resource == "daemonsets.apps"
    assert sec.Grant("o", "cluster", "core", "pods/eviction", "create").kubectl_resource == "pods/eviction"
    binding = [{"kind": "ClusterRole", "metadata": {"name": "r"},
                "rules": [{"apiGroups": ["*"], "resources": ["secrets"], "verbs": ["get"]}]},
               {"kind": "ClusterRoleBinding", "metadata": {"name": "b"}, "roleRef": {"kind": "ClusterRole",
                                                                                     "name": "r"},
                "subjects": [{"kind": "ServiceAccount", "namespace": sec.NAMESPACE, "name": "proxyshift-agent"}]}]
    assert sec.manifest_grants(binding) == {sec.Grant("agent", "cluster", "*", "secrets", "get")}


def _can_i_list(cluster: Any, user: str, namespace: str) -> set[tuple[str, str]]:
    out = cluster.kubectl("auth", "can-i", "--list", f"--as={user}", "-n", namespace).stdout
    return sec.can_i_pairs(sec.parse_can_i_list(out))


@pytest.mark.reliability
@pytest.mark.usefixtures("proxyshift_installed")
@pytest.mark.parametrize("who", sorted(sec.IDENTITIES))
def test_live_permissions_are_exactly_the_documented_set(cluster: Any, who: str) -> None:
    # What every ServiceAccount has anyway (discovery, self reviews), measured on one with no binding at all,
    # in another namespace so that a binding to proxyshift-system's SA group would not be subtracted.
    nobody = f"system:serviceaccount:ps-nobody-{uuid.uuid4().hex[:6]}:nobody"
    documented = sec.documented_grants()
    for namespace in ("kube-system", sec.NAMESPACE, "default"):
        baseline = _can_i_list(cluster, nobody, namespace)
        live = _can_i_list(cluster, sec.IDENTITIES[who], namespace) - baseline
        expected = {(g.kubectl_resource, g.verb) for g in documented
                    if g.who == who and g.where in ("cluster", namespace)}
        assert live - expected == set(), f"{who} in {namespace}: granted live, not documented"
        assert expected - live == set(), f"{who} in {namespace}: documented, not granted live"


@pytest.mark.reliability
@pytest.mark.usefixtures("proxyshift_installed")
@pytest.mark.parametrize("who", sorted(sec.IDENTITIES))
def test_no_secret_verb_is_allowed_anywhere(cluster: Any, who: str) -> None:
    for verb in ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"):
        result = cluster.kubectl("auth", "can-i", verb, "secrets", f"--as={sec.IDENTITIES[who]}",
                                 "--all-namespaces", check=False)
        assert result.stdout.strip() == "no", f"{who} may {verb} secrets: {result.stdout} {result.stderr}"


# ================================================================ no shell


@pytest.mark.unit
def test_nothing_in_the_package_runs_through_a_shell() -> None:
    files = sorted(sec.PACKAGE.rglob("*.py"))
    assert len(files) > 40
    found = [str(f) for p in files for f in sec.shell_findings(p.read_text(), str(p.relative_to(sec.ROOT)))]
    assert found == []


@pytest.mark.unit
def test_the_agents_code_paths_start_programs_only_through_commands_run() -> None:
    closure = sec.import_closure(["proxyshift.cli", "proxyshift.agent.loop", "proxyshift.agent.oneshot"])
    # The static closure must hold what the agent runs, or the scan looks at the wrong files.
    assert {"proxyshift.agent.flush.iptables", "proxyshift.agent.flush.nftables", "proxyshift.agent.flush.ipvs",
            "proxyshift.agent.preflight", "proxyshift.agent.inventory", "proxyshift.agent.probe",
            "proxyshift.commands"} <= set(closure)
    found = [str(f) for mod, path in closure.items() if mod != "proxyshift.commands"
             for f in sec.direct_process_starts(path.read_text(), str(path.relative_to(sec.ROOT)))]
    assert found == []


@pytest.mark.unit
def test_the_scanner_catches_each_way_to_a_shell() -> None:
    bad = textwrap.dedent("""\
        import os, subprocess
        from subprocess import getoutput as go
        subprocess.run("ls", shell=True)
        subprocess.Popen(cmd, shell=flag)
        os.system("ls")
        os.popen("ls")
        go("ls")
        run(["/bin/sh", "-c", "ls"])
        run(["bash", "-c", "ls"])
        x = "/usr/bin/bash"
        y = "sh -c 'ls'"
        """)
    lines = sorted(f.line for f in sec.shell_findings(bad, "bad.py"))
    assert lines == [3, 4, 5, 6, 7, 8, 8, 9, 10, 11], lines
    ok = 'run(["nft", "-f", "-"], input=x)\nsubprocess.run(["ip"], shell=False)\nscheduler = "sh"\n'
    assert sec.shell_findings(ok, "ok.py") == []
    direct = ("import os, subprocess\nfrom subprocess import Popen\nsubprocess.run(['x'])\nPopen(['y'])\n"
              "os.execvp('z', [])\n")
    assert [f.line for f in sec.direct_process_starts(direct, "d.py")] == [3, 4, 5]


# The audit hook the agent runs under: every process start, whatever API started it, goes to a file.
EXEC_HOOK = textwrap.dedent("""\
    import json, os, sys
    _log = open(os.environ["PS_EXEC_LOG"], "a", encoding="utf-8")
    _EVENTS = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
               "os.forkpty", "pty.spawn", "os.popen"}
    def _hook(event, args):
        if event in _EVENTS:
            _log.write(json.dumps({"event": event, "args": [repr(a) for a in args],
                                   "argv": list(map(str, args[1])) if event == "subprocess.Popen"
                                   and not isinstance(args[1], (str, bytes)) else None}) + "\\n")
            _log.flush()
    sys.addaudithook(_hook)
    from proxyshift.cli import main
    sys.exit(main(sys.argv[1:]))
    """)
AGENT_PROGRAMS = {"iptables", "ip6tables", "iptables-save", "ip6tables-save", "iptables-restore", "ip6tables-restore",
                  "iptables-nft-save", "ip6tables-nft-save", "iptables-nft-restore", "ip6tables-nft-restore",
                  "iptables-legacy-save", "ip6tables-legacy-save", "iptables-legacy-restore",
                  "ip6tables-legacy-restore", "nft", "ip", "ipset", "ipvsadm", "modprobe",
                  "tc"}  # Cilium's legacy tc filters, leaving cilium-kpr


@pytest.mark.dataplane
def test_the_agent_starts_no_shell_at_runtime(tmp_path: Path) -> None:
    from tests.support.kp_rules import iptables_mode_rules, kubelet_rules, nftables_mode_ruleset
    from tests.support.ps_netns import Netns, need_root

    need_root()
    ns = Netns()
    log = tmp_path / "execs.jsonl"
    try:
        ns.restore(kubelet_rules())
        ns.restore(iptables_mode_rules(5))
        ns.run(["nft", "-f", "-"], input=nftables_mode_ruleset(3))
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(OPERATOR_DIR), "PS_EXEC_LOG": str(log)}
        for args in (["inventory", "--observed-mode", "iptables"], ["preflight", "--mode", "ipvs"],
                     ["preflight", "--mode", "nftables"],
                     ["cleanup", "--remove", "nftables", "--remove", "ipvs", "--target", "iptables"],
                     ["cleanup", "--remove", "iptables", "--target", "nftables"],
                     ["cleanup", "--remove", "cilium-kpr", "--target", "iptables"],
                     ["probe", "--metrics-address", "127.0.0.1:1", "--health-address", "127.0.0.1:1",
                      "--service", "198.19.0.1:443"]):
            done = subprocess.run(["ip", "netns", "exec", ns.name, sys.executable, "-c", EXEC_HOOK, "agent", *args],
                                  capture_output=True, text=True, timeout=180, env=env, check=False)
            assert done.returncode in (0, 1), f"agent {args}: {done.returncode} {done.stderr[-2000:]}"
    finally:
        ns.delete()
    execs = [json.loads(line) for line in log.read_text().splitlines()]
    programs = Counter(Path(e["argv"][0]).name for e in execs if e["argv"])
    print(f"\nthe agent started {sum(programs.values())} processes: {dict(programs)}")
    # Positive control: the hook saw the agent work (iptables-save, nft, ipset, ip, ...).
    assert sum(programs.values()) >= 10 and {"nft", "ipset", "iptables-nft-save"} <= set(programs), programs
    assert [e for e in execs if e["event"] != "subprocess.Popen" or e["argv"] is None] == []
    assert set(programs) <= AGENT_PROGRAMS, f"programs the agent started: {dict(programs)}"
    assert not set(programs) & set(sec.SHELLS)


# ================================================================ the nftables flush, fuzzed

NFT_FAMILIES = ("ip", "ip6", "inet", "arp", "bridge", "netdev")
# Names a user may well pick; kube-proxy's table is `kube-proxy` in ip and ip6 only, so in the other
# families that very name is a user's and must survive.
NFT_NAME = st.sampled_from(["kube-proxy", "kube_proxy", "kube-proxy-x", "KUBE-PROXY", "kubeproxy", "fw",
                            "user", "kube-proxy2", "k8s", "cilium"])
NFT_OBJ = st.from_regex(r"(services|service-ips|nat-output|KUBE-SERVICES|mark-for-masquerade|cluster-ips|u)"
                        r"[a-z0-9]{0,4}", fullmatch=True)


@st.composite
def nft_user_tables(draw: Any) -> list[str]:
    """`nft -f` scripts, one per user table, with chains, sets and maps named like kube-proxy's."""
    tables = []
    seen = set()
    for _ in range(draw(st.integers(1, 5))):
        family = draw(st.sampled_from(NFT_FAMILIES))
        name = draw(NFT_NAME)
        if (family in ("ip", "ip6") and name == "kube-proxy") or (family, name) in seen:
            continue
        seen.add((family, name))
        lines = [f"add table {family} {name}"]
        objs = draw(st.lists(NFT_OBJ, min_size=1, max_size=4, unique=True))
        for i, obj in enumerate(objs):
            kind = draw(st.sampled_from(["chain", "set", "map"])) if family in ("ip", "ip6", "inet") else "chain"
            if kind == "chain":
                hook = " { type filter hook output priority 0 ; }" if i == 0 and family in ("ip", "ip6", "inet") \
                    else ""
                lines.append(f"add chain {family} {name} {obj}{hook}")
                if family in ("ip", "ip6", "inet"):
                    lines.append(f"add rule {family} {name} {obj} meta mark 0x{draw(st.integers(1, 255)):x} "
                                 f"counter accept comment \"user {obj}\"")
            elif kind == "set":
                lines.append(f"add set {family} {name} {obj} {{ type inet_service ; }}")
                ports = draw(st.lists(st.integers(1, 65535), min_size=1, max_size=5, unique=True))
                lines.append(f"add element {family} {name} {obj} {{ {', '.join(map(str, ports))} }}")
            else:
                lines.append(f"add map {family} {name} {obj} {{ type inet_service : mark ; }}")
                lines.append(f"add element {family} {name} {obj} {{ {draw(st.integers(1, 65535))} : 0x1 }}")
        tables.append("\n".join(lines) + "\n")
    return tables


@pytest.mark.dataplane
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(tables=nft_user_tables(), split=st.integers(0, 5), services=st.integers(0, 20))
def test_random_user_nft_objects_survive_the_nftables_flush(tables: list[str], split: int, services: int) -> None:
    from proxyshift.agent.flush import flush
    from tests.support.kp_rules import nftables_mode_ruleset
    from tests.support.ps_netns import Netns, need_root

    need_root()
    node, ref = Netns(), Netns()
    try:
        for ns, with_kube in ((node, True), (ref, False)):
            for script in tables[:split]:
                ns.run(["nft", "-f", "-"], input=script)
            if with_kube:
                ns.run(["nft", "-f", "-"], input=nftables_mode_ruleset(services, family="ip"))
                ns.run(["nft", "-f", "-"], input=nftables_mode_ruleset(services, family="ip6"))
            for script in tables[split:]:
                ns.run(["nft", "-f", "-"], input=script)
        # nftables -> iptables: kube-proxy's two tables go; and a flush of the iptables/ipvs modes (target
        # nftables) must not touch native nft objects either.
        for remove, target in ((["nftables"], "iptables"), (["iptables", "ipvs"], "nftables")):
            report = flush(remove, target, runner=node.run, iptables_tools=[])
            assert report.ok, report.message()
        ruleset = node.run(["nft", "list", "ruleset"]).stdout
        assert ruleset == ref.run(["nft", "list", "ruleset"]).stdout
    finally:
        node.delete()
        ref.delete()


# ================================================================ secrets never read


@pytest.mark.reliability
@pytest.mark.usefixtures("proxyshift_installed")
def test_a_migration_as_the_service_accounts_reads_no_secret(cluster: Any, api_client: Any,
                                                              node_exec: Callable[..., Any],
                                                              node_http_get: Callable[..., tuple[int, str]],
                                                              wait_for: Callable[..., Any]) -> None:
    """The operator logged in with its own ServiceAccount token (not admin) migrates pool blue to nftables
    with cordon+drain and reverts it by deletion; the agents run as theirs. The audit log must show their
    requests (thousands) and not one on a secret, and no request of the operator refused: the documented
    minimal set is also enough."""
    from localcluster import controlplane, install
    from tests.support.operator_harness import policy

    audit = controlplane.audit_log_path(cluster.require_local("audit log"))
    assert audit.exists(), f"the local API server writes no audit log at {audit}"
    work = scratch_dir()
    kubeconfig = service_account_kubeconfig(cluster, "proxyshift-operator", work / "operator.kubeconfig")
    op = install.OperatorProcess(kubeconfig, cluster.state_dir / "logs" / "operator-as-serviceaccount.log",
                                 metrics_port=18290, health_port=18291)
    h = Harness(api_client, op, node_exec, node_http_get, wait_for)
    offset = audit.stat().st_size
    name = "sec-audit-blue"
    try:
        op.start()
        op.wait_healthy()
        assert op.running, f"the operator exited; see {op.log_path}"
        h.apply(policy(name, "nftables", rollout={"cordon": True, "drain": True}))
        h.wait_condition(name, "Ready", 600)
        assert {h.proxy_mode(n) for n in ("ps-node-1", "ps-node-2")} == {"nftables"}
        h.delete(name, wait=600)
        assert {h.proxy_mode(n) for n in ("ps-node-1", "ps-node-2")} == {"iptables"}
    finally:
        h.cleanup()
        op.stop()
    ours = {u: who for who, u in sec.IDENTITIES.items()}
    per_user: Counter[str] = Counter()
    secrets, refused, outside, agent_other = [], [], [], []
    agent_calls: Counter[str] = Counter()
    seen: set[str] = set()
    for event in sec.audit_events(audit, offset):
        who = ours.get(event.get("user", {}).get("username", ""))
        # A watch is logged as ResponseStarted when it opens and ResponseComplete only when it ends (an
        # agent's lasts 300 s, kopf's too): every request is read at its first stage logged, once.
        if who is None or event.get("stage") not in ("ResponseStarted", "ResponseComplete") \
                or event.get("auditID") in seen:
            continue
        seen.add(event.get("auditID", ""))
        per_user[who] += 1
        ref = event.get("objectRef") or {}
        verb, resource, subresource = event.get("verb"), ref.get("resource"), ref.get("subresource") or ""
        line = f"{who} {verb} {resource}/{subresource} " \
               f"{ref.get('namespace') or ''}/{ref.get('name') or ''} -> {event.get('responseStatus', {}).get('code')}"
        if resource == "secrets":
            secrets.append(line)
        if event.get("responseStatus", {}).get("code") == 403:
            refused.append(line)
        if who == "operator" and resource in ("configmaps", "daemonsets") and ref.get("namespace") != "kube-system":
            outside.append(line)
        if who == "agent" and event.get("objectRef") is not None:
            # Its own node's ProxyNode only: a GET by name, a watch whose field selector names it (the API
            # server puts that name in the objectRef), a status patch. Never a list.
            call = f"{verb} {resource}/{subresource}"
            agent_calls[call] += 1
            if call not in ("get proxynodes/", "watch proxynodes/", "patch proxynodes/status") \
                    or ref.get("name") not in ("ps-node-1", "ps-node-2", "ps-node-3"):
                agent_other.append(line)
    print(f"\naudit: requests by proxyshift's service accounts during the migration: {dict(per_user)}; "
          f"the agents': {dict(agent_calls)}")
    # Positive control: the log saw both identities at work, so an absence below means something.
    assert per_user["operator"] > 50 and per_user["agent"] > 20, dict(per_user)
    # (A watch opened in this window is checked like the rest; none need open: they last 300 s.)
    assert agent_calls["patch proxynodes/status"] > 0, dict(agent_calls)
    assert secrets == [], "secrets requests by proxyshift's identities"
    assert refused == [], f"proxyshift was refused (its documented permissions are not enough): {refused[:20]}"
    assert outside == [], f"the operator read or wrote DaemonSets/ConfigMaps outside kube-system: {outside[:20]}"
    assert agent_other == [], f"agent requests beyond its own ProxyNode: {agent_other[:20]}"
