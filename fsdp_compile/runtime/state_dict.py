"""State dicts (sharded / full / local): what ``model.state_dict()`` gives and ``load_state_dict`` takes.

[Note: state dicts go through hooks on each fully_shard module]
``model.state_dict()`` and ``model.load_state_dict()`` stay nn.Module's own; ``fully_shard``
registers three hooks on each module it takes (``register_state_dict_hooks``):

- before save / load: refuse mid-forward/backward and inside ``unshard_params``, and reshard the
  group (``FSDPState.reshard_for``), so the registered parameters are the sharded ``DTensor`` ones
  (an unsharded group outside forward/backward, e.g. the root with ``reshard_after_forward=False``,
  is all-gathered again by its next use);
- after save: turn this module's entries into the requested kind (``StateDictType``);
- before load: turn whatever kind was given (DTensor, full tensor, local shard) into a DTensor
  with the parameter's own placements, so nn.Module's ``param.copy_(value)`` is a local copy
  (``load_state_dict(assign=True)`` assigns that DTensor, which ``FSDPParam.replace_sharded_param``
  takes as the new shard).

Each hook handles exactly "its" entries: its group's parameters, plus the buffers and unmanaged
parameters of its subtree that no nested ``fully_shard`` module owns. The keys of
``torch.compile(model)`` are the original names too: see compile/compile_wrapper.py.
"""
from __future__ import annotations

import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_compile.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp_compile.runtime.collectives import gather_full
from fsdp_compile.runtime.param import FSDPParam
from fsdp_compile.runtime.state import FSDPState, all_states_under, state_of

__all__ = ["state_dict_type", "get_state_dict_type", "register_state_dict_hooks"]

_DEFAULT_SETTINGS = StateDictSettings(StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(), ShardedOptimStateDictConfig())
_CONFIG_CLASS = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
}
_OPTIM_CONFIG_CLASS = {
    StateDictType.FULL_STATE_DICT: FullOptimStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalOptimStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedOptimStateDictConfig,
}
_LOCAL_WORLD_KEY = "fsdp_compile_local_shard_world_size"


# --- choosing the kind ----------------------------------------------------------------------------


