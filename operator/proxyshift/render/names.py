"""Names and labels of revisions: always valid Kubernetes names and label values, for any policy name.

A policy name is a DNS-1123 subdomain of up to 253 characters; a label value
has at most 63. The revision name `<policy>-<hash>` is used as a label value
(`proxyshift.io/revision`, on nodes and pods) and inside object names
`kube-proxy-<revision>`; the DaemonSet name is kept within 63 characters
because its pods' generated names and controller-revision names are derived
from it. Long policy names are cut deterministically, and a hash of the full
name is kept so two long names with the same prefix never share a revision.
"""

from __future__ import annotations

import hashlib
import re

LABEL_POLICY = "proxyshift.io/policy"
LABEL_REVISION = "proxyshift.io/revision"
LABEL_MANAGED_BY = "proxyshift.io/managed-by"
MANAGED_BY = "proxyshift"
ANNOTATION_CONFIG_HASH = "proxyshift.io/config-hash"
# The policy label value may be shortened to fit 63 characters; the annotation keeps the full name.
ANNOTATION_POLICY = "proxyshift.io/policy"
ANNOTATION_MODE = "proxyshift.io/mode"

OBJECT_PREFIX = "kube-proxy-"
MAX_LABEL_VALUE = 63
# kube-proxy-<revision> must fit 63 characters, so the revision gets what the prefix leaves.
MAX_REVISION = MAX_LABEL_VALUE - len(OBJECT_PREFIX)
HASH_LENGTH = 10
NAME_HASH_LENGTH = 8

_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN_RE = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")


def is_label_value(value: str) -> bool:
    return len(value) <= MAX_LABEL_VALUE and bool(_LABEL_VALUE_RE.match(value))


def is_dns_subdomain(value: str) -> bool:
    return 0 < len(value) <= 253 and bool(_DNS_SUBDOMAIN_RE.match(value))


def _short_hash(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _cut(name: str, room: int) -> str:
    # Strip what would leave a dot-label ending in '-' or a '.' directly before the '-' we append.
    return name[:room].rstrip("-.")


def _bounded(name: str, suffix: str, limit: int) -> str:
    """`<name>-<suffix>` if it fits in limit, else `<cut name>-<hash of name>-<suffix>`."""
    whole = f"{name}-{suffix}" if suffix else name
    if len(whole) <= limit:
        return whole
    tail = f"-{_short_hash(name, NAME_HASH_LENGTH)}" + (f"-{suffix}" if suffix else "")
    prefix = _cut(name, limit - len(tail))
    return f"{prefix}{tail}" if prefix else tail.lstrip("-")


def revision_name(policy: str, config_hash: str) -> str:
    """`<policy>-<hash>`, at most MAX_REVISION characters, a valid label value and DNS subdomain."""
    if not policy:
        raise ValueError("a revision needs the policy's name")
    return _bounded(policy, config_hash, MAX_REVISION)


def policy_label_value(policy: str) -> str:
    """The value of the proxyshift.io/policy label: the name itself when it fits, else cut plus a hash."""
    return _bounded(policy, "", MAX_LABEL_VALUE)


def revision_object_names(revision: str) -> tuple[str, str]:
    """(ConfigMap name, DaemonSet name) of a revision, both in kube-system."""
    name = f"{OBJECT_PREFIX}{revision}"
    return name, name
