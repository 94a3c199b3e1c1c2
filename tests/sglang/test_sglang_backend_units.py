"""The SGLang backend without SGLang: its entry point, its plugin's seams (on a stand-in SGLang), its pure parts
(options, buffer groups, messages) and its data path (two instances in this process pushing pages and aux rows
into registered numpy memory, as the prefill and decode ranks do).

The backend with the real engine: ``test_sglang_pd.py`` (``bash scripts/sglang_tests.sh``)."""

from __future__ import annotations

import enum
import subprocess
import sys
import tomllib
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from aiodatadist import sync
from aiodatadist.integrations.sglang import plugin, wire
from aiodatadist.integrations.sglang.endpoint import Endpoint
from aiodatadist.integrations.sglang.layout import AUX_MODEL_BASE, aux_pushes, group_buffers, matching_prefix
from aiodatadist.integrations.sglang.options import BackendOptions

ROOT = Path(__file__).resolve().parents[2]


def test_the_plugin_is_declared_as_an_sglang_entry_point() -> None:
    """Installing aiodatadist declares the plugin SGLang runs in each of its processes."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["sglang.srt.plugins"]["aiodatadist"]
    module, _, name = target.partition(":")
    assert (module, name) == ("aiodatadist.integrations.sglang.plugin", "register")
    assert getattr(sys.modules[module], name) is plugin.register
    assert "sglang" in project["project"]["optional-dependencies"]


def test_importing_the_backend_never_imports_sglang() -> None:
    code = ("import sys, aiodatadist, aiodatadist.integrations.sglang, aiodatadist.integrations.sglang.endpoint, "
            "aiodatadist.integrations.sglang.wire\n"
            "assert not [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')], 'sglang imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_register_without_sglang_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("sglang", "sglang.srt.arg_groups.choices", "sglang.srt.disaggregation.utils"):
        monkeypatch.setitem(sys.modules, name, None)  # as if SGLang were not installed
    with pytest.raises(RuntimeError, match="needs SGLang's disaggregation modules"):
        plugin.register()


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    """The three seams the plugin uses, as SGLang 0.5.23 has them, in stand-in modules."""

    class TransferBackend(enum.Enum):
        MOONCAKE = "mooncake"
        NIXL = "nixl"

    class KVClassType(enum.Enum):
        KVARGS = "kvargs"
        MANAGER = "manager"
        SENDER = "sender"

    calls: list[tuple[object, object]] = []

    def get_kv_class(backend: TransferBackend, class_type: KVClassType) -> object:
        calls.append((backend, class_type))
        if backend not in TransferBackend.__members__.values():
            raise ValueError(f"Unsupported transfer backend: {backend}")
        return f"{backend.value}-{class_type.value}"

    choices = types.ModuleType("sglang.srt.arg_groups.choices")
    choices.DISAGG_TRANSFER_BACKEND_CHOICES = ["mooncake", "nixl"]  # type: ignore[attr-defined]
    utils = types.ModuleType("sglang.srt.disaggregation.utils")
    utils.TransferBackend, utils.KVClassType, utils.get_kv_class = (  # type: ignore[attr-defined]
        TransferBackend, KVClassType, get_kv_class)
    prefill = types.ModuleType("sglang.srt.disaggregation.prefill")
    prefill.get_kv_class = get_kv_class  # type: ignore[attr-defined]  # bound by name before the plugin ran
    for module in (choices, utils, prefill):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    yield types.SimpleNamespace(choices=choices, utils=utils, prefill=prefill, calls=calls)


def test_register_adds_the_choice_the_enum_member_and_the_classes(fake_sglang: types.SimpleNamespace) -> None:
    plugin.register()
    plugin.register()  # idempotent
    utils = fake_sglang.utils
    assert fake_sglang.choices.DISAGG_TRANSFER_BACKEND_CHOICES == ["mooncake", "nixl", "aiodatadist"]
    member = utils.TransferBackend("aiodatadist")
    assert member is utils.TransferBackend.AIODATADIST and member.name == "AIODATADIST"
    assert [m.value for m in utils.TransferBackend] == ["mooncake", "nixl", "aiodatadist"]
    assert fake_sglang.prefill.get_kv_class is utils.get_kv_class  # modules that imported it see the hook
    assert utils.get_kv_class(utils.TransferBackend.NIXL, utils.KVClassType.SENDER) == "nixl-sender"
    # KVArgs is SGLang's own for every backend
    utils.get_kv_class(member, utils.KVClassType.KVARGS)
    assert fake_sglang.calls[-1] == (member, utils.KVClassType.KVARGS)


def test_options_come_from_the_environment() -> None:
    assert BackendOptions.from_environ({}) == BackendOptions()
    options = BackendOptions.from_environ({"AIODATADIST_SGLANG_TRANSPORT": "tcp",
                                           "AIODATADIST_SGLANG_PUSH_TIMEOUT_MS": "500",
                                           "AIODATADIST_SGLANG_AUTH_KEY": "k", "AIODATADIST_SGLANG_LISTEN_HOST": ""})
    assert (options.transport, options.push_timeout_ms, options.auth_key, options.listen_host) == ("tcp", 500, "k", "")
    with pytest.raises(ValueError, match="AIODATADIST_SGLANG_TRANSPORT"):
        BackendOptions.from_environ({"AIODATADIST_SGLANG_TRANSPORT": "rdma"})
    with pytest.raises(ValueError, match="milliseconds"):
        BackendOptions.from_environ({"AIODATADIST_SGLANG_LINK_TIMEOUT_MS": "0"})
    with pytest.raises(ValueError, match="unknown variables"):
        BackendOptions.from_environ({"AIODATADIST_SGLANG_TRANSPROT": "tcp"})
    assert BackendOptions().share_kv == "on"
    assert BackendOptions.from_environ({"AIODATADIST_SGLANG_SHARE_KV": "off"}).share_kv == "off"
    with pytest.raises(ValueError, match="AIODATADIST_SGLANG_SHARE_KV"):
        BackendOptions.from_environ({"AIODATADIST_SGLANG_SHARE_KV": "no"})


def test_a_decode_endpoint_shares_its_kv_in_place_and_pushes_land_exactly() -> None:
    """The decode side's KV buffers (its own memory) are shared in place before registering: their content stays,
    and pages pushed into them land byte-exact, those on the buffers' partial edge pages included."""
    layers, pages, page_bytes = 3, 64, 8192
    rng = np.random.default_rng(1)
    p_kv = [rng.integers(1, 256, (pages, page_bytes), dtype=np.uint8) for _ in range(2 * layers)]
    # D's buffers: one allocation each in SGLang; here slices of one block (64 bytes past a page, a page apart),
    # so that they are near each other whatever this process allocated before
    pitch = pages * page_bytes + 4096
    pool = rng.integers(1, 256, 2 * layers * pitch + 8192, dtype=np.uint8)
    first = -pool.ctypes.data % 4096 + 64
    d_kv = [pool[first + i * pitch: first + i * pitch + pages * page_bytes].reshape(pages, page_bytes)
            for i in range(2 * layers)]
    before = [a.copy() for a in d_kv]
    kv_groups = [group_buffers([a.ctypes.data for a in kv], [a.nbytes for a in kv], [page_bytes] * len(kv))
                 for kv in (p_kv, d_kv)]
    decode = Endpoint(BackendOptions(), "127.0.0.1")
    prefill = Endpoint(BackendOptions(), None)
    try:
        assert decode.share_in_place(kv_groups[1])
        assert all(np.array_equal(a, b) for a, b in zip(before, d_kv))
        decode.register(kv_groups[1])
        prefill.register(kv_groups[0])
        host, port = decode.address
        src, dst = np.array([5, 1, 2, 63, 0]), np.array([0, 6, 7, 62, 63])

        async def transfer() -> None:
            await prefill.link(decode.cluster_id, host, port)
            await prefill.push_pages(decode.cluster_id, 0, src, dst)

        sync.submit(transfer).result(30)
        for mine, theirs, old in zip(p_kv, d_kv, before, strict=True):
            assert np.array_equal(theirs[dst], mine[src])
            untouched = np.setdiff1d(np.arange(pages), dst)
            assert np.array_equal(theirs[untouched], old[untouched])
    finally:
        prefill.close()
        decode.close()


