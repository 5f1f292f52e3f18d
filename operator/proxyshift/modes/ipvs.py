"""ipvs mode's pure facts (pkg/proxy/ipvs)."""

from __future__ import annotations

from proxyshift.modes.base import ModeFacts, ModuleNeed, ToolNeed

IPVS_MIN_IPSET = (6, 0)
DEFAULT_IPVS_SCHEDULER = "rr"
IPVS_SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "mh", "fo", "ovf", "twos")


def modules(scheduler: str | None) -> tuple[ModuleNeed, ...]:
    sched = scheduler or DEFAULT_IPVS_SCHEDULER
    return (ModuleNeed("ip_vs", "ipvs mode programs IPVS virtual servers", on_demand=True),
            ModuleNeed(f"ip_vs_{sched}", f"the IPVS scheduler {sched!r} is its own module", on_demand=True),
            ModuleNeed("nf_conntrack", "ipvs mode relies on connection tracking"))


FACTS = ModeFacts(
    mode="ipvs",
    # ipvs mode still programs its KUBE-* chains with iptables-restore; the addresses live in ipsets.
    tools=(ToolNeed("iptables"), ToolNeed("ipset", IPVS_MIN_IPSET)),
    modules=modules,
)
