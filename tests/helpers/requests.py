"""Counting the control-plane requests an in-process instance sends, from its statistics
(``LLMDataDist.stats().messages``: messages by kind, per remote cluster)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from aiodatadist import LLMDataDist
from aiodatadist.protocol.codec import Kind


def _sent(dd: LLMDataDist) -> dict[str, int]:
    """Every message ``dd`` sent so far, by kind, summed over its remote clusters."""
    total: dict[str, int] = {}
    for entry in dd.stats().messages:
        for kind, count in entry.sent.items():
            total[kind] = total.get(kind, 0) + count
    return total


class SentRequests(Mapping[str, int]):
    """The requests ``dd`` sent since this was made, by kind (awaited and not; replies are not requests), read
    from its statistics each time it is looked at."""

    def __init__(self, dd: LLMDataDist) -> None:
        self._dd = dd
        self._before = _sent(dd)

    def _now(self) -> dict[str, int]:
        now = _sent(self._dd)
        return {kind: count - self._before.get(kind, 0) for kind, count in now.items()
                if kind != Kind.REPLY and count > self._before.get(kind, 0)}

    def __getitem__(self, kind: str) -> int:
        return self._now()[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._now())

    def __len__(self) -> int:
        return len(self._now())


def count_requests(dd: LLMDataDist) -> SentRequests:
    """Count the requests ``dd`` sends from now on, by kind (awaited and not), kept current."""
    return SentRequests(dd)


def count_begins(dd: LLMDataDist) -> Callable[[], int]:
    """Count the BEGIN requests ``dd`` sends from now on: call the result for the count so far."""
    sent = SentRequests(dd)
    return lambda: sent.get(Kind.BEGIN, 0)
