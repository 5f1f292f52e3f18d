"""Which BPF programs are attached where: the proof that a confined Cilium touches nothing of the host.

bpftool reports cgroup attachments (`cgroup tree`) and a namespace's XDP, tc and flow-dissector
programs (`net show`), but Debian 12's bpftool 7.1 predates tcx (kernel 6.6), the way Cilium attaches
its tc programs on this kernel; and it skips cgroup attach types newer than itself. So the kernel is
also asked directly, with BPF_PROG_QUERY on every host interface's tcx hooks and every cgroup attach
type of the host's root cgroup.

`reached_the_host(before, during, ...)` compares two `host_snapshot`s, one taken before Cilium started
and one while it runs on some nodes: the verdict the Cilium tests share (tests/e2e/test_cilium_localcluster.py
on one labelled node, tests/e2e/test_cilium_kpr_rollout.py while a pool runs Cilium's KPR).
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from localcluster import cilium, network
from proxyshift.commands import run

SYS_BPF = 321  # x86_64
BPF_PROG_QUERY = 16
BPF_TCX_INGRESS, BPF_TCX_EGRESS = 46, 47
# Every attach type that targets a cgroup (include/uapi/linux/bpf.h, up to the unix socket hooks).
CGROUP_ATTACH_TYPES = (0, 1, 2, 3, 6, 8, 9, 10, 11, 12, 13, 14, 15, 18, 19, 20, 21, 22, 29, 30, 31, 32, 34,
                       49, 50, 51, 52, 53)
MAX_IDS = 64

_libc = ctypes.CDLL(None, use_errno=True)


class _ProgQuery(ctypes.Structure):
    _fields_ = [("target", ctypes.c_uint32), ("attach_type", ctypes.c_uint32),
                ("query_flags", ctypes.c_uint32), ("attach_flags", ctypes.c_uint32),
                ("prog_ids", ctypes.c_uint64), ("count", ctypes.c_uint32), ("_pad", ctypes.c_uint32),
                ("prog_attach_flags", ctypes.c_uint64), ("link_ids", ctypes.c_uint64),
                ("link_attach_flags", ctypes.c_uint64), ("revision", ctypes.c_uint64)]


def prog_query(target: int, attach_type: int) -> list[int] | None:
    """Ids of the programs attached at (target, attach_type); None when the kernel refuses the query."""
    ids = (ctypes.c_uint32 * MAX_IDS)()
    attr = _ProgQuery(target=target, attach_type=attach_type, prog_ids=ctypes.addressof(ids), count=MAX_IDS)
    if _libc.syscall(SYS_BPF, BPF_PROG_QUERY, ctypes.byref(attr), ctypes.sizeof(attr)) != 0:
        return None
    return list(ids[:attr.count])


def host_tcx() -> dict[str, list[int]]:
    """tcx programs on the interfaces of the calling thread's network namespace, by 'ifname/direction'."""
    found: dict[str, list[int]] = {}
    for index, name in socket.if_nameindex():
        for attach_type, direction in ((BPF_TCX_INGRESS, "ingress"), (BPF_TCX_EGRESS, "egress")):
            ids = prog_query(index, attach_type)
            if ids:
                found[f"{name}/{direction}"] = ids
    return found


def cgroup_direct(path: Path) -> dict[int, list[int]]:
    """Programs attached directly (not inherited) to one cgroup, by attach type."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        found = {}
        for attach_type in CGROUP_ATTACH_TYPES:
            ids = prog_query(fd, attach_type)
            if ids:
                found[attach_type] = ids
        return found
    finally:
        os.close(fd)


def cgroup_tree(root: Path) -> dict[str, list[dict[str, object]]]:
    """`bpftool cgroup tree`: every cgroup under `root` with programs attached, by path."""
    out = run(["bpftool", "-j", "cgroup", "tree", str(root)], timeout=60).stdout
    return {str(entry["cgroup"]): list(entry.get("programs", [])) for entry in json.loads(out or "[]")}


def net_show() -> list[dict[str, object]]:
    """`bpftool net show` in the caller's network namespace: XDP, tc and flow-dissector programs."""
    return list(json.loads(run(["bpftool", "-j", "net", "show"], timeout=60).stdout or "[]"))


def host_snapshot(cgroup_root: Path) -> dict[str, object]:
    """Everything attached in the host's network namespace and at the host's cgroups, comparable."""
    return {"cgroups": cgroup_tree(cgroup_root), "root_cgroup": cgroup_direct(cgroup_root),
            "net": net_show(), "tcx": host_tcx()}


def outside_nodes(attached: dict[str, list[dict[str, object]]], cgroup_root: Path,
                  allowed: Iterable[Path]) -> dict[str, list[dict[str, object]]]:
    """Attachments (a `cgroup_tree`) at cgroups outside the `allowed` subtrees (the nodes that may run
    Cilium). The cgroups of confined agents that are not the cluster's (a dataplane test of another
    session) are theirs, not the host's; the cluster's other nodes' cgroups count."""
    subtrees = [str(path) for path in allowed]
    foreign = str(cgroup_root / cilium.CGROUP_PREFIX)
    cluster = str(cgroup_root / f"{cilium.CGROUP_PREFIX}{network.NODE_PREFIX}")
    return {path: progs for path, progs in attached.items()
            if not any(path == tree or path.startswith(f"{tree}/") for tree in subtrees)
            and (path.startswith(cluster) or not path.startswith(foreign))}


def reached_the_host(before: dict[str, object], during: dict[str, object], cgroup_root: Path,
                     allowed: Iterable[Path]) -> list[str]:
    """What reached the host while Cilium ran on the nodes whose cgroups are `allowed`: one line per
    finding, [] when nothing did. `before` and `during` are `host_snapshot(cgroup_root)`s, taken before
    Cilium started and while it runs.

    The host is its root cgroup (programs attached directly there apply to every process of the
    machine), every cgroup outside the allowed nodes' subtrees (the other nodes' included), and the host's
    network namespace (XDP, tc, flow dissector, tcx on its interfaces). A finding is any difference from
    `before` there, a program gone included: the test bed has no business with the host's own programs.
    """
    problems = []
    if during["root_cgroup"] != before["root_cgroup"]:
        problems.append(f"attached at the host's root cgroup {cgroup_root}: {during['root_cgroup']} "
                        f"(before: {before['root_cgroup']})")
    cgroups_before, cgroups_during = before["cgroups"], during["cgroups"]
    assert isinstance(cgroups_before, dict) and isinstance(cgroups_during, dict)
    subtrees = list(allowed)
    was = outside_nodes(cgroups_before, cgroup_root, subtrees)
    now = outside_nodes(cgroups_during, cgroup_root, subtrees)
    problems += [f"attached at {path}, outside the nodes' cgroups {[str(t) for t in subtrees]}: {now.get(path)} "
                 f"(before: {was.get(path)})" for path in sorted(set(was) | set(now)) if was.get(path) != now.get(path)]
    if during["net"] != before["net"]:
        problems.append(f"BPF in the host's network namespace: {during['net']} (before: {before['net']})")
    if during["tcx"] != before["tcx"]:
        problems.append(f"tcx programs in the host's network namespace: {during['tcx']} (before: {before['tcx']})")
    return problems


def socket_lb_at(snapshot: dict[str, object], cgroup: Path) -> bool:
    """Whether a `host_snapshot` shows Cilium's socket-LB (a cgroup_inet4_connect program) at `cgroup`."""
    cgroups = snapshot["cgroups"]
    assert isinstance(cgroups, dict)
    return "cgroup_inet4_connect" in {p.get("attach_type") for p in cgroups.get(str(cgroup), [])}
