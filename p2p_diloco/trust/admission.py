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
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2p_diloco.errors import AdmissionError

KEY_PREFIX = "ed25519:"
REVOKED_DIR = "revoked"  # where `admission revoke` keeps the organiser's copy, inside the certificates folder
# libp2p ids are base58 (letters and digits but 0, O, I and l) of a multihash. A revocation's file is
# named after the id, so an id is checked (`is_peer_id`) before it becomes a path ("../x" would write
# outside revoked/), and before the organiser signs it ("QmNotAnId" admitted nobody).
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_MULTIHASHES = {0x12: 32, 0x00: None}  # sha2-256 of a key ("Qm…"), or the key itself ("12D3KooW…")


def is_peer_id(text: str) -> bool:
    """Whether `text` is a libp2p peer id: base58 of a sha2-256 or identity multihash."""
    if not 1 <= len(text) <= 128 or any(c not in BASE58 for c in text):
        return False
    value = 0
    for c in text:
        value = value * 58 + BASE58.index(c)
    raw = bytes(len(text) - len(text.lstrip("1"))) + value.to_bytes((value.bit_length() + 7) // 8, "big")
    if len(raw) < 2 or raw[0] not in _MULTIHASHES:
        return False
    size = _MULTIHASHES[raw[0]]
    return len(raw) == 2 + raw[1] and (size is None or raw[1] == size)


MAX_SIGNED_BYTES = 4096  # a certificate or revocation from another peer larger than this is refused unread


@dataclass(frozen=True)
class _Signed:
    """A statement of the organiser: its fields as canonical JSON, prefixed by a domain string per
    kind (so that a signature made for one kind never verifies as another), and the signature."""

    DOMAIN: ClassVar[bytes] = b""
    KIND: ClassVar[str] = "statement"

    def signed_bytes(self) -> bytes:
        fields = {k: v for k, v in asdict(self).items() if k != "signature"}
        return self.DOMAIN + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def parse(cls, value: Any) -> Any:
        """One from its JSON (a file, or another peer: untrusted); AdmissionError if malformed."""
        if isinstance(value, (str, bytes)):
            if len(value) > MAX_SIGNED_BYTES:
                raise AdmissionError(f"a {cls.KIND} is at most {MAX_SIGNED_BYTES} bytes, got {len(value)}")
            try:
                value = json.loads(value)
            except (ValueError, UnicodeDecodeError):
                raise AdmissionError(f"the {cls.KIND} is not JSON") from None
        if not isinstance(value, dict):
            raise AdmissionError(f"the {cls.KIND} is not a JSON object")
        names = [f.name for f in fields(cls)]
        try:
            return cls(**{f.name: int(value[f.name]) if f.type == "int" else str(value[f.name]) for f in fields(cls)})
        except (KeyError, TypeError, ValueError):
            raise AdmissionError(f"the {cls.KIND} lacks a field ({', '.join(names)})") from None

    def signed_with(self, key: Ed25519PrivateKey) -> Any:
        signature = base64.b64encode(key.sign(self.signed_bytes())).decode()
        return replace(self, **{"signature": signature})  # every kind has the field; the base has none

    def verify(self, organiser: Ed25519PublicKey) -> None:
        try:
            organiser.verify(base64.b64decode(asdict(self)["signature"], validate=True), self.signed_bytes())
        except (InvalidSignature, binascii.Error, ValueError):
            raise AdmissionError(f"the {self.KIND} is not signed by this run's organiser") from None


@dataclass(frozen=True)
class Certificate(_Signed):
    """The organiser's word that `peer_id` may take part in run `run_id` until `expires`."""

    DOMAIN: ClassVar[bytes] = b"p2p-diloco certificate v1\n"
    KIND: ClassVar[str] = "certificate"

    run_id: str
    peer_id: str
    name: str
    expires: int  # unix seconds
    signature: str = ""  # base64 Ed25519 signature over `signed_bytes()`


@dataclass(frozen=True)
class Revocation(_Signed):
    """The organiser's word that `peer_id` is out of run `run_id` from `issued` on, whatever its
    certificate says. It travels through the DHT; every peer that verified it publishes it again."""

    DOMAIN: ClassVar[bytes] = b"p2p-diloco revocation v1\n"
    KIND: ClassVar[str] = "revocation"

    run_id: str
    peer_id: str
    reason: str
    issued: int  # unix seconds
    signature: str = ""


@dataclass(frozen=True)
class ConfigSignature(_Signed):
    """The organiser's word that the config with `fingerprint` is run `run_id`'s config (certified
    runs believe no other config published under the run id)."""

    DOMAIN: ClassVar[bytes] = b"p2p-diloco run config v1\n"
    KIND: ClassVar[str] = "config signature"

    run_id: str
    fingerprint: str
    signature: str = ""


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
        raise AdmissionError(
            f"run key {path} not found: pass --key with the file `admission keygen` wrote for this run (its public "
            f"half is admission.organiser_key in run.toml; a new key cannot sign for a run that has one). For a new "
            f"run, make one with `p2p-diloco admission keygen`"
        ) from None
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
    cert: Certificate = Certificate(run_id, peer_id, name, int(expires)).signed_with(key)
    return cert


def check(cert: Certificate, organiser: Ed25519PublicKey, run_id: str, peer_id: str, now: float) -> None:
    """Raise AdmissionError (saying why) unless `cert` admits `peer_id` to `run_id` at `now`."""
    cert.verify(organiser)
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
    key = _organiser_key_of(key_path, organiser_key)
    if not 0 < days <= 3650:
        raise AdmissionError(f"--days must be in (0, 3650], got {days}")
    if not is_peer_id(peer_id.strip()):
        raise AdmissionError(f"{peer_id!r} is not a peer id; the volunteer gets theirs from `p2p-diloco id`")
    cert = issue(key, run_id, peer_id.strip(), name, int(time.time() + days * 86400))
    if out.exists():
        raise AdmissionError(f"{out} exists; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(cert.to_json())
    return cert


def listing(folder: Path, run_id: str, organiser_key: str) -> list[str]:
    """One line per certificate file in `folder`: name, peer id, expiry, and whether it admits now
    (not if it expired, or the organiser revoked it: revocations are kept in `folder`/revoked/)."""
    organiser = parse_public_key(organiser_key)
    texts = [p.read_text(errors="replace") for p in sorted((Path(folder) / REVOKED_DIR).glob("*.json"))]
    revoked = revoked_ids(texts, organiser, run_id)
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
        if cert.peer_id in revoked:
            verdict = f"REVOKED ({Revocation.parse(revoked[cert.peer_id]).reason})"
        until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(cert.expires))
        lines.append(f"{path.name}: {cert.name} {cert.peer_id} until {until}: {verdict}")
    return lines or [f"no certificates (*.cert) in {folder}"]


# --- revocations ------------------------------------------------------------------------------------


def _organiser_key_of(key_path: Path, organiser_key: str) -> Ed25519PrivateKey:
    key = load_run_key(key_path)
    if public_key_text(key.public_key()) != organiser_key:
        raise AdmissionError(f"{key_path} is not the key of this run (admission.organiser_key in its config)")
    return key


def revoke(key_path: Path, run_id: str, organiser_key: str, peer_id: str, reason: str, out: Path) -> Revocation:
    """Sign a revocation of `peer_id` and write it to `out` (the organiser's record of it)."""
    key = _organiser_key_of(key_path, organiser_key)
    if not is_peer_id(peer_id):
        raise AdmissionError(f"{peer_id!r} is not a peer id (base58, as `p2p-diloco id` prints it)")
    revocation: Revocation = Revocation(run_id, peer_id, reason[:200], int(time.time())).signed_with(key)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(revocation.to_json())
    return revocation


def revoked_ids(texts: Any, organiser: Ed25519PublicKey, run_id: str) -> dict[str, str]:
    """{peer id: revocation JSON} of those of `texts` (untrusted: from the DHT) that are revocations
    of this run signed by its organiser; anything else is skipped."""
    out = {}
    for text in texts if isinstance(texts, (list, tuple)) else []:
        try:
            revocation = Revocation.parse(text)
            revocation.verify(organiser)
        except AdmissionError:
            continue
        if revocation.run_id == run_id:
            out[revocation.peer_id] = revocation.to_json()
    return out


# --- the run config ---------------------------------------------------------------------------------


def sign_config(key_path: Path, run_id: str, organiser_key: str, fingerprint: str) -> ConfigSignature:
    """The organiser's signature of a run config (goes into run.toml as admission.config_signature)."""
    signed: ConfigSignature = ConfigSignature(run_id, fingerprint).signed_with(
        _organiser_key_of(key_path, organiser_key)
    )
    return signed


def check_config_signature(signature: str, organiser_key: str, run_id: str, fingerprint: str) -> None:
    """AdmissionError unless `signature` (base64) is the organiser's over this run id and fingerprint."""
    ConfigSignature(run_id, fingerprint, signature).verify(parse_public_key(organiser_key))
