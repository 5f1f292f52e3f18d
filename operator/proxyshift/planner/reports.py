"""What `proxyshift status -o json|yaml` and `proxyshift plan -o json|yaml` print: typed, stable shapes.

The table output is for a person; these models are for scripts, so their field names are part of the
CLI's interface (docs/cli.md) and change only with a new `apiVersion`. They are built here, without I/O,
from what the views read (ProxyPolicy and ProxyNode bodies, the planner's preview and compatibility
groups), and serialised with `model_dump(by_alias=True)`: camelCase, as kubectl users expect.

Exit codes follow from the same reports (`StatusReport.exit_code`, `PlanReport.exit_code`) so the table
and the machine-readable output cannot disagree about the outcome.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError

from proxyshift.api.common import GROUP_VERSION, Condition, KubeModel
from proxyshift.api.policy import NodeCounts, NodeFailure, ProxyPolicy, ProxyPolicyStatus
from proxyshift.api.proxynode import Phase
from proxyshift.planner.compat import CompatFinding
from proxyshift.planner.preview import CompatGroup, PreviewStage, foreign_ipvs_nodes
from proxyshift.planner.world import World

OutputFormat = Literal["table", "json", "yaml"]
OUTPUT_FORMATS: tuple[OutputFormat, ...] = ("table", "json", "yaml")

# The CLI's exit codes (docs/cli.md): every subcommand uses these three.
EXIT_OK = 0  # done, healthy, or every node passes
EXIT_NOT_READY = 1  # not ready yet, degraded, or some node will fail preflight
EXIT_USAGE = 2  # bad flags, bad input file, unknown name, a cluster that cannot be used

# The node phases whose migration message is an error (the LAST ERROR column of `proxyshift status`).
FAILED_PHASES: tuple[Phase, ...] = ("Failed", "RollingBack", "RolledBack")
MAX_REPORTED_CONFLICTS = 20
NO_INVENTORY = "no inventory yet"

PreflightVerdict = Literal["ok", "unknown", "fail"]


# ---- status ----


class NodeReport(KubeModel):
    """One ProxyNode of the policy: where its migration stands and what the node really runs."""

    name: str
    phase: str = Field(description="The node's migration step (Pending before the operator started it).")
    phase_since: str | None = Field(default=None, description="When the node entered the step (RFC 3339).")
    observed_mode: str | None = Field(default=None, description="kube-proxy's own /proxyMode answer; null: unknown.")
    target_mode: str | None = Field(default=None, description="The mode the operator wants; null: the baseline's.")
    revision: str | None = Field(default=None, description="The target revision; null: the baseline kube-proxy.")
    leftovers: list[str] = Field(default_factory=list, description="Other modes with stale objects on the node.")
    leftover_objects: int | None = Field(default=None, description="How many stale objects; null: not reported.")
    last_error: str | None = Field(default=None, description="Why the node failed or was rolled back.")
    heartbeat: str | None = Field(default=None, description="The agent's last status write (RFC 3339).")


class PolicyReport(KubeModel):
    """One ProxyPolicy's rollout."""

    name: str
    mode: str | None = Field(default=None, description="The policy's target mode.")
    phase: str = Field(description="Pending, Progressing, Paused, Ready, Degraded, Conflict or Deleting.")
    revision: str | None = Field(default=None, description="status.currentRevision.")
    progress: str | None = Field(default=None, description="updated/selected, as the policy's status says.")
    node_counts: NodeCounts = Field(default_factory=NodeCounts, description="status.nodes.")
    conditions: list[Condition] = Field(default_factory=list)
    failed: list[NodeFailure] = Field(default_factory=list, description="Recent failed or rolled-back nodes.")
    nodes: list[NodeReport] | None = Field(
        default=None, description="Every ProxyNode the policy owns, by name; null when all policies are listed.")

    @property
    def ready(self) -> bool:
        return self.phase == "Ready"


class StatusReport(KubeModel):
    """`proxyshift status [POLICY] -o json|yaml`."""

    api_version: str = GROUP_VERSION
    kind: Literal["StatusReport"] = "StatusReport"
    policies: list[PolicyReport] = Field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """0 when every policy shown is Ready (or there is none), else 1."""
        return EXIT_OK if all(p.ready for p in self.policies) else EXIT_NOT_READY


