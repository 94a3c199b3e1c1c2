"""Public names of the package: LLM-DataDist's, and aiodatadist's own (docs/api.md)."""

from __future__ import annotations

import importlib
import inspect
from importlib import resources

import pytest

import aiodatadist

REQUIRED = [
    "LLMDataDist",
    "LLMConfig",
    "LlmConfig",
    "LLMClusterInfo",
    "LLMRole",
    "LLMStatusCode",
    "LLMException",
    "DataType",
    "Placement",
    "CacheDesc",
    "Cache",
    "CacheManager",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "BlocksCacheKey",
]


def test_module_has_docstring() -> None:
    assert aiodatadist.__doc__ and aiodatadist.__doc__.strip()


def test_all_is_a_list_of_unique_strings() -> None:
    names = aiodatadist.__all__
    assert isinstance(names, (list, tuple))
    assert all(isinstance(n, str) for n in names)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("name", REQUIRED)
def test_required_name_in_all(name: str) -> None:
    assert name in aiodatadist.__all__


@pytest.mark.parametrize("name", REQUIRED)
def test_required_name_importable(name: str) -> None:
    module = importlib.import_module("aiodatadist")
    obj = getattr(module, name)
    assert inspect.isclass(obj)


def test_llm_config_alias() -> None:
    assert aiodatadist.LlmConfig is aiodatadist.LLMConfig


def test_star_import_gives_all() -> None:
    namespace: dict[str, object] = {}
    exec("from aiodatadist import *", namespace)  # noqa: S102
    for name in aiodatadist.__all__:
        assert name in namespace, name
        assert namespace[name] is getattr(aiodatadist, name)


@pytest.mark.parametrize("name", list(aiodatadist.__all__))
def test_every_exported_name_importable_and_documented(name: str) -> None:
    obj = getattr(aiodatadist, name)
    if inspect.isclass(obj):
        doc = obj.__doc__
        assert isinstance(doc, str) and doc.strip(), f"{name} has no docstring"
        assert doc.strip() != "An enumeration.", f"{name} has only the Enum default docstring"


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError):
        _ = aiodatadist.NoSuchName  # type: ignore[attr-defined]


def test_py_typed_marker() -> None:
    marker = resources.files("aiodatadist").joinpath("py.typed")
    assert marker.is_file()
