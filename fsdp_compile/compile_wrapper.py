"""State-dict keys of ``torch.compile(model)``: the original names, not ``_orig_mod.``-prefixed.

``torch.compile(model)`` returns a wrapper (``OptimizedModule``) that holds the model as its child
``_orig_mod``, so nn.Module would prefix every key with ``_orig_mod.``. A global
module-registration hook (installed by the first ``fully_shard``) sees a wrapper adopt a model
with ``fully_shard`` modules and gives the wrapper two hooks: after save, strip the prefix; before
load, add it to keys that lack it. Both spellings load; ``get_state_dict`` / ``set_state_dict`` and
``model.compile()`` (in place, no wrapper) give the original names as well.

DCP's ``get_model_state_dict`` is the one caller that must get the keys as nn.Module makes them:
it maps the wrapper's keys to FQNs itself and asserts that the prefix is there. It is recognised
by being the direct caller of the wrapper's ``state_dict()`` (``_called_by_dcp``).
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn as nn

from fsdp_compile.state import all_states_under

__all__ = ["install_compile_wrapper_hook"]

_COMPILE_WRAPPER_CHILD = "_orig_mod"


@functools.cache
def install_compile_wrapper_hook() -> None:
    """Once per process: see the note above on ``torch.compile(model)``'s ``_orig_mod.`` prefix."""
    nn.modules.module.register_module_module_registration_hook(_on_module_registered)


def _on_module_registered(parent: nn.Module, name: str, child: nn.Module | None) -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    # Inside a compiled region (compiled autograd wraps its graphs in torch.compile) Dynamo would
    # trace this hook on a half-built wrapper; such wrappers never hold a user's model anyway.
    if name != _COMPILE_WRAPPER_CHILD or torch.compiler.is_compiling():
        return
    if not isinstance(parent, OptimizedModule) or child is None:
        return
    if not all_states_under([child]):
        return
    parent.register_state_dict_post_hook(_strip_compile_wrapper_prefix)
    parent.register_load_state_dict_pre_hook(_add_compile_wrapper_prefix)


def _called_by_dcp() -> bool:
    """Whether the ``state_dict()`` call running this post-hook came straight from DCP's helper."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    helper = getattr(dcp_state_dict, "_get_model_state_dict", None)
    if helper is None:
        return False
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not nn.Module.state_dict.__code__:
        frame = frame.f_back  # up to nn.Module.state_dict, which runs the post-hooks
    caller = frame.f_back if frame is not None else None
    return caller is not None and caller.f_code is getattr(helper, "__wrapped__", helper).__code__


def _strip_compile_wrapper_prefix(module: nn.Module, destination: dict, prefix: str, local_metadata: dict) -> None:
    if _called_by_dcp():
        return
    wrapped = prefix + _COMPILE_WRAPPER_CHILD + "."
    entries = list(destination.items())
    destination.clear()  # re-inserted below, so the keys keep their order
    for key, value in entries:
        destination[prefix + key[len(wrapped):] if key.startswith(wrapped) else key] = value
    metadata = getattr(destination, "_metadata", None)
    if metadata is None:
        return
    entries = list(metadata.items())
    metadata.clear()
    for key, value in entries:
        if key == prefix + _COMPILE_WRAPPER_CHILD:
            key = prefix[:-1]  # the wrapped model's own version entry replaces the wrapper's
        elif key.startswith(wrapped):
            key = prefix + key[len(wrapped):]
        metadata[key] = value


def _add_compile_wrapper_prefix(
    module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
    missing_keys: list, unexpected_keys: list, error_msgs: list,
) -> None:
    wrapped = prefix + _COMPILE_WRAPPER_CHILD + "."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(wrapped)]:
        state_dict[wrapped + key[len(prefix):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k.startswith(prefix) and not k.startswith(wrapped[:-1])]:
            relative = key[len(prefix):]
            metadata.setdefault(wrapped + relative if relative else wrapped[:-1], metadata[key])