def _policy_status(raw: Mapping[str, Any]) -> ProxyPolicyStatus:
    try:
        return ProxyPolicyStatus.model_validate(raw)
    except ValidationError:
        # A status another version of the operator wrote: show its phase rather than fail the command.
        phase = raw.get("phase")
        return ProxyPolicyStatus(phase=phase if isinstance(phase, str) else None)


def node_report(body: Mapping[str, Any]) -> NodeReport:
    spec, status = body.get("spec") or {}, body.get("status") or {}
    migration = spec.get("migration") or {}
    phase = migration.get("phase") or "Pending"
    count = status.get("leftoverObjects")
    return NodeReport(
        name=str((body.get("metadata") or {}).get("name", "")),
        phase=phase,
        phase_since=migration.get("phaseSince"),
        observed_mode=status.get("observedMode"),
        target_mode=spec.get("mode"),
        revision=spec.get("revision"),
        leftovers=[str(m) for m in status.get("leftovers") or []],
        leftover_objects=count if isinstance(count, int) else None,
        last_error=(migration.get("message") or None) if phase in FAILED_PHASES else None,
        heartbeat=status.get("heartbeat"),
    )


def policy_report(body: Mapping[str, Any], proxynodes: Iterable[Mapping[str, Any]] | None) -> PolicyReport:
    """The policy's report; with `proxynodes`, also every one of them it owns."""
    name = str((body.get("metadata") or {}).get("name", ""))
    status = _policy_status(body.get("status") or {})
    nodes = None
    if proxynodes is not None:
        owned = [n for n in proxynodes if (n.get("spec") or {}).get("policy") == name]
        nodes = sorted((node_report(n) for n in owned), key=lambda n: n.name)
    return PolicyReport(
        name=name, mode=(body.get("spec") or {}).get("mode"), phase=status.phase or "Pending",
        revision=status.current_revision, progress=status.progress, node_counts=status.nodes,
        conditions=status.conditions, failed=status.failed, nodes=nodes,
    )


def status_report(policies: Iterable[Mapping[str, Any]],
                  proxynodes: Iterable[Mapping[str, Any]] | None = None) -> StatusReport:
    """Every policy by name (proxynodes None), or the one policy asked for with its nodes."""
    nodes = list(proxynodes) if proxynodes is not None else None
    reports = [policy_report(p, nodes) for p in policies]
    return StatusReport(policies=sorted(reports, key=lambda p: p.name))


# ---- plan ----


def preflight_verdict(problems: Sequence[str]) -> PreflightVerdict:
    """ok; unknown when the only problem is a missing inventory; else fail."""
    if not problems:
        return "ok"
    if all(p.startswith(NO_INVENTORY) for p in problems):
        return "unknown"
    return "fail"


class PlanNode(KubeModel):
    name: str
    current_revision: str | None = Field(default=None, description="What the node runs now; null: the baseline.")
    preflight: PreflightVerdict = Field(description="ok, unknown (no inventory yet) or fail.")
    problems: list[str] = Field(default_factory=list, description="What preflight will report.")
    notes: list[str] = Field(default_factory=list,
                             description="What a passing preflight passes only because the policy accepts it.")


class PlanStage(KubeModel):
    stage: int = Field(description="1-based.")
    target: int = Field(description="Updated nodes at the end of the stage (cumulative).")
    pause: str | None = Field(default=None, description="The pause after the stage, as the policy writes it.")
    nodes: list[PlanNode] = Field(default_factory=list, description="In the order they will be migrated.")


class PlanFinding(KubeModel):
    change: str = Field(description="The behaviour change's name (gate.behaviour.allowChanges spells it so).")
    summary: str
    services: list[str] = Field(default_factory=list, description="NAMESPACE/NAME of some affected Services.")
    service_count: int = Field(description="How many Services it affects in all.")
    preserving: str | None = Field(default=None, description="The setting that keeps today's behaviour.")
    preserved: bool = Field(default=False, description="The target configuration already keeps it.")
    gated: bool = Field(default=False, description="The behaviour gate sees this change on a node.")


class PlanForeignIPVS(KubeModel):
    """A node holding IPVS virtual servers that are not kube-proxy's, which the move to nftables deletes."""

    node: str
    count: int = Field(description="How many the agent's inventory found.")
    virtual_servers: list[str] = Field(default_factory=list, description="The first of them, 'TCP 198.18.5.1:80 rr'.")
    accepted: bool = Field(description="The policy accepts ForeignIPVSFlush: preflight passes and the switch deletes "
                           "them; false: preflight refuses the node.")


