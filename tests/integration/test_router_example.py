"""The example router suite of ``docs/testing.md`` (``examples/router/test_kv_router.py``), run as part of this
suite: its tests and fixtures are imported here, so they run in CI with the integration tests."""

from __future__ import annotations

import sys
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "examples" / "router"
if str(ROUTER) not in sys.path:
    sys.path.insert(0, str(ROUTER))

from test_kv_router import *  # the example's tests, fixtures and pytestmark
