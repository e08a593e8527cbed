"""Who may join a run: certificates from the run's organiser, checked offline by every peer.

The organiser holds an Ed25519 key (the run key). Its public half goes into the run config
(`admission.organiser_key`, so it is part of the fingerprint); the private half never leaves the
organiser. A volunteer sends the organiser its peer id (`p2p-diloco id`); the organiser answers
with a certificate: the run id, the peer id, a name, an expiry and the organiser's signature over
them. Any peer can check a certificate with the run config alone: no server.

Formats, all standard: the run key is a PKCS#8 PEM file; the public key is written
`ed25519:<base64 of the 32 raw bytes>`; a certificate is a small JSON file whose signature is
Ed25519 over the canonical JSON of its other fields, prefixed by a domain string so that a
signature made for anything else never verifies as a certificate.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2p_diloco.errors import AdmissionError

CERTIFICATE_DOMAIN = b"p2p-diloco certificate v1\n"
KEY_PREFIX = "ed25519:"
MAX_CERTIFICATE_BYTES = 4096  # a certificate from another peer larger than this is refused unread


@dataclass(frozen=True)
class Certificate:
    """The organiser's word that `peer_id` may take part in run `run_id` until `expires`."""

    run_id: str
    peer_id: str
    name: str
    expires: int  # unix seconds
    signature: str = ""  # base64 Ed25519 signature over `signed_bytes()`

    def signed_bytes(self) -> bytes:
        fields = {k: v for k, v in asdict(self).items() if k != "signature"}
        return CERTIFICATE_DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def parse(cls, value: Any) -> Certificate:
        """A certificate from its JSON (a file, or another peer: untrusted); AdmissionError if malformed."""
        if isinstance(value, (str, bytes)):
            if len(value) > MAX_CERTIFICATE_BYTES:
                raise AdmissionError(f"a certificate is at most {MAX_CERTIFICATE_BYTES} bytes, got {len(value)}")
            try:
                value = json.loads(value)
            except (ValueError, UnicodeDecodeError):
                raise AdmissionError("the certificate is not JSON") from None
        if not isinstance(value, dict):
            raise AdmissionError("the certificate is not a JSON object")
        try:
            cert = cls(
                str(value["run_id"]),
                str(value["peer_id"]),
                str(value["name"]),
                int(value["expires"]),
                str(value["signature"]),
            )
        except (KeyError, TypeError, ValueError):
            raise AdmissionError("the certificate lacks a field (run_id, peer_id, name, expires, signature)") from None
        return cert


# --- the organiser's key --------------------------------------------------------------------------


def make_run_key(path: Path) -> str:
    """Write a new run key (private, mode 0600) to `path`; return its public key for run.toml."""
    if path.exists():
        raise AdmissionError(f"{path} exists; a run key is never overwritten (choose another path)")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return public_key_text(key.public_key())


def load_run_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except FileNotFoundError:
        raise AdmissionError(f"run key {path} not found; make one with `p2p-diloco admission keygen`") from None
    except (ValueError, TypeError):
        raise AdmissionError(f"{path} is not a run key (an Ed25519 PEM private key)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise AdmissionError(f"{path} is not an Ed25519 key; make a run key with `p2p-diloco admission keygen`")
    return key


def public_key_text(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KEY_PREFIX + base64.b64encode(raw).decode()


def parse_public_key(text: str) -> Ed25519PublicKey:
    """`ed25519:<base64>` as written in run.toml; AdmissionError naming the fix if it is not one."""
    if not text.startswith(KEY_PREFIX):
        raise AdmissionError(f"admission.organiser_key must start with {KEY_PREFIX!r}, got {text[:20]!r}")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX) :], validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError):
        raise AdmissionError(
            "admission.organiser_key is not an Ed25519 public key; copy the line that "
            "`p2p-diloco admission keygen` printed"
        ) from None


# --- certificates ---------------------------------------------------------------------------------


