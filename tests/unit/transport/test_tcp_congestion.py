"""The congestion control of TCP data connections (``AIODATADIST_TCP_CONGESTION``), on real loopback sockets:
``auto`` takes a pacing algorithm (BBR) off connections to this host and leaves every other one alone,
``system`` leaves all alone, a name is set everywhere, and a name the kernel refuses changes nothing and warns."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator

import pytest

from aiodatadist.transport.tcp import congestion
from aiodatadist.transport.tcp.congestion import UNPACED, congestion_of, is_this_host, tune_congestion

ENV = "AIODATADIST_TCP_CONGESTION"
pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="no TCP_CONGESTION on this platform")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected loopback TCP pair (client, accepted server side)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    with client, accepted:
        yield client, accepted


def _force(sock: socket.socket, name: str) -> None:
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except OSError as exc:
        pytest.skip(f"this kernel does not let the test set {name}: {exc}")


@pytest.mark.parametrize("side", [0, 1])
def test_auto_takes_bbr_off_a_connection_to_this_host(pair: tuple[socket.socket, socket.socket], side: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    sock = pair[side]
    _force(sock, "bbr")
    chosen = tune_congestion(sock)
    assert chosen in UNPACED
    assert congestion_of(sock) == chosen


@pytest.mark.parametrize("setting, algorithm", [("auto", "reno"), ("system", "bbr")],
                         ids=["auto-leaves-an-unpaced-algorithm", "system-keeps-every-algorithm"])
def test_a_connection_keeps_its_algorithm(setting: str, algorithm: str, pair: tuple[socket.socket, socket.socket],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, setting)
    sock = pair[0]
    _force(sock, algorithm)
    assert tune_congestion(sock) is None
    assert congestion_of(sock) == algorithm


def test_a_name_is_set_on_every_connection(pair: tuple[socket.socket, socket.socket],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "reno")  # open to every process
    for sock in pair:
        assert tune_congestion(sock) == "reno"
        assert congestion_of(sock) == "reno"


def test_a_refused_name_changes_nothing_and_warns_once(pair: tuple[socket.socket, socket.socket],
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ENV, "nosuchcc")
    monkeypatch.setattr(congestion, "_warned", set())
    caplog.set_level(logging.WARNING, "aiodatadist.transport")
    before = [congestion_of(s) for s in pair]
    assert [tune_congestion(s) for s in pair] == [None, None]
    assert [congestion_of(s) for s in pair] == before
    refusals = [r for r in caplog.records if "nosuchcc" in r.getMessage()]
    assert len(refusals) == 1


def test_this_host_is_loopback_or_the_sockets_own_address(pair: tuple[socket.socket, socket.socket]) -> None:
    assert all(is_this_host(s) for s in pair)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as unconnected:
        assert not is_this_host(unconnected)


def test_an_ipv4_peer_of_a_dual_stack_listener_is_this_host() -> None:
    try:
        server = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    except (OSError, ValueError) as exc:
        pytest.skip(f"no dual-stack IPv6 here: {exc}")
    # from another loopback address, so that the peer is not simply the socket's own address
    with server, socket.create_connection(("127.0.0.1", server.getsockname()[1]),
                                          source_address=("127.0.0.2", 0)) as client:
        accepted, (peer, *_) = server.accept()
        with accepted:
            assert peer == "::ffff:127.0.0.2" and accepted.getsockname()[0] == "::ffff:127.0.0.1"
            assert is_this_host(accepted) and is_this_host(client)
