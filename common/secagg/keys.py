"""Key agreement and sealed shares: X25519 key pairs, a 32-byte seed agreed between two devices (HKDF-SHA256 over
their shared secret, bound to a context: the federation and round), and ChaCha20-Poly1305 to seal a device's shares
to a neighbour so that the coordinator relaying them reads none."""

from __future__ import annotations

import os

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["KeyPair", "agree", "open_sealed", "seal"]

NONCE_BYTES = 12


class KeyPair:
    """An X25519 key pair of one device for one round (its public half as 32 raw bytes)."""

    def __init__(self, private: X25519PrivateKey | None = None) -> None:
        self.private = private or X25519PrivateKey.generate()
        self.public = self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    def secret_bytes(self) -> bytes:
        """The private half as 32 raw bytes (what is secret-shared, to be recovered if the device drops out)."""
        return self.private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                          serialization.NoEncryption())

    @classmethod
    def from_secret(cls, secret: bytes) -> KeyPair:
        """The key pair whose private half is ``secret`` (32 raw bytes)."""
        return cls(X25519PrivateKey.from_private_bytes(secret))


#: What a derived key is for: sealing shares, or a pair mask's seed (never the same key for both).
PURPOSES = (b"seal", b"mask")


def agree(own: KeyPair, their_public: bytes, context: bytes, purpose: bytes) -> bytes:
    """The 32-byte key ``own`` and the holder of ``their_public`` both derive for ``purpose`` (the same from either
    side), bound to the ``context`` and to both public keys."""
    if purpose not in PURPOSES:
        raise ValueError(f"a derived key is for one of {PURPOSES}, not {purpose!r}")
    shared = own.private.exchange(X25519PublicKey.from_public_bytes(their_public))
    ends = b"".join(sorted((own.public, their_public)))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                info=b"fedfit-secagg:" + purpose + b":" + context + b":" + ends).derive(shared)


def seal(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """``plaintext`` encrypted and authenticated under ``key`` (32 bytes), bound to ``associated``; nonce first."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def open_sealed(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """What :func:`seal` sealed; ValueError when it was altered, sealed under another key or for another context."""
    from cryptography.exceptions import InvalidTag

    try:
        return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except InvalidTag:
        raise ValueError("a sealed share does not open: altered, or sealed for another device or round") from None
