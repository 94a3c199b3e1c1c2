"""``transfer_cache_async``: layer-wise pushes driven by a LayerSynchronizer, between two real instances linked
over ZeroMQ on 127.0.0.1 (in this process, so that the test can release layers one at a time).

The synchronizer is a real blocking one (``threading.Event`` per layer, waited for in the library's worker thread).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest
from helpers.data import blocks, fill_pattern

from aiodatadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    CacheTask,
    DataType,
    LayerSynchronizer,
    LLMException,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aiodatadist.testing import linked_pair

S = LLMStatusCode
LAYERS = 4
BLOCKS_DESC = CacheDesc(2 * LAYERS, (8, 1024), DataType.DT_UINT8, Placement.HOST)  # K and V of 4 layers
SLOTS_DESC = CacheDesc(2 * LAYERS, (2, 4096), DataType.DT_UINT8, Placement.HOST)


class Gate(LayerSynchronizer):
    """Releases layer i when the test sets ``events[i]``; records the order of the calls and their threads."""

    def __init__(self, layers: int, fail_at: int | None = None) -> None:
        self.events = [threading.Event() for _ in range(layers)]
        self.calls: list[tuple[int, int | None]] = []
        self.threads: set[str] = set()
        self.fail_at = fail_at

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.calls.append((layer_index, timeout_in_millis))
        self.threads.add(threading.current_thread().name)
        self.events[layer_index].wait(30)
        return layer_index != self.fail_at

    def open_all(self) -> None:
        for event in self.events:
            event.set()


def layer_rows(cache: Any, layer: int, indices: list[int]) -> list[np.ndarray]:
    """Blocks ``indices`` of layer ``layer``'s two tensors (K, V)."""
    rows = blocks(cache, indices)
    return rows[2 * layer:2 * layer + 2]


async def until(condition: Any, seconds: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_layers_go_out_in_order_as_they_become_ready() -> None:
    """Two destinations: the decoder's blocks cache (layers 0-3 to 0-3) and its second one (layers 1-2 to 0-1).
    Each layer lands once its gate opens, not before; the bytes are exact; both configs end LLM_SUCCESS."""
    async with linked_pair() as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        fill_pattern(src, 71)
        whole = decoder.cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(2, 0))
        part = decoder.cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(2, 1))
        fill_pattern(whole, 72)
        fill_pattern(part, 73)
        before_part = blocks(part, [0, 1, 2, 3, 4, 5, 6, 7])
        gate = Gate(LAYERS)
        configs = [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(4), range(4)),
                   TransferWithCacheKeyConfig(BlocksCacheKey(2, 1), range(1, 3), range(2))]
        task = prompt.cache_manager.transfer_cache_async(src, gate, configs, [1, 5, 6], [0, 3, 7])
        assert isinstance(task, CacheTask)
        for layer in range(LAYERS):
            await asyncio.sleep(0.05)
            if layer < LAYERS:  # nothing of this layer has moved before its gate opened
                assert not any(np.array_equal(a, b) for a, b in
                               zip(layer_rows(src, layer, [1, 5, 6]), layer_rows(whole, layer, [0, 3, 7])))
            gate.events[layer].set()
            await until(lambda layer=layer: all(np.array_equal(a, b) for a, b in zip(
                layer_rows(src, layer, [1, 5, 6]), layer_rows(whole, layer, [0, 3, 7]))))
        assert await task == S.LLM_SUCCESS
        assert await task.get_results() == [S.LLM_SUCCESS, S.LLM_SUCCESS]
        assert gate.calls == [(0, None), (1, None), (2, None), (3, None)]
        assert all(not name.startswith("MainThread") for name in gate.threads)  # never on the event loop
        for src_layer, dst_layer in ((1, 0), (2, 1)):
            assert all(np.array_equal(a, b) for a, b in zip(layer_rows(src, src_layer, [1, 5, 6]),
                                                            layer_rows(part, dst_layer, [0, 3, 7])))
        # The partial destination's layers 2-3, and every block not named, are untouched.
        after = blocks(part, [0, 1, 2, 3, 4, 5, 6, 7])
        for t in (4, 5, 6, 7):
            assert np.array_equal(after[t], before_part[t])
        for t in range(8):
            assert np.array_equal(after[t][[1, 2, 4, 5, 6]], before_part[t][[1, 2, 4, 5, 6]])


async def test_a_contiguous_destination_by_cache_key_by_id_and_index() -> None:
    async with linked_pair() as (prompt, decoder):
        src = prompt.cache_manager.allocate_cache(SLOTS_DESC)
        data = fill_pattern(src, 81)
        dst = decoder.cache_manager.allocate_cache(SLOTS_DESC)
        fill_pattern(dst, 82)
        gate = Gate(LAYERS)
        gate.open_all()
        key = CacheKeyByIdAndIndex(2, dst.cache_id, 1)
        task = prompt.cache_manager.transfer_cache_async(
            src, gate, [TransferWithCacheKeyConfig(key, range(4), range(4), src_batch_index=0)])
        assert await task.synchronize(10_000) == S.LLM_SUCCESS
        slot = SLOTS_DESC.size // 2
        for t in range(2 * LAYERS):
            got = dst.tensors[t].reshape(-1).view(np.uint8)
            assert np.array_equal(got[slot:], data[t][:slot])


