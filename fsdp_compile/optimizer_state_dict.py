"""Optimizer state dicts with FSDP1's API (``FSDP.optim_state_dict`` / ``optim_state_dict_to_load``).

The kind follows ``state_dict_type`` (the ``optim_state_dict_config`` half of its settings); the
work is done by ``torch.distributed.checkpoint.state_dict`` (DCP), which already checkpoints our
``DTensor`` parameters and their optimizer state at any world size:

- ``FULL_STATE_DICT``: plain full tensors, ``StateDictOptions(full_state_dict=True)``; on load
  with ``rank0_only``, ``broadcast_from_rank0=True``.
- ``SHARDED_STATE_DICT``: ``DTensor`` state laid out like the parameters (DCP's default), what
  ``torch.distributed.checkpoint.save`` / ``load`` take; loads at any world size.
- ``LOCAL_STATE_DICT``: as in FSDP1, whose optimizer half of ``LOCAL_STATE_DICT`` is the sharded
  one: the same ``DTensor`` state (only ``offload_to_cpu`` defaults to ``False``).

Keys are parameter FQNs (``OptimStateKeyType.PARAM_NAME``), as in FSDP1.

[Note: optim_state_dict_to_load returns what DCP would load]
DCP's ``set_optimizer_state_dict`` converts a state dict of any kind into the optimizer's own
(sharded) form and ends by calling ``optim.load_state_dict(converted)``; FSDP1's
``optim_state_dict_to_load`` returns that converted dict instead. So we call DCP with the
optimizer's ``load_state_dict`` replaced, for the call, by one that keeps its argument
(``_replaced``). For ``rank0_only`` DCP copies rank 0's values into the optimizer's current
state tensors in place on the way; the returned dict is still what completes the load
(``param_groups`` included).

[Note: an optimizer without state gets one]
Both functions go through DCP, which first gives an optimizer that has no state yet one (a step
with zero gradients and ``lr=0``: parameters unchanged, AdamW's ``step`` counts 1). That is what
lets a fresh optimizer's sharded state dict serve as the template ``dcp.load`` fills in place;
FSDP1 instead returned an empty ``"state"`` for a fresh optimizer.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from fsdp_compile.api import OptimStateKeyType, StateDictSettings, StateDictType
from fsdp_compile.compile.compile_wrapper import COMPILE_WRAPPER_PREFIX
from fsdp_compile.runtime.state import all_states_under
from fsdp_compile.runtime.state_dict import get_state_dict_type

__all__ = ["optim_state_dict", "optim_state_dict_to_load", "rekey_optim_state_dict"]


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optim``'s state keyed by parameter FQNs, of the kind ``state_dict_type`` set on ``model``.

    ``optim_state_dict``: the dict to convert (default: ``optim.state_dict()``). A collective:
    call it on every rank. FSDP1's ``FSDP.optim_state_dict``.

    Example::

        with state_dict_type(model, StateDictType.FULL_STATE_DICT,
                             FullStateDictConfig(rank0_only=True),
                             FullOptimStateDictConfig(rank0_only=True)):
            checkpoint = {"model": model.state_dict(), "optim": optim_state_dict(model, optimizer)}
        if dist.get_rank() == 0:
            torch.save(checkpoint, "checkpoint.pt")   # full CPU tensors; {} on the other ranks
    """
    settings = _settings(model, "optim_state_dict", group)
    config = settings.optim_state_dict_config
    full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
    rank0_only = full and config.rank0_only
    options = StateDictOptions(full_state_dict=full, cpu_offload=config.offload_to_cpu and (rank0_only or not full))
    with _reading(model, optim, optim_state_dict):
        result = get_optimizer_state_dict(model, optim, options=options)
    if rank0_only and dist.get_rank() != 0:
        return {}
    if full:
        result = _snapshot(result, optim, config.offload_to_cpu)
    return result


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optim_state_dict`` (as ``optim_state_dict`` returned it) converted for ``optim.load_state_dict``.

    The kind expected follows ``state_dict_type`` on ``model``; with ``FullOptimStateDictConfig
    (rank0_only=True)`` only rank 0's dict is read (the other ranks may pass ``{}``). Keys may be
    FQNs or, like a plain ``optimizer.state_dict()``, positions in the optimizer's parameter order.
    Returns a dict keyed by positions (by FQNs with ``is_named_optimizer=True``); with
    ``load_directly=True`` also loads it. A collective: call it on every rank. See
    [Note: optim_state_dict_to_load returns what DCP would load].

    Example::

        state = {"model": model.state_dict(), "optim": optim_state_dict(model, optimizer)}
        torch.distributed.checkpoint.load(state, checkpoint_id=path)   # any world size
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(optim_state_dict_to_load(model, optimizer, state["optim"]))
    """
    settings = _settings(model, "optim_state_dict_to_load", group)
    kind = settings.state_dict_type
    broadcast = kind == StateDictType.FULL_STATE_DICT and settings.optim_state_dict_config.rank0_only
    order = _parameter_order(model, optim)
    if broadcast:
        named = _read_on_rank0(optim_state_dict, order)
    else:
        named = _rekeyed(optim_state_dict, OptimStateKeyType.PARAM_NAME, order)
        _check_kind(named, kind)
    options = StateDictOptions(full_state_dict=kind == StateDictType.FULL_STATE_DICT, broadcast_from_rank0=broadcast)
    captured: list[dict[str, Any]] = []
    with _replaced(optim, "load_state_dict", lambda state_dict: captured.append(state_dict)):
        set_optimizer_state_dict(model, optim, named, options=options)
    result = captured[0] if is_named_optimizer else _rekeyed(captured[0], OptimStateKeyType.PARAM_ID, order)
    if load_directly:
        optim.load_state_dict(result)
    return result


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: OptimStateKeyType,
    model: nn.Module,
    optim_input: Any = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """The same optimizer state dict keyed by ``optim_state_key_type``; FSDP1's ``rekey_optim_state_dict``.

    ``PARAM_ID`` is the position of a parameter in ``optim``'s parameter order, ``PARAM_NAME`` its
    FQN in ``model``. Tensors are shared, not copied; no communication.

    Example::

        # a single-process AdamW checkpoint, keyed by position, for FULL_STATE_DICT loading
        named = rekey_optim_state_dict(torch.load("adamw.pt"), OptimStateKeyType.PARAM_NAME, model, optim=optimizer)
    """
    if not isinstance(optim_state_key_type, OptimStateKeyType):
        raise TypeError(
            f"rekey_optim_state_dict: unknown key type {optim_state_key_type!r}; pass "
            "OptimStateKeyType.PARAM_NAME (parameter FQNs) or OptimStateKeyType.PARAM_ID (positions)"
        )
    if optim_input is not None or optim is None:
        raise ValueError("rekey_optim_state_dict: pass the optimizer as optim=...; optim_input is not supported")
    return _rekeyed(optim_state_dict, optim_state_key_type, _parameter_order(model, optim))


# --- helpers ----------------------------------------------------------------------------------------


def _settings(model: nn.Module, caller: str, group: dist.ProcessGroup | None) -> StateDictSettings:
    """The one ``state_dict_type`` setting of the ``fully_shard`` modules under ``model``."""
    states = all_states_under([model])
    if not states:
        raise ValueError(f"{caller}: no fully_shard module in this {type(model).__name__}; apply fully_shard to the model first")
    if group is not None and group is not dist.group.WORLD:
        raise ValueError(
            f"{caller}: group= is not used: the parameters are DTensors that carry their DeviceMesh, which "
            "decides the communication. Pass group=None."
        )
    settings = get_state_dict_type(states[0])
    if any(get_state_dict_type(state) != settings for state in states[1:]):
        raise ValueError(
            f"{caller}: the fully_shard modules under this {type(model).__name__} have different state_dict_type "
            "settings; call state_dict_type(model, ...) on the root model so all of them agree"
        )
    return settings


def _parameter_order(model: nn.Module, optim: torch.optim.Optimizer) -> list[str]:
    """The FQN of each of ``optim``'s parameters, in the optimizer's order (its ``PARAM_ID``s)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name.replace(COMPILE_WRAPPER_PREFIX, ""))
    order = []
    for group in optim.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not in this "
                    f"{type(model).__name__}; build the optimizer from model.parameters() after fully_shard"
                )
            order.append(names[id(param)])
    return order


