"""Why recent links went away, per cluster: a call to a cluster whose link dropped raises ``LLMLinkError`` naming
the reason, instead of a bare "not linked"."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from ..errors import LinkDropReason, LLMException, LLMLinkError, LLMStatusCode

__all__ = ["MAX_REMEMBERED", "DropLog", "Dropped"]

MAX_REMEMBERED: Final = 1024
"""Clusters whose last drop is remembered (the oldest is forgotten first)."""


@dataclass(frozen=True)
class Dropped:
    """How the last link to a cluster ended."""

    reason: LinkDropReason
    detail: str  # the drop's message
    at: float  # time.monotonic()


class DropLog:
    """The last drop of each of the :data:`MAX_REMEMBERED` clusters that lost a link most recently; a cluster is
    forgotten once a new link to it exists."""

    def __init__(self, bound: int = MAX_REMEMBERED) -> None:
        self._bound = bound
        self._dropped: OrderedDict[int, Dropped] = OrderedDict()

    def record(self, cluster: int, reason: LinkDropReason, detail: str) -> None:
        """Remember that the link to ``cluster`` went away (or its last attempt failed) for ``reason``."""
        self._dropped.pop(cluster, None)
        self._dropped[cluster] = Dropped(reason, detail, time.monotonic())
        while len(self._dropped) > self._bound:
            self._dropped.popitem(last=False)

    def forget(self, cluster: int) -> None:
        """A link to ``cluster`` exists again."""
        self._dropped.pop(cluster, None)

    def get(self, cluster: int) -> Dropped | None:
        """The last drop of ``cluster``'s link, if remembered."""
        return self._dropped.get(cluster)

    def not_linked(self, cluster: int) -> LLMException:
        """The error of a call to ``cluster``, which has no link: ``LLM_NOT_YET_LINK``, as an ``LLMLinkError``
        naming why when its link dropped recently."""
        dropped = self._dropped.get(cluster)
        if dropped is None:
            return LLMException(f"cluster {cluster} is not linked", status_code=LLMStatusCode.LLM_NOT_YET_LINK)
        ago = time.monotonic() - dropped.at
        what = ("its last link attempt failed" if dropped.reason == LinkDropReason.AUTH_FAILED
                else "its link dropped")
        why = dropped.detail if dropped.reason in dropped.detail else f"{dropped.reason}: {dropped.detail}"
        return LLMLinkError(f"cluster {cluster} is not linked: {what} {ago:.1f} s ago ({why})",
                            status_code=LLMStatusCode.LLM_NOT_YET_LINK, reason=dropped.reason)