async def test_cancel_mid_way_writes_nothing_afterwards_and_the_link_stays_usable() -> None:
    async with linked_pair() as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        fill_pattern(src, 91)
        dst = decoder.cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(2, 0))
        fill_pattern(dst, 92)
        gate = Gate(LAYERS)
        config = TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(4), range(4))
        task = prompt.cache_manager.transfer_cache_async(src, gate, [config], [0, 1], [2, 3])
        gate.events[0].set()
        gate.events[1].set()
        await until(lambda: len(gate.calls) == 3)  # layers 0 and 1 sent, layer 2 waited for
        assert await task.synchronize(50) == S.LLM_TIMEOUT
        assert await task.get_results(0) == [S.LLM_TIMEOUT]
        snapshot = blocks(dst, list(range(8)))
        assert await task.cancel() is True
        assert task.done() and await task.cancel() is False
        gate.open_all()  # the synchronizer's thread returns: nothing may move any more
        await asyncio.sleep(0.2)
        assert all(np.array_equal(a, b) for a, b in zip(snapshot, blocks(dst, list(range(8)))))
        for layer in (0, 1):
            assert all(np.array_equal(a, b) for a, b in zip(layer_rows(src, layer, [0, 1]),
                                                            layer_rows(dst, layer, [2, 3])))
        assert await task.get_results() == [None]
        assert await task == S.LLM_FAILED
        await prompt.cache_manager.push_blocks(BlocksCacheKey(2, 0), src, [4], [5])  # the link still works
        assert all(np.array_equal(a, b) for a, b in zip(blocks(src, [4]), blocks(dst, [5])))


async def test_a_synchronizer_failure_or_a_failed_push_ends_the_job() -> None:
    async with linked_pair() as (prompt, decoder):
        src = prompt.cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        decoder.cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(2, 0))  # the destination
        early = TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(1), range(1))
        late = TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(2, 4), range(2, 4))
        never = TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(3, 4), range(3, 4))
        gate = Gate(LAYERS, fail_at=2)
        gate.open_all()
        task = prompt.cache_manager.transfer_cache_async(src, gate, [early, late], [0], [0])
        assert await task == S.LLM_PARAM_INVALID
        assert await task.get_results() == [S.LLM_SUCCESS, S.LLM_PARAM_INVALID]
        assert [layer for layer, _ in gate.calls] == [0, 1, 2]

        missing = TransferWithCacheKeyConfig(BlocksCacheKey(2, 7), range(1, 2), range(1, 2))  # no such cache
        gate = Gate(LAYERS)
        gate.open_all()
        task = prompt.cache_manager.transfer_cache_async(src, gate, [early, missing, never], [0], [0])
        assert await task == S.LLM_KV_CACHE_NOT_EXIST
        assert await task.get_results() == [S.LLM_SUCCESS, S.LLM_KV_CACHE_NOT_EXIST, None]


async def test_arguments_are_checked_before_any_layer_is_waited_for() -> None:
    async with linked_pair() as (prompt, _):
        cm = prompt.cache_manager
        src = cm.allocate_blocks_cache(BLOCKS_DESC)
        odd = cm.allocate_blocks_cache(CacheDesc(3, (8, 1024), DataType.DT_UINT8, Placement.HOST))
        gate = Gate(LAYERS)
        good = TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(4), range(4))
        with pytest.raises(TypeError):
            cm.transfer_cache_async(src, object(), [good], [0], [0])  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            cm.transfer_cache_async(src, gate, [good, "x"], [0], [0])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            cm.transfer_cache_async(src, gate, [good, TransferConfig(2, [1, 2])], [0], [0])
        bad = [(src, [], [0], [0]), (odd, [good], [0], [0]), (src, [good], [0, 1], [0]),
               (src, [TransferConfig(2, [1, 2, 3], range(2))], [0], [0]),  # 2 addresses per layer
               (src, [TransferConfig(2, [1, 2])], [0], [0]),  # all 4 layers: 8 addresses
               (src, [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(3, 5), range(2))], [0], [0]),
               (src, [good], [0], None)]
        for cache, configs, s, d in bad:
            with pytest.raises(LLMException) as info:
                cm.transfer_cache_async(cache, gate, configs, s, d)
            assert info.value.status_code == S.LLM_PARAM_INVALID
        assert gate.calls == []
        with pytest.raises(LLMException):
            TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(2), range(3))
        with pytest.raises(LLMException):
            TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), None, range(3))
        with pytest.raises(LLMException):
            TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(2), range(2), src_batch_index=1)