def _key_type(optim_state_dict: dict[str, Any]) -> OptimStateKeyType:
    if not isinstance(optim_state_dict, dict) or "state" not in optim_state_dict or "param_groups" not in optim_state_dict:
        raise ValueError(
            "an optimizer state dict has the keys 'state' and 'param_groups' (what optim_state_dict() or "
            f"optimizer.state_dict() return); got {type(optim_state_dict).__name__} with keys "
            f"{sorted(map(str, optim_state_dict)) if isinstance(optim_state_dict, dict) else '-'}"
        )
    keys = list(optim_state_dict["state"]) + [key for group in optim_state_dict["param_groups"] for key in group["params"]]
    if all(isinstance(key, str) for key in keys):
        return OptimStateKeyType.PARAM_NAME
    if all(isinstance(key, int) and not isinstance(key, bool) for key in keys):
        return OptimStateKeyType.PARAM_ID
    unknown = sorted({type(key).__name__ for key in keys})
    raise ValueError(
        f"optimizer state dict keys must be all parameter FQNs (str, OptimStateKeyType.PARAM_NAME) or all "
        f"positions in the optimizer's parameter order (int, OptimStateKeyType.PARAM_ID); got {unknown}. "
        "Use the dict optim_state_dict() or optimizer.state_dict() returned."
    )


