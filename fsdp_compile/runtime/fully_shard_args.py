"""What ``fully_shard`` takes, checked before anything is sharded, and how it shards it: which
parameters a call owns, the dim each is sharded on, their tensor-parallel layout, the mesh checks.
Every error names the module, the parameter and the fix.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from fsdp_compile.api import CommPolicy
from fsdp_compile.runtime.mesh import MeshInfo, TensorParallelLayout, tensor_parallel_layout
from fsdp_compile.runtime.param import ParamRef
from fsdp_compile.runtime.state import state_of

__all__ = [
    "OWNER_ATTR", "check_comm", "check_comm_policy", "shard_dim", "tensor_parallel_layout_of", "label_groups", "check_reshard_after_forward",
    "collect_params", "check_params", "check_param_device", "move_buffers",
]

# Set on each original parameter a fully_shard call takes: the call's label. An attribute, not a
# weak mapping: tensors compare elementwise, and weak references block torch.utils.swap_tensors.
OWNER_ATTR = "_fsdp_compile_owner"


def check_comm_policy(policy: CommPolicy, post_forward_size: int, label: str) -> None:
    if not isinstance(policy, CommPolicy):
        raise TypeError(f"fully_shard({label}): comm_policy takes a fsdp_compile.CommPolicy, got {type(policy).__name__}")
    policy.check(label)  # integer parameters are refused for every policy by check_params
    if post_forward_size and policy.quantizes_all_gather:
        raise ValueError(
            f"fully_shard({label}): an int reshard_after_forward re-gathers full-precision post-forward shards, which "
            "CommPolicy's quantized all-gather does not do; pass reshard_after_forward=True or False"
        )


def shard_dim(param: nn.Parameter, name: str, shard_placement_fn: Callable | None, info: MeshInfo, label: str) -> int:
    """The dim ``shard_placement_fn`` shards ``param`` on (0 without one), checked."""
    from torch.distributed.tensor import DTensor, Shard

    placement = None if shard_placement_fn is None else shard_placement_fn(param)
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise ValueError(
            f"fully_shard({label}): shard_placement_fn returned {placement!r} for '{name}'; it must return "
            "Shard(dim) or None. A per-parameter mesh (ShardPlacementResult) is not supported: shard such "
            "parameters (e.g. MoE experts) with a separate fully_shard call on their own mesh."
        )
    dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.dim():
        # FSDP2's exception type and words (_fsdp_param.py), then ours.
        raise AssertionError(
            f"Shard dim {dim} is invalid for {param.dim()}D tensor: {param.shape}. fully_shard({label}): "
            f"shard_placement_fn returned Shard({placement.dim}) for the {param.dim()}-D '{name}'; return a dim "
            f"below {param.dim()}, or None for Shard(0)."
        )
    is_tp = isinstance(param, DTensor)
    shape = param._local_tensor.shape if is_tp else param.shape  # FSDP splits the tensor-parallel piece
    if dim > 0 and shape[dim] % info.shard_size != 0:
        piece = " in its tensor-parallel piece" if is_tp else ""
        # FSDP2's exception type and words (_fsdp_param.py), then ours.
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {tuple(shape)} (world size: {info.shard_size}). "
            f"fully_shard({label}): '{name}' has {shape[dim]} entries on dim {dim}{piece}, which do not split evenly "
            f"over the {info.shard_size} shard ranks. Sharding on a dim > 0 must be even: return Shard(0) for this "
            "parameter, or pad its shape."
        )
    return dim


def tensor_parallel_layout_of(
    param: nn.Parameter, name: str, shard_dim: int, info: MeshInfo, label: str, post_forward_size: int
) -> TensorParallelLayout | None:
    """How FSDP composes with ``param`` when it is a DTensor (tensor parallel), checked; None for a plain tensor."""
    from torch.distributed.tensor import DTensor

    where = f"fully_shard({label}): parameter '{name}'"
    if not isinstance(param, DTensor):
        if info.spmd_mesh is not None:
            raise ValueError(
                f"{where} is a plain tensor, but with dp_mesh_dims every parameter must be a DTensor on the mesh passed to "
                "fully_shard (replicated on its data-parallel dims): distribute it (distribute_tensor(p, mesh, "
                "[Replicate()] * mesh.ndim)), or pass mesh=<the dp sub-mesh> without dp_mesh_dims."
            )
        return None
    if post_forward_size:
        raise NotImplementedError(
            f"{where} is a tensor-parallel DTensor, and reshard_after_forward=<int> is not supported with tensor "
            "parallelism (as in FSDP2); use reshard_after_forward=True or False."
        )
    return tensor_parallel_layout(param, info, shard_dim, where)


def label_groups(modules: tuple[nn.Module, ...]) -> None:
    """Name groups by their path from the outermost fully_shard module ("layers.3"), for logs and errors."""
    for root in modules:
        for name, module in root.named_modules():
            state = state_of(module)
            if name and state is not None and state.group is not None and state.group.modules[0] is module:
                state.group.label = name


def check_reshard_after_forward(value: bool | int | None, info: MeshInfo, label: str) -> int:
    """The post-forward group size for an int ``reshard_after_forward``, else 0."""
    if value is None or isinstance(value, bool):
        return 0
    if not isinstance(value, int) or value < 1 or info.shard_size % value != 0:
        raise ValueError(
            f"fully_shard({label}): reshard_after_forward={value!r} must divide the shard mesh size "
            f"{info.shard_size} (e.g. the ranks per node); use True or False otherwise"
        )
    return 0 if value in (1, info.shard_size) else value


def collect_params(
    modules: tuple[nn.Module, ...], ignored: set[int], label: str
) -> tuple[list[nn.Parameter], dict[int, list[ParamRef]]]:
    """Parameters of ``modules`` not owned by an earlier fully_shard on a submodule, with every
    place each is registered (tied parameters appear under several names).

    A module PyTorch's own FSDP (fully_shard or FullyShardedDataParallel) manages holds parameters
    in that library's layout, which ours would shard a second time: refused by name on the way."""
    from torch.distributed.fsdp import FSDPModule as PyTorchFSDPModule, FullyShardedDataParallel

    params: list[nn.Parameter] = []
    refs: dict[int, list[ParamRef]] = {}
    seen_slots: set[tuple[int, str]] = set()
    root_ids = {id(m) for m in modules}

    def visit(module: nn.Module, prefix: str) -> None:
        if isinstance(module, (PyTorchFSDPModule, FullyShardedDataParallel)):
            where = f"submodule '{prefix.rstrip('.')}'" if prefix else "the module itself"
            raise ValueError(
                f"fully_shard({label}): {where} ({type(module).__name__}) is already sharded by PyTorch's FSDP "
                "(torch.distributed.fsdp); one model takes one FSDP. Apply fsdp_compile.fully_shard to that module "
                "too (from fsdp_compile import fully_shard), blocks first, then the model."
            )
        for name, param in module._parameters.items():
            if param is None or id(param) in ignored or (id(module), name) in seen_slots:
                continue
            seen_slots.add((id(module), name))
            if id(param) not in refs:
                params.append(param)
                refs[id(param)] = []
            refs[id(param)].append(ParamRef(module, name, prefix + name))
        for child_name, child in module._modules.items():
            if child is None or (state_of(child) is not None and id(child) not in root_ids):
                continue
            visit(child, f"{prefix}{child_name}.")

    for index, module in enumerate(modules):
        visit(module, "" if len(modules) == 1 else f"[{index}].")
    return params, refs


