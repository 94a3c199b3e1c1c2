"""The pytest plugin (``aiodatadist.testing.plugin``, entry point ``pytest11``) in real pytest runs: inner test
suites run by ``pytester`` in a pytest subprocess each, with pytest-asyncio in auto mode.

* the fixtures work in function, module and session loop scopes (and a session-scoped prompt started on the
  session loop serves function-scoped tests on their own loops);
* ``leak_check`` passes clean tests and fails (at teardown) a test that leaves a link, a child process or a
  peer process behind, and cleans up after it so that the next test passes;
* ``leak_check`` names each leaked descriptor (number, kind, target, a socket's addresses, its holder), and
  lets known leaks pass (the ``aiodatadist_leaks`` marker, ``leak_check.allow``);
* a test that uses none of the fixtures runs as without the plugin: its import loads neither numpy nor ZeroMQ
  (and ``leak_check`` on the first test that loads them does not take their import-time threads for leaks).
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest

pytest_plugins = ["pytester"]

# Inner runs without hypothesis's plugin (its import takes most of a second) nor the cache
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")

INI = """
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
"""

CONFTEST = '''
import asyncio

import numpy as np
import pytest_asyncio

from aiodatadist import CacheDesc, Placement
from aiodatadist.testing import PromptServer, block_rows, tensor_bytes


async def pull_and_check(server, decoder, src, dst):
    """Pull blocks ``src`` of the server's cache into ``dst`` of a new local cache: byte for byte."""
    desc = server.caches["kv"].desc
    cache = decoder.cache_manager.allocate_blocks_cache(
        CacheDesc(desc.num_tensors, tuple(desc.shape), desc.data_type, Placement.HOST))
    await decoder.cache_manager.pull_blocks(server.caches["kv"].key, cache, src, dst)
    for have, want in zip(block_rows(tensor_bytes(cache), desc.shape[0], dst), server.expected("kv", src)):
        assert np.array_equal(have, want)
    decoder.cache_manager.deallocate_blocks_cache(cache)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def shared_server():
    """A prompt started on the session's loop, used by tests on other loops."""
    async with PromptServer.start() as server:
        yield server
'''

SCOPED_TESTS = '''
import asyncio

import pytest
from conftest import pull_and_check

{mark}
LOOPS = []


async def test_prompt_server_and_linked_decoder(leak_check, prompt_server, linked_decoder):
    LOOPS.append(asyncio.get_running_loop())
    await pull_and_check(prompt_server, linked_decoder, [3, 1, 15], [0, 2, 9])


async def test_faults_on_this_loop(prompt_server, fault_injector, linked_decoder):
    LOOPS.append(asyncio.get_running_loop())
    fault_injector.stall_control()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await pull_and_check(prompt_server, linked_decoder, [4], [4])
    fault_injector.pass_control()
    await pull_and_check(prompt_server, linked_decoder, [5], [6])


async def test_a_session_prompt_and_an_instance_of_this_loop(leak_check, shared_server, datadist_factory):
    LOOPS.append(asyncio.get_running_loop())
    decoder = await datadist_factory()
    code, _ = await decoder.link_clusters([shared_server.cluster_info()], timeout=5000)
    assert code == 0
    await pull_and_check(shared_server, decoder, [7, 8], [8, 7])
    assert await shared_server.peer.call("ping") == "pong"


async def test_the_loops():
    assert len(LOOPS) == 3
    assert len(set(map(id, LOOPS))) == {distinct}
'''


def _scoped(mark: str, distinct: int) -> str:
    return SCOPED_TESTS.format(mark=mark, distinct=distinct)


def test_fixtures_work_in_function_module_and_session_loop_scopes(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_function_loops=_scoped("", 3),
        test_module_loop=_scoped('pytestmark = pytest.mark.asyncio(loop_scope="module")', 1),
        test_session_loop=_scoped('pytestmark = pytest.mark.asyncio(loop_scope="session")', 1),
    )
    result = pytester.runpytest_subprocess(*QUIET, "-q")
    result.assert_outcomes(passed=12)


LEAKY_TESTS = '''
import subprocess
import sys

