"""The examples of ``docs/testing.md`` run as written, in both of pytest-asyncio's modes.

Every ``python`` block of the page but the example router's files (shown whole, run by
``test_router_example.py``) is a complete test module: each runs as a module of a real pytest session in a
subprocess (``pytester``), in a directory of its own whose ini file sets ``asyncio_mode`` to ``strict`` (the
default, where async tests must be marked) and then to ``auto``, so that this repository's own configuration
(``auto``) hides nothing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")
BLOCK = re.compile(r"^(<!-- (?P<shown>[^>]*) -->\n)?```python\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
TEST = re.compile(r"^(async )?def test_\w+", re.MULTILINE)


def examples() -> list[str]:
    """The page's python blocks, but the files it shows whole (``<!-- path -->`` before the block)."""
    if not DOC.exists():
        pytest.skip("the package is not imported from its source tree")
    return [m.group("code") for m in BLOCK.finditer(DOC.read_text()) if not m.group("shown")]


def test_every_example_is_a_test_module() -> None:
    found = examples()
    assert len(found) >= 4
    for code in found:
        assert TEST.search(code), f"a python block of docs/testing.md has no test to run:\n{code}"
        compile(code, "docs/testing.md", "exec")


@pytest.mark.parametrize("mode", ["strict", "auto"])
def test_the_examples_pass_as_written(pytester: pytest.Pytester, mode: str) -> None:
    pytester.makeini(f"[pytest]\nasyncio_mode = {mode}\nasyncio_default_fixture_loop_scope = function\n"
                     "addopts = --strict-markers\n")
    found = examples()
    pytester.makepyfile(**{f"test_doc_example_{i}": code for i, code in enumerate(found)})
    result = pytester.runpytest_subprocess(*QUIET, "-q", "-rfEs")
    result.assert_outcomes(passed=sum(len(TEST.findall(code)) for code in found))
