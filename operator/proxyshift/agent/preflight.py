"""Can this node run kube-proxy in a given mode? Kernel, modules and tools, with fixes.

kube-proxy exits when its mode cannot be used (no fallback), so a node that
fails preflight is not touched. Every root (/proc, /sys, /lib/modules) and the
tool versions are parameters: the unit tests run against fixture trees and
canned versions, never against the host they run on.

A module counts as present when it is loaded (/proc/modules, /sys/module/<m>)
or built in (modules.builtin of the running release; /proc/net/ip_vs also
proves ip_vs). A module that is only installed is reported missing with the
modprobe to run, because a kube-proxy container cannot always load it -- with
one exception, seen on a real kernel (Debian 6.1 in the QEMU test bed,
tests/vm): ip_vs and the scheduler's ip_vs_<s>. kube-proxy's ipvs check creates
a dummy virtual server with the configured scheduler, and the kernel itself
loads both modules for that request (request_module runs the node's modprobe,
whatever the container may do). On a fresh boot with neither loaded, kube-proxy
v1.37.2 started in ipvs mode and lsmod then listed ip_vs and ip_vs_<s>; with a
scheduler the kernel lacks (twos on 6.1) it exited "can't use the IPVS
proxier". So those two are accepted when installed and the kernel can load
modules on demand (/proc/sys/kernel/modules_disabled 0, a modprobe path set),
and the report says they will be loaded on first use. nf_conntrack is not:
kube-proxy writes its conntrack sysctls (tcpEstablishedTimeout, ...) before it
touches IPVS, and on that fresh boot it exited "open
/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_established: no such file".

A move to nftables (from any mode, nftables itself included: every restart
counts) is refused on a node holding IPVS virtual servers that are not
kube-proxy's: kube-proxy v1.37.2 in nftables mode runs the ipvs cleanup at every
start (cmd/kube-proxy/app/server_linux.go platformCleanup), and that flushes
every virtual server on the host (pkg/proxy/ipvs/cleanup.go), a keepalived's or
a hand-made LVS too. Which ones are kube-proxy's is the inventory's decision,
the same one the IPVS flush makes (flush/ipvs.py select_owned). The policy may
accept the deletion (gate.behaviour.allowChanges: [ForeignIPVSFlush]); then the
check passes and names what the switch deletes.

A move to ipvs is refused the same way for the foreign virtual servers an ipvs
kube-proxy would delete: at every sync it deletes each virtual server of its
IP family that it did not create, unless the address is in ipvs.excludeCIDRs
(pkg/proxy/ipvs cleanLegacyService; firewall-mark services have no address and
are kept). The operator sends the target's excludeCIDRs; an operator too old to
send them gets the check skipped, as before.
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from proxyshift.agent.flush.base import Runner
from proxyshift.agent.inventory import Inventory, foreign_ipvs, take_ipvs_inventory
from proxyshift.api.proxynode import ForeignIPVS
from proxyshift.commands import CommandError, ToolMissingError, run, side_by_side
from proxyshift.modes import (
    DEFAULT_IPVS_SCHEDULER,
    FOREIGN_IPVS_CHANGE,
    IPVS_PRUNES_UNEXCLUDED,
    IPVS_SCHEDULERS,
    MODE_FACTS,
    MODES,
    NFTABLES_DELETES_IPVS,
    KernelFeature,
    Mode,
    ToolNeed,
    deletes_foreign_ipvs,
    outside_exclude_cidrs,
    prunes_unexcluded_ipvs,
    version_text,
)

# What the status lists under "modules": the ones any mode cares about.
RELEVANT_MODULES = ("ip_vs", *(f"ip_vs_{s}" for s in IPVS_SCHEDULERS), "nf_conntrack", "nf_tables",
                    "nft_chain_nat", "nf_nat", "ip_tables", "iptable_nat", "ip6_tables", "ip6table_nat",
                    "ip_set", "xt_set", "br_netfilter")

ModuleState = Literal["present", "loadable", "absent", "unknown"]

_VERSION = re.compile(r"v?(\d+(?:\.\d+)+)")
_MODULE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def parse_version(text: str | None) -> tuple[int, ...] | None:
    """First dotted version in a tool's --version text ("nftables v1.0.6 (...)" -> (1, 0, 6))."""
    if not text:
        return None
    m = _VERSION.search(text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def parse_kernel_release(release: str) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", release)
    return tuple(int(g) for g in m.groups(default="0")) if m else None


def _fmt(version: tuple[int, ...] | None) -> str | None:
    return version_text(version) if version else None


@dataclass(frozen=True)
class ToolVersions:
    """Versions of the tools on the node; each None when the tool is missing."""

    nft: str | None = None
    iptables: str | None = None
    iptables_backend: str | None = None      # "nf_tables" or "legacy"
    ipset: str | None = None
    ipvsadm: str | None = None
    nft_usable: bool | None = None           # `nft list tables` worked (nf_tables in the kernel)
    iptables_nat: bool | None = None         # `iptables -t nat -S` worked (nat support)

    def as_status(self) -> dict[str, str]:
        """The ProxyNode status `tools` map (only what is known)."""
        out = {"nft": self.nft, "iptables": self.iptables, "iptablesBackend": self.iptables_backend,
               "ipset": self.ipset, "ipvsadm": self.ipvsadm}
        return {k: v for k, v in out.items() if v}


class VersionCache:
    """The tools' version lines, asked once for the agent process's life.

    They are the agent's own binaries, its image's, which cannot change while it runs; each preflight asked them
    again (three or four fork/execs on the path of the rollout's first node). Only a version that was read, or a
    tool that is not installed, is kept: a run that failed or timed out says nothing lasting. Whether the kernel
    lets a tool work (`nft list tables`, the nat table) is asked at every preflight, never kept: a module can be
    loaded meanwhile.
    """

    def __init__(self) -> None:
        self._known: dict[tuple[str, ...], str | None] = {}
        self._lock = threading.Lock()

    def version_of(self, runner: Runner, argv: list[str], prefix: str) -> str | None:
        """The tool's version line, only from a successful run that looks like one: anything else (an error
        message that happens to contain a kernel release, say) is no version at all."""
        key = tuple(argv)
        with self._lock:
            if key in self._known:
                return self._known[key]
        try:
            res = runner(argv, timeout=10, check=False)
        except ToolMissingError:
            text = None
        except CommandError:
            return None
        else:
            text = res.stdout.strip()
            if res.returncode != 0 or not text.startswith(prefix):
                return None
        with self._lock:
            self._known[key] = text
        return text


def _works(runner: Runner, argv: list[str]) -> bool | None:
    try:
        return runner(argv, timeout=15, check=False).returncode == 0
    except CommandError:
        return None


def detect_tools(runner: Runner = run, *, proc_root: str | Path = "/proc",
                 versions: VersionCache | None = None) -> ToolVersions:
    """Ask the node's tools for their versions; read-only commands only. `versions`: the agent's cache of the
    version lines (None: ask them all now).

    ipvsadm is asked only when the kernel has IPVS already: on any call it tries to
    modprobe ip_vs, which would change the node just by looking at it.
    """
    cache = versions if versions is not None else VersionCache()
    has_ipvs = (Path(proc_root) / "net" / "ip_vs").exists()
    asks: list[tuple[list[str], str]] = [(["nft", "--version"], "nftables v"),
                                         (["iptables", "--version"], "iptables v"),
                                         (["ipset", "--version"], "ipset v")]
    if has_ipvs:
        asks.append((["ipvsadm", "--version"], "ipvsadm v"))
    # Side by side: the version lines (each asked once per process) and then the two checks of the kernel.
    texts = side_by_side([functools.partial(cache.version_of, runner, argv, prefix) for argv, prefix in asks],
                         name="preflight-versions")
    nft_text, ipt_text, ipset_text = texts[:3]
    backend = None
    if ipt_text:
        backend = "nf_tables" if "nf_tables" in ipt_text else "legacy" if "legacy" in ipt_text else None
    checks: list[Callable[[], bool | None]] = [
        functools.partial(_works, runner, ["nft", "list", "tables"]) if nft_text else lambda: None,
        functools.partial(_works, runner, ["iptables", "-w", "5", "-t", "nat", "-S", "POSTROUTING"])
        if ipt_text else lambda: None,
    ]
    nft_usable, iptables_nat = side_by_side(checks, name="preflight-checks")
    return ToolVersions(
        nft=_fmt(parse_version(nft_text)),
        iptables=_fmt(parse_version(ipt_text)),
        iptables_backend=backend,
        ipset=_fmt(parse_version(ipset_text)),
        ipvsadm=_fmt(parse_version(texts[3])) if has_ipvs else None,
        nft_usable=nft_usable,
        iptables_nat=iptables_nat,
    )


@dataclass(frozen=True)
class Missing:
    what: str
    why: str
    fix: str


@dataclass
class PreflightReport:
    mode: Mode
    scheduler: str | None
    kernel_release: str | None
    modules: dict[str, ModuleState]
    tools: ToolVersions
    missing: list[Missing] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    on_demand: list[str] = field(default_factory=list)  # installed, the kernel loads them on first use
    # IPVS virtual servers that are not kube-proxy's, which the target mode's kube-proxy deletes (nftables: all of
    # them; ipvs: those outside excludeCIDRs); accepted: the policy named ForeignIPVSFlush, so they do not fail.
    foreign_ipvs: ForeignIPVS | None = None
    foreign_ipvs_accepted: bool = False
    ipvs_unreadable: str | None = None  # why the IPVS table could not be listed (nftables or ipvs target)
    # foreign_ipvs is only those outside the target's excludeCIDRs (ipvs), not every foreign virtual server.
    foreign_ipvs_excluded_some: bool = False

    @property
    def ok(self) -> bool:
        return not self.missing

    def present_modules(self) -> list[str]:
        return sorted(m for m, s in self.modules.items() if s == "present")

    def message(self) -> str:
        target = self.mode + (f" (scheduler {self.scheduler})" if MODE_FACTS[self.mode].ipvs_scheduler else "")
        if self.ok:
            loaded = f"; loaded {', '.join(self.loaded)} with modprobe" if self.loaded else ""
            if self.on_demand:
                loaded += (f"; {', '.join(self.on_demand)} installed, not loaded: the kernel loads them when "
                           "kube-proxy creates its first virtual server")
            if self.foreign_ipvs is not None and self.foreign_ipvs.count:
                loaded += (f"; {FOREIGN_IPVS_CHANGE} accepted: the switch deletes "
                           f"{self.foreign_ipvs.describe()}")
            elif self.ipvs_unreadable:
                loaded += (f"; {FOREIGN_IPVS_CHANGE} accepted: the IPVS table could not be read "
                           f"({self.ipvs_unreadable[:200]}), the switch deletes every virtual server in it")
            return f"preflight for {target} passed on kernel {self.kernel_release}{loaded}"
        items = "; ".join(f"{m.what}: {m.why} (fix: {m.fix})" for m in self.missing)
        return f"preflight for {target} failed on kernel {self.kernel_release}: {items}"

    def details(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "scheduler": self.scheduler,
            "kernelRelease": self.kernel_release,
            "missing": [asdict(m) for m in self.missing],
            "missingModules": [m.what.removeprefix("kernel module ") for m in self.missing
                               if m.what.startswith("kernel module ")],
            "modulesPresent": self.present_modules(),
            "loaded": list(self.loaded),
            "onDemand": list(self.on_demand),
            "tools": self.tools.as_status(),
        } | ({"foreignIPVS": self.foreign_ipvs.to_k8s() | {"accepted": self.foreign_ipvs_accepted}}
             if self.foreign_ipvs is not None and self.foreign_ipvs.count else {})


def foreign_ipvs_refusal(foreign: ForeignIPVS, mode: Mode) -> Missing:
    """Pure: why preflight for `mode` refuses a node holding a user's IPVS virtual servers, and the ways out."""
    if prunes_unexcluded_ipvs(mode):
        return Missing(
            "IPVS virtual servers that are not kube-proxy's",
            f"this node holds {foreign.describe()}: {IPVS_PRUNES_UNEXCLUDED}",
            "add their addresses to the policy's spec.ipvs.excludeCIDRs, move them off this node, keep the node "
            f"out of this policy, or accept the deletion with gate.behaviour.allowChanges: [{FOREIGN_IPVS_CHANGE}]",
        )
    return Missing(
        "IPVS virtual servers that are not kube-proxy's",
        f"this node holds {foreign.describe()}: {NFTABLES_DELETES_IPVS}",
        "move them off this node or recreate them after the switch (keepalived does at its next reload), keep "
        f"the node out of this policy, or accept the deletion with gate.behaviour.allowChanges: "
        f"[{FOREIGN_IPVS_CHANGE}]",
    )


@dataclass
class KernelView:
    """What the /proc, /sys and /lib/modules trees say about modules."""

    proc_root: Path
    sys_root: Path
    modules_root: Path
    release: str | None = None
    _loaded: set[str] = field(default_factory=set)
    _builtin: set[str] | None = None
    _installed: set[str] = field(default_factory=set)
    modules_supported: bool = True
    autoload: bool = False  # the kernel may load a module on demand (modules enabled, modprobe path set)

    @staticmethod
    def _norm(name: str) -> str:
        return name.replace("-", "_")

    @staticmethod
    def _ko_name(path: str) -> str:
        base = path.strip().rsplit("/", 1)[-1]
        return KernelView._norm(base.split(".ko", 1)[0])

    def read(self) -> KernelView:
        osrelease = self.proc_root / "sys" / "kernel" / "osrelease"
        self.release = osrelease.read_text().strip() if osrelease.exists() else None
        self._loaded = set()
        proc_modules = self.proc_root / "modules"
        # No /proc/modules: a kernel without CONFIG_MODULES. What is not built in can never be loaded.
        self.modules_supported = proc_modules.exists()
        disabled = self.proc_root / "sys" / "kernel" / "modules_disabled"
        modprobe = self.proc_root / "sys" / "kernel" / "modprobe"
        self.autoload = (self.modules_supported and disabled.exists() and disabled.read_text().strip() == "0"
                         and modprobe.exists() and bool(modprobe.read_text().strip()))
        if proc_modules.exists():
            self._loaded |= {self._norm(line.split()[0]) for line in proc_modules.read_text().splitlines()
                             if line.strip()}
        sys_modules = self.sys_root / "module"
        if sys_modules.is_dir():
            self._loaded |= {self._norm(p.name) for p in sys_modules.iterdir()}
        if (self.proc_root / "net" / "ip_vs").exists():
            self._loaded.add("ip_vs")
        self._builtin = None
        self._installed = set()
        if self.release:
            release_dir = self.modules_root / self.release
            builtin = release_dir / "modules.builtin"
            if builtin.exists():
                self._builtin = {self._ko_name(line) for line in builtin.read_text().splitlines() if line.strip()}
            dep = release_dir / "modules.dep"
            if dep.exists():
                self._installed = {self._ko_name(line.split(":", 1)[0]) for line in dep.read_text().splitlines()
                                   if ":" in line}
        return self

    def state(self, module: str) -> ModuleState:
        name = self._norm(module)
        if name in self._loaded or (self._builtin is not None and name in self._builtin):
            return "present"
        if name in self._installed:
            return "loadable"
        return "absent" if self._builtin is not None or not self.modules_supported else "unknown"


def _module_missing(view: KernelView, module: str, why: str) -> Missing:
    state = view.state(module)
    if state == "loadable":
        return Missing(f"kernel module {module}", f"{why}; installed but not loaded",
                       f"modprobe {module} on the node, or set spec.preflight.loadModules")
    if state == "unknown":
        return Missing(f"kernel module {module}",
                       f"{why}; not loaded, and modules.builtin of {view.release} is not readable to prove "
                       "it is built in",
                       f"modprobe {module} on the node (or set spec.preflight.loadModules), and mount "
                       "/lib/modules read-only into the agent")
    if not view.modules_supported:
        return Missing(f"kernel module {module}", f"{why}; kernel {view.release} is not built with it and cannot "
                       "load modules (no /proc/modules)", f"use a kernel built with {module}")
    return Missing(f"kernel module {module}", f"{why}; kernel {view.release} has neither it loaded, built in "
                   "nor installed", f"use a kernel built with {module} (or install its modules package)")


def loaded_on_demand(mode: Mode, scheduler: str | None) -> set[str]:
    """The required modules the kernel itself loads when kube-proxy first uses them (see the module doc)."""
    return {need.module for need in MODE_FACTS[mode].modules(scheduler) if need.on_demand}


def required_modules(mode: Mode, scheduler: str | None, extra_modules: Iterable[str]) -> list[tuple[str, str]]:
    mods = [(need.module, need.why) for need in MODE_FACTS[mode].modules(scheduler)]
    mods += [(m, "listed in spec.preflight.extraModules") for m in extra_modules]
    return mods


def _kernel_missing(mode: Mode, minimum: tuple[int, int], release_v: tuple[int, ...] | None,
                    release: str | None) -> list[Missing]:
    if release_v is not None and release_v[:2] >= minimum:
        return []
    wanted = version_text(minimum)
    replacement = MODE_FACTS[mode].replacement
    who = f"{replacement.agent}'s kube-proxy replacement" if replacement is not None else f"kube-proxy's {mode} mode"
    return [Missing(f"kernel >= {wanted}", f"{who} needs kernel {wanted} or newer; this "
                    f"node runs {release or 'an unknown kernel'}",
                    "upgrade the node's kernel, or keep this pool on iptables")]


def _filesystems(proc_root: Path) -> set[str]:
    """The filesystem types this kernel supports (/proc/filesystems' last field), bounded.

    Not /proc/mounts: the agent's container sees its own mount namespace (a hybrid host's cgroup2 sits at
    /sys/fs/cgroup/unified, or nowhere a pod can see), and Cilium's agent mounts cgroup2 and bpffs itself
    where the node has none. What the move needs is the kernel's support for both.
    """
    try:
        with (proc_root / "filesystems").open(encoding="utf-8", errors="replace") as listing:
            return {fields[-1] for line in itertools.islice(listing, 1_000) if (fields := line.split())}
    except OSError:
        return set()


# How each kernel feature a replacement needs is seen from /proc and /sys, and what a person does without it.
_FEATURE_CHECKS: dict[KernelFeature, tuple[Callable[[Path, Path], bool], str, str]] = {
    "cgroup2": (lambda proc, sys: "cgroup2" in _filesystems(proc), "kernel cgroup v2 support",
                "a kernel built with cgroup v2 (CONFIG_CGROUPS; every kernel since 4.5 has it)"),
    "bpffs": (lambda proc, sys: "bpf" in _filesystems(proc), "the BPF filesystem",
              "a kernel built with CONFIG_BPF_SYSCALL (Cilium's DaemonSet mounts bpffs itself)"),
    "btf": (lambda proc, sys: (sys / "kernel" / "btf" / "vmlinux").exists(), "kernel BTF (/sys/kernel/btf/vmlinux)",
            "a kernel built with CONFIG_DEBUG_INFO_BTF=y"),
}


def features_missing(mode: Mode, proc_root: Path, sys_root: Path) -> list[Missing]:
    """The kernel features the mode's facts list that this node lacks."""
    missing = []
    for need in MODE_FACTS[mode].features:
        present, what, fix = _FEATURE_CHECKS[need.feature]
        if not present(proc_root, sys_root):
            missing.append(Missing(what, need.why, fix))
    return missing


def _iptables_missing(mode: Mode, need: ToolNeed, tools: ToolVersions) -> list[Missing]:
    if tools.iptables is None:
        return [Missing("iptables binary", f"{mode} mode programs rules with iptables-restore",
                        "install the iptables package")]
    if tools.iptables_nat is False:
        return [Missing("iptables nat table", "`iptables -t nat -S` fails: no NAT support",
                        "load iptable_nat (legacy) or nft_chain_nat (nf_tables backend)")]
    return []


def _ipset_missing(mode: Mode, need: ToolNeed, tools: ToolVersions) -> list[Missing]:
    ipset_v = parse_version(tools.ipset)
    if ipset_v is None:
        return [Missing("ipset binary", f"{mode} mode keeps service addresses in ipsets", "install the ipset package")]
    if need.min_version is not None and ipset_v < need.min_version:
        return [Missing(f"ipset >= {version_text(need.min_version)}",
                        f"ipset {tools.ipset} is older than kube-proxy accepts", "upgrade the ipset package")]
    return []


def _nft_missing(mode: Mode, need: ToolNeed, tools: ToolVersions) -> list[Missing]:
    missing: list[Missing] = []
    wanted = version_text(need.min_version) if need.min_version else None
    nft_v = parse_version(tools.nft)
    if nft_v is None:
        missing.append(Missing("nft binary", f"{mode} mode is checked and debugged with nft",
                               f"install the nftables package (nft >= {wanted})" if wanted
                               else "install the nftables package"))
    elif need.min_version is not None and nft_v < need.min_version:
        missing.append(Missing(f"nft >= {wanted}", f"nft {tools.nft} is older than kube-proxy supports",
                               f"upgrade the nftables package to {wanted} or newer"))
    if tools.nft_usable is False:
        missing.append(Missing("nf_tables", "`nft list tables` fails: the kernel has no usable nf_tables",
                               "load nf_tables (modprobe nf_tables) or use a kernel with CONFIG_NF_TABLES"))
    return missing


# How the node checks each tool a mode's ToolNeed names (the planner's preview reads the same table).
_TOOL_CHECKS: dict[str, Callable[[Mode, ToolNeed, ToolVersions], list[Missing]]] = {
    "iptables": _iptables_missing,
    "ipset": _ipset_missing,
    "nft": _nft_missing,
}


def _check_tools(mode: Mode, release_v: tuple[int, ...] | None, release: str | None,
                 tools: ToolVersions) -> list[Missing]:
    facts = MODE_FACTS[mode]
    missing = _kernel_missing(mode, facts.min_kernel, release_v, release) if facts.min_kernel else []
    for need in facts.tools:
        missing += _TOOL_CHECKS[need.tool](mode, need, tools)
    return missing


def check(mode: str, scheduler: str | None = None, *, proc_root: str | Path = "/proc",
          sys_root: str | Path = "/sys", modules_root: str | Path = "/lib/modules", load_modules: bool = False,
          extra_modules: Iterable[str] = (), tools: ToolVersions | None = None,
          runner: Runner = run, allow_changes: Iterable[str] = (),
          ipvs_inventory: Callable[[], Inventory] | None = None,
          ipvs_exclude_cidrs: Iterable[str] | None = None, versions: VersionCache | None = None) -> PreflightReport:
    """Preflight of `mode` on this node. `tools` defaults to asking the real tools, `ipvs_inventory` to reading
    the node's IPVS state with `runner`; `allow_changes` is the policy's gate.behaviour.allowChanges
    (ForeignIPVSFlush is the one preflight reads); `ipvs_exclude_cidrs` the target's ipvs.excludeCIDRs (None: not
    told, so a move to ipvs does not check what its kube-proxy would delete)."""
    if mode not in MODES:
        raise ValueError(f"unknown kube-proxy mode {mode!r}; expected one of {list(MODES)}")
    if scheduler and scheduler not in IPVS_SCHEDULERS:
        raise ValueError(f"unknown IPVS scheduler {scheduler!r}; expected one of {list(IPVS_SCHEDULERS)}")
    extra_modules = list(extra_modules)
    # The names come from a user's policy and end up on modprobe's command line.
    bad = [m for m in extra_modules if not _MODULE_NAME.match(m)]
    if bad:
        raise ValueError(f"invalid kernel module name(s) {bad}: letters, digits, '_' and '-' only")
    view = KernelView(Path(proc_root), Path(sys_root), Path(modules_root)).read()
    needed = required_modules(mode, scheduler, extra_modules)
    loaded: list[str] = []
    if load_modules:
        for module, _ in needed:
            if view.state(module) in ("loadable", "unknown"):
                try:
                    runner(["modprobe", "--", module], timeout=30)
                    loaded.append(module)
                except CommandError:
                    pass  # reported below as still missing
        if loaded:
            view.read()
    # The tools and the IPVS table, side by side (they share nothing), once any module asked for is loaded: each
    # looks at IPVS only when the kernel has it.
    with ThreadPoolExecutor(1, thread_name_prefix="preflight-ipvs") as pool:
        ipvs = pool.submit(_foreign_ipvs, mode, Path(proc_root),
                           ipvs_inventory or (lambda: take_ipvs_inventory(runner=runner, proc_root=Path(proc_root))),
                           None if ipvs_exclude_cidrs is None else list(ipvs_exclude_cidrs))
        found = tools if tools is not None else detect_tools(runner, proc_root=proc_root, versions=versions)
        foreign, unreadable, foreign_missing = ipvs.result()
    on_demand = loaded_on_demand(mode, scheduler) if view.autoload else set()
    accepted = [m for m, _ in needed if view.state(m) == "loadable" and m in on_demand]
    missing = [_module_missing(view, m, why) for m, why in needed
               if view.state(m) != "present" and m not in accepted]
    missing += _check_tools(mode, parse_kernel_release(view.release or ""), view.release, found)
    missing += features_missing(mode, Path(proc_root), Path(sys_root))
    foreign_accepted = FOREIGN_IPVS_CHANGE in set(allow_changes)
    if not foreign_accepted:
        missing += foreign_missing
    modules = {m: view.state(m) for m in dict.fromkeys([*RELEVANT_MODULES, *(m for m, _ in needed)])}
    return PreflightReport(mode=mode, scheduler=(scheduler or DEFAULT_IPVS_SCHEDULER)
                           if MODE_FACTS[mode].ipvs_scheduler else None,
                           kernel_release=view.release, modules=modules, tools=found, missing=missing,
                           loaded=loaded, on_demand=accepted, foreign_ipvs=foreign,
                           foreign_ipvs_accepted=foreign_accepted and foreign is not None and foreign.count > 0,
                           foreign_ipvs_excluded_some=prunes_unexcluded_ipvs(mode) and foreign is not None,
                           ipvs_unreadable=unreadable)


def _foreign_ipvs(mode: Mode, proc_root: Path, read: Callable[[], Inventory],
                  exclude_cidrs: list[str] | None) -> tuple[ForeignIPVS | None, str | None, list[Missing]]:
    """The virtual servers that are not kube-proxy's which the target mode's kube-proxy would delete (or why the
    table could not be read), and the refusal.

    Read only for nftables (it deletes them all) and for ipvs when the operator sent the excludeCIDRs (it deletes
    those outside them), and only when the kernel has IPVS (no /proc/net/ip_vs: no virtual server can exist,
    and ipvsadm would load ip_vs just by looking).
    """
    pruning = prunes_unexcluded_ipvs(mode) and exclude_cidrs is not None
    if not (deletes_foreign_ipvs(mode) or pruning) or not (proc_root / "net" / "ip_vs").exists():
        return None, None, []
    inv = read()
    unreadable = [e for e in inv.errors if e.startswith("ipvsadm")]
    if unreadable:
        # Unknown is not "none": the cleanup deletes whatever is there.
        deletes = ("the ipvs kube-proxy deletes, at every sync, each IPVS virtual server it did not create outside "
                   "ipvs.excludeCIDRs" if pruning else
                   "the nftables kube-proxy deletes every IPVS virtual server on the host at each start")
        return None, unreadable[0], [Missing("a readable IPVS table",
                              f"{unreadable[0][:300]}; {deletes}, and whether any of them is not kube-proxy's "
                              "cannot be told",
                              "install ipvsadm where the agent runs, or accept the deletion with "
                              f"gate.behaviour.allowChanges: [{FOREIGN_IPVS_CHANGE}]")]
    if pruning:
        assert exclude_cidrs is not None
        inv.foreign_virtual_servers = [vs for vs in inv.foreign_virtual_servers
                                       if outside_exclude_cidrs(vs.address, exclude_cidrs)]
    foreign = foreign_ipvs(inv)
    return foreign, None, [foreign_ipvs_refusal(foreign, mode)] if foreign.count else []
