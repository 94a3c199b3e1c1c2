"""``testing.free_port``: a port bindable now, out of the range where the kernel hands out ports by itself."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from aiodatadist.testing import addresses, free_port
from aiodatadist.testing.addresses import _ephemeral_low


def test_ports_are_bindable_distinct_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    for port in ports:
        assert port < low  # outgoing connections and bind(0) cannot take it between the check and the bind
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def _unused_ports(count: int) -> list[int]:
    """Ports below the ephemeral range that bind now and that free_port has not handed out lately."""
    found = []
    for port in range(10_000, _ephemeral_low()):
        if port in addresses._given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    pytest.skip("no free ports below the ephemeral range")


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    if _ephemeral_low() <= 11_024:
        pytest.skip("the ephemeral range leaves no room below it: free_port asks the kernel")
    taken, spare = _unused_ports(2)
    with socket.socket() as held:
        held.bind(("127.0.0.1", taken))
        held.listen()
        choices = iter([taken, taken, spare])
        monkeypatch.setattr(addresses, "_picks", SimpleNamespace(randrange=lambda a, b: next(choices)))
        port = free_port()
    assert port == spare  # the held port is skipped (twice), the next choice that binds is taken
