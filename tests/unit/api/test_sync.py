"""``aiodatadist.sync``: the same surface as the asyncio API, and the lifecycle of its one loop thread."""

from __future__ import annotations

import inspect
import threading

import pytest
from helpers.ids import new_cluster_id

from aiodatadist import CacheManager as AsyncCacheManager
from aiodatadist import LLMConfig, LLMException, LLMNotInitializedError, LLMRole, LLMStatusCode, sync
from aiodatadist import LLMDataDist as AsyncLLMDataDist

CACHE_METHODS = ["allocate_cache", "allocate_blocks_cache", "allocate_host_memory", "register_cache", "register_blocks_cache",
                 "unregister_cache", "deallocate_cache", "deallocate_blocks_cache", "remove_cache_key",
                 "copy_cache", "copy_blocks", "swap_blocks", "pull_cache", "pull_blocks", "push_cache", "push_blocks",
                 "transfer_cache_async", "remap_registered_memory"]
COROUTINES = [m for m in CACHE_METHODS if inspect.iscoroutinefunction(getattr(AsyncCacheManager, m))]
DATADIST_METHODS = ["init", "finalize", "link_clusters", "unlink_clusters", "switch_role", "links", "stats", "notify",
                    "get_notification", "link", "unlink", "query_register_mem_status", "check_link_status"]
PROPERTIES = ["cluster_id", "role", "is_initialized", "settings", "cache_manager", "listen_address"]


def _params(fn: object) -> list[tuple[str, object, object, object]]:
    return [(p.name, p.kind, p.default, p.annotation) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == sync.THREAD_NAME]


@pytest.mark.parametrize("name", CACHE_METHODS)
def test_cache_manager_methods_have_the_asyncio_signature(name: str) -> None:
    blocking, original = getattr(sync.CacheManager, name), getattr(AsyncCacheManager, name)
    assert not inspect.iscoroutinefunction(blocking)
    assert _params(blocking) == _params(original)
    assert inspect.signature(blocking).return_annotation == inspect.signature(original).return_annotation


@pytest.mark.parametrize("name", COROUTINES)
def test_submit_mirrors_every_coroutine_method(name: str) -> None:
    submit, original = getattr(sync.CacheManagerSubmit, name), getattr(AsyncCacheManager, name)
    assert _params(submit) == _params(original)
    assert inspect.signature(submit).return_annotation == "TransferFuture[None]"


def test_submit_has_only_the_coroutine_methods() -> None:
    public = {n for n in vars(sync.CacheManagerSubmit) if not n.startswith("_")}
    assert public == set(COROUTINES)
    assert len(COROUTINES) == 7


@pytest.mark.parametrize("name", DATADIST_METHODS)
def test_datadist_methods_have_the_asyncio_signature(name: str) -> None:
    blocking, original = getattr(sync.LLMDataDist, name), getattr(AsyncLLMDataDist, name)
    assert not inspect.iscoroutinefunction(blocking)
    assert _params(blocking) == _params(original)
    assert inspect.signature(blocking).return_annotation == inspect.signature(original).return_annotation


@pytest.mark.parametrize("name", PROPERTIES)
def test_datadist_properties(name: str) -> None:
    assert isinstance(getattr(sync.LLMDataDist, name), property)
    assert isinstance(getattr(AsyncLLMDataDist, name), property)


def test_every_public_member_of_the_asyncio_classes_is_mirrored() -> None:
    for blocking, original in ((sync.LLMDataDist, AsyncLLMDataDist), (sync.CacheManager, AsyncCacheManager)):
        public = {n for n in dir(original) if not n.startswith("_")}
        internal = {"close"}  # CacheManager's, used by LLMDataDist
        missing = sorted(public - internal - set(dir(blocking)))
        assert not missing, f"sync.{blocking.__name__} lacks {missing}"


def test_constructor_checks_like_the_asyncio_one() -> None:
    with pytest.raises(TypeError):
        sync.LLMDataDist(1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        sync.LLMDataDist(LLMRole.PROMPT, -1)
    assert sync.loop_thread() is None  # constructing starts nothing


def test_the_loop_thread_stops_when_the_last_instance_is_finalized() -> None:
    assert sync.loop_thread() is None and not _loop_threads()
    first = sync.LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    second = sync.LLMDataDist(LLMRole.DECODER, new_cluster_id())
    with pytest.raises(LLMNotInitializedError):
        first.links()  # a call on an instance that is not initialized: the loop runs for the call only
    assert sync.loop_thread() is None and not _loop_threads()
    first.init(LLMConfig().generate_options())
    thread = sync.loop_thread()
    assert thread is not None and thread.is_alive() and thread.daemon
    second.init(LLMConfig().generate_options())
    second.init(LLMConfig().generate_options())  # a no-op, holds nothing more
    assert sync.loop_thread() is thread  # one loop thread for every instance
    assert first.links() == [] and second.cache_manager.allocate_blocks_cache is not None
    first.finalize()
    assert sync.loop_thread() is thread and thread.is_alive()  # second still holds it
    second.finalize()
    assert sync.loop_thread() is None
    assert not thread.is_alive() and not _loop_threads()  # stopped and joined before finalize returned
    assert first.stats().links == ()  # statistics survive finalize; the loop runs for the call only
    assert sync.loop_thread() is None
    with sync.LLMDataDist(LLMRole.MIX, new_cluster_id()) as third:  # a new loop thread on next use
        third.init(LLMConfig().generate_options())
        again = sync.loop_thread()
        assert again is not None and again is not thread
    assert sync.loop_thread() is None and not _loop_threads()


def test_a_failed_init_holds_no_loop() -> None:
    dd = sync.LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    with pytest.raises(LLMException) as info:
        dd.init({"llm.listenIpInfo": "not an address"})
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert not dd.is_initialized
    assert sync.loop_thread() is None


def test_cache_manager_wrapper_follows_the_instance() -> None:
    dd = sync.LLMDataDist(LLMRole.PROMPT, new_cluster_id())
    with pytest.raises(LLMNotInitializedError):
        _ = dd.cache_manager
    with dd:
        dd.init(LLMConfig().generate_options())
        cm = dd.cache_manager
        assert dd.cache_manager is cm and isinstance(cm, sync.CacheManager)
    dd.init(LLMConfig().generate_options())
    try:
        assert dd.cache_manager is not cm  # a new manager after a new init
        with pytest.raises(LLMNotInitializedError):
            cm.remove_cache_key  # noqa: B018 - the attribute exists; a call raises
            cm.unregister_cache(1)
    finally:
        dd.finalize()
    assert sync.loop_thread() is None
