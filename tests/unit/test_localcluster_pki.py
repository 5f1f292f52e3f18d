"""The local cluster's PKI: SANs, identities, and that re-running keeps existing keys."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from localcluster import pki

pytestmark = pytest.mark.unit


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_apiserver_cert_names_every_address(tmp_path: Path) -> None:
    files = pki.ensure_pki(tmp_path / "pki")
    sans = _cert(files.apiserver_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert ips == {"127.0.0.1", "198.18.0.1", "198.19.0.1"}
    assert "kubernetes.default.svc.cluster.local" in sans.get_values_for_type(x509.DNSName)
    assert all(isinstance(ipaddress.ip_address(ip), ipaddress.IPv4Address) for ip in ips)


def test_client_identities(tmp_path: Path) -> None:
    files = pki.ensure_pki(tmp_path / "pki")
    admin = _cert(files.client_cert("admin")).subject
    assert admin.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    kcm = _cert(files.client_cert("kube-controller-manager")).subject
    assert kcm.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:kube-controller-manager"
    cert, key = pki.issue_client_cert(files.root, "ps-node-1", "system:node:ps-node-1", ("system:nodes",))
    assert _cert(cert).issuer == _cert(files.ca_cert).subject
    assert key.stat().st_mode & 0o077 == 0


def test_rerun_keeps_the_ca(tmp_path: Path) -> None:
    first = pki.ensure_pki(tmp_path / "pki").ca_cert.read_bytes()
    assert pki.ensure_pki(tmp_path / "pki").ca_cert.read_bytes() == first


def test_kubeconfig_embeds_credentials(tmp_path: Path) -> None:
    files = pki.ensure_pki(tmp_path / "pki")
    path = pki.write_kubeconfig(tmp_path / "admin.kubeconfig", "https://127.0.0.1:6443", files.root, "admin")
    config = yaml.safe_load(path.read_text())
    assert config["clusters"][0]["cluster"]["server"] == "https://127.0.0.1:6443"
    assert "client-key-data" in config["users"][0]["user"]
