"""ZeroMQ CURVE keys of the control plane (``llm.CurveSecretKey`` + ``llm.CurvePeerKeys``; docs/security.md).

Everything about the keys is here: the two option names, the Z85 text of one key (:func:`parse_curve_key`)
and of the trusted peers (:func:`parse_curve_peer_keys`), what :class:`~aiodatadist.config.LLMConfig` accepts
for them (:func:`secret_key_text`, :func:`peer_keys_text`), what ``init`` makes of the options
(:func:`curve_keys_from_options` -> :class:`CurveKeys`), and the keys the control sockets choose from
(:meth:`CurveKeys.server_key`, :meth:`CurveKeys.clusters_of`).  No message ever repeats a key's value: it may
be a secret key.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import zmq

from .._checks import check_int, check_isinstance, param_invalid, require
from ..errors import LLMException, LLMStatusCode
from ..types import Transport

__all__ = [
    "CURVE_KEY_CHARS",
    "PEER_KEYS_OPTION",
    "SECRET_KEY_OPTION",
    "Z85_ALPHABET",
    "CurveKeys",
    "curve_keys_from_options",
    "parse_curve_key",
    "parse_curve_peer_keys",
    "peer_keys_text",
    "secret_key_text",
]

log = logging.getLogger("aiodatadist.settings")

SECRET_KEY_OPTION: Final = "llm.CurveSecretKey"
"""This instance's own CURVE secret key (``OptionKey.CURVE_SECRET_KEY``)."""
PEER_KEYS_OPTION: Final = "llm.CurvePeerKeys"
"""The public keys of the peers this instance trusts (``OptionKey.CURVE_PEER_KEYS``)."""

Z85_ALPHABET: Final = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_VALUES: Final = {c: i for i, c in enumerate(Z85_ALPHABET)}
CURVE_KEY_CHARS: Final = 40
"""A 32-byte CURVE key, Z85-encoded (what ``zmq.curve_keypair()`` returns)."""


# -- the text of the keys --------------------------------------------------------------------------------
def parse_curve_key(raw: str) -> bytes:
    """A Z85-encoded 32-byte CURVE key (``zmq.curve_keypair()`` gives them) -> its Z85 text as bytes; ValueError
    otherwise.  The message never repeats the value (it may be a secret key)."""
    if len(raw) != CURVE_KEY_CHARS:
        raise ValueError(f"a CURVE key is {CURVE_KEY_CHARS} Z85 characters, but this one has {len(raw)}")
    for start in range(0, CURVE_KEY_CHARS, 5):
        value = 0
        for char in raw[start:start + 5]:
            digit = _Z85_VALUES.get(char)
            if digit is None:
                raise ValueError("a CURVE key is Z85 text, but this one has a character outside the Z85 alphabet")
            value = value * 85 + digit
        if value >= 1 << 32:
            raise ValueError("this CURVE key is not valid Z85 (a 5-character group exceeds 32 bits)")
    return raw.encode("ascii")


def parse_curve_peer_keys(raw: str) -> tuple[tuple[int | None, bytes], ...]:
    """``llm.CurvePeerKeys``: comma-separated entries, each ``PUBLIC_KEY`` (a peer of any cluster id) or
    ``CLUSTER_ID=PUBLIC_KEY`` (the peer that is that cluster); ValueError naming the bad entry otherwise.

    A cluster id may have one key only; one key may be listed for several ids."""
    entries: list[tuple[int | None, bytes]] = []
    bound: dict[int, bytes] = {}
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            raise ValueError("an entry is empty")
        cluster: int | None = None
        text = entry
        if len(entry) != CURVE_KEY_CHARS:  # a key is exactly 40 characters: anything longer names a cluster
            head, sep, text = entry.partition("=")
            if not sep or not (head.isascii() and head.isdigit()) or int(head) >= 1 << 64:
                raise ValueError(f"entry {entry!r} is neither a public key nor CLUSTER_ID=PUBLIC_KEY")
            cluster = int(head)
        try:
            key = parse_curve_key(text)
        except ValueError as exc:
            raise ValueError(f"entry {entry!r}: {exc}") from None
        if cluster is not None and bound.setdefault(cluster, key) != key:
            raise ValueError(f"cluster {cluster} is given two different keys")
        entries.append((cluster, key))
    return tuple(entries)


# -- LLMConfig's two properties --------------------------------------------------------------------------
def secret_key_text(value: Any) -> str:
    """``LLMConfig.curve_secret_key``'s check: a Z85 secret key (TypeError, ``LLM_PARAM_INVALID``)."""
    check_isinstance("curve_secret_key", value, str)
    try:
        parse_curve_key(value)
    except ValueError as exc:
        param_invalid(f"curve_secret_key is invalid: {exc}.")
    text: str = value
    return text


