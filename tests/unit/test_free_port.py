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


def test_a_port_in_use_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0 if _ephemeral_low() <= 11024 else 10500))
        held.listen()
        taken = held.getsockname()[1]
        choices = iter([taken, taken, taken + 1])
        monkeypatch.setattr(addresses, "_picks", SimpleNamespace(randrange=lambda a, b: next(choices)))
        port = free_port()
    assert port != taken
    if _ephemeral_low() > 11024:
        assert port == taken + 1  # the next choice that binds
