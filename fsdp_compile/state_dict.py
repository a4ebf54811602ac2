"""State dicts (sharded / full / local) and ``unshard_params``: reading and writing whole parameters.

[Note: state dicts go through hooks on each fully_shard module]
``model.state_dict()`` and ``model.load_state_dict()`` stay nn.Module's own; ``fully_shard``
registers three hooks on each module it takes (``register_state_dict_hooks``):

- before save / load: refuse mid-forward/backward and inside ``unshard_params``, and reshard the
  group, so the registered parameters are the sharded ``DTensor`` ones (an unsharded group outside
  forward/backward, e.g. the root with ``reshard_after_forward=False``, is all-gathered again by
  its next use);
- after save: turn this module's entries into the requested kind (``StateDictType``);
- before load: turn whatever kind was given (DTensor, full tensor, local shard) into a DTensor
  with the parameter's own placements, so nn.Module's ``param.copy_(value)`` is a local copy
  (``load_state_dict(assign=True)`` assigns that DTensor, which ``FSDPParam.replace_sharded_param``
  takes as the new shard).

Each hook handles exactly "its" entries: its group's parameters, plus the buffers and unmanaged
parameters of its subtree that no nested ``fully_shard`` module owns.

``torch.compile(model)`` returns a wrapper (``OptimizedModule``) that holds the model as its
child ``_orig_mod``, so nn.Module would prefix every key with ``_orig_mod.``. A global
module-registration hook (installed by the first ``fully_shard``) sees the wrapper adopt a model
with ``fully_shard`` modules and gives the wrapper two hooks: after save, strip the prefix; before
load, add it to keys that lack it. Both spellings load; ``get_state_dict`` / ``set_state_dict``
and ``model.compile()`` (in place, no wrapper) give the original names as well. DCP's
``get_state_dict`` is the one caller that is handed the prefixed keys: it maps them itself.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import warnings
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_compile.api import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from fsdp_compile.collectives import CollectiveRecord, all_gather_single, record
from fsdp_compile.param import FSDPParam
from fsdp_compile.param_group import TrainingState
from fsdp_compile.state import FSDPState, all_states_under, state_of

__all__ = ["state_dict_type", "get_state_dict_type", "unshard_params", "register_state_dict_hooks"]

_COMPILE_WRAPPER_CHILD = "_orig_mod"


_DEFAULT_SETTINGS = StateDictSettings(StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig())
_CONFIG_CLASS = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig,
    StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig,
}
# The settings of each state; a weak mapping so a dropped model takes its settings with it.
_settings: "weakref.WeakKeyDictionary[FSDPState, StateDictSettings]" = weakref.WeakKeyDictionary()
# States whose parameters are exposed unsharded by an open unshard_params context.
_summoned: "weakref.WeakSet[FSDPState]" = weakref.WeakSet()
_LOCAL_WORLD_KEY = "fsdp_compile_local_shard_world_size"


# --- choosing the kind ----------------------------------------------------------------------------


class state_dict_type:  # noqa: N801 - used like FSDP1's function-style context manager
    """Set which state dict the ``fully_shard`` modules under ``module`` save and load.

    Takes effect when called; used as a context manager, restores the previous settings on exit
    (FSDP1's ``FSDP.state_dict_type`` / ``set_state_dict_type``).

    Example::

        with fsdp_compile.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                          FullStateDictConfig(rank0_only=True, offload_to_cpu=True)):
            full = model.state_dict()        # plain tensors on rank 0, {} elsewhere
        model.load_state_dict(full)            # default again: sharded; full tensors are accepted too
    """

    def __init__(self, module: nn.Module, state_dict_type: StateDictType, state_dict_config: StateDictConfig | None = None) -> None:
        if not isinstance(state_dict_type, StateDictType):
            raise TypeError(f"state_dict_type takes a StateDictType member, got {state_dict_type!r}")
        config_class = _CONFIG_CLASS[state_dict_type]
        config = config_class() if state_dict_config is None else state_dict_config
        if type(config) is not config_class:
            raise ValueError(
                f"{state_dict_type.name} takes a {config_class.__name__}, got {type(config).__name__}; "
                f"pass {config_class.__name__}(...) or None"
            )
        states = all_states_under([module])
        if not states:
            raise ValueError(f"state_dict_type: no fully_shard module in this {type(module).__name__}; apply fully_shard first")
        self._previous = {state: get_state_dict_type(state) for state in states}
        for state in states:
            _settings[state] = StateDictSettings(state_dict_type, config)

    def __enter__(self) -> "state_dict_type":
        return self

    def __exit__(self, *exc: Any) -> None:
        for state, settings in self._previous.items():
            _settings[state] = settings


def get_state_dict_type(module_or_state: nn.Module | FSDPState) -> StateDictSettings:
    """The settings a ``fully_shard`` module's state-dict hooks use now."""
    state = module_or_state if isinstance(module_or_state, FSDPState) else state_of(module_or_state)
    if state is None:
        raise ValueError(f"get_state_dict_type takes a module fully_shard was applied to, got {type(module_or_state).__name__}")
    return _settings.get(state, _DEFAULT_SETTINGS)


