"""SGLang's plugin entry point: makes ``--disaggregation-transfer-backend aiodatadist`` exist.

aiodatadist declares ``register`` in the entry-point group ``sglang.srt.plugins``; SGLang runs every such entry
point early in each of its processes (the launcher before it parses the command line, the schedulers, the
detokenizer, the data-parallel controller).  SGLang's backend selection is closed (a list of CLI choices, an enum,
``get_kv_class`` raising on unknown names), so ``register``:

1. adds ``aiodatadist`` to the CLI choices (``add_disagg_transfer_backend_choices``);
2. adds the member ``TransferBackend.AIODATADIST`` (value ``"aiodatadist"``);
3. wraps ``get_kv_class`` (in ``sglang.srt.disaggregation.utils`` and in the modules that imported it already)
   so that the new member gives this package's classes (:mod:`.manager`, imported then: only a process that uses
   the backend imports it), every other backend SGLang's own.

It imports only SGLang's lightweight modules and is idempotent; a SGLang without these seams makes it raise
``RuntimeError`` saying which one is missing.  Importing this module never imports SGLang.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["BACKEND", "MEMBER", "register"]

BACKEND = "aiodatadist"
MEMBER = "AIODATADIST"
_USERS = ("sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode",
          "sglang.srt.managers.disagg_service")  # modules that bind get_kv_class by name


def register() -> None:
    """Make SGLang accept and use ``--disaggregation-transfer-backend aiodatadist`` in this process."""
    try:
        choices: Any = importlib.import_module("sglang.srt.arg_groups.choices")
        utils: Any = importlib.import_module("sglang.srt.disaggregation.utils")
    except ImportError as exc:
        raise RuntimeError(f"the aiodatadist SGLang backend needs SGLang's disaggregation modules: {exc}") from exc
    for owner, name in ((choices, "DISAGG_TRANSFER_BACKEND_CHOICES"), (utils, "TransferBackend"),
                        (utils, "get_kv_class"), (utils, "KVClassType")):
        if not hasattr(owner, name):
            raise RuntimeError(f"this SGLang has no {owner.__name__}.{name}: the aiodatadist backend cannot plug in")
    if BACKEND not in choices.DISAGG_TRANSFER_BACKEND_CHOICES:
        choices.DISAGG_TRANSFER_BACKEND_CHOICES.append(BACKEND)
    member = _add_member(utils.TransferBackend)
    hooked = _hooked(utils.get_kv_class, member, utils.KVClassType)
    utils.get_kv_class = hooked
    for name in _USERS:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "get_kv_class"):
            setattr(module, "get_kv_class", hooked)  # noqa: B010 - a module SGLang imported before


def _add_member(enum_class: Any) -> Any:
    """``enum_class.AIODATADIST`` (value ``"aiodatadist"``), added to the enum if it is not there yet."""
    existing = enum_class._value2member_map_.get(BACKEND)
    if existing is not None:
        return existing
    member = object.__new__(enum_class)
    member._name_ = MEMBER
    member._value_ = BACKEND
    member.__objclass__ = enum_class
    type.__setattr__(enum_class, MEMBER, member)
    enum_class._member_map_[MEMBER] = member
    enum_class._value2member_map_[BACKEND] = member
    enum_class._member_names_.append(MEMBER)
    return member


def _hooked(original: Callable[..., Any], member: Any, class_types: Any) -> Callable[..., Any]:
    """``get_kv_class`` answering for ``member`` and deferring to ``original`` otherwise (wrapped once)."""
    if getattr(original, "__aiodatadist_hook__", False):
        return original

    @functools.wraps(original)
    def get_kv_class(transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend is not member or class_type == class_types.KVARGS:
            return original(transfer_backend, class_type)
        from .manager import (
            AiodatadistKVBootstrapServer,
            AiodatadistKVManager,
            AiodatadistKVReceiver,
            AiodatadistKVSender,
        )

        return {
            class_types.MANAGER: AiodatadistKVManager,
            class_types.SENDER: AiodatadistKVSender,
            class_types.RECEIVER: AiodatadistKVReceiver,
            class_types.BOOTSTRAP_SERVER: AiodatadistKVBootstrapServer,
        }.get(class_type)

    get_kv_class.__aiodatadist_hook__ = True  # type: ignore[attr-defined]
    return get_kv_class
