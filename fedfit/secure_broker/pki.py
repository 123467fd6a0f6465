"""The broker's TLS material, made with the ``openssl`` command: a certificate authority for the fleet and the
broker's server certificate, signed by it and naming every host and address the devices connect to.

Keys are ECDSA P-256: small, fast on a Raspberry Pi, and read by every TLS stack Mosquitto and paho-mqtt use.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

CA_DAYS = 3650
SERVER_DAYS = 825  # the longest validity clients commonly accept for a server certificate


class PkiError(RuntimeError):
    """The TLS material could not be made; the message says what to install or fix."""


def _openssl() -> str:
    found = shutil.which("openssl")
    if found is None:
        raise PkiError("the 'openssl' command is not installed (apt-get install openssl); it makes the broker's "
                       "TLS certificates")
    return found


def _run(*args: str) -> None:
    result = subprocess.run([_openssl(), *args], capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {(result.stderr or result.stdout).strip()[-400:]}")


def _new_key(path: Path) -> None:
    """A new private key in ``path``, which is 0600 before the key is written into it."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    os.chmod(path, 0o600)
    _run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))


def subject_alt_names(hosts: Sequence[str]) -> str:
    """The subjectAltName value naming ``hosts``: ``IP:`` for addresses, ``DNS:`` for names."""
    if not hosts:
        raise ValueError("the broker's certificate needs at least one host name or address")
    entries = []
    for host in hosts:
        try:
            entries.append(f"IP:{ipaddress.ip_address(host)}")
        except ValueError:
            if not host or any(c.isspace() or c in ",/\\" for c in host):
                raise ValueError(f"{host!r} is not a host name or an IP address") from None
            entries.append(f"DNS:{host}")
    return ",".join(entries)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate authority: ``ca.crt`` (goes to every device) and ``ca.key`` (stays here, 0600)."""
    key, cert = directory / "ca.key", directory / "ca.crt"
    _new_key(key)
    _run("req", "-x509", "-new", "-key", str(key), "-out", str(cert), "-days", str(CA_DAYS), "-sha256",
         "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    return cert, key


def make_server_certificate(directory: Path, ca: tuple[Path, Path], hosts: Sequence[str]) -> tuple[Path, Path]:
    """``server.crt`` and ``server.key`` for the broker, signed by ``ca`` and valid for ``hosts``."""
    san = subject_alt_names(hosts)
    key, cert = directory / "server.key", directory / "server.crt"
    _new_key(key)
    with tempfile.TemporaryDirectory(prefix="fedfit-pki-") as scratch:
        request = Path(scratch) / "server.csr"
        extensions = Path(scratch) / "server.ext"
        _run("req", "-new", "-key", str(key), "-out", str(request), "-subj", f"/CN={hosts[0]}")
        extensions.write_text(f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
                              "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
        _run("x509", "-req", "-in", str(request), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-set_serial",
             str(int.from_bytes(os.urandom(8), "big")), "-out", str(cert), "-days", str(SERVER_DAYS), "-sha256",
             "-extfile", str(extensions))
    os.chmod(key, 0o640)
    return cert, key
