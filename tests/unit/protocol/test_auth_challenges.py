"""The server's challenge table and the HMAC proofs, with the time passed in: no clock, no sleeps."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from aiodatadist.protocol import auth
from aiodatadist.protocol.auth import CHALLENGE_TTL, MAX_PENDING, NONCE_BYTES, ChallengeTable

T0 = 5000.0
CN = b"c" * NONCE_BYTES


def rid(n: int) -> bytes:
    return b"r" + n.to_bytes(8, "big")


def test_the_table_reads_no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    def no_clock() -> float:
        raise AssertionError("ChallengeTable read the clock")

    monkeypatch.setattr(time, "monotonic", no_clock)
    monkeypatch.setattr(time, "time", no_clock)
    table = ChallengeTable()
    sn = table.issue(rid(1), CN, T0)
    assert table.take(rid(1), T0) == (CN, sn)


def test_issue_then_take() -> None:
    table = ChallengeTable()
    sn = table.issue(rid(1), CN, T0)
    assert isinstance(sn, bytes) and len(sn) == NONCE_BYTES and sn != CN
    assert len(table) == 1
    assert table.take(rid(1), T0 + 1) == (CN, sn)
    assert len(table) == 0


def test_single_use() -> None:
    table = ChallengeTable()
    sn = table.issue(rid(1), CN, T0)
    assert table.take(rid(1), T0) == (CN, sn)
    assert table.take(rid(1), T0) is None


def test_unknown_connection() -> None:
    table = ChallengeTable()
    table.issue(rid(1), CN, T0)
    assert table.take(rid(2), T0) is None
    assert len(table) == 1  # the other connection's challenge stays


@pytest.mark.parametrize(("after", "valid"), [(0.0, True), (CHALLENGE_TTL - 0.001, True), (CHALLENGE_TTL, True),
                                              (CHALLENGE_TTL + 0.001, False), (3600.0, False)])
def test_expiry(after: float, valid: bool) -> None:
    table = ChallengeTable()
    sn = table.issue(rid(1), CN, T0)
    assert table.take(rid(1), T0 + after) == ((CN, sn) if valid else None)
    assert len(table) == 0  # taken either way: an expired challenge is gone too
    assert CHALLENGE_TTL == 10.0


def test_a_new_challenge_replaces_the_old_one() -> None:
    table = ChallengeTable()
    old = table.issue(rid(1), CN, T0)
    other_cn = b"d" * NONCE_BYTES
    new = table.issue(rid(1), other_cn, T0 + 5)
    assert new != old and len(table) == 1
    assert table.take(rid(1), T0 + 5 + CHALLENGE_TTL) == (other_cn, new)  # the new one's deadline


def test_server_nonces_are_fresh() -> None:
    table = ChallengeTable()
    nonces = {table.issue(rid(n), CN, T0) for n in range(200)}
    assert len(nonces) == 200


def test_the_table_is_bounded_expired_challenges_go_first() -> None:
    table = ChallengeTable()
    for n in range(MAX_PENDING // 2):
        table.issue(rid(n), CN, T0)  # these expire at T0 + TTL
    later = T0 + CHALLENGE_TTL / 2
    for n in range(MAX_PENDING // 2, MAX_PENDING):
        table.issue(rid(n), CN, later)
    assert len(table) == MAX_PENDING
    now = T0 + CHALLENGE_TTL + 1  # the first half has expired, the second has not
    table.issue(rid(MAX_PENDING), CN, now)
    assert len(table) == MAX_PENDING // 2 + 1
    assert table.take(rid(0), now) is None
    assert table.take(rid(MAX_PENDING - 1), now) is not None
    assert table.take(rid(MAX_PENDING), now) is not None


def test_the_table_is_bounded_else_the_first_issued_goes() -> None:
    table = ChallengeTable()
    for n in range(MAX_PENDING):
        table.issue(rid(n), CN, T0 + n * 0.001)
    table.issue(rid(MAX_PENDING), CN, T0 + 1)  # nothing has expired: one challenge makes room
    assert len(table) == MAX_PENDING
    assert table.take(rid(0), T0 + 1) is None
    assert table.take(rid(1), T0 + 1) is not None
    assert table.take(rid(MAX_PENDING), T0 + 1) is not None
    for n in range(10 * MAX_PENDING):  # a flood never grows it
        table.issue(rid(10_000 + n), CN, T0 + 2)
    assert len(table) == MAX_PENDING


# -- proofs --------------------------------------------------------------------------------------------------------
def test_derive_key() -> None:
    key = auth.derive_key("s3cret")
    assert key == hashlib.sha256(b"aiodatadist-auth-v1\0s3cret").digest()
    assert key == auth.derive_key("s3cret") != auth.derive_key("s3cret ")
    assert len(key) == 32


def test_proofs_are_bound_to_side_nonces_and_ids() -> None:
    key = auth.derive_key("k")
    cn, sn = b"c" * 32, b"s" * 32
    base = auth.proof(key, "client", cn, sn, 2, 1)
    assert base == hmac.new(key, b"client|" + cn + b"|" + sn + b"|2|1", hashlib.sha256).digest()
    variants = [auth.proof(key, "server", cn, sn, 2, 1), auth.proof(key, "client", sn, cn, 2, 1),
                auth.proof(key, "client", cn, sn, 1, 2), auth.proof(key, "client", cn, sn, 2, 3),
                auth.proof(auth.derive_key("other"), "client", cn, sn, 2, 1)]
    assert len({base, *variants}) == len(variants) + 1


def test_verify() -> None:
    expected = b"x" * 32
    assert auth.verify(expected, b"x" * 32)
    for given in (b"y" * 32, b"x" * 31, b"", None, "x" * 32, 5, bytearray(b"x" * 32)):
        assert not auth.verify(expected, given)


def test_data_token() -> None:
    key = auth.derive_key("k")
    token = auth.data_token(key, b"c" * 32, b"s" * 32)
    assert len(token) == 16
    assert token == hmac.new(key, b"data|" + b"c" * 32 + b"|" + b"s" * 32, hashlib.sha256).digest()[:16]
    assert token != auth.data_token(key, b"s" * 32, b"c" * 32)


def test_new_nonce() -> None:
    assert len(auth.new_nonce()) == NONCE_BYTES
    assert auth.new_nonce() != auth.new_nonce()


def test_a_challenge_issued_again_counts_from_its_new_issue() -> None:
    """A connection challenged again moves to the back: the table stays in deadline order, so a full table
    pushes out the oldest challenge, never one just issued."""
    table = ChallengeTable()
    for n in range(MAX_PENDING):
        table.issue(rid(n), CN, T0)
    again = table.issue(rid(0), CN, T0 + 1)
    table.issue(rid(MAX_PENDING), CN, T0 + 1)  # full: the oldest goes, rid(1)
    assert len(table) == MAX_PENDING
    assert table.take(rid(1), T0 + 1) is None
    assert table.take(rid(0), T0 + 1 + CHALLENGE_TTL) == (CN, again)  # its deadline is the new issue's