def check_params(params: list[nn.Parameter], refs: dict[int, list[ParamRef]], device: torch.device, label: str) -> None:
    """Everything that would make a later collective hang or compute garbage, said up front."""
    for param in params:
        name = refs[id(param)][0].fqn
        owner = getattr(param, OWNER_ATTR, None)
        # A DTensor without an owner is the user's (tensor parallel): tensor_parallel_layout_of checks it.
        if owner is not None:
            raise ValueError(
                f"fully_shard({label}): parameter '{name}' is already managed by fully_shard({owner}). "
                "A parameter shared by several modules (tied weights) must belong to one group: apply fully_shard "
                "to a common ancestor of all the modules that use it, or pass them together as a list."
            )
        if not param.is_floating_point():
            raise ValueError(
                f"fully_shard({label}): parameter '{name}' has dtype {param.dtype}; only floating-point parameters "
                "can be sharded. Register it as a buffer, or pass it in ignored_params."
            )
        if param.dim() == 0:
            raise ValueError(
                f"fully_shard doesn't support scalar parameters: fully_shard({label}): parameter '{name}' is 0-dim; "
                "give it shape (1,) to shard it on dim 0"
            )
    devices = _first_name_per(params, refs, lambda param: param.device)
    if len(devices) > 1:
        listed = ", ".join(f"'{name}' on {dev}" for dev, name in devices.items())
        raise ValueError(
            f"fully_shard({label}): parameters sit on different devices ({listed}); move the module to one device "
            "(or materialize meta parameters with to_empty) before fully_shard"
        )
    for param_device, name in devices.items():
        check_param_device(label, name, param_device, device)
    # Frozen parameters may differ: see [Note: frozen parameters of another dtype] in param_group.py.
    dtypes = _first_name_per([p for p in params if p.requires_grad], refs, lambda param: param.dtype)
    if len(dtypes) > 1:
        listed = ", ".join(f"'{name}' is {dtype}" for dtype, name in dtypes.items())
        raise ValueError(
            f"fully_shard({label}): the parameters that require gradients need one dtype in a group (FSDP expects "
            f"uniform original parameter dtype), but {listed}. Convert the module to one dtype (module.to(dtype)) and "
            "use MixedPrecisionPolicy for low precision, or shard the differently-typed submodules with separate "
            "fully_shard calls."
        )


def _first_name_per(params: list[nn.Parameter], refs: dict[int, list[ParamRef]], key: Callable[[nn.Parameter], Any]) -> dict[Any, str]:
    """One example parameter name for each distinct ``key`` (device, dtype), for error messages."""
    names: dict[Any, str] = {}
    for param in params:
        names.setdefault(key(param), refs[id(param)][0].fqn)
    return names


def check_param_device(label: str, param_name: str, param_device: torch.device, mesh_device: torch.device) -> None:
    """Parameters may start on CPU or meta (moved/sharded onto the mesh device), else must match it."""
    if param_device.type in ("cpu", "meta") or param_device.type == mesh_device.type:
        return
    raise ValueError(
        f"fully_shard({label}): parameter '{param_name}' is on {param_device} but the mesh is on {mesh_device.type}. "
        f"Build the mesh for the parameters' device (init_device_mesh('{param_device.type}', ...)) or move the module "
        f"to {mesh_device.type} first."
    )


def move_buffers(modules: tuple[nn.Module, ...], device: torch.device) -> None:
    for module in modules:
        for submodule in module.modules():
            for name, buffer in submodule._buffers.items():
                if buffer is not None and buffer.device != device and buffer.device.type != "meta":
                    submodule._buffers[name] = buffer.to(device)


def check_comm(comm: Any, method: str, label: str) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method} on '{label}' takes an FSDP2 Comm object (torch.distributed.fsdp's AllGather / ReduceScatter, "
            f"or any object with allocate(size, *, dtype, device) and __call__), got {type(comm).__name__}"
        )