def test_blocking_api_with_layers_released_by_another_thread() -> None:
    """``aiodatadist.sync``: the producer thread starts the job and computes "layers" (releasing them with
    delays) while the library sends the earlier ones; ``synchronize`` blocks until the last layer landed."""
    from aiodatadist import LLMConfig, LLMRole, sync
    from aiodatadist.testing import cluster_info, free_port

    port = free_port()
    with sync.LLMDataDist(LLMRole.PROMPT, 11) as prompt, sync.LLMDataDist(LLMRole.DECODER, 12) as decoder:
        server = LLMConfig()
        server.listen_ip_info = f"127.0.0.1:{port}"
        prompt.init(server.generate_options())
        decoder.init(LLMConfig().generate_options())
        assert decoder.link_clusters([cluster_info(11, port)])[0] == S.LLM_SUCCESS
        src = prompt.cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        data = fill_pattern(src, 101)
        dst = decoder.cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(12, 0))
        gate = Gate(LAYERS)
        config = TransferWithCacheKeyConfig(BlocksCacheKey(12, 0), range(4), range(4))
        task = prompt.cache_manager.transfer_cache_async(src, gate, [config], list(range(8)), list(range(8)))
        assert isinstance(task, sync.CacheTask)
        assert task.synchronize(20) == S.LLM_TIMEOUT
        for event in gate.events:
            threading.Timer(0.02, event.set).start()
            event.wait(5)
        assert task.synchronize() == S.LLM_SUCCESS and task.get_results() == [S.LLM_SUCCESS]
        assert all(np.array_equal(t.reshape(-1).view(np.uint8), d) for t, d in zip(dst.tensors, data))
        assert task.cancel() is False


async def test_raw_address_destinations_are_resolved_by_their_owner() -> None:
    """``TransferConfig``: the owner says which registered cache, tensors and slot the raw destination addresses
    are (RESOLVE), and the layers go there: a contiguous cache's slot 1 (slot-offset addresses, layers 1-2 into
    its layers 2-3) and a keyed blocks cache (its tensors' bases).  Addresses in no cache, or not K,V pairs of
    consecutive layers, fail the job before any layer."""
    async with linked_pair() as (prompt, decoder):
        src = prompt.cache_manager.allocate_cache(SLOTS_DESC)
        data = fill_pattern(src, 121)
        dst = decoder.cache_manager.allocate_cache(SLOTS_DESC)
        before = fill_pattern(dst, 122)
        slot = SLOTS_DESC.size // 2
        addrs = [dst.tensor_addrs[t] + slot for t in (4, 5, 6, 7)]  # K, V of layers 2 and 3, slot 1
        gate = Gate(LAYERS)
        gate.open_all()
        task = prompt.cache_manager.transfer_cache_async(src, gate, [TransferConfig(2, addrs, range(1, 3))])
        assert await task == S.LLM_SUCCESS, await task.get_results()
        for t in range(2 * LAYERS):
            got = dst.tensors[t].reshape(-1).view(np.uint8)
            if t in (4, 5, 6, 7):  # source layer t//2 - 1, slot 0 -> destination slot 1
                assert np.array_equal(got[slot:], data[t - 2][:slot]) and np.array_equal(got[:slot], before[t][:slot])
            else:
                assert np.array_equal(got, before[t])

        blocks_src = prompt.cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        fill_pattern(blocks_src, 123)
        keyed = decoder.cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(2, 4))
        task = prompt.cache_manager.transfer_cache_async(
            blocks_src, gate, [TransferConfig(2, list(keyed.tensor_addrs))], [1, 2], [6, 0])
        assert await task == S.LLM_SUCCESS
        assert all(np.array_equal(a, b) for a, b in zip(blocks(blocks_src, [1, 2]), blocks(keyed, [6, 0])))

        unkeyed = decoder.cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        nowhere = [1 << 40, (1 << 40) + 64]
        crossed = [dst.tensor_addrs[1], dst.tensor_addrs[0]]  # V then K: not a layer's K,V pair
        for config, code in ((TransferConfig(2, nowhere, range(1)), S.LLM_KV_CACHE_NOT_EXIST),
                             (TransferConfig(2, crossed, range(1)), S.LLM_PARAM_INVALID),
                             (TransferConfig(2, list(unkeyed.tensor_addrs)), S.LLM_PARAM_INVALID)):
            gate = Gate(LAYERS)
            gate.open_all()
            cache, s, d = (blocks_src, [0], [0]) if len(config.dst_addrs) == 8 else (src, None, None)
            task = prompt.cache_manager.transfer_cache_async(cache, gate, [config], s, d)
            assert await task == code
            assert gate.calls == []  # resolved before any layer was waited for
