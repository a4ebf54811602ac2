"""FSDPParam: one parameter's sharded and unsharded views and the switch between them."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.nn.utils.stateless import _reparametrize_module

from fsdp_compile.api import MixedPrecisionPolicy
from fsdp_compile.runtime.layout import ShardLayout
from fsdp_compile.runtime.optimizer_check import mark_replaced, mark_unsharded
from fsdp_compile.runtime.mesh import MeshInfo, PostForwardMeshInfo, TensorParallelLayout

__all__ = ["ShardedState", "ParamRef", "FSDPParam"]


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




def _allocate_storage(tensor: torch.Tensor) -> None:
    """Give a tensor whose storage was freed (``resize_(0)``) its bytes back, in place."""
    storage = tensor.untyped_storage()
    nbytes = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if storage.size() < nbytes:
        storage.resize_(nbytes)


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
        mp_policy: MixedPrecisionPolicy,
        offload_to_cpu: bool,
        pin_memory: bool,
        shard_dim: int = 0,
        tensor_parallel: TensorParallelLayout | None = None,
    ) -> None:
        self.refs = refs
        self.fqn = refs[0].fqn
        self.mesh_info = mesh_info
        self.post_forward_mesh_info = post_forward_mesh_info
        self.device = device
        self.offload_to_cpu = offload_to_cpu
        self.pin_memory = pin_memory
        self.orig_size = param.shape  # the user's (global) shape
        # A DTensor parameter (tensor parallel): FSDP shards its local piece; see
        # [Note: FSDP over tensor-parallel parameters] in mesh.py.
        self.tensor_parallel = tensor_parallel
        local = param._local_tensor if tensor_parallel is not None else param
        if tensor_parallel is not None and hasattr(local, "fsdp_pre_all_gather"):
            raise NotImplementedError(
                f"fsdp_compile: '{self.fqn}' is a tensor-parallel DTensor whose local tensor has an all-gather extension "
                "(fsdp_pre_all_gather); the two together are not supported. Drop one of them for this parameter."
            )
        # See [Note: shard layout] in layout.py. Its shape is the local piece's (the user's shape without TP).
        self.layout = ShardLayout(tuple(local.shape), shard_dim, mesh_info.shard_size, mesh_info.shard_rank)
        self.post_forward_layout = (
            None if post_forward_mesh_info is None
            else self.layout.for_group(post_forward_mesh_info.shard_size, post_forward_mesh_info.shard_rank)
        )
        # The sharded parameter's DTensor mesh and placements.
        self.sharded_mesh = mesh_info.mesh if tensor_parallel is None else tensor_parallel.sharded_mesh
        self.placements = mesh_info.placements(shard_dim) if tensor_parallel is None else tensor_parallel.sharded_placements
        self._sharded_specs: dict[torch.dtype, DTensorSpec] = {}  # see sharded_dtensor
        # The policy's dtypes (None: follow the parameter's own dtype, also after module.to(dtype)).
        self.mp_policy = mp_policy
        self._set_dtypes(param.dtype)
        self.sharded_param = self._make_sharded_param(param)
        self._unsharded_param: nn.Parameter | None = None
        self.post_forward_shard: torch.Tensor | None = None
        self.index_in_group = 0  # its position in its group (set by the group)
        # All-gather extensions: see [Note: all-gather extensions].
        self._extension_metadata: Any = None
        self._extension_outputs: list[torch.Tensor] = []
        self._extension_inner_tensors: list[torch.Tensor] = []
        # The no-sync sum handed to a compiled forward by its root; see _stage_accumulated_grads.
        self.staged_accumulated_grad: torch.Tensor | None = None
        # The same for the reduce-scattered sum awaiting its all-reduce ([Note: deferred all-reduce]).
        self.staged_deferred_all_reduce: torch.Tensor | None = None
        # See [Note: late reduce-scatter wait across block frames] in frames.py: the sink its block
        # frame's graph hands its gradient over with, and the shard that graph reads, without the
        # autograd edge to the parameter that would run its post-accumulate-grad hooks a second time.
        self.gradient_handover_sink = torch.zeros(1, device=self.device, requires_grad=True)
        self.detached_sharded_param: torch.Tensor | None = None
        # Whether the sharded parameter required gradients as its block frame was last entered: what that
        # frame's trace reads instead of the parameter (a tensor it would guard on; [Note: a block frame's
        # guards] in compile/compiled_state.py).
        self.requires_grad_at_frame_entry = True
        self.sharded_state = ShardedState.SHARDED
        self.register_everywhere(self.sharded_param)

    def _set_dtypes(self, orig_dtype: torch.dtype) -> None:
        self.orig_dtype = orig_dtype
        self.param_dtype = self.mp_policy.param_dtype or orig_dtype
        self.reduce_dtype = self.mp_policy.reduce_dtype or self.param_dtype
        pending = getattr(self, "accumulation_sink", None)
        self.accumulation_sink = self._new_accumulation_sink()
        if pending is not None and pending.grad is not None:
            self.accumulation_sink.grad = pending.grad.to(self.reduce_dtype)
        deferred = getattr(self, "deferred_all_reduce_sink", None)
        self.deferred_all_reduce_sink = self._new_deferred_all_reduce_sink()
        if deferred is not None and deferred.grad is not None:
            self.deferred_all_reduce_sink.grad = deferred.grad.to(self.reduce_dtype)

    def _new_accumulation_sink(self) -> torch.Tensor:
        """[Note: no-sync accumulation]
        Between ``set_requires_gradient_sync(False)`` steps a parameter's unsharded gradient
        accumulates (in ``reduce_dtype``) in the ``.grad`` of this leaf, and the next synced step
        reduce-scatters it with that step's gradient. Eagerly, post-backward moves the gradient there
        (``unsharded_accumulated_grad``); compiled, the traced unshard routes the gradient to the
        leaf, so autograd accumulates it there, and the synced graph's root pre-forward takes the
        sum out of ``.grad`` for the traced unshard to add (the root's pre-forward, compile/param_reads.py). One place for
        both, so eager and compiled micro-batches can mix. The leaf has the parameter's full shape
        but, with zero strides, one element of storage.
        """
        shape = self.layout.shape
        sink = torch.empty_strided(shape, (0,) * len(shape), dtype=self.reduce_dtype, device=self.device)
        return sink.requires_grad_()

    @property
    def unsharded_accumulated_grad(self) -> torch.Tensor | None:
        """The unsharded gradient summed over no-sync steps; see [Note: no-sync accumulation]."""
        return self.accumulation_sink.grad

    @unsharded_accumulated_grad.setter
    def unsharded_accumulated_grad(self, value: torch.Tensor | None) -> None:
        self.accumulation_sink.grad = value

    def pop_accumulated_grad(self) -> torch.Tensor | None:
        """Remove and return the no-sync sum (None when there is none)."""
        accumulated = self.accumulation_sink.grad
        if accumulated is not None:
            self.accumulation_sink.grad = None
        return accumulated

    def _new_deferred_all_reduce_sink(self) -> torch.Tensor:
        """[Note: deferred all-reduce]
        HSDP with ``set_requires_all_reduce(False)``: a step reduce-scatters but leaves the sum across
        replicas for a later step. This parameter's reduce-scattered, not yet all-reduced sum waits
        (in ``reduce_dtype``, its padded shard in the dim-0 view) in the ``.grad`` of this leaf; the
        next step that all-reduces adds it first. Eagerly the reduction adds it there; compiled,
        the traced reduce-scatter returns it as this leaf's gradient, so autograd sums it across
        deferring steps (whose graphs never read it: one graph for all of them), and the
        all-reducing graph's root pre-forward takes it out (as for [Note: no-sync accumulation]).
        One element of storage, like the no-sync sink.
        """
        shape = self.layout.dim0_shape(self.layout.padded_shard_shape)
        sink = torch.empty_strided(shape, (0,) * len(shape), dtype=self.reduce_dtype, device=self.device)
        return sink.requires_grad_()

    def pop_deferred_all_reduce(self) -> torch.Tensor | None:
        """Remove and return the reduce-scattered sum awaiting its all-reduce (None when there is none)."""
        deferred = self.deferred_all_reduce_sink.grad
        if deferred is not None:
            self.deferred_all_reduce_sink.grad = None
        return deferred

    # --- registration on the modules ------------------------------------------------------------
    def register_everywhere(self, value: nn.Parameter) -> None:
        """Make ``value`` what every place of this parameter holds (tied names share it).

        The one writer of ``module._parameters`` for managed parameters (besides the traced,
        scoped ``parameters_placed_for_trace`` below): it bypasses nn.Module.__setattr__, which
        would reject swapping a Parameter for a differently-typed one (and which our
        traced-parameter class routes to ``replace_sharded_param``).
        """
        for ref in self.refs:
            ref.module._parameters[ref.name] = value

    def registered_value(self) -> nn.Parameter | None:
        return self.refs[0].module._parameters.get(self.refs[0].name)

    # --- layout -----------------------------------------------------------------------
    @property
    def padded_shard_numel(self) -> int:
        return self.layout.padded_shard_numel

    @property
    def padded_post_forward_numel(self) -> int:
        assert self.post_forward_layout is not None
        return self.post_forward_layout.padded_shard_numel

    @property
    def shard_device(self) -> torch.device:
        return torch.device("cpu") if self.offload_to_cpu else self.device

    @property
    def is_tensor_parallel(self) -> bool:
        return self.tensor_parallel is not None

    def sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's shard, or its gradient; detached) as the sharded parameter's kind of DTensor."""
        if self.tensor_parallel is not None:
            return self.tensor_parallel.sharded(local)
        # [Note: a sharded DTensor without from_local] Built from a spec kept per dtype, as FSDP2 builds
        # its shards and gradients: DTensor.from_local made a new spec (and a meta tensor for the
        # stride) for every parameter's gradient every step, the largest single host cost of our eager
        # step at world size 1, and it moves a CPU-offloaded shard onto a GPU mesh's device.
        spec = self._sharded_specs.get(local.dtype)
        if spec is None:
            stride = torch.empty(self.orig_size, device="meta").stride()
            spec = DTensorSpec(self.mesh_info.mesh, tuple(self.placements), tensor_meta=TensorMeta(self.orig_size, stride, local.dtype))
            self._sharded_specs[local.dtype] = spec
        # [Note: a DTensor made by its __new__] ``DTensor(...)`` is its C++ ``__new__`` followed by an
        # ``__init__`` that only calls ``Tensor.__init__`` (nothing) under ``torch._disable_dynamo``,
        # whose wrapper switches Dynamo's frame callback off and on: twice the cost of the tensor
        # itself, for every parameter's gradient every step. The same tensor without that call
        # (torch 2.13; tests/test_runtime.py checks it is one DTensor like the constructor's).
        return DTensor.__new__(DTensor, local, spec, requires_grad=False)

    def piece_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """What FSDP shards of a full (global) tensor: this rank's TP piece (the tensor itself without TP)."""
        return full if self.tensor_parallel is None else self.tensor_parallel.local_of_full(full)

    def shard_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard (unpadded rows) of a full (global) tensor: no communication."""
        return self.layout.shard_of(self.piece_of_full(full))

    def full_of_piece(self, piece: torch.Tensor) -> torch.Tensor:
        """The full (global) tensor from every TP rank's all-gathered piece (a TP collective; identity without TP)."""
        return piece if self.tensor_parallel is None else self.tensor_parallel.full_of_local(piece)

    def _make_sharded_param(self, param: torch.Tensor) -> nn.Parameter:
        # Meta parameters stay on meta until the user materializes them (module.to_empty).
        target = param.device if param.device.type == "meta" else self.shard_device
        piece = param.detach()._local_tensor if isinstance(param, DTensor) else self.piece_of_full(param.detach())
        local = self.layout.shard_of(piece).to(target).clone(memory_format=torch.contiguous_format)
        if self.offload_to_cpu and self.pin_memory and local.device.type == "cpu" and torch.cuda.is_available():
            local = local.pin_memory()
        return nn.Parameter(self.sharded_dtensor(local), requires_grad=param.requires_grad)

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
        """What this rank contributes to the next all-gather, on the device, in the dim-0 view
        (unpadded: the copy-in pads it; see [Note: shard layout])."""
        if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
            assert self.post_forward_shard is not None
            return self.post_forward_shard
        shard = self.local_shard()
        if shard.device != self.device:  # CPU offload
            shard = shard.to(self.device, non_blocking=True)
        return self.layout.to_dim0(shard).contiguous()

    # --- unsharded parameter ---------------------------------------------------------------
    @property
    def unsharded_param(self) -> nn.Parameter:
        """The persistent unsharded parameter; see [Note: unsharded parameter storage]."""
        if self._unsharded_param is None:
            data = torch.empty(self.layout.shape, dtype=self.param_dtype, device=self.device)
            data.untyped_storage().resize_(0)
            value = data if self.tensor_parallel is None else self.tensor_parallel.unsharded(data)
            self._set_unsharded_param(value)
        return self._unsharded_param

    def _set_unsharded_param(self, value: torch.Tensor) -> None:
        """The unsharded parameter over ``value``, marked for the optimizer check (an optimizer
        holding it would train nothing once the module is resharded)."""
        self._unsharded_param = nn.Parameter(value, requires_grad=self.sharded_param.requires_grad)
        mark_unsharded(self._unsharded_param, self.fqn)

    def _unsharded_storage_tensor(self) -> torch.Tensor:
        """The plain tensor whose storage the unsharded parameter lives in: itself, or with tensor
        parallelism the local tensor of its DTensor (which shares the storage)."""
        param = self.unsharded_param
        return param._local_tensor if self.tensor_parallel is not None else param

    def unsharded_data_for_copy_out(self) -> torch.Tensor:
        """Where the all-gather copy-out writes, contiguous in the dim-0 view: the unsharded
        parameter's data with its storage allocated, or for a parameter sharded on a dim > 0 a
        temporary that :meth:`finish_copy_out` moves into it."""
        param = self.unsharded_param
        data = param if self.tensor_parallel is None else param._local_tensor  # _unsharded_storage_tensor
        storage = data.untyped_storage()
        nbytes = data.nbytes
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        requires_grad = self.sharded_param.requires_grad
        if param.requires_grad != requires_grad:  # requires_grad_ is refused under torch.func
            param.requires_grad_(requires_grad)
        if self.layout.dim == 0:
            return data.data
        return torch.empty(self.layout.dim0_shape(), dtype=data.dtype, device=data.device)

    def finish_copy_out(self, written: torch.Tensor) -> None:
        """Place what the copy-out wrote (see :meth:`unsharded_data_for_copy_out`) in the parameter."""
        if self.layout.dim != 0:
            self._unsharded_storage_tensor().data.copy_(self.layout.from_dim0(written))

    def free_unsharded(self) -> None:
        if self._extension_outputs:
            for tensor in (*self._extension_outputs, *self._extension_inner_tensors):
                tensor.untyped_storage().resize_(0)
        elif self._unsharded_param is not None:
            self._unsharded_storage_tensor().untyped_storage().resize_(0)

    def unsharded_storage_bytes(self) -> int:
        if self._extension_outputs:
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().size() for t in (*self._extension_outputs, *self._extension_inner_tensors)}
            return sum(storages.values())
        return 0 if self._unsharded_param is None else self._unsharded_storage_tensor().untyped_storage().size()

    # --- all-gather extensions ------------------------------------------------------------------
    # [Note: all-gather extensions]
    # A local shard that defines FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (tensor
    # subclasses of float8 or NF4 training, or methods bound onto a plain local tensor) decides
    # what is sent and how the unsharded parameter is built from what arrives:
    #   pre(mesh, outer_size, outer_stride, module, mp_policy) -> (inputs, metadata)   (or pre(mesh))
    #   post(outputs, metadata, param_dtype)          -> (unsharded, inner tensors to free)  first time
    #   post(outputs, metadata, param_dtype, out=unsharded)                                     later
    # Each output is every rank's input concatenated on dim 0. The outputs are kept across steps:
    # resharding frees their storage and the inner tensors', unsharding reallocates it in place,
    # so a tensor saved for backward (the unsharded parameter) is valid again when refilled, as in
    # [Note: unsharded parameter storage]. A group holding such a parameter all-gathers every input
    # of every parameter as bytes in one buffer (``collectives.issue_packed_all_gather``).
    @property
    def uses_all_gather_extension(self) -> bool:
        local = self.sharded_param._local_tensor
        has_pre, has_post = hasattr(local, "fsdp_pre_all_gather"), hasattr(local, "fsdp_post_all_gather")
        if has_pre != has_post:
            raise ValueError(
                f"fsdp_compile: the local shard of '{self.fqn}' defines only one of fsdp_pre_all_gather / "
                "fsdp_post_all_gather; an all-gather extension needs both."
            )
        return has_pre

    def all_gather_inputs(self) -> list[torch.Tensor]:
        """What this rank sends for this parameter: the extension's inputs, or the padded dim-0 shard
        in ``param_dtype`` (see [Note: all-gather extensions])."""
        if not self.uses_all_gather_extension:
            return [self.layout.padded_dim0_shard(self.local_shard().to(self.device)).to(self.param_dtype)]
        local = self.local_shard()
        if local.device != self.device:
            local = local.to(self.device, non_blocking=True)
        pre = local.fsdp_pre_all_gather
        if len(inspect.signature(pre).parameters) == 1:
            inputs, self._extension_metadata = pre(self.mesh_info.shard_mesh)
        else:
            contiguous_stride = torch.empty(self.orig_size, device="meta").stride()
            inputs, self._extension_metadata = pre(self.mesh_info.shard_mesh, self.orig_size, contiguous_stride, self.refs[0].module, self.mp_policy)
        layout = self.layout
        if layout.rows() != layout.chunk and any(tuple(t.shape) != layout.padded_shard_shape for t in inputs):
            # As in FSDP2: only the ranks holding padding can see this; the others will wait.
            raise ValueError(
                f"fsdp_compile: '{self.fqn}' is sharded unevenly ({layout.size} rows over {layout.world_size} ranks) and "
                f"its fsdp_pre_all_gather returned shapes {[tuple(t.shape) for t in inputs]} on rank {layout.rank}; every "
                f"rank must send the padded shard shape {layout.padded_shard_shape}: pad inside fsdp_pre_all_gather."
            )
        return [t.contiguous() for t in inputs]

    def all_gather_output_buffers(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Where each input's gathered rows go (``world x`` the input's rows, contiguous, allocated)."""
        world = self.mesh_info.shard_size
        shapes = [(world * t.shape[0], *t.shape[1:]) if t.dim() else (world,) for t in inputs]
        if not self.uses_all_gather_extension:
            return [torch.empty(shape, dtype=t.dtype, device=self.device) for shape, t in zip(shapes, inputs)]
        if not self._extension_outputs:
            self._extension_outputs = [torch.empty(shape, dtype=t.dtype, device=self.device) for shape, t in zip(shapes, inputs)]
        for tensor in self._extension_outputs:
            _allocate_storage(tensor)
        return self._extension_outputs

    def finish_unshard_from_outputs(self, outputs: list[torch.Tensor]) -> None:
        """Build the unsharded parameter from the gathered outputs (the packed all-gather's copy-out)."""
        if not self.uses_all_gather_extension:
            (gathered,) = outputs
            target = self.unsharded_data_for_copy_out()
            target.copy_(gathered.narrow(0, 0, self.layout.size))  # both in the dim-0 view
            self.finish_copy_out(target)
            return
        local = self.sharded_param._local_tensor
        if self._unsharded_param is not None:
            for tensor in self._extension_inner_tensors:
                _allocate_storage(tensor)
            local.fsdp_post_all_gather(tuple(outputs), self._extension_metadata, self.param_dtype, out=self._unsharded_param)
            return
        unsharded, inner = local.fsdp_post_all_gather(tuple(outputs), self._extension_metadata, self.param_dtype)
        # [Note: the unsharded parameter is read from the start of what fsdp_post_all_gather returned]
        # FSDP2 takes the parameter's shape with contiguous strides over the storage of the returned
        # tensor, from its start, whatever that tensor's own size and stride: an extension may return
        # its data flat, or padded, and still train. We do the same so that an extension written for
        # FSDP2 builds the same parameter here; the ``out=`` calls of later steps then write into it.
        contiguous_stride = torch.empty(self.orig_size, device="meta").stride()
        unsharded = torch.as_strided(unsharded, self.orig_size, contiguous_stride, storage_offset=0)
        self._extension_inner_tensors = list(inner)
        self._set_unsharded_param(unsharded)

    # --- state transitions ----------------------------------------------------------------
    def to_unsharded(self) -> None:
        self.register_everywhere(self.unsharded_param)
        self.post_forward_shard = None
        self.sharded_state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        self.register_everywhere(self.sharded_param)
        self.free_unsharded()
        self.post_forward_shard = None
        self.sharded_state = ShardedState.SHARDED

    def to_sharded_post_forward(self) -> None:
        """Keep only this rank's rows of the smaller post-forward split; expose the sharded parameter."""
        layout = self.post_forward_layout
        assert layout is not None and self.sharded_state == ShardedState.UNSHARDED
        rows = layout.shard_of(self._unsharded_storage_tensor().data)
        self.post_forward_shard = layout.to_dim0(rows).clone(memory_format=torch.contiguous_format)
        self.register_everywhere(self.sharded_param)
        self.free_unsharded()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def replace_sharded_param(self, value: torch.Tensor) -> None:
        """Make ``value`` this parameter from now on, at every place it is registered.

        ``module.weight = nn.Parameter(full)`` after ``fully_shard`` (meta-device init, loading with
        ``assign=True``) goes through here: a full tensor of the original shape is sharded like the
        original was; a ``DTensor`` laid out like the shard is taken as it is.
        """
        if self.sharded_state != ShardedState.SHARDED:
            raise RuntimeError(
                f"fsdp_compile: '{self.fqn}' was assigned while its group holds unsharded parameters (during "
                "forward/backward, or on a module with reshard_after_forward=False). Assign it between steps, "
                "after calling reshard() on its fully_shard module."
            )
        if value.dtype != self.orig_dtype:
            raise ValueError(
                f"fsdp_compile: '{self.fqn}' was assigned a {value.dtype} tensor but its group holds {self.orig_dtype} "
                "parameters; assign a tensor of the same dtype (use module.to(dtype) to change every parameter's dtype)."
            )
        tp = self.tensor_parallel
        if isinstance(value, DTensor) and tp is not None and value.device_mesh == tp.param_mesh and tuple(value.placements) == tp.param_placements:
            new = self._make_sharded_param(value)  # the user's TP DTensor of the whole parameter
        elif isinstance(value, DTensor):
            if value.device_mesh != self.sharded_mesh or tuple(value.placements) != self.placements or value.shape != self.orig_size:
                raise ValueError(
                    f"fsdp_compile: '{self.fqn}' was assigned a DTensor of shape {tuple(value.shape)} with placements "
                    f"{tuple(value.placements)}; it needs shape {tuple(self.orig_size)} with {self.placements} "
                    f"on {self.sharded_mesh}. Assign the full tensor instead and it is sharded for you."
                )
            new = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=value.requires_grad)
        elif tuple(value.shape) == tuple(self.orig_size):
            new = self._make_sharded_param(value)
        else:
            raise ValueError(
                f"fsdp_compile: '{self.fqn}' was assigned a tensor of shape {tuple(value.shape)}, but fully_shard sharded "
                f"a parameter of shape {tuple(self.orig_size)}. Assign a full tensor of that shape."
            )
        mark_replaced(self.sharded_param, f"an assignment to '{self.fqn}'")
        self.sharded_param = new
        self._unsharded_param = None
        self.register_everywhere(new)

    def adopt_registered_param(self) -> None:
        """Lazy init: a tensor put straight into ``module._parameters`` after ``fully_shard`` (not
        through ``module.<name> = ...``, which replaces at once) replaces the sharded parameter too."""
        registered = [ref.module._parameters.get(ref.name) for ref in self.refs]
        if self.sharded_state != ShardedState.SHARDED or all(value is self.sharded_param for value in registered):
            return
        if len({id(value) for value in registered}) > 1 or registered[0] is None:
            places = ", ".join(f"'{ref.fqn}'" for ref in self.refs)
            raise ValueError(
                f"fsdp_compile: the parameter registered at {places} (tied) was replaced at some of these places only. "
                "Assign the same tensor at every place (re-tie the weights), or untie them before fully_shard."
            )
        self.replace_sharded_param(registered[0])

    def reset_after_module_apply(self) -> None:
        """After ``module.to(...)``/``to_empty``: pick up the new local tensor, drop stale buffers."""
        registered = self.registered_value()
        if isinstance(registered, nn.Parameter) and isinstance(registered.data, DTensor):
            self.sharded_param = registered
        self._set_dtypes(self.sharded_param._local_tensor.dtype)
        self._unsharded_param = None
        self.post_forward_shard = None

    # --- gradients --------------------------------------------------------------------------
    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Remove and return this step's unsharded gradient (plus any no-sync accumulation)."""
        param = self._unsharded_param
        grad = None if param is None else self._local_grad(param.grad)
        if param is not None:
            param.grad = None
        accumulated = self.pop_accumulated_grad()
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
        grad = self._local_grad(param.grad)
        param.grad = None
        if self.unsharded_accumulated_grad is None:
            self.unsharded_accumulated_grad = grad.to(self.reduce_dtype)
        else:
            self.unsharded_accumulated_grad += grad

    def _local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The unsharded gradient as the plain tensor the reduction takes (its TP-local piece)."""
        if grad is None or self.tensor_parallel is None:
            return grad
        return self.tensor_parallel.local_grad(grad)

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

    def refresh_detached_sharded_param(self) -> None:
        """Eagerly, as its block frame is entered: ``detached_sharded_param`` shares the sharded
        parameter's storage as it is now (a load, ``.data`` or a dtype change may have replaced it)."""
        local = self.sharded_param._local_tensor
        held = self.detached_sharded_param
        if held is None or held._local_tensor.data_ptr() != local.data_ptr() or held._local_tensor.dtype != local.dtype or held.shape != self.sharded_param.shape:
            self.detached_sharded_param = self.sharded_param.detach()

    def run_post_accumulate_grad_hooks(self) -> None:
        """``Tensor.register_post_accumulate_grad_hook`` hooks of the sharded parameter, as autograd
        would run them: once its ``.grad`` holds this step's reduced gradient (optimizer in backward)."""
        hooks = getattr(self.sharded_param, "_post_accumulate_grad_hooks", None)
        for hook in list((hooks or {}).values()):
            hook(self.sharded_param)

    def set_sharded_grad(self, local_grad: torch.Tensor) -> None:
        if self.sharded_param.grad is not None and self.sharded_param.grad._local_tensor is local_grad:
            return
        if local_grad.device != self.shard_device:
            local_grad = local_grad.to(self.shard_device, non_blocking=True)
        self.sharded_param.grad = self.sharded_dtensor(local_grad)


def parameters_placed_for_trace(module: nn.Module, tensors: dict[str, torch.Tensor]) -> Any:
    """A context in which ``module._parameters[name]`` holds ``tensors[name]``, restored on exit: how
    a block region's body reads its unsharded parameters ([Note: compile once per block] in
    regions.py). torch's ``_reparametrize_module``, which Dynamo traces as a swap of the parameter
    dict rather than a side effect, so the traced body stays reusable across blocks."""
    return _reparametrize_module(module, tensors)
