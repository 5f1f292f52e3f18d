"""kind-config.yaml parses as kind's v1alpha4 Cluster, with kind's own strictness.

kind decodes its config strictly (an unknown field is an error) and then validates it. The models
below mirror kubernetes-sigs/kind pkg/apis/config/v1alpha4/types.go (field names from its yaml tags,
types from its Go types) and the checks of pkg/internal/apis/config/validate.go that apply to a
file, so a misspelt or misplaced field fails here rather than at `kind create cluster`.

Cross-checked once by hand (not here: it needs Go and kind's source) against kind's own code at
kind commit fed26882 (2026-08-21): encoding.Load + Validate accept this file and refuse a node's
misspelt `lables`, and kind's kubeadm rendering with our patch gives a KubeProxyConfiguration of
mode iptables with conntrack {maxPerCore: 0, tcpBeLiberal: true} and node-labels pool=<pool>.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
KIND_CONFIG = ROOT / "kind-config.yaml"

Int32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]  # Go int32


class Strict(BaseModel):
    # extra="forbid" is kind's strict decoding; strict=True keeps YAML's "3" from passing as an int.
    model_config = ConfigDict(extra="forbid", strict=True)


class PatchJSON6902(Strict):
    group: str
    version: str
    kind: str
    patch: str


class Mount(Strict):
    containerPath: str | None = None
    hostPath: str | None = None
    readOnly: bool | None = None
    selinuxRelabel: bool | None = None
    propagation: Literal["None", "HostToContainer", "Bidirectional"] | None = None


class PortMapping(Strict):
    containerPort: Int32 | None = None
    hostPort: Int32 | None = None
    listenAddress: str | None = None
    protocol: Literal["TCP", "UDP", "SCTP"] | None = None


class Node(Strict):
    role: Literal["control-plane", "worker"] = "control-plane"
    image: str | None = None
    labels: dict[str, str] | None = None
    extraMounts: list[Mount] | None = None
    extraPortMappings: list[PortMapping] | None = None
    kubeadmConfigPatches: list[str] | None = None
    kubeadmConfigPatchesJSON6902: list[PatchJSON6902] | None = None


class Networking(Strict):
    ipFamily: Literal["ipv4", "ipv6", "dual"] | None = None
    apiServerPort: Int32 | None = None
    apiServerAddress: str | None = None
    podSubnet: str | None = None
    serviceSubnet: str | None = None
    disableDefaultCNI: bool | None = None
    # validate.go accepts "none" too; v1alpha4 names iptables, ipvs and nftables.
    kubeProxyMode: Literal["iptables", "ipvs", "nftables", "none"] | None = None
    dnsSearch: list[str] | None = None


class Cluster(Strict):
    kind: Literal["Cluster"]
    apiVersion: Literal["kind.x-k8s.io/v1alpha4"]
    name: str | None = None
    nodes: list[Node] | None = None
    networking: Networking | None = None
    featureGates: dict[str, bool] | None = None
    runtimeConfig: dict[str, str] | None = None
    kubeadmConfigPatches: list[str] | None = None
    kubeadmConfigPatchesJSON6902: list[PatchJSON6902] | None = None
    containerdConfigPatches: list[str] | None = None
    containerdConfigPatchesJSON6902: list[str] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str | None) -> str | None:
        if name is not None and not re.match(r"^[a-z0-9.-]+$", name):
            raise ValueError(f"{name!r} is not a valid kind cluster name")
        return name

    @model_validator(mode="after")
    def _control_plane(self) -> Cluster:
        if not any(n.role == "control-plane" for n in self.nodes or [Node()]):
            raise ValueError("must have at least one control-plane node")
        return self


def load() -> Cluster:
    return Cluster.model_validate(yaml.safe_load(KIND_CONFIG.read_text()))


def test_kind_config_is_a_valid_kind_cluster() -> None:
    load()


def test_pools_and_mode() -> None:
    cluster = load()
    assert cluster.networking is not None and cluster.networking.kubeProxyMode == "iptables"
    nodes = cluster.nodes or []
    assert [n.role for n in nodes].count("control-plane") == 1
    pools = [(n.labels or {}).get("pool") or "" for n in nodes if n.role == "worker"]
    assert sorted(pools) == ["blue", "blue", "green"]  # the e2e suite's pools (tests/conftest.py E2E_POOLS)


def test_kubeadm_patches_are_yaml_objects_with_a_kind() -> None:
    # kind applies each patch to the generated object whose `kind` matches; a patch that is not a
    # mapping with a kind matches nothing and is silently useless.
    cluster = load()
    patches = [*(cluster.kubeadmConfigPatches or []),
               *(p for n in cluster.nodes or [] for p in n.kubeadmConfigPatches or [])]
    for text in patches:
        doc = yaml.safe_load(text)
        assert isinstance(doc, dict) and doc.get("kind"), text


@pytest.mark.parametrize("mutation", [
    {"nodes": [{"role": "worker", "lables": {"pool": "blue"}}, {"role": "control-plane"}]},
    {"networking": {"kubeproxymode": "iptables"}},
    {"networking": {"kubeProxyMode": "userspace"}},
    {"nodes": [{"role": "master"}]},
    {"nodes": [{"role": "worker"}]},
    {"apiVersion": "kind.x-k8s.io/v1alpha3"},
    {"networking": {"apiServerPort": "6443"}},
    {"featureGates": {"NFTablesProxyMode": "true"}},
])
def test_the_model_refuses_what_kind_refuses(mutation: dict[str, object]) -> None:
    doc = yaml.safe_load(KIND_CONFIG.read_text()) | mutation
    with pytest.raises(ValidationError):
        Cluster.model_validate(doc)
