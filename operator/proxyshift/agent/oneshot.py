"""One-shot agent commands for a person on a node (`kubectl exec <agent pod> -- proxyshift agent ...`).

    proxyshift agent inventory
    proxyshift agent preflight --mode ipvs [--scheduler mh] [--load-modules] [--extra-module M ...]
                               [--allow-change ForeignIPVSFlush] [--ipvs-exclude-cidr CIDR ...]
    proxyshift agent cleanup --remove iptables [--remove ipvs] --target nftables [--dry-run]
    proxyshift agent probe [--metrics-address A] [--health-address A] [--service IP:PORT ...]
    proxyshift agent behaviour --params '{"targets": [...], "nodeIps": [...]}'   (BehaviourParams as JSON)
    proxyshift agent conntrack --service-cidr CIDR [--service-ip IP ...] [--node-port N ...]

Each prints JSON (the same shapes the agent writes to ProxyNode status) and
exits 0 when all is well, 1 otherwise. The image has no shell; these are the
way to look at, or act on, one node by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from proxyshift.agent import behaviour as behaviour_mod
from proxyshift.agent import conntrack as conntrack_mod
from proxyshift.agent import flush as flush_mod
from proxyshift.agent import inventory as inventory_mod
from proxyshift.agent import preflight as preflight_mod
from proxyshift.agent import probe as probe_mod
from proxyshift.agent.ownership import MODES
from proxyshift.api.behaviour import BehaviourParams, ConntrackParams
from proxyshift.commands import run

COMMANDS = ("inventory", "preflight", "cleanup", "probe", "behaviour", "conntrack")


def _print(doc: dict[str, Any]) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="proxyshift agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    inv = sub.add_parser("inventory", help="kube-proxy objects per mode on this node")
    inv.add_argument("--observed-mode", choices=MODES, help="name leftovers relative to this mode")
    pre = sub.add_parser("preflight", help="can this node run a mode")
    pre.add_argument("--mode", required=True, choices=MODES)
    pre.add_argument("--scheduler")
    pre.add_argument("--load-modules", action="store_true")
    pre.add_argument("--extra-module", action="append", default=[])
    pre.add_argument("--allow-change", action="append", default=[],
                     help="a change the policy accepts (gate.behaviour.allowChanges), e.g. ForeignIPVSFlush")
    pre.add_argument("--ipvs-exclude-cidr", action="append", default=None,
                     help="for --mode ipvs: an ipvs.excludeCIDRs entry; given (even once), foreign IPVS virtual "
                     "servers outside them are refused, as the operator's preflight does")
    cln = sub.add_parser("cleanup", help="flush the stale objects of modes this node left")
    cln.add_argument("--remove", action="append", required=True, choices=MODES)
    cln.add_argument("--target", required=True, choices=MODES, help="the mode kube-proxy runs now (kept)")
    cln.add_argument("--dry-run", action="store_true", help="say what would be removed, change nothing")
    prb = sub.add_parser("probe", help="read the local kube-proxy's endpoints")
    prb.add_argument("--metrics-address", default=probe_mod.DEFAULT_METRICS_ADDRESS)
    prb.add_argument("--health-address", default=probe_mod.DEFAULT_HEALTH_ADDRESS)
    prb.add_argument("--service", action="append", default=[], help="ClusterIP:port to TCP-connect to")
    beh = sub.add_parser("behaviour", help="probe a sample of Services from this node (the gate's matrix)")
    beh.add_argument("--params", required=True, help="BehaviourParams as JSON (targets, nodeIps, podProbe, ...)")
    ct = sub.add_parser("conntrack", help="delete un-NATed conntrack entries to Service addresses")
    ct.add_argument("--service-cidr", action="append", default=[])
    ct.add_argument("--service-ip", action="append", default=[])
    ct.add_argument("--node-port", action="append", type=int, default=[])
    args = p.parse_args(list(argv))

    if args.command == "behaviour":
        try:
            params = BehaviourParams.model_validate_json(args.params)
        except ValueError as exc:
            p.error(f"--params: {exc}")
        facts = probe_mod.facts_from_probe(probe_mod.probe())
        matrix = behaviour_mod.run_behaviour(params, mode=facts.proxy_mode if facts.proxy_mode in MODES else None,
                                             operation_id="oneshot")
        _print(matrix.to_k8s())
        return 1 if matrix.truncated or matrix.pod_path_error else 0
    if args.command == "conntrack":
        local = [a for a, _ in behaviour_mod.parse_ip_addr(run(["ip", "-j", "-4", "addr", "show"], timeout=2.0).stdout)]
        report = conntrack_mod.clean_unnated(ConntrackParams(service_cidrs=args.service_cidr,
                                                             service_ips=args.service_ip, node_ports=args.node_port),
                                             local)
        _print(report.to_k8s())
        return 1 if report.error else 0

    if args.command == "inventory":
        found = inventory_mod.take_inventory()
        _print({"objects": [o.to_k8s() for o in inventory_mod.mode_objects(found, args.observed_mode)],
                "leftovers": inventory_mod.leftovers(found, args.observed_mode),
                "leftoverObjects": inventory_mod.leftover_objects(found, args.observed_mode),
                "foreignIPVS": inventory_mod.foreign_ipvs(found).to_k8s(), "errors": found.errors})
        return 1 if found.errors else 0
    if args.command == "preflight":
        verdict = preflight_mod.check(args.mode, args.scheduler, load_modules=args.load_modules,
                                      extra_modules=args.extra_module, allow_changes=args.allow_change,
                                      ipvs_exclude_cidrs=args.ipvs_exclude_cidr)
        _print({"ok": verdict.ok, "message": verdict.message(), **verdict.details()})
        return 0 if verdict.ok else 1
    if args.command == "cleanup":
        result = flush_mod.flush(args.remove, args.target, dry_run=args.dry_run)
        _print({"ok": result.ok, "message": result.message(), **result.details()})
        return 0 if result.ok else 1
    facts = probe_mod.facts_from_probe(probe_mod.probe(args.metrics_address, args.health_address))
    connects = probe_mod.tcp_connect(args.service) if args.service else {}
    _print({"kubeProxy": facts.model_dump(by_alias=True, mode="json"), "connects": connects})
    return 0 if facts.error is None and all(v is True for v in connects.values()) else 1
