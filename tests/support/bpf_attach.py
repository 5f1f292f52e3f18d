"""Which BPF programs are attached where: the proof that a confined Cilium touches nothing of the host.

bpftool reports cgroup attachments (`cgroup tree`) and a namespace's XDP, tc and flow-dissector
programs (`net show`), but Debian 12's bpftool 7.1 predates tcx (kernel 6.6), the way Cilium attaches
its tc programs on this kernel; and it skips cgroup attach types newer than itself. So the kernel is
also asked directly, with BPF_PROG_QUERY on every host interface's tcx hooks and every cgroup attach
type of the host's root cgroup.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
from pathlib import Path

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