import pytest

from aiodatadist import LLMConfig, LLMDataDist, LLMRole
from aiodatadist.testing import PeerProcess
from conftest import pull_and_check

KEEP = []


async def test_clean(leak_check, shared_server, linked_decoder, prompt_server):
    await pull_and_check(prompt_server, linked_decoder, [0], [1])


async def test_leaks_a_link(leak_check, shared_server):
    leak_check.settle_s = 0.5
    dd = LLMDataDist(LLMRole.DECODER, 4242)
    await dd.init(LLMConfig().generate_options())
    code, _ = await dd.link_clusters([shared_server.cluster_info()], timeout=5000)
    assert code == 0
    KEEP.append(dd)


async def test_leaks_a_child_process(leak_check):
    leak_check.settle_s = 0.5
    KEEP.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))


async def test_leaks_a_peer_process(leak_check):
    leak_check.settle_s = 0.5
    peer = await PeerProcess.start()
    await peer.init(4343)
    KEEP.append(peer)


def test_clean_sync_test(leak_check):
    pass


async def test_clean_listed_last(prompt_server, linked_decoder, leak_check):
    await pull_and_check(prompt_server, linked_decoder, [4], [5])


@pytest.mark.usefixtures("leak_check")
async def test_clean_after_the_leaks(shared_server, datadist_factory):
    decoder = await datadist_factory()
    assert (await decoder.link_clusters([shared_server.cluster_info()], timeout=5000))[0] == 0
    await pull_and_check(shared_server, decoder, [2], [3])
'''


def test_leak_check_catches_a_leaked_link_and_leaked_processes(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_leaks=LEAKY_TESTS)
    result = pytester.runpytest_subprocess(*QUIET, "-rE", "--setup-show")
    result.assert_outcomes(passed=7, errors=3)
    out = result.stdout.str()
    # leak_check, requested last, is set up before the test's other function-scoped fixtures
    setup = out.split("test_leaks.py::test_clean_sync_test", 1)[1].split("test_leaks.py::test_clean_listed_last")[0]
    assert setup.index("SETUP    F leak_check") < setup.index("SETUP    F prompt_server_factory")
    assert "ERROR at teardown of test_leaks_a_link" in out
    assert "LLMDataDist(role=LLMRole.DECODER, cluster_id=4242, initialized) was not finalized, linked to" in out
    assert "ERROR at teardown of test_leaks_a_child_process" in out
    assert "time.sleep(60)" in out
    assert "ERROR at teardown of test_leaks_a_peer_process" in out
    assert "aiodatadist.testing._agent" in out
    for clean in ("test_clean ", "test_clean_sync_test", "test_clean_listed_last", "test_clean_after_the_leaks"):
        assert f"ERROR at teardown of {clean}" not in out


def test_a_test_without_the_fixtures_runs_as_without_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI)
    pytester.makepyfile(test_plain=textwrap.dedent('''
        import sys

        HEAVY = ("numpy", "zmq", "aiodatadist.datadist", "aiodatadist.testing.prompt_server")


        def test_sync():
            assert "aiodatadist.testing.plugin" in sys.modules  # the plugin is loaded ...
            assert not [m for m in HEAVY if m in sys.modules]  # ... and cheap


        async def test_async():
            assert not [m for m in HEAVY if m in sys.modules]
    '''))
    # then the first use of the library in the process, under leak_check: what numpy starts on import (its BLAS
    # threads) is not the test's
    pytester.makepyfile(test_z_first_use=textwrap.dedent('''
        async def test_first_use(leak_check, prompt_server, linked_decoder):
            assert linked_decoder.links()
    '''))
    result = pytester.runpytest_subprocess(*QUIET, "-q")
    result.assert_outcomes(passed=3)
    listed = pytester.runpytest_subprocess(*QUIET, "--fixtures", "-q")
    for name in ("prompt_server", "prompt_server_factory", "datadist_factory", "linked_decoder", "fault_injector",
                 "leak_check"):
        assert name in listed.stdout.str()
    disabled = pytester.runpytest_subprocess(*QUIET, "-p", "no:aiodatadist", "--fixtures")
    assert "prompt_server_factory" not in disabled.stdout.str()


DESCRIPTOR_TESTS = '''
import json
import os
import socket
from pathlib import Path