class PlanCompatibility(KubeModel):
    source: str = Field(description="'baseline' or the revision the nodes run now.")
    from_mode: str
    to_mode: str
    nodes: list[str]
    findings: list[PlanFinding] = Field(default_factory=list)


class PlanReport(KubeModel):
    """`proxyshift plan -f FILE -o json|yaml`."""

    api_version: str = GROUP_VERSION
    kind: Literal["PlanReport"] = "PlanReport"
    policy: str
    mode: str
    revision: str = Field(description="The revision the policy renders to on this cluster's baseline.")
    nodes_to_change: int = Field(description="Nodes the stages would migrate.")
    preflight_failures: int = Field(description="Nodes whose preflight is predicted to fail.")
    stages: list[PlanStage] = Field(default_factory=list)
    conflicts: list[str] = Field(default_factory=list,
                                 description=f"Selected nodes other policies own (at most {MAX_REPORTED_CONFLICTS}).")
    conflict_count: int = 0
    compatibility: list[PlanCompatibility] = Field(default_factory=list)
    foreign_ipvs: list[PlanForeignIPVS] = Field(
        default_factory=list, alias="foreignIPVS",
        description="For a move to nftables: the nodes holding IPVS virtual servers that are not kube-proxy's.")
    advice: str | None = None

    @property
    def exit_code(self) -> int:
        """1 when some node will fail preflight, else 0 (an unknown preflight is not a failure)."""
        return EXIT_NOT_READY if self.preflight_failures else EXIT_OK


def conflicting_nodes(policy: ProxyPolicy, world: World) -> list[str]:
    """Nodes the policy selects that another policy's ProxyNode names as its owner, sorted."""
    return sorted(n for n, pn in world.proxynodes.items() if pn.spec.policy not in (None, policy.name)
                  and policy.spec.node_selector.matches(world.nodes[n].labels if n in world.nodes else {}))


def _finding(finding: CompatFinding, gated: frozenset[str]) -> PlanFinding:
    return PlanFinding(change=finding.change, summary=finding.summary, services=list(finding.services),
                       service_count=finding.service_count, preserving=finding.preserving,
                       preserved=finding.preserved, gated=finding.change in gated)


def plan_report(policy: ProxyPolicy, world: World, stages: Sequence[PreviewStage], groups: Sequence[CompatGroup],
                advice: str | None, gated: Iterable[str] = ()) -> PlanReport:
    gated_changes = frozenset(gated)
    stage_reports = [
        PlanStage(stage=s.stage, target=s.target, pause=s.pause, nodes=[
            PlanNode(name=n, current_revision=world.nodes[n].revision if n in world.nodes else None,
                     preflight=preflight_verdict(s.preflight_failures.get(n, [])),
                     problems=list(s.preflight_failures.get(n, [])), notes=list(s.preflight_notes.get(n, [])))
            for n in s.nodes])
        for s in stages]
    conflicts = conflicting_nodes(policy, world)
    target = world.current_revisions.get(policy.name)
    return PlanReport(
        policy=policy.name, mode=policy.spec.mode, revision=target.name if target else "",
        nodes_to_change=sum(len(s.nodes) for s in stage_reports),
        preflight_failures=sum(n.preflight == "fail" for s in stage_reports for n in s.nodes),
        stages=stage_reports, conflicts=conflicts[:MAX_REPORTED_CONFLICTS], conflict_count=len(conflicts),
        compatibility=[PlanCompatibility(source=g.source, from_mode=g.mode, to_mode=policy.spec.mode, nodes=g.nodes,
                                         findings=[_finding(f, gated_changes) for f in g.findings])
                       for g in groups],
        foreignIPVS=[PlanForeignIPVS(node=f.node, count=f.count, virtual_servers=list(f.virtual_servers),
                                      accepted=f.accepted) for f in foreign_ipvs_nodes(world, policy.name)],
        advice=advice,
    )


# ---- serialisation ----


def dump(report: BaseModel, output: OutputFormat) -> str:
    """The report as JSON or YAML text (no trailing newline), camelCase field names."""
    data = report.model_dump(mode="json", by_alias=True)
    if output == "json":
        return json.dumps(data, indent=2)
    if output == "yaml":
        return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True).rstrip("\n")
    raise ValueError(f"no machine-readable output {output!r}: the table is rendered by the view")
