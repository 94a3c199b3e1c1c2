"""Shared fixtures of the aiodatadist test suite, and the markers given by folder (see ``tests/README.md``).

Fixtures
    ``datadist``       an initialized ``LLMDataDist(LLMRole.PROMPT, <unique id>)``, finalized afterwards.
    ``cache_manager``  the ``CacheManager`` of ``datadist``.

Markers by folder (registered in ``pyproject.toml``)
    ``unit/``          none: the fast subset, ``pytest -m "not slow and not integration"``, which also runs a
                       tenth of each property test's examples (``helpers.examples``; CI runs them all).
    ``integration/``   ``integration``.
    ``gpu/``           ``gpu`` and ``integration`` (a real or emulated GPU, linked pairs and peer processes).
    ``smoke/``         ``slow`` and ``integration`` (whole processes: the CLI, the examples).
    ``vllm_connector/`` ``vllm``: the vLLM connector; skipped without vLLM (``bash scripts/vllm_tests.sh``).
    ``sglang/``        ``sglang``: the SGLang backend; skipped without SGLang (``bash scripts/sglang_tests.sh``).

``unit/`` mirrors the package: ``unit/<layer>/`` holds the tests of ``aiodatadist/<layer>/`` (``unit/api/``: the
public modules at the package's root; ``unit/package/``: the package's shape).

Helpers live in ``tests/helpers/`` (``tests/`` is on ``sys.path``): ``from helpers.data import fill_rows``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers.examples import QUICK_SCALE, set_quick
from helpers.ids import new_cluster_id
from hypothesis import settings

from aiodatadist import CacheManager, LLMConfig, LLMDataDist, LLMRole
from aiodatadist.testing import PeerProcess, cluster_info, free_port

_TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS: dict[str, tuple[str, ...]] = {
    "unit": (),
    "integration": ("integration",),
    "gpu": ("gpu", "integration"),
    "smoke": ("slow", "integration"),
    "vllm_connector": ("vllm",),
    "sglang": ("sglang",),
}


settings.register_profile("quick", max_examples=max(5, settings.default.max_examples // QUICK_SCALE))


def pytest_configure(config: pytest.Config) -> None:
    """The quick loop (``-m "not slow and not integration"``) runs a tenth of each property test's examples."""
    expression = " ".join(str(config.getoption("markexpr", "") or "").split())
    if "not slow" in expression and "not integration" in expression:
        set_quick(True)
        settings.load_profile("quick")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            folder = Path(str(item.path)).resolve().relative_to(_TESTS).parts[0]
        except ValueError:
            continue
        for name in FOLDER_MARKERS.get(folder, ()):
            item.add_marker(name)


@pytest.fixture
async def datadist() -> AsyncIterator[LLMDataDist]:
    """An initialized PROMPT instance with a unique cluster id; finalized after the test."""
    dd = LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    await dd.init(LLMConfig().generate_options())
    try:
        yield dd
    finally:
        await dd.finalize()


@pytest.fixture
def cache_manager(datadist: LLMDataDist) -> CacheManager:
    """The cache manager of the ``datadist`` fixture."""
    return datadist.cache_manager


# A real peer process (PROMPT, cluster 1) linked to a decoder here (cluster 2), process_vm_* refused on both sides.
@pytest.fixture
async def peer_without_pvm(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[PeerProcess, LLMDataDist]]:
    monkeypatch.setenv("AIODATADIST_SAME_HOST", "map")
    port = free_port()
    peer = await PeerProcess.start(env={"AIODATADIST_SAME_HOST": "map"})
    try:
        await peer.call("init", role="PROMPT", cluster_id=1, options={"llm.listenIpInfo": f"127.0.0.1:{port}"})
        async with LLMDataDist(LLMRole.DECODER, 2) as dd:
            await dd.init({})
            await dd.link_clusters([cluster_info(1, port)])
            yield peer, dd
    finally:
        await peer.close()
