"""How the test bed starts the operator: confined as its Deployment, reading a kubeconfig made for it."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest
import yaml

from localcluster import install

pytestmark = pytest.mark.unit


def test_the_confinement_is_the_deployments_securitycontext() -> None:
    limits = install.operator_confinement()
    assert (limits.uid, limits.gid) == (65532, 65532)
    assert limits.capabilities == frozenset() and limits.read_only_root and limits.no_new_privs
    assert limits.launcher_args() == ["--uid", "65532", "--gid", "65532", "--caps", "", "--read-only-root",
                                      "--no-new-privs"]


def test_the_operators_kubeconfig_copies_every_credential_it_names_or_embeds(tmp_path: Path) -> None:
    ca, cert, key = b"-----CA-----\n", b"-----CERT-----\n", b"-----KEY-----\n"
    (tmp_path / "pki").mkdir(mode=0o700)
    (tmp_path / "pki" / "ca.crt").write_bytes(ca)
    original = {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "local", "cluster": {"server": "https://198.18.0.1:6443",
                                                    "certificate-authority-data": base64.b64encode(ca).decode()}},
                     {"name": "named", "cluster": {"server": "https://198.18.0.1:6443",
                                                    "certificate-authority": str(tmp_path / "pki" / "ca.crt")}}],
        "users": [{"name": "sa", "user": {"token": "secret-token"}},
                  {"name": "file-token", "user": {"tokenFile": "token"}},
                  {"name": "admin", "user": {"client-certificate-data": base64.b64encode(cert).decode(),
                                             "client-key-data": base64.b64encode(key).decode()}}],
        "contexts": [{"name": "c", "context": {"cluster": "local", "user": "sa"}}],
    }
    source = tmp_path / "private" / "operator.kubeconfig"
    source.parent.mkdir(mode=0o700)
    (source.parent / "token").write_text("file-token")
    source.write_text(yaml.safe_dump(original))
    copy = install.credentials_for(source, os.getuid(), os.getgid())
    try:
        config = yaml.safe_load(copy.read_text())
        cluster = config["clusters"][0]["cluster"]
        assert "certificate-authority-data" not in cluster and Path(cluster["certificate-authority"]).read_bytes() == ca
        named = config["clusters"][1]["cluster"]["certificate-authority"]
        assert Path(named).parent == copy.parent and Path(named).read_bytes() == ca
        assert config["users"][0]["user"] == {"token": "secret-token"}
        assert Path(config["users"][1]["user"]["tokenFile"]).read_text() == "file-token"
        admin = config["users"][2]["user"]
        assert set(admin) == {"client-certificate", "client-key"}
        assert Path(admin["client-certificate"]).read_bytes() == cert and Path(admin["client-key"]).read_bytes() == key
        # Outside the original's private folder, readable only by the operator's user.
        assert copy.parent != source.parent
        assert stat.S_IMODE(copy.parent.stat().st_mode) == 0o500
        assert {stat.S_IMODE(p.stat().st_mode) for p in copy.parent.iterdir()} == {0o400}
        assert yaml.safe_load(source.read_text()) == original, "the original is left as it was"
    finally:
        copy.parent.chmod(0o700)
        for path in copy.parent.iterdir():
            path.unlink()
        copy.parent.rmdir()
