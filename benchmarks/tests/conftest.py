"""The tests of the benchmarks distribution, collected with the library's from the repository root (the root's
``pyproject.toml`` lists this folder in ``testpaths``; its markers and ``tests/`` helpers apply here too).

Markers by folder (as in ``tests/conftest.py``)
    ``unit/``          none: no peer process, no socket.
    ``integration/``   ``integration``: sockets or processes of their own (the TCP ceiling).
    ``smoke/``         ``slow`` and ``integration``: whole benchmark and soak runs in real processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
FOLDER_MARKERS: dict[str, tuple[str, ...]] = {"integration": ("integration",), "smoke": ("slow", "integration")}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            folder = Path(str(item.path)).resolve().relative_to(_HERE).parts[0]
        except ValueError:
            continue
        for name in FOLDER_MARKERS.get(folder, ()):
            item.add_marker(name)
