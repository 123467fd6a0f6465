"""Mosquitto's password file: one ``name:hash`` line per login, hashed the way ``mosquitto_passwd`` does.

The hash is Mosquitto 2's ``$7$`` form: PBKDF2-HMAC-SHA512 over a random 12-byte salt, written as
``$7$<iterations>$<base64 salt>$<base64 hash>``; Mosquitto 2.0 and later read it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from pathlib import Path

from common.durable import write_atomic

#: What ``mosquitto_passwd`` uses; Mosquitto verifies every login with it, so more would slow each connect.
ITERATIONS = 101
_SALT_BYTES = 12


def new_password() -> str:
    """A random password of 32 URL-safe characters (192 bits)."""
    return secrets.token_urlsafe(24)


def hash_password(password: str, *, iterations: int = ITERATIONS, salt: bytes | None = None) -> str:
    """The ``$7$`` hash of ``password`` that Mosquitto's password file holds."""
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, iterations)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def check_password(password: str, hashed: str) -> bool:
    """Whether ``password`` matches a ``$7$`` hash (False for any other form)."""
    parts = hashed.split("$")
    if len(parts) != 5 or parts[1] != "7" or not parts[2].isdigit():
        return False
    try:
        salt, expected = base64.b64decode(parts[3], validate=True), base64.b64decode(parts[4], validate=True)
    except ValueError:
        return False
    digest = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, int(parts[2]))
    return hmac.compare_digest(digest, expected)


def read_password_file(path: Path) -> dict[str, str]:
    """Logins of a password file, name -> hash, in file order (a missing file has none)."""
    if not path.exists():
        return {}
    entries: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, hashed = line.partition(":")
        if not sep or not name or not hashed:
            raise ValueError(f"{path}:{number} is not a 'name:hash' line")
        entries[name] = hashed
    return entries


def write_password_file(path: Path, entries: dict[str, str]) -> None:
    """Replace the password file atomically (mode 0640: the broker's group reads it, nobody else)."""
    text = "".join(f"{name}:{hashed}\n" for name, hashed in entries.items())
    write_atomic(path, text.encode("utf-8"), mode=0o640)