def issue(key: Ed25519PrivateKey, run_id: str, peer_id: str, name: str, expires: int) -> Certificate:
    """The organiser signs a certificate for `peer_id`."""
    unsigned = Certificate(run_id, peer_id, name, int(expires))
    return Certificate(
        run_id, peer_id, name, int(expires), base64.b64encode(key.sign(unsigned.signed_bytes())).decode()
    )


def check(cert: Certificate, organiser: Ed25519PublicKey, run_id: str, peer_id: str, now: float) -> None:
    """Raise AdmissionError (saying why) unless `cert` admits `peer_id` to `run_id` at `now`."""
    try:
        organiser.verify(base64.b64decode(cert.signature, validate=True), cert.signed_bytes())
    except (InvalidSignature, binascii.Error, ValueError):
        raise AdmissionError("the certificate is not signed by this run's organiser") from None
    if cert.run_id != run_id:
        raise AdmissionError(f"the certificate is for run {cert.run_id!r}, not {run_id!r}")
    if cert.peer_id != peer_id:
        raise AdmissionError(f"the certificate is for peer {cert.peer_id}, not {peer_id}")
    if cert.expires <= now:
        raise AdmissionError(f"the certificate of {cert.name!r} expired (at unix time {cert.expires})")


def read_certificate(path: Path) -> Certificate:
    """This peer's certificate file; AdmissionError (one line, the fix) if it is missing or garbage."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise AdmissionError(f"certificate file {path} not found") from None
    try:
        return Certificate.parse(data)
    except AdmissionError as e:
        raise AdmissionError(
            f"certificate file {path} is not a certificate ({e}); ask the organiser for a new one"
        ) from None


# --- the organiser's commands -------------------------------------------------------------------------


def admit(
    key_path: Path, run_id: str, organiser_key: str, peer_id: str, name: str, days: float, out: Path
) -> Certificate:
    """Certify `peer_id` for `days` and write the certificate to `out` (never over another file)."""
    key = load_run_key(key_path)
    if public_key_text(key.public_key()) != organiser_key:
        raise AdmissionError(f"{key_path} is not the key of this run (admission.organiser_key in its config)")
    if not 0 < days <= 3650:
        raise AdmissionError(f"--days must be in (0, 3650], got {days}")
    if not peer_id.strip() or len(peer_id) > 128:
        raise AdmissionError(f"{peer_id!r} is not a peer id; the volunteer gets theirs from `p2p-diloco id`")
    cert = issue(key, run_id, peer_id.strip(), name, int(time.time() + days * 86400))
    if out.exists():
        raise AdmissionError(f"{out} exists; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(cert.to_json())
    return cert


def listing(folder: Path, run_id: str, organiser_key: str) -> list[str]:
    """One line per certificate file in `folder`: name, peer id, expiry, and whether it admits now."""
    organiser = parse_public_key(organiser_key)
    lines = []
    for path in sorted(Path(folder).glob("*.cert")):
        try:
            cert = read_certificate(path)
        except AdmissionError as e:
            lines.append(f"{path.name}: unreadable: {e}")
            continue
        try:
            check(cert, organiser, run_id, cert.peer_id, time.time())
            verdict = "admitted"
        except AdmissionError as e:
            verdict = f"NOT admitted: {e}"
        until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(cert.expires))
        lines.append(f"{path.name}: {cert.name} {cert.peer_id} until {until}: {verdict}")
    return lines or [f"no certificates (*.cert) in {folder}"]


def check_member(user_data: Any, run_id: str, organiser_key: str, peer_id: str, now: float) -> None:
    """A group member's certificate, from what it sent in the group's all-gather; AdmissionError if
    it does not admit `peer_id` (the member's transport-authenticated libp2p id)."""
    text = user_data.get("cert") if isinstance(user_data, dict) else None
    if not isinstance(text, str):
        raise AdmissionError("it sent no certificate")
    check(Certificate.parse(text), parse_public_key(organiser_key), run_id, peer_id, now)
