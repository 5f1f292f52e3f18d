"""A minimal stand-in for kube-apiserver, just enough for a real kube-proxy to sync its rules.

Serves list and (idle) watch of the objects kube-proxy's informers ask for:
its Node, Services, EndpointSlices, ServiceCIDRs; accepts Events. Everything
is JSON over plain HTTP on loopback, and it runs inside the test's network
namespace, so the kube-proxy next to it needs no real control plane. Used to
capture real /metrics and real iptables/nftables rules for the agent's tests;
the local cluster (tests/e2e) is the full-size version.

    python -m tests.support.fake_apiserver --port 6443 --node ps-node-1 --node-ip 198.18.0.11 --services 20
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import sys
import time
import urllib.parse
from http.server import ThreadingHTTPServer
from typing import Any

from tests.support.fake_http import JsonHandler

RV = "100"


def world(node: str, node_ip: str, services: int, udp_services: int = 0) -> dict[str, list[dict[str, Any]]]:
    """The objects: one Node, `services` ClusterIP Services (every 4th a NodePort), 2 endpoints each;
    then `udp_services` UDP ClusterIP Services udp<i> (port 53 -> 5353) after them, 2 endpoints each."""
    svcs, slices = [], []
    for i in range(services):
        name, ns = f"svc{i}", f"ns{i % 5}"
        cip = str(ipaddress.IPv4Address("198.19.0.10") + i)
        svc: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "uid": f"svc-{i}", "resourceVersion": RV},
            "spec": {"type": "NodePort" if i % 4 == 0 else "ClusterIP", "clusterIP": cip, "clusterIPs": [cip],
                     "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "sessionAffinity": "None",
                     "internalTrafficPolicy": "Cluster",
                     "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080,
                                **({"nodePort": 30000 + i} if i % 4 == 0 else {})}]},
        }
        if i % 4 == 0:
            svc["spec"]["externalTrafficPolicy"] = "Cluster"
        svcs.append(svc)
        eps = [str(ipaddress.IPv4Address("198.18.16.1") + 2 * i + k) for k in range(2)]
        slices.append({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-abcde", "namespace": ns, "uid": f"eps-{i}", "resourceVersion": RV,
                         "labels": {"kubernetes.io/service-name": name,
                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True, "serving": True, "terminating": False},
                           "nodeName": node} for ip in eps],
            "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
        })
    for j in range(udp_services):
        i = services + j
        cip = str(ipaddress.IPv4Address("198.19.0.10") + i)
        svcs.append({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"udp{j}", "namespace": "ns0", "uid": f"svc-{i}", "resourceVersion": RV},
            "spec": {"type": "ClusterIP", "clusterIP": cip, "clusterIPs": [cip], "ipFamilies": ["IPv4"],
                     "ipFamilyPolicy": "SingleStack", "sessionAffinity": "None", "internalTrafficPolicy": "Cluster",
                     "ports": [{"name": "dns", "protocol": "UDP", "port": 53, "targetPort": 5353}]},
        })
        eps = [str(ipaddress.IPv4Address("198.18.16.1") + 2 * i + k) for k in range(2)]
        slices.append({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"udp{j}-abcde", "namespace": "ns0", "uid": f"eps-{i}", "resourceVersion": RV,
                         "labels": {"kubernetes.io/service-name": f"udp{j}",
                                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True, "serving": True, "terminating": False},
                           "nodeName": node} for ip in eps],
            "ports": [{"name": "dns", "protocol": "UDP", "port": 5353}],
        })
    node_obj = {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node, "uid": "node-1", "resourceVersion": RV,
                     "labels": {"kubernetes.io/hostname": node}},
        "spec": {"podCIDR": "198.18.16.0/20", "podCIDRs": ["198.18.16.0/20"]},
        "status": {"addresses": [{"type": "InternalIP", "address": node_ip}, {"type": "Hostname", "address": node}]},
    }
    cidr = {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": {"name": "kubernetes", "uid": "cidr-1", "resourceVersion": RV},
            "spec": {"cidrs": ["198.19.0.0/16"]}}
    return {"nodes": [node_obj], "services": svcs, "endpointslices": slices, "servicecidrs": [cidr]}


LISTS = {
    "/api/v1/nodes": ("v1", "NodeList", "nodes"),
    "/api/v1/services": ("v1", "ServiceList", "services"),
    "/apis/discovery.k8s.io/v1/endpointslices": ("discovery.k8s.io/v1", "EndpointSliceList", "endpointslices"),
    "/apis/networking.k8s.io/v1/servicecidrs": ("networking.k8s.io/v1", "ServiceCIDRList", "servicecidrs"),
}


def make_handler(objects: dict[str, list[dict[str, Any]]]) -> type[JsonHandler]:
    class Handler(JsonHandler):
        log_prefix = "fake-apiserver"

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            entry = LISTS.get(url.path)
            if entry is None:
                self.not_found(url.path)
                return
            api_version, kind, key = entry
            items = objects[key]
            selector = query.get("fieldSelector", [""])[0]
            if selector.startswith("metadata.name="):
                items = [o for o in items if o["metadata"]["name"] == selector.split("=", 1)[1]]
            if query.get("watch") == ["true"]:
                self._watch(items, api_version, kind.removesuffix("List"),
                            query.get("sendInitialEvents") == ["true"],
                            min(float(query.get("timeoutSeconds", ["60"])[0]), 60.0))
                return
            self.send_json(200, {"apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": RV},
                                 "items": items})

        def _watch(self, items: list[dict[str, Any]], api_version: str, kind: str, initial: bool,
                   timeout: float) -> None:
            # Nothing ever changes here: after the initial state the watch idles until the client's
            # timeout is up.
            self.start_stream()
            if initial:
                self.send_initial_events(items, api_version, kind, RV)
            time.sleep(timeout)
            self.end_stream()

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            self.send_json(201, body)

        do_PUT = do_POST
        do_PATCH = do_POST

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=6443)
    p.add_argument("--node", default="ps-node-1")
    p.add_argument("--node-ip", default="198.18.0.11")
    p.add_argument("--services", type=int, default=20)
    p.add_argument("--udp-services", type=int, default=0)
    args = p.parse_args(argv)
    srv = ThreadingHTTPServer(("127.0.0.1", args.port),
                              make_handler(world(args.node, args.node_ip, args.services, args.udp_services)))
    srv.daemon_threads = True
    srv.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