import pytest

KEEP = []


def record(name, **fds):
    Path(f"{name}.json").write_text(json.dumps(fds))


def test_leaks_a_pipe(leak_check):
    leak_check.settle_s = 0.2
    r, w = os.pipe()
    KEEP.append((r, w))
    record("pipe", r=r, w=w)


def test_leaks_a_connection(leak_check):
    leak_check.settle_s = 0.2
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    KEEP.extend([server, client])
    record("connection", server=server.fileno(), client=client.fileno(), port=server.getsockname()[1],
           local=client.getsockname()[1])


@pytest.mark.aiodatadist_leaks(allow="pipe", count=2)
def test_an_allowed_pipe(leak_check):
    KEEP.append(os.pipe())


@pytest.mark.aiodatadist_leaks("pipe", count=1)
def test_one_pipe_end_allowed(leak_check):
    leak_check.settle_s = 0.2
    r, w = os.pipe()
    KEEP.append((r, w))
    record("one", r=r, w=w)


@pytest.mark.aiodatadist_leaks(allow=[lambda leak: leak.kind == "socket" and "unix" in leak.detail, "eventfd"])
async def test_allowed_by_a_predicate_and_by_a_call(leak_check):
    KEEP.extend(socket.socketpair())
    leak_check.allow("pipe")
    KEEP.append(os.pipe())


@pytest.mark.aiodatadist_leaks(allow="pipe", colour="red")
def test_a_wrong_marker(leak_check):
    pass
'''


def test_leak_reports_name_each_descriptor_and_known_leaks_are_allowed(pytester: pytest.Pytester) -> None:
    pytester.makeini(INI + "addopts = --strict-markers\n")
    pytester.makepyfile(test_descriptors=DESCRIPTOR_TESTS)
    result = pytester.runpytest_subprocess(*QUIET, "-rE")
    result.assert_outcomes(passed=5, errors=4)
    out = result.stdout.str()
    reports = {name: out.split(f"ERROR at teardown of {name}", 1)[1].split("\n_", 1)[0]
               for name in ("test_leaks_a_pipe", "test_leaks_a_connection", "test_one_pipe_end_allowed")}

    pipe = json.loads((pytester.path / "pipe.json").read_text())
    assert re.search(rf"2 file descriptors:\n\s+fd {pipe['r']}: pipe, read end \(pipe:\[\d+\]\), no Python "
                     rf"object holds it\n\s+fd {pipe['w']}: pipe, write end \(pipe:\[\d+\]\)",
                     reports["test_leaks_a_pipe"])
    assert "a known leak: leak_check.allow(kind or predicate, count=None), or " \
           "@pytest.mark.aiodatadist_leaks(allow=..., count=...)" in reports["test_leaks_a_pipe"]

    conn = json.loads((pytester.path / "connection.json").read_text())
    report = reports["test_leaks_a_connection"]
    assert re.search(rf"fd {conn['server']}: socket, tcp listening on 127\.0\.0\.1:{conn['port']} "
                     rf"\(socket:\[\d+\]\), held by socket\.socket", report)
    assert re.search(rf"fd {conn['client']}: socket, tcp 127\.0\.0\.1:{conn['local']} -> "
                     rf"127\.0\.0\.1:{conn['port']} \(socket:\[\d+\]\), held by socket\.socket", report)

    one = json.loads((pytester.path / "one.json").read_text())  # the first end allowed, the second reported
    assert f"1 file descriptor:\n    fd {one['w']}: pipe, write end" in reports["test_one_pipe_end_allowed"]
    assert f"fd {one['r']}:" not in reports["test_one_pipe_end_allowed"]

    for allowed in ("test_an_allowed_pipe", "test_allowed_by_a_predicate_and_by_a_call"):
        assert f"ERROR at teardown of {allowed}" not in out
    assert "ERROR at setup of test_a_wrong_marker" in out
    assert "@pytest.mark.aiodatadist_leaks takes (allow, count=None)" in out
