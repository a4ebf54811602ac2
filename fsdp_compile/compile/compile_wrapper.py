"""State-dict keys of ``torch.compile(model)``: the original names, not ``_orig_mod.``-prefixed.

``torch.compile(model)`` returns a wrapper (``OptimizedModule``) that holds the model as its child
``_orig_mod``, so nn.Module would prefix every key with ``_orig_mod.``. Where the user's compile is
seen, as the wrapper is built (a patch of ``OptimizedModule.__init__``, in torch_patches.py, applied
by the first ``fully_shard``), a wrapper whose model holds ``fully_shard`` modules gets its own
``state_dict``, which strips the prefix, and a load pre-hook, which adds it to keys that lack it;
any other wrapper, and every other module, is left alone. Both spellings load; ``get_state_dict`` /
``set_state_dict`` and ``model.compile()`` (in place, no wrapper) give the original names as well.

DCP's ``get_model_state_dict`` is the one caller that must get the keys as nn.Module makes them:
it maps the wrapper's keys to FQNs itself and asserts that the prefix is there. DCP has its own
registry for that: it calls the class's ``state_dict`` in place of an instance's ``state_dict``
listed in ``torch.distributed.checkpoint.state_dict._patched_state_dict`` (the registry of its
``_patch_model_state_dict``), so the wrapper's renaming ``state_dict`` is listed there.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from fsdp_compile.runtime.state import all_states_under

__all__ = ["name_keys_as_the_model_does", "COMPILE_WRAPPER_PREFIX"]

_COMPILE_WRAPPER_CHILD = "_orig_mod"
COMPILE_WRAPPER_PREFIX = _COMPILE_WRAPPER_CHILD + "."


def name_keys_as_the_model_does(wrapper: nn.Module) -> None:
    """As ``torch.compile(model)`` builds its wrapper: see the note above. Wrappers of models without
    ``fully_shard`` modules are left alone."""
    child = getattr(wrapper, _COMPILE_WRAPPER_CHILD, None)
    if not isinstance(child, nn.Module) or not all_states_under([child]):
        return
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    bypassed_by_dcp = getattr(dcp_state_dict, "_patched_state_dict", None)
    if bypassed_by_dcp is None:  # a torch without DCP's registry: keep nn.Module's prefixed keys
        return
    wrapper.state_dict = _state_dict_under_original_names(wrapper)
    bypassed_by_dcp.add(wrapper.state_dict)
    wrapper.register_load_state_dict_pre_hook(_add_compile_wrapper_prefix)


def _state_dict_under_original_names(wrapper: nn.Module):
    """``wrapper.state_dict`` with nn.Module's arguments, its keys without the wrapper's prefix.
    It holds the wrapper weakly: DCP's registry keeps it for the life of the process."""
    wrapper_ref = weakref.ref(wrapper)

    def state_dict(*args, destination=None, prefix: str = "", keep_vars: bool = False):
        wrapper = wrapper_ref()
        destination = type(wrapper).state_dict(wrapper, *args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        _strip_compile_wrapper_prefix(destination, args[1] if len(args) > 1 else prefix)
        return destination

    return state_dict


def _strip_compile_wrapper_prefix(destination: dict, prefix: str) -> None:
    wrapped = prefix + COMPILE_WRAPPER_PREFIX
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
    wrapped = prefix + COMPILE_WRAPPER_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(wrapped)]:
        state_dict[wrapped + key[len(prefix):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k.startswith(prefix) and not k.startswith(wrapped[:-1])]:
            relative = key[len(prefix):]
            metadata.setdefault(wrapped + relative if relative else wrapped[:-1], metadata[key])
