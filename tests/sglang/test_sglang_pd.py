"""``--disaggregation-transfer-backend aiodatadist`` between real SGLang engines on this machine's CPU.

A prefill server (P) and a decode server (D), each with its scheduler and detokenizer processes, behind SGLang's PD
router; a random 4-layer Llama (``vllm_model.build_model``: no network).  D's greedy tokens must equal a single
engine's (no disaggregation) for page sizes 16 and 1, for a prompt whose prefix P already holds in its radix cache,
and after D restarted; P sends every prompt in several chunks (``--chunked-prefill-size``).  Requests aborted on
D or on P while P is still sending end at once, and the engines go on serving.  The negative control: a P that
zeroes its source pages before each push makes D produce other tokens.

Skipped without SGLang (``bash scripts/sglang_tests.sh`` builds a venv with SGLang and the CPU shim and runs these).
Each server takes 30-60 s to start on 2 cores; the whole file about 10 minutes.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.disaggregation.utils")
pytest.importorskip("sglang_router")

pytest.importorskip("aiodatadist_benchmarks",
                    reason="the benchmarks are not installed (pip install -e ./benchmarks)")
from aiodatadist_benchmarks.bench.sglang_servers import Router, Server, ServerError, ServerSettings, generate
from aiodatadist_benchmarks.bench.sglang_tweaks import site_dir
from aiodatadist_benchmarks.bench.vllm_model import ModelSpec, build_model, random_prompts

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SPEC = ModelSpec(layers=4)
PROMPT_TOKENS = 200
TOKENS = 12
CHUNK = 32  # P's --chunked-prefill-size: a 200-token prompt leaves P in 7 chunks
LONG_PROMPT = 960  # 30 chunks: P is still sending when the abort comes


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sglang")
    build_model(path / "model", SPEC)
    return path


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    plain = random_prompts(4, PROMPT_TOKENS, SPEC.vocab_size, seed=11)
    tail = random_prompts(1, 40, SPEC.vocab_size, seed=12)[0]
    return {"a": plain[0], "b": plain[1], "c": plain[2], "d": plain[3],
            "prefix": plain[0][:160] + tail}  # shares 160 tokens (10 pages of 16) with "a"


def settings(workdir: Path, page_size: int) -> ServerSettings:
    return ServerSettings(str(workdir / "model"), page_size=page_size, log_dir=str(workdir / "logs"),
                          chunked_prefill_size=CHUNK, site_dir=site_dir())


@pytest.fixture(scope="module")
def references(workdir: Path, prompts: dict[str, list[int]]) -> dict[int, dict[str, list[int]]]:
    """Each prompt's tokens from a single engine, per page size."""
    out: dict[int, dict[str, list[int]]] = {}
    for page_size in (16, 1):
        server = Server(f"single-{page_size}", settings(workdir, page_size), "single")
        try:
            server.wait_ready()
            out[page_size] = {name: generate(server.url, prompt, TOKENS)["output_ids"]
                              for name, prompt in prompts.items()}
        finally:
            server.stop()
    return out


class Pair:
    """P, D and the router, started together; ``restart_decode`` replaces D on the same port."""

    def __init__(self, workdir: Path, page_size: int, name: str, p_tweaks: str = "",
                 decode: Server | None = None) -> None:
        self.settings = settings(workdir, page_size)
        self.owned: list[Server | Router] = []
        self.prefill = self._own(Server(f"{name}-P", self.settings, "prefill", "aiodatadist", tweaks=p_tweaks))
        self.decode = decode or self._own(Server(f"{name}-D", self.settings, "decode", "aiodatadist"))
        self.name = name
        self.router: Router | None = None

    def _own(self, process: Server) -> Server:
        self.owned.append(process)
        return process

    def start(self, probe: list[int]) -> Pair:
        self.prefill.wait_ready()
        self.decode.wait_ready()
        self.router = Router(self.prefill, self.decode, self.settings.log_dir)
        self.owned.append(self.router)
        self.router.wait_ready(probe[:20])
        return self

    def tokens(self, prompt: list[int]) -> list[int]:
        assert self.router is not None
        tokens: list[int] = generate(self.router.url, prompt, TOKENS)["output_ids"]
        return tokens

    def restart_decode(self, probe: list[int]) -> None:
        old = self.decode
        old.stop()
        self.owned.remove(old)
        self.decode = self._own(Server(f"{self.name}-D2", self.settings, "decode", "aiodatadist", port=old.port))
        self.decode.wait_ready()
        assert self.router is not None
        self.router.wait_ready(probe[:20])

    def stop(self) -> None:
        for process in reversed(self.owned):
            process.stop()


@pytest.fixture(scope="class")
def pair16(workdir: Path, prompts: dict[str, list[int]], references: object) -> Iterator[Pair]:
    pair = Pair(workdir, 16, "pd16")
    try:
        yield pair.start(prompts["d"])
    finally:
        pair.stop()


