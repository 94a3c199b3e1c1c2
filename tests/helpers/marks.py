"""Skip marks for optional extras."""

from __future__ import annotations

import pytest

from aiodatadist.transport.nixl import nixl_available

NIXL = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed (pip install 'aiodatadist[nixl]')")
"""The test needs NIXL (the nixl data plane); it is skipped cleanly without it."""