def test_buffers_group_by_item_size_and_aux_pushes_cover_the_shared_prefix() -> None:
    groups = group_buffers([0x1000, 0x2000, 0x3000, 0x4000], [640, 640, 256, 960], [64, 64, 128, 64], 7)
    assert [(g.model_id, g.indices, g.item_len, g.blocks) for g in groups] == [(7, (0, 1, 3), 64, 10),
                                                                            (8, (2,), 128, 2)]
    with pytest.raises(ValueError, match="differ in length"):
        group_buffers([1], [64, 64], [64])
    with pytest.raises(ValueError, match="whole items"):
        group_buffers([1], [32], [64])
    assert matching_prefix([64, 64, 128], [64, 64, 128, 8]) == 3
    mine = group_buffers([16, 32, 48, 64], [640] * 4, [64, 32, 64, 128], AUX_MODEL_BASE)
    # The peer lacks the last buffer, and groups its buffers in the same order of first appearance.
    pushes = aux_pushes(mine, [64, 32, 64, 128], [64, 32, 64])
    assert [(p.group.model_id, p.dst_model_id, p.tensors) for p in pushes] == [
        (AUX_MODEL_BASE, AUX_MODEL_BASE, 2), (AUX_MODEL_BASE + 1, AUX_MODEL_BASE + 1, 1)]


