"""docs/testing.md stays true: the example router and its suite shown there are the files CI runs, the agent's
commands table lists every command, the fixture table every fixture of the pytest plugin, and the page names
every public helper (its other examples run in ``tests/integration/test_testing_docs_examples.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aiodatadist import testing
from aiodatadist.testing import _agent, plugin

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "testing.md"


def _doc() -> str:
    if not DOC.exists():
        pytest.skip("the package is not imported from its source tree")
    return DOC.read_text()


@pytest.mark.parametrize("path", ["examples/router/kv_router.py", "examples/router/test_kv_router.py"])
def test_the_example_files_are_shown_whole(path: str) -> None:
    match = re.search(rf"<!-- {re.escape(path)} -->\n```python\n(.*?)```\n", _doc(), re.DOTALL)
    assert match, f"docs/testing.md does not show {path}"
    assert match.group(1) == (ROOT / path).read_text(), f"docs/testing.md shows an old {path}: copy it again"


def test_the_commands_table_lists_every_agent_command() -> None:
    commands = {name[4:] for name in vars(_agent.Agent) if name.startswith("cmd_")}
    table = _doc().split("| command | arguments | result |", 1)[1].split("\n\n", 1)[0]
    cells = re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE)
    documented = {name for cell in cells for name in re.findall(r"`(\w+)`", cell)}
    assert documented == commands


def test_the_fixture_table_lists_every_fixture() -> None:
    table = _doc().split("| fixture | what it gives", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE))
    assert documented == set(plugin.__all__)


def test_the_page_names_every_public_helper() -> None:
    """Each name of ``aiodatadist.testing`` is documented (in code, on the page)."""
    doc = _doc()
    missing = [name for name in testing.__all__ if not re.search(rf"`[^`]*\b{name}\b[^`]*`", doc)]
    assert not missing, f"docs/testing.md does not name {missing}"


def test_the_leaks_marker_is_documented() -> None:
    assert f"@pytest.mark.{plugin.LEAKS_MARKER}(allow=" in _doc()
