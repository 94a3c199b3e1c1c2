"""The SGLang backend without SGLang: its entry point, its plugin's seams (on a stand-in SGLang), its pure parts
(options, buffer groups, messages) and its data path (two instances in this process pushing pages and aux rows
into registered numpy memory, as the prefill and decode ranks do).

The backend with the real engine: ``test_sglang_pd.py`` (``bash tools/sglang_tests.sh``)."""

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
from aiodatadist.integrations.sglang.layout import group_buffers, matching_prefix
from aiodatadist.integrations.sglang.options import BackendOptions
from aiodatadist.notifications import MAX_NOTIFICATION_BYTES

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
                                           "AIODATADIST_SGLANG_TRANSFER_TIMEOUT_MS": "500",
                                           "AIODATADIST_SGLANG_AUTH_KEY": "k", "AIODATADIST_SGLANG_LISTEN_HOST": ""})
    assert (options.transport, options.transfer_timeout_ms, options.auth_key, options.listen_host) == ("tcp", 500, "k", "")
    with pytest.raises(ValueError, match="AIODATADIST_SGLANG_TRANSPORT"):
        BackendOptions.from_environ({"AIODATADIST_SGLANG_TRANSPORT": "rdma"})
    with pytest.raises(ValueError, match="milliseconds"):
        BackendOptions.from_environ({"AIODATADIST_SGLANG_LINK_TIMEOUT_MS": "0"})
    with pytest.raises(ValueError, match="unknown variables"):
        BackendOptions.from_environ({"AIODATADIST_SGLANG_TRANSPROT": "tcp"})


def test_buffers_group_by_item_size() -> None:
    groups = group_buffers([0x1000, 0x2000, 0x3000, 0x4000], [640, 640, 256, 960], [64, 64, 128, 64], 7)
    assert [(g.model_id, g.indices, g.item_len, g.blocks) for g in groups] == [(7, (0, 1, 3), 64, 10),
                                                                            (8, (2,), 128, 2)]
    with pytest.raises(ValueError, match="differ in length"):
        group_buffers([1], [64, 64], [64])
    with pytest.raises(ValueError, match="whole items"):
        group_buffers([1], [32], [64])
    assert matching_prefix([64, 64, 128], [64, 64, 128, 8]) == 3
    assert matching_prefix([64, 32], [64, 64]) == 1


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


def test_notifications_round_trip_and_fit() -> None:
    src = np.arange(wire.PAGES_PER_NOTE, dtype=np.int32)
    message = wire.encode_ready(2**64 - 1, 3, 32, src, True, 700)
    assert len(message) <= MAX_NOTIFICATION_BYTES
    ready = wire.parse_note(message)
    assert isinstance(ready, wire.Ready)
    assert (ready.room, ready.prefill_rank, ready.start, ready.last, ready.aux_len) == (2**64 - 1, 3, 32, True, 700)
    assert ready.src.tolist() == src.tolist()
    assert wire.parse_note(wire.encode_aux(5, 4000, b"\n\x00 row")) == wire.AuxPiece(5, 4000, b"\n\x00 row")
    assert len(wire.encode_aux(5, 2**40, bytes(wire.AUX_PER_NOTE))) <= MAX_NOTIFICATION_BYTES
    assert wire.parse_note(wire.encode_pulled(9)) == wire.Pulled(9)
    assert wire.parse_note(wire.encode_failed(9, "no link")) == wire.Failed(9, "no link")
    for bad in (b"something else", b"kv-ready 1 2 3 4\n", b"kv-ready 1 2 3 2 0\n", b"kv-ready 1 2 3 1 0\n\x00",
                b"kv-pulled x", b"kv-failed 1"):
        assert wire.parse_note(bad) is None, bad


def test_a_decode_endpoint_pulls_pages_from_a_prefill_endpoint() -> None:
    """The data path of the backend: the decode instance listens with its registered pages, the prefill links to
    it and says which pages are ready; the decode pulls them (every layer at once), the pull's notification
    reaches the prefill."""
    layers, pages, page_bytes = 3, 8, 256
    rng = np.random.default_rng(0)
    p_kv = [rng.integers(0, 255, (pages, page_bytes), dtype=np.uint8) for _ in range(2 * layers)]
    d_kv = [np.zeros((pages, page_bytes), np.uint8) for _ in range(2 * layers)]

    def groups(kv: list[np.ndarray]) -> list:  # type: ignore[type-arg]
        return group_buffers([a.ctypes.data for a in kv], [a.nbytes for a in kv], [page_bytes] * len(kv))

    options = BackendOptions(transfer_timeout_ms=10000)
    decode = Endpoint(options, "127.0.0.1")
    prefill = Endpoint(options, None)
    try:
        decode.register(groups(d_kv))
        prefill.register(groups(p_kv))
        host, port = decode.address

        async def transfer() -> bytes:
            await prefill.link(decode.cluster_id, host, port)
            await prefill.notify(decode.cluster_id, wire.encode_ready(42, 0, 0, np.array([5, 1, 2]), True))
            note = await decode.dd.aio.get_notification(5)
            assert note is not None and note.cluster_id == prefill.cluster_id
            ready = wire.parse_note(note.message)
            assert isinstance(ready, wire.Ready)
            await decode.pull_pages(note.cluster_id, 0, ready.src, np.array([0, 6, 7]),
                                    notify=wire.encode_pulled(ready.room))
            ack = await prefill.dd.aio.get_notification(5)
            assert ack is not None
            return ack.message

        assert wire.parse_note(sync.submit(transfer).result(30)) == wire.Pulled(42)
        for src, dst in zip(p_kv, d_kv, strict=True):
            assert (dst[[0, 6, 7]] == src[[5, 1, 2]]).all()
            assert not dst[1:6].any()  # nothing else written
    finally:
        prefill.close()
        decode.close()