def test_messages_round_trip_and_malformed_ones_are_refused() -> None:
    reg = wire.PeerRegistration("17", "10.0.0.2", 5555, 17, "10.0.0.2", 6000, 2, 1, 16, (4096,) * 8, (64, 128))
    assert wire.parse(reg.encode()) == reg
    room = wire.RoomTarget(2**63 + 5, "17", "10.0.0.2", 5555, np.array([3, 1, 2], np.int32), 9, 1, 32, False)
    parsed = wire.parse(room.encode())
    assert isinstance(parsed, wire.RoomTarget)
    assert parsed.dst_kv_indices.tolist() == [3, 1, 2] and parsed.room == room.room and parsed.decode_prefix_len == 32
    frames = room.encode()
    for bad in ([wire.GUARD, b"M", frames[2], b"\x00" * 3], [wire.GUARD, b"M", b"\xc1", frames[3]],
                [wire.GUARD, b"X", frames[2]], [b"other"], [wire.GUARD, b"M", frames[2],
                                                            np.array([-1], np.int32).tobytes()]):
        with pytest.raises(ValueError):
            wire.parse(bad)
    assert wire.decode_done(wire.encode_done(2**64 - 1, 3)) == (2**64 - 1, 3, b"")
    assert wire.decode_done(wire.encode_done(7, 0, b"\n row \x00")) == (7, 0, b"\n row \x00")  # aux row inline
    assert wire.decode_done(b"something else") is None
    assert wire.decode_done(b"kv-done 1 x\n") is None


def test_a_prefill_endpoint_pushes_pages_and_aux_rows_into_a_decode_endpoint() -> None:
    """The data path of the backend: the decode instance listens with its registered buffers, the prefill links
    and pushes chunk pages (every layer at once) and one aux row, then notifies."""
    layers, pages, page_bytes = 3, 8, 256
    rng = np.random.default_rng(0)
    p_kv = [rng.integers(0, 255, (pages, page_bytes), dtype=np.uint8) for _ in range(2 * layers)]
    d_kv = [np.zeros((pages, page_bytes), np.uint8) for _ in range(2 * layers)]
    p_aux = [rng.integers(0, 255, (4, 64), dtype=np.uint8), rng.integers(0, 255, (4, 128), dtype=np.uint8)]
    d_aux = [np.zeros((6, 64), np.uint8), np.zeros((6, 128), np.uint8)]

    def groups(kv: list[np.ndarray], aux: list[np.ndarray]) -> tuple[list, list]:  # type: ignore[type-arg]
        return (group_buffers([a.ctypes.data for a in kv], [a.nbytes for a in kv], [page_bytes] * len(kv)),
                group_buffers([a.ctypes.data for a in aux], [a.nbytes for a in aux], [a.shape[1] for a in aux],
                              AUX_MODEL_BASE))

    options = BackendOptions(push_timeout_ms=10000)
    decode = Endpoint(options, "127.0.0.1")
    prefill = Endpoint(options, None)
    try:
        d_kv_groups, d_aux_groups = groups(d_kv, d_aux)
        p_kv_groups, p_aux_groups = groups(p_kv, p_aux)
        decode.register(d_kv_groups + d_aux_groups)
        prefill.register(p_kv_groups + p_aux_groups)
        host, port = decode.address
        [aux1, aux2] = aux_pushes(p_aux_groups, [64, 128], [64, 128])

        async def transfer() -> bytes:
            await prefill.link(decode.cluster_id, host, port)
            await prefill.push_aux(decode.cluster_id, aux1, 3, 5)
            await prefill.push_aux(decode.cluster_id, aux2, 3, 5)
            # the last push carries the "done": it arrives once the pages are in place
            await prefill.push_pages(decode.cluster_id, 0, np.array([5, 1, 2]), np.array([0, 6, 7]),
                                     notify=wire.encode_done(42, 0))
            note = await decode.dd.aio.get_notification(5)
            assert note is not None
            return note.message

        assert wire.decode_done(sync.submit(transfer).result(30)) == (42, 0, b"")
        for src, dst in zip(p_kv, d_kv, strict=True):
            assert (dst[[0, 6, 7]] == src[[5, 1, 2]]).all()
            assert not dst[1:6].any()  # nothing else written
        for src, dst in zip(p_aux, d_aux, strict=True):
            assert (dst[5] == src[3]).all() and not dst[:5].any()
    finally:
        prefill.close()
        decode.close()