def peer_keys_text(value: Any) -> str:
    """``LLMConfig.curve_peer_keys``'s check: a string, a list of entries or a ``{cluster_id: key}`` dict ->
    the ``llm.CurvePeerKeys`` text (TypeError, ``LLM_PARAM_INVALID``)."""
    check_isinstance("curve_peer_keys", value, (str, list, tuple, dict))
    entries: list[str]
    if isinstance(value, dict):
        entries = []
        for cluster, key in value.items():
            check_int("curve_peer_keys cluster id", cluster, "uint64")
            check_isinstance("curve_peer_keys key", key, str)
            entries.append(f"{cluster}={key}")
    elif isinstance(value, (list, tuple)):
        for entry in value:
            check_isinstance("curve_peer_keys entry", entry, str)
        entries = list(value)
    else:
        entries = [value]
    text = ",".join(entries)
    try:
        parse_curve_peer_keys(text)
    except ValueError as exc:
        param_invalid(f"curve_peer_keys is invalid: {exc}.")
    return text


# -- the keys of an instance -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CurveKeys:
    """ZeroMQ CURVE on the control plane (``llm.CurveSecretKey`` + ``llm.CurvePeerKeys``; docs/security.md).

    Keys are Z85 text (bytes), as ZeroMQ's socket options take them."""

    secret_key: bytes = field(repr=False)
    public_key: bytes  # derived from the secret key (zmq.curve_public)
    peers: tuple[tuple[int | None, bytes], ...]  # (cluster id, or None for any, public key)

    def server_key(self, cluster_id: int) -> bytes | None:
        """The public key a client expects from the server of cluster ``cluster_id``: the one listed for that id,
        else the only one listed without an id; None when there is none (or several) to choose from."""
        for cluster, key in self.peers:
            if cluster == cluster_id:
                return key
        unbound = {key for cluster, key in self.peers if cluster is None}
        return unbound.pop() if len(unbound) == 1 else None

    def clusters_of(self, public_key: bytes) -> frozenset[int] | None:
        """Server side: the cluster ids a client with ``public_key`` may claim; None = any (listed without an
        id); empty = the key is not trusted at all."""
        ids: set[int] = set()
        for cluster, key in self.peers:
            if key == public_key:
                if cluster is None:
                    return None
                ids.add(cluster)
        return frozenset(ids)

    def trusts(self, public_key: bytes) -> bool:
        """Whether ``public_key`` is listed at all (for any cluster id)."""
        return any(key == public_key for _, key in self.peers)


_curve_warned = False


def curve_keys_from_options(opts: Mapping[str, str], transport: Transport) -> CurveKeys | None:
    """The CURVE keys of ``init``'s options: both options or neither; an empty value is refused, never read as
    "off" (``LLM_PARAM_INVALID``; ``LLM_FEATURE_NOT_ENABLED`` when libzmq has no CURVE).  The first instance
    with keys and a data plane other than shared memory warns that only the control plane is encrypted."""
    secret = opts.get(SECRET_KEY_OPTION)
    peers = opts.get(PEER_KEYS_OPTION)
    if secret is None and peers is None:
        return None
    require(secret is not None, f"option {PEER_KEYS_OPTION} needs {SECRET_KEY_OPTION} (this "
            "instance's own CURVE secret key).")
    require(peers is not None and peers != "", f"option {SECRET_KEY_OPTION} needs "
            f"{PEER_KEYS_OPTION} (the public keys of the peers this instance trusts).")
    assert secret is not None and peers is not None
    if not zmq.has("curve"):
        raise LLMException(f"option {SECRET_KEY_OPTION}: this pyzmq/libzmq ({zmq.zmq_version()}) was built "
                           "without CURVE security (zmq.has('curve') is False).",
                           status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
    try:
        secret_key = parse_curve_key(secret)
    except ValueError as exc:  # the value itself is never put in the message: it is a secret
        raise LLMException(f"option {SECRET_KEY_OPTION} must be a Z85-encoded CURVE secret key "
                           f"(zmq.curve_keypair()[1]): {exc}.",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    try:
        trusted = parse_curve_peer_keys(peers)
    except ValueError as exc:
        raise LLMException(f"option {PEER_KEYS_OPTION} must be comma-separated PUBLIC_KEY or "
                           f"CLUSTER_ID=PUBLIC_KEY entries (Z85 CURVE public keys): {exc}.",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
    global _curve_warned  # once per process
    if not _curve_warned and transport is not Transport.SHM:
        _curve_warned = True
        log.warning("CURVE encrypts and authenticates the control plane only: the TCP data plane still carries "
                    "KV cache bytes in the clear (see docs/security.md; use IPsec/WireGuard on untrusted networks)")
    return CurveKeys(secret_key, zmq.curve_public(secret_key), trusted)
