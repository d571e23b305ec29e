"""Throwaway CA, server and client certificates for the TLS tests (openssl CLI)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path  # a CA that signed nothing the server trusts
    other_client_cert: Path
    other_client_key: Path


def have_openssl() -> bool:
    return shutil.which("openssl") is not None


def make_certs(directory: Path) -> Certs:
    d = directory
    _ca(d, "ca")
    _ca(d, "other-ca")
    san = "subjectAltName=DNS:localhost,IP:127.0.0.1"
    _leaf(d, "server", "ca", "localhost", san, "serverAuth")
    _leaf(d, "client", "ca", "specserve-test-client", None, "clientAuth")
    _leaf(d, "other-client", "other-ca", "intruder", None, "clientAuth")
    return Certs(
        d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key",
        d / "other-ca.pem", d / "other-client.pem", d / "other-client.key",
    )  # fmt: skip


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _run(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN=specserve test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _leaf(d: Path, name: str, ca: str, cn: str, san: str | None, usage: str) -> None:
    _run(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
        "-out", f"{name}.csr", "-subj", f"/CN={cn}",
        cwd=d,
    )  # fmt: skip
    ext = [f"extendedKeyUsage={usage}", "basicConstraints=CA:FALSE"]
    if san:
        ext.append(san)
    (d / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _run(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext",
        cwd=d,
    )  # fmt: skip