def test_sglang_sees_the_backend_once_aiodatadist_is_installed(workdir: Path) -> None:
    """Nothing but the installed package: SGLang's plugin loader finds it, the CLI accepts the name, and
    ``get_kv_class`` gives this package's classes."""
    code = (
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class\n"
        f"args = prepare_server_args(['--model-path', {str(workdir / 'model')!r}, '--device', 'cpu',"
        " '--disaggregation-transfer-backend', 'aiodatadist'])\n"
        "backend = TransferBackend(args.disaggregation_transfer_backend)\n"
        "print(backend.name, get_kv_class(backend, KVClassType.MANAGER).__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-2:] == ["AIODATADIST", "aiodatadist.integrations.sglang.manager"]


@pytest.mark.usefixtures("references")
class TestPageSize16:
    def test_decode_continues_the_prefill_exactly(self, pair16: Pair, prompts: dict[str, list[int]],
                                                  references: dict[int, dict[str, list[int]]]) -> None:
        for name in ("a", "b", "c"):
            assert pair16.tokens(prompts[name]) == references[16][name], name

    def test_the_copy_threads_run_at_the_schedulers_priority(self, pair16: Pair,
                                                            prompts: dict[str, list[int]]) -> None:
        """P's copy threads (the only ``SCHED_BATCH`` threads of its processes) have their process's nice value,
        not the library's default of 10 more: SGLang's scheduler thread polls without sleeping while a transfer is
        in flight, and would leave them a fraction of the core."""
        pair16.tokens(prompts["a"])
        threads = _batch_threads(pair16.prefill.process.pid)
        assert threads, "no copy thread found in P's processes"
        assert all(nice == process_nice for nice, process_nice in threads), threads

    def test_a_radix_cache_hit_on_the_prefill(self, pair16: Pair, prompts: dict[str, list[int]],
                                              references: dict[int, dict[str, list[int]]]) -> None:
        """P holds the first 10 pages of "prefix" (from "a"): it computes only the rest, and still sends every page
        of the prompt, in chunks."""
        pair16.tokens(prompts["a"])
        assert pair16.tokens(prompts["prefix"]) == references[16]["prefix"]

    @pytest.mark.parametrize(("side", "other_side_says"), [
        ("decode", "Aborted by decode-side abort notification."),  # P failed the room on D's ABORT
        ("prefill", "Aborted on the prefill side."),  # D learnt it from P at once (no waiting timeout)
    ])
    def test_an_aborted_request_ends_and_the_engines_go_on(self, pair16: Pair, prompts: dict[str, list[int]],
                                                           references: dict[int, dict[str, list[int]]],
                                                           side: str, other_side_says: str) -> None:
        """Aborted while P is still sending its chunks (a fresh 960-token prompt, 30 chunks): the request ends
        at once with an error, the other engine says why, and the next requests get the reference's tokens."""
        assert pair16.router is not None
        aborted, other = (pair16.decode, pair16.prefill) if side == "decode" else (pair16.prefill, pair16.decode)
        prompt = random_prompts(1, LONG_PROMPT, SPEC.vocab_size, seed=100 + len(side))[0]
        rid = f"abort-{side}-{time.monotonic_ns()}"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            answer = pool.submit(generate, pair16.router.url, prompt, TOKENS, rid=rid, timeout=120)
            time.sleep(0.3)
            aborted.abort(rid)
            with pytest.raises(ServerError, match="(?i)abort"):
                answer.result(120)
            assert time.monotonic() - started < 60
        deadline = time.monotonic() + 10
        while other_side_says not in other.log_path.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert other_side_says in other.log_path.read_text(errors="replace")
        for name in ("b", "c"):
            assert pair16.tokens(prompts[name]) == references[16][name], name

    def test_a_decode_that_restarts(self, pair16: Pair, prompts: dict[str, list[int]],
                                    references: dict[int, dict[str, list[int]]]) -> None:
        """D stops and a new D starts on its port: P links to the new instance when it registers."""
        pair16.restart_decode(prompts["d"])
        for name in ("a", "c"):
            assert pair16.tokens(prompts[name]) == references[16][name], name


def _batch_threads(group: int) -> list[tuple[int, int]]:
    """(nice, its process's nice) of every ``SCHED_BATCH`` thread in process group ``group``."""
    def fields(stat: Path) -> list[str]:
        return stat.read_text().rsplit(")", 1)[1].split()  # fields from the 3rd (state) on

    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int(fields(proc / "stat")[2]) != group:
                continue
            process_nice = int(fields(proc / "stat")[16])
            for task in (proc / "task").iterdir():
                values = fields(task / "stat")
                if int(values[38]) == 3:  # SCHED_BATCH
                    found.append((int(values[16]), process_nice))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


@pytest.mark.usefixtures("references")
def test_page_size_1(workdir: Path, prompts: dict[str, list[int]],
                     references: dict[int, dict[str, list[int]]]) -> None:
    pair = Pair(workdir, 1, "pd1")
    try:
        pair.start(prompts["d"])
        for name in ("a", "b", "prefix"):
            assert pair.tokens(prompts[name]) == references[1][name], name
    finally:
        pair.stop()


@pytest.mark.usefixtures("references")
def test_negative_control_corrupted_source_pages_change_the_tokens(
        workdir: Path, prompts: dict[str, list[int]], references: dict[int, dict[str, list[int]]]) -> None:
    """The same P/D pair, but P zeroes its source pages just before pushing them: D's tokens differ for every
    prompt (so the tests above do check the bytes moved)."""
    pair = Pair(workdir, 16, "pd16-corrupt", p_tweaks="corrupt_sources")
    try:
        pair.start(prompts["d"])
        for name in ("a", "b", "c"):
            assert pair.tokens(prompts[name]) != references[16][name], name
    finally:
        pair.stop()

