"""FSDPParam: one parameter's sharded and unsharded views and the switch between them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_compile.mesh import MeshInfo, PostForwardMeshInfo
from fsdp_compile.traceable import TraceInfo

__all__ = ["ShardedState", "ParamRef", "FSDPParam", "shard_rows"]


class ShardedState(Enum):
    """What the module's attributes hold for a group's parameters."""

    SHARDED = auto()  # the sharded DTensor parameters (between steps; what the optimizer sees)
    SHARDED_POST_FORWARD = auto()  # sharded over the smaller post-forward group (reshard_after_forward=<int>)
    UNSHARDED = auto()  # full plain-tensor parameters (during forward/backward)


@dataclass(frozen=True)
class ParamRef:
    """One place a parameter is registered: ``module.<name>``, reachable as ``fqn`` from the root."""

    module: nn.Module
    name: str
    fqn: str


def shard_rows(dim0: int, world_size: int, rank: int) -> tuple[int, int, int]:
    """(rows per rank after padding, first row of ``rank``, rows ``rank`` really holds).

    Same split as ``torch.chunk`` and DTensor's ``Shard(0)``: ceil-sized chunks, the last
    ranks holding fewer (possibly zero) rows.
    """
    padded_rows = math.ceil(dim0 / world_size) if dim0 else 0
    start = min(rank * padded_rows, dim0)
    return padded_rows, start, max(0, min(padded_rows, dim0 - start))


def _set_on_module(ref: ParamRef, value: nn.Parameter) -> None:
    # Bypasses nn.Module.__setattr__, which would reject swapping a Parameter for a
    # differently-typed one and is slower; the registration itself is all we change.
    ref.module._parameters[ref.name] = value


class FSDPParam:
    """Owns one parameter's dim-0 shard (a DTensor ``nn.Parameter``) and its unsharded twin.

    [Note: unsharded parameter storage]
    The unsharded parameter is one ``nn.Parameter`` kept for the module's lifetime; only its
    storage comes and goes (``untyped_storage().resize_``). Autograd saves that same tensor
    for backward, so freeing the storage after forward really frees the memory, and refilling
    it before backward makes the saved tensor valid again. Writes go through ``.data`` so the
    version counter autograd checks is not bumped by our refills.
    """

    def __init__(
        self,
        param: nn.Parameter,
        refs: list[ParamRef],
        mesh_info: MeshInfo,
        post_forward_mesh_info: PostForwardMeshInfo | None,
        device: torch.device,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        offload_to_cpu: bool,
        pin_memory: bool,
    ) -> None:
        self.refs = refs
        self.fqn = refs[0].fqn
        self.mesh_info = mesh_info
        self.post_forward_mesh_info = post_forward_mesh_info
        self.device = device
        self.offload_to_cpu = offload_to_cpu
        self.pin_memory = pin_memory
        self.orig_size = param.shape
        self.orig_dtype = param.dtype
        self.param_dtype = param_dtype if param_dtype is not None else param.dtype
        self.reduce_dtype = reduce_dtype if reduce_dtype is not None else self.param_dtype
        self.sharded_param = self._make_sharded_param(param)
        self._unsharded_param: nn.Parameter | None = None
        self.post_forward_shard: torch.Tensor | None = None
        # Gradient kept unsharded across no-sync steps (set_requires_gradient_sync(False)).
        self.unsharded_accumulated_grad: torch.Tensor | None = None
        self.sharded_state = ShardedState.SHARDED
        # What a read of this parameter traces to under torch.compile (set by its group).
        self.trace_info: TraceInfo | None = None
        for ref in refs:
            _set_on_module(ref, self.sharded_param)

    # --- layout -----------------------------------------------------------------------
    @property
    def row_numel(self) -> int:
        return math.prod(self.orig_size[1:])

    @property
    def padded_shard_numel(self) -> int:
        return shard_rows(self.orig_size[0], self.mesh_info.shard_size, 0)[0] * self.row_numel

    @property
    def padded_post_forward_numel(self) -> int:
        assert self.post_forward_mesh_info is not None
        return shard_rows(self.orig_size[0], self.post_forward_mesh_info.shard_size, 0)[0] * self.row_numel

    @property
    def shard_device(self) -> torch.device:
        return torch.device("cpu") if self.offload_to_cpu else self.device

    def _make_sharded_param(self, param: nn.Parameter) -> nn.Parameter:
        _, start, rows = shard_rows(self.orig_size[0], self.mesh_info.shard_size, self.mesh_info.shard_rank)
        # Meta parameters stay on meta until the user materializes them (module.to_empty).
        target = param.device if param.device.type == "meta" else self.shard_device
        local = param.detach().narrow(0, start, rows).to(target).clone(memory_format=torch.contiguous_format)
        if self.offload_to_cpu and self.pin_memory and local.device.type == "cpu" and torch.cuda.is_available():
            local = local.pin_memory()
        dtensor = DTensor.from_local(
            local, self.mesh_info.mesh, self.mesh_info.placements, run_check=False,
            shape=self.orig_size, stride=torch.empty(self.orig_size, device="meta").stride(),
        )
        return nn.Parameter(dtensor, requires_grad=param.requires_grad)

    def local_shard(self) -> torch.Tensor:
        """This rank's (unpadded) shard, read live so optimizer updates and ``.data`` swaps are seen."""
        local = self.sharded_param._local_tensor
        if not local.is_contiguous():
            raise RuntimeError(
                f"the local shard of '{self.fqn}' became non-contiguous (stride {local.stride()}); "
                "assign contiguous tensors to sharded parameters"
            )
        return local

    def all_gather_input(self) -> torch.Tensor:
        """What this rank contributes to the next all-gather, on the device."""
        if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
            assert self.post_forward_shard is not None
            return self.post_forward_shard
        shard = self.local_shard()
        if shard.device != self.device:  # CPU offload
            shard = shard.to(self.device, non_blocking=True)
        return shard

    # --- unsharded parameter ---------------------------------------------------------------
    @property
    def unsharded_param(self) -> nn.Parameter:
        """The persistent unsharded parameter; see [Note: unsharded parameter storage]."""
        if self._unsharded_param is None:
            data = torch.empty(self.orig_size, dtype=self.param_dtype, device=self.device)
            self._unsharded_param = nn.Parameter(data, requires_grad=self.sharded_param.requires_grad)
            self._unsharded_param.untyped_storage().resize_(0)
        return self._unsharded_param

    def unsharded_data_for_copy_out(self) -> torch.Tensor:
        """The unsharded parameter's data with storage allocated, ready to be filled."""
        param = self.unsharded_param
        storage = param.untyped_storage()
        nbytes = param.numel() * param.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
        param.requires_grad_(self.sharded_param.requires_grad)
        return param.data

    def free_unsharded(self) -> None:
        if self._unsharded_param is not None:
            self._unsharded_param.untyped_storage().resize_(0)

    def unsharded_storage_bytes(self) -> int:
        return 0 if self._unsharded_param is None else self._unsharded_param.untyped_storage().size()

    # --- state transitions ----------------------------------------------------------------
    def to_unsharded(self) -> None:
        for ref in self.refs:
            _set_on_module(ref, self.unsharded_param)
        self.post_forward_shard = None
        self.sharded_state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        for ref in self.refs:
            _set_on_module(ref, self.sharded_param)
        self.free_unsharded()
        self.post_forward_shard = None
        self.sharded_state = ShardedState.SHARDED

    def to_sharded_post_forward(self) -> None:
        """Keep only this rank's rows of the smaller post-forward split; expose the sharded parameter."""
        info = self.post_forward_mesh_info
        assert info is not None and self.sharded_state == ShardedState.UNSHARDED
        _, start, rows = shard_rows(self.orig_size[0], info.shard_size, info.shard_rank)
        self.post_forward_shard = self.unsharded_param.data.narrow(0, start, rows).clone()
        for ref in self.refs:
            _set_on_module(ref, self.sharded_param)
        self.free_unsharded()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def reset_after_module_apply(self) -> None:
        """After ``module.to(...)``/``to_empty``: pick up the new local tensor, drop stale buffers."""
        registered = self.refs[0].module._parameters[self.refs[0].name]
        if isinstance(registered, nn.Parameter) and isinstance(registered.data, DTensor):
            self.sharded_param = registered
        local = self.sharded_param._local_tensor
        self.orig_dtype = local.dtype
        self._unsharded_param = None
        self.post_forward_shard = None

    # --- gradients --------------------------------------------------------------------------
    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Remove and return this step's unsharded gradient (plus any no-sync accumulation)."""
        param = self._unsharded_param
        grad = None if param is None else param.grad
        if param is not None:
            param.grad = None
        accumulated = self.unsharded_accumulated_grad
        self.unsharded_accumulated_grad = None
        if accumulated is None:
            return grad
        if grad is not None:
            accumulated += grad
        return accumulated

    def accumulate_unsharded_grad(self) -> None:
        """No-sync step: move the unsharded gradient aside (in ``reduce_dtype``) so params can reshard."""
        param = self._unsharded_param
        if param is None or param.grad is None:
            return
        grad = param.grad
        param.grad = None
        if self.unsharded_accumulated_grad is None:
            self.unsharded_accumulated_grad = grad.to(self.reduce_dtype)
        else:
            self.unsharded_accumulated_grad += grad

    def sharded_grad_out(self) -> tuple[torch.Tensor, bool]:
        """The local tensor the reduced gradient goes into, and whether a gradient already exists."""
        grad = self.sharded_param.grad
        if grad is None:
            # CPU offload: the new gradient lives on CPU from the start (pinned when asked), so the
            # reduced shard is copied into it once instead of allocated on the device and moved.
            local = torch.empty(self.local_shard().shape, dtype=self.orig_dtype, device=self.shard_device)
            if self.offload_to_cpu and self.pin_memory and torch.cuda.is_available():
                local = local.pin_memory()
            return local, False
        return grad._local_tensor, True

    def set_sharded_grad(self, local_grad: torch.Tensor) -> None:
        if self.sharded_param.grad is not None and self.sharded_param.grad._local_tensor is local_grad:
            return
        if local_grad.device != self.shard_device:
            local_grad = local_grad.to(self.shard_device, non_blocking=True)
        self.sharded_param.grad = DTensor.from_local(
            local_grad, self.mesh_info.mesh, self.mesh_info.placements, run_check=False,
            shape=self.orig_size, stride=self.sharded_param.stride(),
        )
