"""charts/proxyshift: helm lint, the generated CRDs and alerts it ships, the same objects as config/default.

helm is the pinned build of `make go-tools` (tests/tools/helm); without it these tests fail and say so.
"""

from __future__ import annotations

import tarfile
from typing import Any

import pytest
import yaml

from tests.support.chart_render import (
    CHART,
    CHART_LABELS,
    NAMESPACE,
    ROOT,
    by_key,
    differences,
    helm_run,
    kustomize_subset,
    render,
    without_chart_labels,
)

pytestmark = pytest.mark.unit

OPTIONAL = ("alerts.enabled=true", "metrics.serviceMonitor.enabled=true")


def _one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind}/{name} rendered"
    return found[0]


def _container(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    containers: list[dict[str, Any]] = _one(objects, kind, name)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


@pytest.mark.parametrize("values", [(), OPTIONAL], ids=["defaults", "alerts-and-servicemonitor"])
def test_helm_lint_is_clean(values: tuple[str, ...]) -> None:
    argv = ["lint", "--strict", str(CHART)]
    for value in values:
        argv += ["--set", value]
    out = helm_run(*argv)
    assert "1 chart(s) linted, 0 chart(s) failed" in out, out


def test_chart_crds_are_the_generated_files() -> None:
    # The chart's crds/ links to crds/ (`make crds` writes those); a copy that drifted fails here.
    listed = yaml.safe_load((ROOT / "crds" / "kustomization.yaml").read_text())["resources"]
    shipped = sorted(p.name for p in (CHART / "crds").iterdir())
    assert shipped == sorted(listed)
    for name in listed:
        assert (CHART / "crds" / name).read_bytes() == (ROOT / "crds" / name).read_bytes(), name


def test_chart_alerts_are_config_prometheus_alerts() -> None:
    shipped = CHART / "files" / "prometheusrule.yaml"
    assert shipped.read_bytes() == (ROOT / "config" / "prometheus" / "alerts" / "prometheusrule.yaml").read_bytes()


def test_chart_admission_policies_are_config_admission() -> None:
    # templates/admission.yaml renders what files/admission/kustomization.yaml lists, so a policy added
    # to config/admission reaches the chart by itself.
    shipped = CHART / "files" / "admission"
    source = ROOT / "config" / "admission"
    assert sorted(p.name for p in shipped.iterdir()) == sorted(p.name for p in source.iterdir())
    for path in source.iterdir():
        assert (shipped / path.name).read_bytes() == path.read_bytes(), path.name


def test_default_values_render_the_objects_of_config_default() -> None:
    assert differences(render(), kustomize_subset(ROOT / "config" / "default")) == []


def test_the_stated_differences_are_all_there_is() -> None:
    # Every chart object carries Helm's labels, and nothing else tells it from config/'s.
    for obj in render():
        labels = obj["metadata"].get("labels", {})
        if obj["kind"] == "CustomResourceDefinition":
            continue  # crds/ is installed as it is, never templated
        assert set(CHART_LABELS) <= labels.keys(), obj["metadata"]
    kinds = {(o["kind"], o["metadata"]["name"]) for o in kustomize_subset(ROOT / "config" / "default")}
    rendered = {(o["kind"], o["metadata"]["name"]) for o in render()}
    assert kinds - rendered == {("Namespace", NAMESPACE)}


def test_optional_monitoring_renders_config_prometheus() -> None:
    chart = by_key([without_chart_labels(o) for o in render(*OPTIONAL)
                    if o["kind"] in ("ServiceMonitor", "PodMonitor", "PrometheusRule")])
    assert chart == by_key(kustomize_subset(ROOT / "config" / "prometheus"))


def test_alert_annotations_reach_prometheus_as_its_templates() -> None:
    rule = _one(render("alerts.enabled=true"), "PrometheusRule", "proxyshift")
    summaries = [r["annotations"]["summary"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert any("{{ $labels.policy }}" in s for s in summaries), summaries


def test_monitoring_is_off_by_default() -> None:
    # These kinds exist only where the Prometheus Operator is installed.
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule"} & {o["kind"] for o in render()}


def test_monitoring_labels_are_added() -> None:
    objects = render(*OPTIONAL, "alerts.labels.release=kube-prometheus",
                     "metrics.serviceMonitor.labels.release=kube-prometheus", "metrics.serviceMonitor.interval=10s")
    rule = _one(objects, "PrometheusRule", "proxyshift")
    monitor = _one(objects, "ServiceMonitor", "proxyshift-operator")
    agents = _one(objects, "PodMonitor", "proxyshift-agent")
    assert rule["metadata"]["labels"]["release"] == monitor["metadata"]["labels"]["release"] == "kube-prometheus"
    assert agents["metadata"]["labels"]["release"] == "kube-prometheus"
    assert agents["spec"]["podMetricsEndpoints"][0]["interval"] == "10s"
    assert rule["metadata"]["labels"]["app.kubernetes.io/name"] == "proxyshift-operator"
    assert monitor["spec"]["endpoints"][0]["interval"] == "10s"


def test_image_replicas_and_resources_follow_the_values() -> None:
    objects = render("image.repository=registry.example/proxyshift", "image.tag=0.2.0-rc1",
                     "image.pullPolicy=Always", "image.pullSecrets[0]=regcred", "operator.replicas=1",
                     "operator.resources.requests.cpu=200m", "agent.resources.limits.memory=256Mi",
                     "probe.resources.requests.memory=40Mi")
    assert _one(objects, "Deployment", "proxyshift-operator")["spec"]["replicas"] == 1
    for kind, name in (("Deployment", "proxyshift-operator"), ("DaemonSet", "proxyshift-agent"),
                       ("DaemonSet", "proxyshift-probe")):
        container = _container(objects, kind, name)
        assert container["image"] == "registry.example/proxyshift:0.2.0-rc1"
        assert container["imagePullPolicy"] == "Always"
        assert _one(objects, kind, name)["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert _container(objects, "Deployment", "proxyshift-operator")["resources"]["requests"]["cpu"] == "200m"
    assert _container(objects, "DaemonSet", "proxyshift-agent")["resources"]["limits"]["memory"] == "256Mi"
    assert _container(objects, "DaemonSet", "proxyshift-probe")["resources"]["requests"]["memory"] == "40Mi"


def test_agent_placement_places_the_probe_server_too() -> None:
    objects = render("agent.nodeSelector.pool=blue", "agent.tolerations[0].key=dedicated",
                     "agent.tolerations[0].operator=Exists", "agent.tolerations[0].effect=NoSchedule")
    for name in ("proxyshift-agent", "proxyshift-probe"):
        pod = _one(objects, "DaemonSet", name)["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"pool": "blue"}, name
        assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}], name


def test_admission_policies_can_be_left_out() -> None:
    kinds = {o["kind"] for o in render("admission.enabled=false")}
    assert "Deployment" in kinds
    assert not {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"} & kinds


def test_another_namespace_reaches_every_identity_and_the_probe_lookup() -> None:
    objects = render("metrics.serviceMonitor.enabled=true", namespace="netops")
    text = yaml.safe_dump_all(objects)
    assert "proxyshift-system" not in text
    policy = _one(objects, "ValidatingAdmissionPolicy", "proxyshift-agent-own-node")
    assert "system:serviceaccount:netops:proxyshift-agent" in policy["spec"]["matchConditions"][0]["expression"]
    env = _container(objects, "Deployment", "proxyshift-operator")["env"]
    assert {"name": "PROXYSHIFT_PROBE_NAMESPACE", "value": "netops"} in env
    binding = _one(objects, "RoleBinding", "proxyshift-operator")
    assert binding["metadata"]["namespace"] == "kube-system"  # revisions live beside kube-proxy
    assert binding["subjects"][0]["namespace"] == "netops"
    monitor = _one(objects, "ServiceMonitor", "proxyshift-operator")
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["netops"]


def test_kustomize_subset_refuses_what_it_cannot_read(tmp_path: Any) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: x-\n")
    with pytest.raises(AssertionError, match="namePrefix"):
        kustomize_subset(tmp_path)


def test_a_difference_is_named_by_its_field() -> None:
    objects = kustomize_subset(ROOT / "config" / "default")
    changed = [dict(o) for o in objects]
    deployment = next(o for o in changed if o["kind"] == "Deployment")
    deployment["spec"] = {**deployment["spec"], "replicas": 3}
    found = differences([o for o in changed if o["kind"] != "Namespace"], objects)
    assert found == ["('apps/v1', 'Deployment', 'proxyshift-system', 'proxyshift-operator') .spec.replicas: "
                     "chart 3, kustomize 2"]


def test_the_packaged_chart_carries_the_linked_files_themselves(tmp_path: Any) -> None:
    # A chart repository or OCI registry gets the .tgz, where a link to outside the chart would dangle.
    helm_run("package", str(CHART), "--destination", str(tmp_path))
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    with tarfile.open(tmp_path / f"proxyshift-{version}.tgz") as archive:
        members = {m.name: m for m in archive.getmembers()}
        for inside, source in [*((f"crds/{p.name}", p) for p in sorted((CHART / "crds").iterdir())),
                               *((f"files/admission/{p.name}", p)
                                 for p in sorted((ROOT / "config" / "admission").iterdir())),
                               ("files/prometheusrule.yaml",
                                ROOT / "config" / "prometheus" / "alerts" / "prometheusrule.yaml")]:
            member = members[f"proxyshift/{inside}"]
            assert member.isfile(), inside
            extracted = archive.extractfile(member)
            assert extracted is not None
            assert extracted.read() == source.read_bytes(), inside
