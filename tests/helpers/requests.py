"""Counting the control-plane requests an in-process instance sends to its (only) peer."""

from __future__ import annotations

from typing import Any

from aiodatadist.protocol.codec import Kind


def count_requests(dd: Any) -> dict[str, int]:
    """Count the requests ``dd`` sends to its (only) peer, by kind (awaited and not)."""
    link = next(iter(dd._links.links.values()))
    sent: dict[str, int] = {}
    channel = link.channel
    request, notify = channel.request, channel.notify

    async def counting(msg: Any) -> dict[str, Any]:
        sent[msg.KIND] = sent.get(msg.KIND, 0) + 1
        return await request(msg)

    def counting_notify(msg: Any) -> None:
        sent[msg.KIND] = sent.get(msg.KIND, 0) + 1
        notify(msg)

    channel.request = counting
    channel.notify = counting_notify
    return sent


def count_begins(dd: Any) -> list[int]:
    """Count the BEGIN requests ``dd`` sends to its (only) peer: ``[n]``, kept current."""
    link = next(iter(dd._links.links.values()))
    sent = [0]
    request = link.channel.request

    async def counting(msg: Any) -> dict[str, Any]:
        sent[0] += msg.KIND == Kind.BEGIN
        return await request(msg)

    link.channel.request = counting
    return sent
