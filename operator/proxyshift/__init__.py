"""proxyshift: migrate Kubernetes nodes between kube-proxy modes, node by node, safely."""

__version__ = "0.1.0"