# --- hooks ------------------------------------------------------------------------------------------


def register_state_dict_hooks(state: FSDPState) -> None:
    """Called by ``fully_shard``; see [Note: state dicts go through hooks on each fully_shard module]."""
    for index, module in enumerate(state.modules):
        module.register_state_dict_pre_hook(functools.partial(_pre_state_dict_hook, state))
        module.register_state_dict_post_hook(functools.partial(_post_state_dict_hook, state, index))
        module.register_load_state_dict_pre_hook(functools.partial(_pre_load_state_dict_hook, state, index))
    _install_compile_wrapper_hook()


@functools.cache
def _install_compile_wrapper_hook() -> None:
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


def _inside_dcp_get_state_dict() -> bool:
    """Whether DCP's ``get_state_dict`` helper is asking: it maps the wrapper's keys to FQNs itself
    and asserts that the ``_orig_mod`` prefix is there, so it must get them as nn.Module makes them."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    helper = getattr(dcp_state_dict, "_get_model_state_dict", None)
    helper_code = getattr(inspect.unwrap(helper), "__code__", None) if helper is not None else None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is helper_code:
            return True
        frame = frame.f_back
    return False


def _strip_compile_wrapper_prefix(module: nn.Module, destination: dict, prefix: str, local_metadata: dict) -> None:
    if _inside_dcp_get_state_dict():
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


def _reshard_for(state: FSDPState, action: str) -> None:
    """Make the registered parameters the sharded ones, or say why that is not possible now."""
    if state in _summoned:
        raise RuntimeError(
            f"fsdp_compile: {action} on '{state.label}' inside unshard_params(): the module holds temporary full "
            "parameters there. Call it after the `with unshard_params(...)` block."
        )
    group = state.group
    if group is None:
        return
    if group.training_state != TrainingState.IDLE or state.training_state != TrainingState.IDLE:
        busy = group.training_state if group.training_state != TrainingState.IDLE else state.training_state
        raise RuntimeError(
            f"fsdp_compile: {action} on '{state.label}' while it is in {busy.name}: its parameters are unsharded "
            "and in use. Call it outside forward/backward (e.g. after loss.backward() or before the next forward)."
        )
    group.reshard()


def _pre_state_dict_hook(state: FSDPState, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _reshard_for(state, "state_dict()")


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
                # Every rank takes part in the all-gather, also those that drop the result.
                value = _gather_full(fsdp_param.local_shard(), fsdp_param, "state_dict").detach()
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
    _reshard_for(state, "load_state_dict()")
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


def _gather_full(local: torch.Tensor, fsdp_param: FSDPParam, reason: str) -> torch.Tensor:
    """The full tensor from each rank's shard of it (``local``), in ``local``'s dtype.

    Plain collectives over the shard group, outside the runtime's all-gather: the result is in the
    parameters' own dtype (FSDP1 forces full precision here), not in ``param_dtype``.
    """
    info = fsdp_param.mesh_info
    layout = fsdp_param.layout
    local = local.detach().to(fsdp_param.device)  # CPU-offloaded shards travel over the device's backend
    if info.shard_size == 1:
        return local.clone()
    send = layout.padded_dim0_shard(local)
    gathered = torch.empty((layout.chunk * info.shard_size, *send.shape[1:]), dtype=local.dtype, device=local.device)
    record(CollectiveRecord("all_gather", fsdp_param.fqn, send.numel(), send.dtype, reason))
    all_gather_single(gathered, send, group=info.shard_group)
    full = layout.full_from_gathered(gathered)
    # A copy when the result is a view of padding or of the dim-0 layout: it outlives the buffer.
    return full if full.is_contiguous() and full.numel() == gathered.numel() else full.clone(memory_format=torch.contiguous_format)


def _padded_local_shard(fsdp_param: FSDPParam) -> torch.Tensor:
    layout = fsdp_param.layout
    local = fsdp_param.local_shard().detach()
    padded = local.new_zeros(layout.padded_shard_shape)
    padded.narrow(layout.dim, 0, layout.rows()).copy_(local)
    return padded


def _sharded_from_rows(rows_tensor: torch.Tensor, fsdp_param: FSDPParam) -> DTensor:
    target = fsdp_param.local_shard()
    local = rows_tensor.detach().to(device=target.device).clone(memory_format=torch.contiguous_format)
    return DTensor.from_local(
        local, fsdp_param.mesh_info.mesh, fsdp_param.placements, run_check=False,
        shape=fsdp_param.orig_size, stride=fsdp_param.sharded_param.stride(),
    )


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
        if value.device_mesh == info.mesh and tuple(value.placements) == fsdp_param.placements:
            return value
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor):
        return value  # nn.Module reports the type error with the key
    if tuple(value.shape) != tuple(fsdp_param.orig_size):
        raise ValueError(
            f"fsdp_compile: size mismatch for '{key}': the state dict has shape {tuple(value.shape)}, the model's "
            f"parameter is {tuple(fsdp_param.orig_size)}. Load a state dict saved from the same model definition."
        )
    return _sharded_from_rows(layout.shard_of(value), fsdp_param)


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


# --- unshard_params -------------------------------------------------------------------------------


@contextlib.contextmanager
def unshard_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Expose full parameters as plain tensors on the module (FSDP1's ``summon_full_params``).

    Collective: every rank must enter. Inside, ``module.<name>`` is a full ``nn.Parameter`` in the
    parameter's own dtype (not ``param_dtype``); on exit the sharded ``DTensor`` parameters return.

    Args:
        recurse: also the ``fully_shard`` modules nested in ``module`` (else only ``module``'s own group).
        writeback: copy in-place edits of the full parameters (and of their ``.grad`` with
            ``with_grads``) back into the shards on exit.
        rank0_only: only rank 0 sees full parameters; the others keep the sharded ones.
            Incompatible with ``writeback``.
        offload_to_cpu: the full parameters are CPU tensors (pair with ``rank0_only`` to keep
            one copy per machine).
        with_grads: the full parameters' ``.grad`` is the all-gathered sharded gradient.

    Example::

        with fsdp_compile.unshard_params(model):
            model.head.weight.mul_(0.5)         # written back into each rank's shard
        with fsdp_compile.unshard_params(model, writeback=False, rank0_only=True):
            if dist.get_rank() == 0:
                print(model.head.weight.norm())
    """
    states = all_states_under([module]) if recurse else [s for s in [state_of(module)] if s is not None]
    if not states:
        raise ValueError(
            f"unshard_params: no fully_shard module in this {type(module).__name__}"
            + ("" if recurse else " (recurse=False takes the fully_shard module itself)")
        )
    _check_unshard_params_args(states, writeback, rank0_only, offload_to_cpu, with_grads)
    for state in states:
        if state in _summoned:
            raise RuntimeError(
                f"fsdp_compile: unshard_params() entered for '{state.label}' inside another unshard_params() that "
                "already exposes it; nesting is not supported. Use one context around the code that needs them."
            )
    for state in states:
        _reshard_for(state, "unshard_params()")
    exposed: list[tuple[FSDPParam, nn.Parameter]] = []
    show = not rank0_only or dist.get_rank() == 0
    _summoned.update(states)
    try:
        for state in states:
            if state.group is None:
                continue
            for fsdp_param in state.group.fsdp_params:
                full, grad = _gather_param_and_grad(fsdp_param, with_grads)
                if not show:
                    continue
                if offload_to_cpu:
                    full = full.cpu()
                full_param = nn.Parameter(full, requires_grad=fsdp_param.sharded_param.requires_grad)
                full_param.grad = grad
                for ref in fsdp_param.refs:
                    # Registration only (see param._set_on_module): tied names share one full tensor.
                    ref.module._parameters[ref.name] = full_param
                exposed.append((fsdp_param, full_param))
        yield
    finally:
        try:
            if writeback:
                for fsdp_param, _ in exposed:
                    _write_back(fsdp_param, with_grads)
        finally:
            for fsdp_param, _ in exposed:
                for ref in fsdp_param.refs:
                    ref.module._parameters[ref.name] = fsdp_param.sharded_param
            for state in states:
                _summoned.discard(state)


