"""A peer's identity is its libp2p key, and the same key signs its DHT records (I4).

hivemind's `RSASignatureValidator` lets only the owner of an `[owner:<ssh-rsa public key>]` subkey
write under it, but by default it signs with a key of its own, unrelated to the peer id: anyone
could publish a record that *claims* any peer id. Here the validator signs with the peer's libp2p
identity key (RSA, as hivemind makes it), so the peer id a record may claim is a function of the
key that signed it (`owner_peer_id`), and records whose claim does not match are dropped
(swarm/trust/records.py). One key, one id: a process that wants more ids must make more keys.
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from p2p_diloco.errors import SwarmError

_OWNER = re.compile(rb"^\[owner:(.+)\]$", re.S)
_SHA2_256 = bytes([0x12, 0x20])  # multihash prefix: sha2-256, 32 bytes (libp2p peer ids of RSA keys)


def not_a_key(path: Path, entry_node: bool = False) -> str:
    """What to do about an identity file that holds no private key. A peer may start afresh under a
    new id; a bootstrap node's id is part of the address every volunteer was given."""
    if entry_node:
        return (
            f"identity file {path} is not a private key; it is this bootstrap node's identity, and its peer id is "
            f"in the address every volunteer was given: restore the file from its backup and pass it with "
            f"--identity (only if it is lost for good, delete it: the node then gets a new address to hand out)"
        )
    return (
        f"identity file {path} is not a private key; delete it to make a new one (this peer then "
        f"gets a new peer id), or point swarm.identity_path at the right file"
    )


MADE_HERE: set[Path] = set()  # keys this process made: no other node can hold them (in_use.py)


def load_identity(path: Path, entry_node: bool = False) -> RSAPrivateKey:
    """The peer's libp2p private key from `path`, made there on first start (the peer's id for good)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
        MADE_HERE.add(path.resolve())
    try:
        key = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    except Exception:  # protobuf raises DecodeError and others on foreign bytes
        key = crypto_pb2.PrivateKey()
    if key.data and key.key_type != crypto_pb2.KeyType.RSA:
        raise SwarmError(
            f"identity file {path} holds a {crypto_pb2.KeyType.Name(key.key_type)} key; p2p-diloco signs its "
            f"records with the peer's key and needs an RSA one: delete the file to make one"
        )
    try:
        loaded = serialization.load_der_private_key(key.data, password=None)
    except (ValueError, TypeError):
        loaded = None
    if not isinstance(loaded, rsa.RSAPrivateKey):
        raise SwarmError(not_a_key(path, entry_node))
    private = RSAPrivateKey.__new__(RSAPrivateKey)
    private.__setstate__({"_private_key": key.data})  # hivemind's own way back from DER bytes
    return private


def peer_id_of(path: Path) -> str:
    """The peer id of the identity key in `path` (made there if missing): what `p2p-diloco id` prints."""
    load_identity(path)
    return str(PeerID.from_identity(path.read_bytes()))


def make_validator(identity_path: Path, entry_node: bool = False) -> RSASignatureValidator:
    """Signs this peer's DHT records with its identity key and checks everyone's signatures."""
    return RSASignatureValidator(load_identity(identity_path, entry_node))


@functools.lru_cache(maxsize=4096)
def owner_peer_id(subkey: bytes) -> str | None:
    """The libp2p peer id of the key that owns (signed) a record's subkey, or None if the subkey
    holds no RSA key. Every peer computes the same id from the same subkey."""
    match = _OWNER.match(subkey) if isinstance(subkey, bytes) else None
    if match is None:
        return None
    try:
        public = serialization.load_ssh_public_key(match.group(1))
    except (ValueError, TypeError, UnsupportedAlgorithm):  # "[owner:not a key]": a key type nobody knows
        return None
    if not isinstance(public, rsa.RSAPublicKey):
        return None
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(_SHA2_256 + hashlib.sha256(encoded).digest()).to_base58()


def public_key_bytes(private: RSAPrivateKey) -> bytes:
    """The public half of an identity key, as peers show it to their group (OpenSSH format)."""
    return private.get_public_key().to_bytes()


def key_of(peer: str, shown: object) -> RSAPublicKey | None:
    """The public key `shown` (untrusted bytes) if it is `peer`'s identity key, else None."""
    if not isinstance(shown, bytes) or len(shown) > 4096 or owner_peer_id(b"[owner:" + shown + b"]") != peer:
        return None
    try:
        return RSAPublicKey.from_bytes(shown)
    except (ValueError, TypeError):
        return None


def draw_lot(private: RSAPrivateKey, statement: bytes) -> bytes:
    """This key's lot for `statement`: its RSA PKCS#1 v1.5 signature over it, the only one that
    verifies (hivemind's own signatures are PSS, salted: a signer could make as many as it likes).
    So a lot is fixed by the key and the statement, and only the key's holder can compute it
    (trust/audit.py, the audit's seed)."""
    return private._private_key.sign(statement, padding.PKCS1v15(), hashes.SHA256())


def lot_holds(public: RSAPublicKey, statement: bytes, lot: bytes) -> bool:
    """Whether `lot` is the lot of `public`'s holder for `statement`: the key's size in bytes, below
    its modulus (the one value that verifies, not it plus the modulus), and a valid signature."""
    key = public._public_key
    size = (key.key_size + 7) // 8
    if len(lot) != size or int.from_bytes(lot, "big") >= key.public_numbers().n:
        return False
    try:
        key.verify(lot, statement, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        return False
    return True