def _rekeyed(optim_state_dict: dict[str, Any], key_type: OptimStateKeyType, order: list[str]) -> dict[str, Any]:
    """A copy of the dict's outer structure with every parameter key translated; values shared."""
    source = _key_type(optim_state_dict)
    if source == key_type:
        mapping: dict[Any, Any] = {}
    elif key_type == OptimStateKeyType.PARAM_NAME:
        mapping = dict(enumerate(order))
    else:
        mapping = {name: index for index, name in enumerate(order)}

    def translate(key: Any) -> Any:
        return mapping.get(key, key)

    return {
        **optim_state_dict,
        "state": {translate(key): value for key, value in optim_state_dict["state"].items()},
        "param_groups": [{**group, "params": [translate(key) for key in group["params"]]} for group in optim_state_dict["param_groups"]],
    }


def _read_on_rank0(optim_state_dict: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """``rank0_only`` loading: rank 0's dict by FQN, ``{}`` elsewhere. A bad dict on rank 0 raises on
    every rank, before DCP's broadcasts would leave the other ranks waiting for it."""
    named: dict[str, Any] = {}
    problem: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            named = _rekeyed(optim_state_dict, OptimStateKeyType.PARAM_NAME, order)
        except ValueError as error:
            problem[0] = str(error)
    dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        raise ValueError(f"optim_state_dict_to_load (rank0_only, rank 0's dict): {problem[0]}")
    return named


def _snapshot(full: dict[str, Any], optim: torch.optim.Optimizer, offload_to_cpu: bool) -> dict[str, Any]:
    """A full state dict that later steps do not change: DCP hands back the optimizer's own
    tensors where there was nothing to gather (``step``, unsharded parameters' state), and the
    optimizer updates those in place. With ``offload_to_cpu`` every tensor on CPU (DCP offloads
    a full state dict only together with ``rank0_only``)."""
    live = {id(value) for per_param in optim.state.values() for value in per_param.values() if isinstance(value, torch.Tensor)}

    def detached(tensor: torch.Tensor) -> torch.Tensor:
        if offload_to_cpu and tensor.device.type != "cpu":
            return tensor.cpu()
        return tensor.clone() if id(tensor) in live else tensor

    return tree_map_only(torch.Tensor, detached, full)


def _check_kind(named: dict[str, Any], kind: StateDictType) -> None:
    """Full loading takes plain tensors, sharded / local loading DTensors: DCP would take the other
    kind as is and fail later (a plain tensor as a sharded parameter's state, at the next step)."""
    full = kind == StateDictType.FULL_STATE_DICT
    for fqn, per_param in named["state"].items():
        for name, value in per_param.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or isinstance(value, DTensor) != full:
                continue
            given, other = ("a DTensor", "SHARDED_STATE_DICT") if full else ("a plain tensor", "FULL_STATE_DICT")
            raise ValueError(
                f"optim_state_dict_to_load: state '{name}' of '{fqn}' is {given} of shape {tuple(value.shape)}, "
                f"but {kind.name} loads {'plain full tensors' if full else 'DTensors'} (what optim_state_dict() gives "
                f"under it). To load this dict, use state_dict_type(model, StateDictType.{other})."
            )


@contextlib.contextmanager
def _replaced(optim: torch.optim.Optimizer, attribute: str, replacement: Callable[..., Any]) -> Iterator[None]:
    """``optim.<attribute>`` is ``replacement`` inside the block (an instance attribute shadowing the
    method); a previous instance attribute (e.g. DCP's own patch) comes back afterwards."""
    missing = object()
    previous = vars(optim).get(attribute, missing)
    setattr(optim, attribute, replacement)
    try:
        yield
    finally:
        if previous is missing:
            delattr(optim, attribute)
        else:
            setattr(optim, attribute, previous)


@contextlib.contextmanager
def _reading(model: nn.Module, optim: torch.optim.Optimizer, given: dict[str, Any] | None) -> Iterator[None]:
    """DCP reads ``optim.state_dict()``; inside the block it reads ``given`` (keyed by position) instead."""
    if given is None:
        yield
        return
    order = _parameter_order(model, optim)
    by_position = _rekeyed(given, OptimStateKeyType.PARAM_ID, order)
    # DCP re-keys the dict it reads in place: hand it a fresh outer copy each time.
    with _replaced(optim, "state_dict", lambda: _rekeyed(by_position, OptimStateKeyType.PARAM_ID, order)):
        yield
