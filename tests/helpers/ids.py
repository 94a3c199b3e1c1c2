"""Cluster ids for the instances a test creates in this process."""

from __future__ import annotations

import itertools
import os

_ids = itertools.count(30_000_000 + (os.getpid() % 10_000) * 1_000)


def new_cluster_id() -> int:
    """A cluster id that no other instance created through this helper in this test process has used."""
    return next(_ids)