def _check_unshard_params_args(states: list[FSDPState], writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> None:
    """FSDP1's summon_full_params argument rules, with the fix in each message."""
    if with_grads and offload_to_cpu:
        raise NotImplementedError(
            "unshard_params(with_grads=True, offload_to_cpu=True) is not supported: gradients stay on the device. "
            "Use offload_to_cpu=False with with_grads=True, or read the gradients in a second context."
        )
    one_rank = [s.label for s in states if s.group is not None and s.group.mesh_info.shard_size == 1]
    if offload_to_cpu and one_rank:
        raise NotImplementedError(
            f"unshard_params(offload_to_cpu=True) on groups sharded over one rank (NO_SHARD-like: {one_rank}) is not "
            "supported: their parameters are already full. Use offload_to_cpu=False and copy what you need to CPU."
        )
    if writeback and rank0_only:
        raise NotImplementedError(
            "unshard_params(writeback=True, rank0_only=True) is not supported: the other ranks never see the edits. "
            "Pass writeback=False with rank0_only=True, or rank0_only=False to edit on every rank."
        )
    if with_grads:
        for state in states:
            if state.group is not None and any(p.unsharded_accumulated_grad is not None for p in state.group.fsdp_params):
                raise NotImplementedError(
                    f"unshard_params(with_grads=True): '{state.label}' holds gradients accumulated without sync "
                    "(set_requires_gradient_sync(False)); run a backward with gradient sync first."
                )
    if offload_to_cpu and not rank0_only:
        warnings.warn(
            "unshard_params(offload_to_cpu=True, rank0_only=False) copies the full parameters to CPU on every rank, "
            "which may run a machine out of CPU memory; prefer rank0_only=True with offload_to_cpu=True.",
            stacklevel=3,
        )


def _gather_param_and_grad(fsdp_param: FSDPParam, with_grads: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    full = _gather_full(fsdp_param.local_shard(), fsdp_param, "unshard_params")
    sharded_grad = fsdp_param.sharded_param.grad
    if not with_grads or sharded_grad is None:
        return full, None
    return full, _gather_full(sharded_grad._local_tensor, fsdp_param, "unshard_params-grad")


def _write_back(fsdp_param: FSDPParam, with_grads: bool) -> None:
    """Copy this rank's rows of the (possibly edited or reassigned) full parameter into its shard."""
    ref = fsdp_param.refs[0]
    full = ref.module._parameters[ref.name]
    if full is None or tuple(full.shape) != tuple(fsdp_param.orig_size):
        raise RuntimeError(
            f"fsdp_compile: unshard_params(writeback=True): '{fsdp_param.fqn}' was replaced by a tensor of shape "
            f"{None if full is None else tuple(full.shape)}; the shard needs shape {tuple(fsdp_param.orig_size)}. "
            "Edit parameters in place (e.g. param.copy_(...)) inside the context."
        )
    layout = fsdp_param.layout
    with torch.no_grad():
        local = fsdp_param.local_shard()
        local.copy_(layout.shard_of(full.detach()))
        if with_grads and full.grad is not None:
            grad_rows = layout.shard_of(full.grad.detach())
            sharded_grad = fsdp_param.sharded_param.grad
            if sharded_grad is None:
                fsdp_param.set_sharded_grad(grad_rows.to(local.dtype).clone())
            else:
                sharded_grad._local_tensor.copy_(grad_rows)
