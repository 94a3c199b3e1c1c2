"""The pytest plugin of aiodatadist (entry point ``pytest11``: ``aiodatadist``; ``-p no:aiodatadist`` disables it).

Opt-in: it only offers fixtures, and a test that uses none of them runs as if the plugin were not there.  Needs
pytest-asyncio (1.0 or later).  Its async fixtures run on the event loop of the test that uses them, whatever the
test's loop scope (function, class, module, package or session): a module-scoped test gets a decoder created on
the module's loop.  Loading it imports neither numpy nor ZeroMQ; the fixtures import what they need.

Fixtures (all function-scoped; see ``docs/testing.md``):

``prompt_server``           a :class:`~aiodatadist.testing.PromptServer`: a prompt in a child process, listening
                            on a free port of 127.0.0.1, with one blocks cache ``"kv"`` of random bytes.
``prompt_server_factory``   ``await prompt_server_factory(**kwargs)`` starts more (``PromptServer.start``'s
                            arguments); all are closed after the test.
``datadist_factory``        ``await datadist_factory(role=LLMRole.DECODER, cluster_id=None, *, listen=False,
                            options=None)``: initialized in-process instances, finalized after the test.
``linked_decoder``          a DECODER instance in this process linked to ``prompt_server`` (through
                            ``fault_injector``'s proxy when the test uses it too).
``fault_injector``          a :class:`~aiodatadist.testing.FaultInjector` for ``prompt_server``.
``leak_check``              fails the test (an error at teardown) if it leaves unfinalized instances or links,
                            child processes, threads, descriptors, shared memory or tasks behind; a
                            :class:`~aiodatadist.testing.LeakCheck`.  Request it first, or with
                            ``pytest.mark.usefixtures("leak_check")`` (it is moved before the test's other
                            function-scoped fixtures either way).

Marker: ``@pytest.mark.aiodatadist_leaks(allow=..., count=None)`` lets ``leak_check`` pass known leaks of a test
(``allow``: a kind such as ``"pipe"``, a predicate on a :class:`~aiodatadist.testing.Leak`, or a list of them;
see :meth:`~aiodatadist.testing.LeakCheck.allow`).

Works in pytest-asyncio's strict and auto modes alike: the fixtures are ``pytest_asyncio`` fixtures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

try:
    import pytest_asyncio
except ImportError:  # pragma: no cover - the fixtures then fail with pytest's message about async fixtures
    pytest_asyncio = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from ..datadist import LLMDataDist
    from ..types import LLMRole
    from .faults import FaultInjector
    from .leaks import LeakCheck
    from .prompt_server import PromptServer

__all__ = ["datadist_factory", "fault_injector", "leak_check", "linked_decoder", "prompt_server",
           "prompt_server_factory"]

F = TypeVar("F", bound=Callable[..., Any])
_FOLLOWS_TEST_LOOP = "_aiodatadist_follows_test_loop"
LINK_TIMEOUT_MS = 5000
LEAKS_MARKER = "aiodatadist_leaks"
"""``@pytest.mark.aiodatadist_leaks(allow=..., count=None)``: known leaks ``leak_check`` lets pass."""


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker (projects run with ``--strict-markers``)."""
    config.addinivalue_line(
        "markers", f"{LEAKS_MARKER}(allow, count=None): leaks the aiodatadist leak_check fixture lets pass in "
                   "this test: allow is a kind ('pipe', 'socket', 'fd', 'thread', ...), a predicate on a Leak, or "
                   "a list of them; count: at most that many of each (docs/testing.md)")


def _async_fixture(func: F) -> F:
    """A function-scoped async fixture that runs on the loop of the test using it (see
    :func:`pytest_fixture_setup`)."""
    setattr(func, _FOLLOWS_TEST_LOOP, True)
    if pytest_asyncio is not None:
        return pytest_asyncio.fixture(func)  # type: ignore[return-value]
    return pytest.fixture(func)  # pragma: no cover


