"""Tensors inside the structures models pass between modules.

Forward inputs and outputs are rarely bare tensors: models pass tuples, dicts, named tuples and
dataclasses (HF ``ModelOutput``, attention caches). The hooks must see every tensor in them to
cast inputs, to hook backward onto outputs and to reduce gradients once they reach the inputs;
a tensor the hooks do not see is a group that is never unsharded for backward.
``torch.utils._pytree`` leaves unregistered dataclasses opaque, hence this walk.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["map_tensors", "tensors_in"]


# Leaves met in every forward's arguments (flags, sizes, None): told apart from containers at once,
# without the Mapping and dataclass checks below.
_SCALAR_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def _children(tree: Any) -> list[Any] | None:
    """The items of a container we walk into, or ``None`` for a leaf (``tree`` is not a tensor).
    The exact types the hooks meet in every forward are told first."""
    if isinstance(tree, _SCALAR_TYPES):
        return None
    kind = type(tree)
    if kind is tuple or kind is list:
        return list(tree)
    if kind is dict:
        return list(tree.values())
    if isinstance(tree, (tuple, list)):
        return list(tree)
    if isinstance(tree, Mapping):
        return list(tree.values())
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return [getattr(tree, field.name) for field in dataclasses.fields(tree)]
    return None


def _rebuild(tree: Any, children: list[Any]) -> Any:
    """A new container like ``tree`` holding ``children`` (in ``_children``'s order)."""
    if isinstance(tree, tuple):
        if hasattr(tree, "_fields"):  # a named tuple takes its fields positionally
            return type(tree)(*children)
        return tuple(children) if type(tree) is tuple else type(tree)(children)
    if isinstance(tree, list):
        return type(tree)(children)
    if type(tree) is dict:  # the common case, and one Dynamo traces (it does not trace dict.copy)
        return dict(zip(tree.keys(), children))
    rebuilt = copy.copy(tree)
    if isinstance(tree, Mapping):
        for key, value in zip(list(tree.keys()), children):
            rebuilt[key] = value
        return rebuilt
    for field, value in zip(dataclasses.fields(tree), children):
        # object.__setattr__: frozen dataclasses too, and no __init__/__post_init__ side effects.
        object.__setattr__(rebuilt, field.name, value)
    return rebuilt


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``; containers are rebuilt, not mutated.

    Walks tuples (named ones too), lists, mappings (``dict`` subclasses keep their type, so an HF
    ``ModelOutput`` stays one) and dataclass instances (frozen ones too); anything else is a leaf
    returned as is. A container none of whose tensors ``fn`` replaced is returned as it was, not
    rebuilt: the hooks map every forward's arguments, and most of them change nothing.

    Example::

        half = map_tensors(lambda t: t.to(torch.bfloat16), (x, {"mask": mask}))
    """
    return _map_tensors(fn, tree)[0]


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> tuple[Any, bool]:
    """``map_tensors(fn, tree)`` and whether any tensor in it was replaced (told at the tensors:
    Dynamo, which traces the hooks, compares tensors by identity but not containers)."""
    if isinstance(tree, torch.Tensor):
        mapped = fn(tree)
        return mapped, mapped is not tree
    children = _children(tree)
    if children is None:
        return tree, False
    pairs = [_map_tensors(fn, child) for child in children]
    if not any(changed for _, changed in pairs):
        return tree, False
    return _rebuild(tree, [mapped for mapped, _ in pairs]), True


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree`` (the walk of :func:`map_tensors`), in walk order."""
    found: list[torch.Tensor] = []
    _collect_tensors(tree, found)
    return found


def _collect_tensors(tree: Any, found: list[torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        found.append(tree)
        return
    for child in _children(tree) or ():
        _collect_tensors(child, found)
