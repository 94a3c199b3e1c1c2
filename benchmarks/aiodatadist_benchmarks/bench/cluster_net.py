"""Where the workers of ``bench cluster`` (:mod:`aiodatadist_benchmarks.bench.cluster`) run: on loopback, or
``--netns``: one network namespace per worker on a veth pair to one bridge, optionally with ``tc netem``."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
from collections.abc import Iterator

__all__ = ["Namespaces", "Network"]


class Network:
    """Where the workers run: all on loopback in this namespace (the base class), or see :class:`Namespaces`."""

    def address(self, index: int) -> str:
        """The IP address worker ``index`` listens and links on."""
        return "127.0.0.1"

    def prefix(self, index: int) -> list[str]:
        """What runs worker ``index``'s command (e.g. ``ip netns exec NAME``)."""
        return []


class Namespaces(Network):
    """One network namespace per worker, each on a veth pair to one bridge, addresses 10.77.0.0/16 (root).

    Names start with a random prefix per run; :meth:`close` removes every namespace (their veth pairs go with
    them) and the bridge, also after a failed :meth:`open`."""

    def __init__(self, count: int, netem: str | None) -> None:
        self.count, self.netem = count, netem
        self.tag = "adt" + secrets.token_hex(2)
        self.created: list[str] = []
        self.bridge: str | None = None

    def address(self, index: int) -> str:
        return f"10.77.{index // 250}.{index % 250 + 1}"

    def prefix(self, index: int) -> list[str]:
        return ["ip", "netns", "exec", f"{self.tag}-{index}"]

    @staticmethod
    def _ip(*args: str) -> None:
        try:
            done = subprocess.run(args, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise RuntimeError(f"{args[0]}: {exc}") from None
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip() or done.returncode}")

    def open(self) -> None:
        bridge = f"{self.tag}br"
        self._ip("ip", "link", "add", bridge, "type", "bridge")
        self.bridge = bridge
        self._ip("ip", "link", "set", bridge, "up")
        for i in range(self.count):
            ns, veth = f"{self.tag}-{i}", f"{self.tag}v{i}"
            self._ip("ip", "netns", "add", ns)
            self.created.append(ns)
            self._ip("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("ip", "link", "set", veth, "master", bridge, "up")
            self._ip("ip", "-n", ns, "addr", "add", f"{self.address(i)}/16", "dev", "eth0")
            self._ip("ip", "-n", ns, "link", "set", "eth0", "up")
            self._ip("ip", "-n", ns, "link", "set", "lo", "up")
            if self.netem:
                self._ip("tc", "qdisc", "add", "dev", veth, "root", "netem", *self.netem.split())

    def close(self) -> None:
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.created.clear()
        if self.bridge is not None:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
            self.bridge = None


@contextlib.contextmanager
def _network(netns: bool, count: int, netem: str | None) -> Iterator[Network]:
    if not netns:
        yield Network()
        return
    spaces = Namespaces(count, netem)
    try:
        spaces.open()
        yield spaces
    finally:
        spaces.close()