class state_dict_type:  # noqa: N801 - used like FSDP1's function-style context manager
    """Set which state dict the ``fully_shard`` modules under ``module`` save and load, and which
    optimizer state dict ``fsdp_compile.optim_state_dict`` / ``optim_state_dict_to_load`` use.

    Takes effect when called; used as a context manager, restores the previous settings on exit
    (FSDP1's ``FSDP.state_dict_type`` / ``set_state_dict_type``). Each config defaults to its
    class's defaults and must be the class that belongs to ``state_dict_type``.

    Example::

        with fsdp_compile.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                          FullStateDictConfig(rank0_only=True, offload_to_cpu=True),
                                          FullOptimStateDictConfig(rank0_only=True)):
            full = model.state_dict()        # plain tensors on rank 0, {} elsewhere
            optim_full = fsdp_compile.optim_state_dict(model, optimizer)   # likewise
        model.load_state_dict(full)            # default again: sharded; full tensors are accepted too
    """

    def __init__(
        self,
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> None:
        if not isinstance(state_dict_type, StateDictType):
            raise TypeError(f"state_dict_type takes a StateDictType member, got {state_dict_type!r}")
        config = _checked_config(state_dict_type, state_dict_config, _CONFIG_CLASS, "state_dict_config")
        optim_config = _checked_config(state_dict_type, optim_state_dict_config, _OPTIM_CONFIG_CLASS, "optim_state_dict_config")
        states = all_states_under([module])
        if not states:
            raise ValueError(f"state_dict_type: no fully_shard module in this {type(module).__name__}; apply fully_shard first")
        self._previous = {state: get_state_dict_type(state) for state in states}
        for state in states:
            state.state_dict_settings = StateDictSettings(state_dict_type, config, optim_config)

    def __enter__(self) -> "state_dict_type":
        return self

    def __exit__(self, *exc: Any) -> None:
        for state, settings in self._previous.items():
            state.state_dict_settings = settings


def _checked_config(kind: StateDictType, config: Any, classes: dict, argument: str) -> Any:
    config_class = classes[kind]
    if config is None:
        return config_class()
    if type(config) is not config_class:
        raise ValueError(
            f"{kind.name} takes {argument}={config_class.__name__}(...), got {type(config).__name__}; "
            f"pass {config_class.__name__}(...) or None"
        )
    return config


def get_state_dict_type(module_or_state: nn.Module | FSDPState) -> StateDictSettings:
    """The settings a ``fully_shard`` module's state-dict hooks use now."""
    state = module_or_state if isinstance(module_or_state, FSDPState) else state_of(module_or_state)
    if state is None:
        raise ValueError(f"get_state_dict_type takes a module fully_shard was applied to, got {type(module_or_state).__name__}")
    return state.state_dict_settings or _DEFAULT_SETTINGS


# --- hooks ------------------------------------------------------------------------------------------


def register_state_dict_hooks(state: FSDPState) -> None:
    """Called by ``fully_shard``; see [Note: state dicts go through hooks on each fully_shard module]."""
    for index, module in enumerate(state.modules):
        module.register_state_dict_pre_hook(functools.partial(_pre_state_dict_hook, state))
        module.register_state_dict_post_hook(functools.partial(_post_state_dict_hook, state, index))
        module.register_load_state_dict_pre_hook(functools.partial(_pre_load_state_dict_hook, state, index))


def _pre_state_dict_hook(state: FSDPState, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    state.reshard_for("state_dict()")


def _owned_entries(state: FSDPState, index: int) -> Iterator[tuple[str, FSDPParam | None, torch.Tensor]]:
    """(key relative to the hooked module, its FSDPParam or None, current value) for the entries
    this module's hooks handle: see [Note: state dicts go through hooks on each fully_shard module]."""
    managed = {id(p.sharded_param): p for p in state.group.fsdp_params} if state.group is not None else {}

    def visit(module: nn.Module, path: str) -> Iterator[tuple[str, FSDPParam | None, torch.Tensor]]:
        for name, param in module._parameters.items():
            if param is not None:
                yield path + name, managed.get(id(param)), param
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield path + name, None, buffer
        for child_name, child in module._modules.items():
            if child is None:
                continue
            child_state = state_of(child)
            if child_state is not None and child_state is not state:
                continue  # the nested fully_shard module's own hooks handle it
            yield from visit(child, f"{path}{child_name}.")

    yield from visit(state.modules[index], "")


def _post_state_dict_hook(state: FSDPState, index: int, module: nn.Module, destination: dict, prefix: str, local_metadata: dict) -> None:
    settings = get_state_dict_type(state)
    kind, config = settings.state_dict_type, settings.state_dict_config
    drop = kind == StateDictType.FULL_STATE_DICT and getattr(config, "rank0_only", False) and dist.get_rank() != 0
    for relative, fsdp_param, _ in _owned_entries(state, index):
        key = prefix + relative
        if key not in destination:
            continue
        value = destination[key]
        if fsdp_param is not None:
            if kind == StateDictType.FULL_STATE_DICT:
                # Every rank takes part in the all-gather (and, with tensor parallelism, in the TP
                # gather of the pieces), also those that drop the result.
                piece = gather_full(
                    fsdp_param.local_shard(), fsdp_param.layout, fsdp_param.mesh_info, fsdp_param.device, fsdp_param.fqn, "state_dict"
                )
                value = fsdp_param.full_of_piece(piece).detach()
            elif kind == StateDictType.LOCAL_STATE_DICT:
                value = _padded_local_shard(fsdp_param)
                local_metadata[_LOCAL_WORLD_KEY] = fsdp_param.mesh_info.shard_size
        if drop:
            destination.pop(key, None)
            continue
        if config.offload_to_cpu:
            value = _to_cpu(value)
        destination[key] = value


def _pre_load_state_dict_hook(
    state: FSDPState, index: int, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
    strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list,
) -> None:
    state.reshard_for("load_state_dict()")
    settings = get_state_dict_type(state)
    entries = list(_owned_entries(state, index))
    config = settings.state_dict_config
    if settings.state_dict_type == StateDictType.FULL_STATE_DICT and getattr(config, "rank0_only", False):
        _broadcast_from_rank0(state_dict, [(prefix + relative, fsdp_param, value) for relative, fsdp_param, value in entries], state.device)
    for relative, fsdp_param, _ in entries:
        key = prefix + relative
        if fsdp_param is not None and key in state_dict:
            state_dict[key] = _as_sharded(state_dict[key], fsdp_param, key, settings.state_dict_type, local_metadata)


# --- conversions ----------------------------------------------------------------------------------


def _padded_local_shard(fsdp_param: FSDPParam) -> torch.Tensor:
    layout = fsdp_param.layout
    local = fsdp_param.local_shard().detach()
    padded = local.new_zeros(layout.padded_shard_shape)
    padded.narrow(layout.dim, 0, layout.rows()).copy_(local)
    return padded


def _sharded_from_rows(rows_tensor: torch.Tensor, fsdp_param: FSDPParam) -> DTensor:
    target = fsdp_param.local_shard()
    local = rows_tensor.detach().to(device=target.device).clone(memory_format=torch.contiguous_format)
    return fsdp_param.sharded_dtensor(local)


def _as_sharded(value: Any, fsdp_param: FSDPParam, key: str, kind: StateDictType, local_metadata: dict) -> Any:
    """``value`` (any kind of state-dict entry) as a DTensor laid out like the parameter."""
    info = fsdp_param.mesh_info
    layout = fsdp_param.layout
    if kind == StateDictType.LOCAL_STATE_DICT:
        saved_world = local_metadata.get(_LOCAL_WORLD_KEY)
        expected = layout.padded_shard_shape
        if (saved_world is not None and saved_world != info.shard_size) or tuple(value.shape) != expected:
            raise ValueError(
                f"fsdp_compile: LOCAL_STATE_DICT entry '{key}' was saved at shard world size "
                f"{saved_world if saved_world is not None else 'unknown'} (shape {tuple(value.shape)}) but this model "
                f"shards over {info.shard_size} ranks (expects {expected}). Local state dicts only load at the world "
                "size they were saved at: save a SHARDED_STATE_DICT (torch.distributed.checkpoint) or a "
                "FULL_STATE_DICT to change world size."
            )
        return _sharded_from_rows(value.narrow(layout.dim, 0, layout.rows()), fsdp_param)
    if isinstance(value, DTensor):
        if value.device_mesh == fsdp_param.sharded_mesh and tuple(value.placements) == fsdp_param.placements:
            return value
        tp = fsdp_param.tensor_parallel
        if tp is not None and value.device_mesh == tp.param_mesh and tuple(value.placements) == tp.param_placements:
            return _sharded_from_rows(layout.shard_of(value.to_local()), fsdp_param)  # the user's TP layout: no gather
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor):
        return value  # nn.Module reports the type error with the key
    if tuple(value.shape) != tuple(fsdp_param.orig_size):
        raise ValueError(
            f"fsdp_compile: size mismatch for '{key}': the state dict has shape {tuple(value.shape)}, the model's "
            f"parameter is {tuple(fsdp_param.orig_size)}. Load a state dict saved from the same model definition."
        )
    return _sharded_from_rows(fsdp_param.shard_of_full(value), fsdp_param)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, DTensor):
        local = value.to_local()
        if local.device.type == "cpu":
            return value
        return DTensor.from_local(local.cpu(), value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride())
    return value.cpu() if isinstance(value, torch.Tensor) else value


def _broadcast_from_rank0(state_dict: dict, entries: list[tuple[str, FSDPParam | None, torch.Tensor]], device: torch.device) -> None:
    """Full-state-dict load with ``rank0_only``: every rank gets rank 0's values for ``entries``.

    Rank 0 announces which keys it has, with shapes and dtypes, so every rank makes the same
    broadcasts even when the dict is incomplete (a missing key is then reported, not hung on).
    """
    rank = dist.get_rank()
    announced: list[Any] = [None]
    if rank == 0:
        announced[0] = [
            (key, tuple(state_dict[key].shape), state_dict[key].dtype)
            for key, _, _ in entries
            if isinstance(state_dict.get(key), torch.Tensor)
        ]
    dist.broadcast_object_list(announced, src=0)
    for key, shape, dtype in announced[0]:
        if rank == 0:
            tensor = state_dict[key].detach().to(device)
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
        else:
            tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=0)
        state_dict[key] = tensor