def _test_loop_scope(request: pytest.FixtureRequest) -> str | None:
    """The loop scope of the test being set up: its ``asyncio`` marker's, or pytest-asyncio's default; None for
    a test that is not an asyncio test."""
    marker = request.node.get_closest_marker("asyncio")
    if marker is None:
        return None
    scope = marker.kwargs.get("loop_scope") or marker.kwargs.get("scope")
    if scope:
        return str(scope)
    try:
        return str(request.config.getini("asyncio_default_test_loop_scope") or "function")
    except ValueError:  # an older pytest-asyncio without the option: tests ran on function loops
        return "function"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any],
                         request: pytest.FixtureRequest) -> Generator[None, Any, Any]:
    """Our async fixtures take the loop scope of the test (pytest-asyncio reads a fixture's ``_loop_scope``
    when it sets it up); any other fixture is left alone."""
    func: Any = fixturedef.func
    scope = _test_loop_scope(request) if getattr(func, _FOLLOWS_TEST_LOOP, False) else None
    if scope is None:
        return (yield)
    had, previous = hasattr(func, "_loop_scope"), getattr(func, "_loop_scope", None)
    func._loop_scope = scope
    try:
        return (yield)
    finally:
        if had:
            func._loop_scope = previous
        else:
            del func._loop_scope


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move ``leak_check`` before the other function-scoped fixtures of the tests that use it, so that its
    baseline is taken before they start anything and its check runs after they stopped it all."""
    for item in items:
        names: list[str] | None = getattr(item, "fixturenames", None)
        if not names or "leak_check" not in names:
            continue
        defs: Mapping[str, Any] = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        names.remove("leak_check")
        names.insert(next((i for i, n in enumerate(names) if _function_scoped(defs.get(n))), len(names)),
                     "leak_check")


def _function_scoped(fixturedefs: Any) -> bool:
    return bool(fixturedefs) and getattr(fixturedefs[-1], "scope", None) == "function"


# -- fixtures ------------------------------------------------------------------------------------------------
@_async_fixture
async def prompt_server_factory() -> AsyncIterator[Callable[..., Awaitable[PromptServer]]]:
    """``await prompt_server_factory(cluster_id=None, *, caches=None, fill=True, options=None, env=None,
    host="127.0.0.1", port=0)``: a started :class:`~aiodatadist.testing.PromptServer`; closed after the test."""
    from .prompt_server import PromptServer

    servers: list[PromptServer] = []

    async def start(*args: Any, **kwargs: Any) -> PromptServer:
        server = await PromptServer.start(*args, **kwargs)
        servers.append(server)
        return server

    try:
        yield start
    finally:
        for server in reversed(servers):
            await server.close()


@_async_fixture
async def prompt_server(prompt_server_factory: Callable[..., Awaitable[PromptServer]]) -> PromptServer:
    """A prompt in a child process listening on a free port of 127.0.0.1, with one blocks cache ``"kv"``
    (4 tensors of 16 blocks of 1 KiB) of random bytes: ``prompt_server.expected("kv", blocks)`` says which."""
    return await prompt_server_factory()


@_async_fixture
async def datadist_factory() -> AsyncIterator[Callable[..., Awaitable[LLMDataDist]]]:
    """``await datadist_factory(role=LLMRole.DECODER, cluster_id=None, *, listen=False, options=None)``: an
    initialized ``LLMDataDist`` in this process (a fresh cluster id by default; ``listen``: on a free port of
    127.0.0.1, then in ``listen_address``); finalized after the test."""
    from ..config import LLMConfig
    from ..datadist import LLMDataDist
    from ..types import LLMRole
    from .addresses import new_cluster_id

    made: list[LLMDataDist] = []

    async def make(role: LLMRole = LLMRole.DECODER, cluster_id: int | None = None, *, listen: bool = False,
                   options: Mapping[str, str] | None = None) -> LLMDataDist:
        opts = dict(LLMConfig().generate_options())
        opts.update(options or {})
        if listen:
            opts["llm.listenIpInfo"] = "127.0.0.1:0"
        dd = LLMDataDist(role, cluster_id if cluster_id is not None else new_cluster_id())
        await dd.init(opts)
        made.append(dd)
        return dd

    try:
        yield make
    finally:
        for dd in reversed(made):
            await dd.finalize()


@_async_fixture
async def fault_injector(prompt_server: PromptServer) -> AsyncIterator[FaultInjector]:
    """A :class:`~aiodatadist.testing.FaultInjector` for ``prompt_server``: kill, stop, restart it; stall or cut
    its control connection (for decoders linked through ``fault_injector.cluster_info()``); cut TCP data
    connections."""
    from .faults import FaultInjector

    async with FaultInjector.start(prompt_server) as faults:
        yield faults


@_async_fixture
async def linked_decoder(request: pytest.FixtureRequest, prompt_server: PromptServer,
                         datadist_factory: Callable[..., Awaitable[LLMDataDist]]) -> AsyncIterator[LLMDataDist]:
    """A DECODER ``LLMDataDist`` in this process, linked to ``prompt_server``, through ``fault_injector``'s
    proxy when the test uses ``fault_injector`` as well; finalized after the test."""
    from ..errors import LLMException, LLMStatusCode
    from .faults import FaultInjector

    faults = request.getfixturevalue("fault_injector") if "fault_injector" in request.fixturenames else None
    if not isinstance(faults, FaultInjector):
        faults = None
    target = faults.cluster_info() if faults is not None else prompt_server.cluster_info()
    decoder = await datadist_factory()
    code, _ = await decoder.link_clusters([target], timeout=LINK_TIMEOUT_MS)
    if code != LLMStatusCode.LLM_SUCCESS:
        raise LLMException(f"linked_decoder: link to {prompt_server!r} failed with {code}", status_code=code)
    try:
        yield decoder
    finally:
        if faults is not None:  # let the decoder say goodbye quickly
            faults.pass_control()
            faults.cont()


@_async_fixture
async def leak_check(request: pytest.FixtureRequest) -> AsyncIterator[LeakCheck]:
    """Fails the test (an error at its teardown) if it left unfinalized ``LLMDataDist`` instances (with their
    links), child processes, threads, file descriptors, shared-memory mappings or pending tasks behind; what it
    found is cleaned up first (instances finalized, processes killed).  Yields the
    :class:`~aiodatadist.testing.LeakCheck` (``allow(what, count=None)``, ``ignore_thread(pattern)``,
    ``settle_s``); the test's ``aiodatadist_leaks`` markers are its first allowances."""
    from .leaks import LeakCheck

    check = LeakCheck()
    for marker in request.node.iter_markers(LEAKS_MARKER):
        _allow_from_marker(check, marker)
    check.start()
    yield check
    found = await check.leaks()
    if found:
        await check.clean_up()
        pytest.fail(f"leak_check: {check.report(found)}\n  (a known leak: leak_check.allow(kind or predicate, "
                    f"count=None), or @pytest.mark.{LEAKS_MARKER}(allow=..., count=...))", pytrace=False)


def _allow_from_marker(check: LeakCheck, marker: pytest.Mark) -> None:
    """``aiodatadist_leaks(allow, count=None)`` (``allow`` also positional): ``check.allow`` for each."""
    unknown = set(marker.kwargs) - {"allow", "count"}
    if unknown or len(marker.args) > 1 or (marker.args and "allow" in marker.kwargs):
        pytest.fail(f"@pytest.mark.{LEAKS_MARKER} takes (allow, count=None), not {marker.args!r} "
                    f"{marker.kwargs!r}", pytrace=False)
    allow = marker.args[0] if marker.args else marker.kwargs.get("allow")
    if allow is None:
        pytest.fail(f"@pytest.mark.{LEAKS_MARKER} needs allow= (a kind, a predicate or a list of them)",
                    pytrace=False)
    for what in allow if isinstance(allow, (list, tuple)) else [allow]:
        check.allow(what, marker.kwargs.get("count"))
