"""The local cluster's "kubelet": one process per node that keeps the Node alive and runs its pods.

    python -m localcluster.nodesim --node ps-node-1 --node-ip 198.18.0.11 \\
        --kubeconfig STATE/admin.kubeconfig --bin-dir BIN --state-dir STATE

It keeps the Node Ready and its Lease renewed, watches the pods bound to the
node and runs the two images it knows (docs/architecture.md): kube-proxy as
the real binary and the proxyshift image as `python -m proxyshift.cli`, each
through `localcluster.container` (the node's network namespace for a
hostNetwork pod, the node's one pod namespace (podnet) for any other, with status.podIP
that namespace's address; plus a private mount namespace with the pod's volumes bound at
their mountPaths). It reports
pod status, restarts crashed containers with back-off, runs readiness and
liveness probes inside the node, and stops a pod's processes when the pod is
deleted or terminating, then finalises the pod.

One module per job: config (what a simulator is told), node (Node and Lease), podspec (reading a
pod spec), volumes, containers, probes, pod (one pod's worker), logserver (the kubelet log API)
and simulator (the process). The raw API client is localcluster.kubeapi.
"""
