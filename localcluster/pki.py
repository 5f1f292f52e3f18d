"""The local cluster's PKI: one CA, the apiserver's serving cert, client certs, SA keys, kubeconfigs.

Built with `cryptography` instead of parsing openssl CLI output. Keys are ECDSA
P-256: every Kubernetes component accepts them (ES256 service-account tokens
included) and they are generated in microseconds, which keeps `up` fast.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from localcluster import paths

VALIDITY = dt.timedelta(days=365)
# Backdated so a node simulator whose clock is a little behind still accepts the certs.
CLOCK_SKEW = dt.timedelta(hours=1)

APISERVER_IP_SANS = ("127.0.0.1", paths.BRIDGE_ADDRESS, paths.KUBERNETES_SERVICE_IP)
APISERVER_DNS_SANS = (
    "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)

# name -> (common name, organisations); the names are RBAC's bootstrap subjects.
CLIENT_IDENTITIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "admin": ("kubernetes-admin", ("system:masters",)),
    "kube-controller-manager": ("system:kube-controller-manager", ()),
    "kube-scheduler": ("system:kube-scheduler", ()),
}


@dataclass(frozen=True)
class Pki:
    """Paths of the PKI files under <state>/pki."""

    root: Path

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def apiserver_cert(self) -> Path:
        return self.root / "apiserver.crt"

    @property
    def apiserver_key(self) -> Path:
        return self.root / "apiserver.key"

    @property
    def sa_key(self) -> Path:
        return self.root / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.root / "sa.pub"

    def client_cert(self, name: str) -> Path:
        return self.root / f"{name}.crt"

    def client_key(self, name: str) -> Path:
        return self.root / f"{name}.key"


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_secret(path: Path, data: bytes) -> None:
    # Created 0600 from the start: no window in which another user can read a key.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _load_ca(pki: Pki) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{pki.ca_key} is not an ECDSA key")
    return cert, key


def _builder(subject: x509.Name, issuer: x509.Name,
             public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + VALIDITY))


def _create_ca(pki: Pki) -> None:
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "proxyshift-localcluster-ca")])
    cert = (_builder(name, name, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write_secret(pki.ca_key, _key_pem(key))
    pki.ca_cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _issue(pki: Pki, subject: x509.Name, *, server: bool, ip_sans: tuple[str, ...] = (),
           dns_sans: tuple[str, ...] = ()) -> tuple[bytes, bytes]:
    ca_cert, ca_key = _load_ca(pki)
    key = _new_key()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (_builder(subject, ca_cert.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False,
                                            content_commitment=False, data_encipherment=False,
                                            key_agreement=False, key_cert_sign=False, crl_sign=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_sans]
    sans += [x509.DNSName(name) for name in dns_sans]
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _subject(common_name: str, organisations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organisations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


def issue_client_cert(pki_dir: Path, name: str, common_name: str,
                      organisations: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Issue a client cert signed by the cluster CA; returns (cert path, key path).

    The node half uses this for node identities, e.g.
    issue_client_cert(pki_dir, "ps-node-1", "system:node:ps-node-1", ("system:nodes",)).
    """
    pki = Pki(pki_dir)
    cert, key = _issue(pki, _subject(common_name, organisations), server=False)
    _write_secret(pki.client_key(name), key)
    pki.client_cert(name).write_bytes(cert)
    return pki.client_cert(name), pki.client_key(name)


def ensure_pki(pki_dir: Path) -> Pki:
    """Create every key and cert the control plane needs, keeping those already there.

    Keeping them means a restarted control plane serves the same CA, so tokens
    and kubeconfigs handed out earlier stay valid.
    """
    pki = Pki(pki_dir)
    pki_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not (pki.ca_cert.is_file() and pki.ca_key.is_file()):
        _create_ca(pki)
    if not pki.apiserver_cert.is_file():
        cert, key = _issue(pki, _subject("kube-apiserver"), server=True,
                           ip_sans=APISERVER_IP_SANS, dns_sans=APISERVER_DNS_SANS)
        _write_secret(pki.apiserver_key, key)
        pki.apiserver_cert.write_bytes(cert)
    if not pki.sa_key.is_file():
        sa_key = _new_key()
        _write_secret(pki.sa_key, _key_pem(sa_key))
        pki.sa_pub.write_bytes(sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    for name, (common_name, orgs) in CLIENT_IDENTITIES.items():
        if not pki.client_cert(name).is_file():
            issue_client_cert(pki_dir, name, common_name, orgs)
    return pki


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig_dict(server: str, ca_cert: Path, *, user: str, client_cert: Path | None = None,
                    client_key: Path | None = None, token_file: str | None = None) -> dict:
    """A one-cluster, one-user kubeconfig; cert data is embedded so the file stands alone."""
    user_entry: dict[str, str] = {}
    if client_cert and client_key:
        user_entry = {"client-certificate-data": _b64(client_cert), "client-key-data": _b64(client_key)}
    elif token_file:
        user_entry = {"tokenFile": token_file}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "proxyshift-local",
                      "cluster": {"server": server, "certificate-authority-data": _b64(ca_cert)}}],
        "users": [{"name": user, "user": user_entry}],
        "contexts": [{"name": f"{user}@proxyshift-local",
                      "context": {"cluster": "proxyshift-local", "user": user}}],
        "current-context": f"{user}@proxyshift-local",
    }


def write_kubeconfig(path: Path, server: str, pki_dir: Path, name: str) -> Path:
    """Write a kubeconfig for the client cert `name` (as issued by ensure_pki/issue_client_cert)."""
    pki = Pki(pki_dir)
    config = kubeconfig_dict(server, pki.ca_cert, user=name, client_cert=pki.client_cert(name),
                             client_key=pki.client_key(name))
    _write_secret(path, yaml.safe_dump(config, sort_keys=False).encode())
    return path
