"""The owner's ``CacheKey`` bookkeeping across pulls by key, as a state machine against a model.

A pull by ``CacheKey`` takes its key off at ``BEGIN`` (it stops resolving at once, so it is gone by the time the
pull returns), and its ``END`` settles it: a successful pull releases the key, a failed one binds it again unless
the key was removed, bound anew or its (registered) cache released meanwhile.  Random sequences of binding,
pulling, ending, removing and releasing, on caches aiodatadist allocated (their keys keep their memory alive
after a release) and caches of registered memory (a release drops their keys), must keep the registry equal to
a plain model: what each key resolves to, which keys a pull holds, and which caches' memory is gone.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from aiodatadist import CacheDesc, CacheKey, DataType, LLMException, LLMStatusCode, Placement
from aiodatadist._checks import U64_MAX
from aiodatadist.memory.segment import cache_segment
from aiodatadist.registry.caches import CacheEntry, CacheRegistry, IndexKey

KEYS = [("req", 1, 0), ("req", 2, 0), ("prefix", 7, 3)]
DESC = CacheDesc(1, (2, 64), DataType.DT_UINT8, Placement.HOST)


def _cache_key(index: IndexKey) -> CacheKey:
    kind, a, b = index
    return CacheKey(9, a, b) if kind == "req" else CacheKey(9, U64_MAX, b, a)


class KeyLifecycle(RuleBasedStateMachine):
    caches = Bundle("caches")

    @initialize()
    def start(self) -> None:
        self.registry = CacheRegistry()
        self.buffers: list[np.ndarray] = []  # registered memory, alive for the run
        self.bound: dict[IndexKey, CacheEntry] = {}  # the model: what each key resolves to
        self.taken: dict[IndexKey, CacheEntry] = {}  # keys a running pull holds
        self.pulls: list[tuple[IndexKey, CacheEntry]] = []  # running pulls by key (each holds a lease)
        self.released: set[int] = set()
        self.entries: list[CacheEntry] = []

    def teardown(self) -> None:
        if hasattr(self, "registry"):
            self.registry.close_all()

    @rule(target=caches, index=st.sampled_from(KEYS), owned=st.booleans())
    def bind(self, index: IndexKey, owned: bool) -> CacheEntry | None:
        try:
            keys = self.registry.check_keys([_cache_key(index)], 2)
        except LLMException as exc:
            assert exc.status_code == LLMStatusCode.LLM_PARAM_INVALID
            assert index in self.bound
            return None
        assert index not in self.bound, "a bound key was bound a second time"
        segment = cache_segment(DESC.size, "aiodatadist-test") if owned else None
        if segment is None:
            self.buffers.append(np.zeros(DESC.size, dtype=np.uint8))
        addr = segment.address if segment is not None else int(self.buffers[-1].ctypes.data)
        entry = self.registry.add(DESC, [addr], is_blocks=False, remote_accessible=False, segment=segment, keys=keys)
        self.bound[index] = entry
        self.entries.append(entry)
        return entry

    @rule(index=st.sampled_from(KEYS))
    def begin_pull(self, index: IndexKey) -> None:
        """The owner's BEGIN of a pull by this key (``transfer/owner.py``)."""
        if self.registry.is_taken(index):
            assert index in self.taken
            return  # LLM_REPEAT_REQUEST
        try:
            entry, _ = self.registry.resolve_wire(*index)
        except LLMException as exc:
            assert exc.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
            assert index not in self.bound
            return
        assert entry is self.bound[index]
        self.registry.acquire(entry)  # the pull's lease
        self.registry.take_key(index)
        self.taken[index] = self.bound.pop(index)
        self.pulls.append((index, entry))

    @rule(data=st.data(), ok=st.booleans())
    @precondition(lambda self: bool(self.pulls))
    def end_pull(self, data: st.DataObject, ok: bool) -> None:
        index, entry = self.pulls.pop(data.draw(st.integers(0, len(self.pulls) - 1)))
        self.registry.settle_key(index, entry, ok)
        self.registry.release_lease(entry)
        if self.taken.get(index) is entry:  # (else removed or its cache released while the pull ran)
            del self.taken[index]
            if not ok and index not in self.bound:
                self.bound[index] = entry

    @rule(index=st.sampled_from(KEYS))
    def remove_key(self, index: IndexKey) -> None:
        self.registry.remove_key(_cache_key(index))
        self.bound.pop(index, None)
        self.taken.pop(index, None)

    @rule(entry=caches)
    def release(self, entry: CacheEntry | None) -> None:
        if entry is None or entry.cache_id in self.released:
            return
        self.registry.release(entry)
        self.released.add(entry.cache_id)
        if not entry.owned:  # a registered cache's keys go with it
            for table in (self.bound, self.taken):
                for index in [i for i, e in table.items() if e is entry]:
                    del table[index]

    @invariant()
    def keys_resolve_as_the_model_says(self) -> None:
        if not hasattr(self, "registry"):
            return
        for index in KEYS:
            assert self.registry.is_taken(index) == (index in self.taken)
            if index in self.bound:
                assert self.registry.resolve_wire(*index)[0] is self.bound[index]
            else:
                with pytest.raises(LLMException) as info:
                    self.registry.resolve_wire(*index)
                assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST

    @invariant()
    def memory_goes_once_nothing_holds_it(self) -> None:
        if not hasattr(self, "registry"):
            return
        for entry in self.entries:
            held = any(e is entry for e in [*self.bound.values(), *self.taken.values(), *(e for _, e in self.pulls)])
            expected_freed = entry.cache_id in self.released and not held
            if entry.owned:
                assert entry.freed == expected_freed, (entry.cache_id, entry.freed, held)
            elif entry.cache_id in self.released:
                assert not entry.keys, "a released registered cache kept keys"


KeyLifecycle.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestKeyLifecycle = KeyLifecycle.TestCase
