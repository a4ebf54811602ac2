"""FSDPParamGroup: the parameters of one ``fully_shard`` call, moved by one collective each way."""
from __future__ import annotations

import contextlib
import functools
from enum import Enum, auto
from typing import Any, Callable

import torch
import torch.nn as nn

from fsdp_compile.runtime import collectives
from fsdp_compile.api import CommPolicy
from fsdp_compile.runtime.collectives import (
    PendingAllGather, PendingPackedAllGather, PendingQuantizedAllGather, PendingReduceScatter, ReduceSpec,
)
from fsdp_compile.runtime.comm_context import CommContext, InFlightAllGather
from fsdp_compile.kernels import ops, quantized, quantized_reference
from fsdp_compile.runtime.mesh import MeshInfo, PostForwardMeshInfo
from fsdp_compile.runtime.param import FSDPParam, ShardedState
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _dynamo_frame_callback

__all__ = ["TrainingState", "FSDPParamGroup", "UnshardHandle"]

class _OneRankUnshard:
    """The pending unshard of a group over one rank: nothing in flight; the copies run at the wait
    (see [Note: an unshard over a shard group of one rank])."""

    overlapped = False

    def wait(self, comm: CommContext) -> None:
        return None


def _eager_only(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` as plain eager code: never traced by Dynamo (a backward hook can fire inside a
    compiled frame that called ``loss.backward()``), with functorch transforms
    (``torch.func.jvp``/``vmap``) off, since the unsharded parameters are real tensors whose storage
    we resize, never a transform's wrapper of one; and outside ``torch.inference_mode``, since those
    parameters and their buffers outlive the step: made as inference tensors by an evaluation
    forward, they could be neither written nor saved for backward by the training step after it
    (PyTorch FSDP2 fails there: "Inplace update to inference tensor outside InferenceMode").

    [Note: Dynamo's disable only where Dynamo runs]
    ``torch._dynamo.disable(recursive=True)`` keeps Dynamo out of the frames a call makes by
    switching its frame callback off and on around the call, four calls into Dynamo per call: some
    twenty a block and step in eager training, where no callback is set and no frame would be
    compiled anyway. The method is reached through ``call``, whose own frame Dynamo skips (a trace
    reaching it breaks the graph there, as at a disabled function) and which takes the disabled path
    only while a frame callback is set: inside a compiled function's call, where Dynamo would
    compile the frames the method makes. (``torch._dynamo.decorators.skip``: ``disable(recursive=False)`` wraps
    the function in one more Python frame.)
    """

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch._C._are_functorch_transforms_active() and not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)  # the common case, without a context stack per call
        with contextlib.ExitStack() as modes:
            if torch._C._are_functorch_transforms_active():
                modes.enter_context(torch._C._DisableFuncTorch())
            if torch.is_inference_mode_enabled():
                modes.enter_context(torch.inference_mode(False))
            return method(*args, **kwargs)

    disabled = torch._dynamo.disable(run, recursive=True)

    def call(*args: Any, **kwargs: Any) -> Any:
        if _dynamo_frame_callback() is None:
            return run(*args, **kwargs)
        return disabled(*args, **kwargs)

    functools.update_wrapper(call, method, updated=())
    del call.__wrapped__  # Dynamo's skip takes the function it is given, not what it wraps
    return torch._dynamo.decorators.skip(call)


class TrainingState(Enum):
    """Where a group is in the training step; each hook moves it in one place."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class FSDPParamGroup:
    """One all-gather before use, one reduce-scatter after backward, for all its parameters."""

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        modules: tuple[nn.Module, ...],
        label: str,
        mesh_info: MeshInfo,
        post_forward_mesh_info: PostForwardMeshInfo | None,
        device: torch.device,
        reshard_after_forward: bool,
        comm_policy: CommPolicy = CommPolicy(),
    ) -> None:
        self.fsdp_params = fsdp_params
        self.comm_policy = comm_policy
        for index, fsdp_param in enumerate(fsdp_params):
            fsdp_param.index_in_group = index
        # Fixed per parameter at fully_shard, read by every unshard and reduction over one rank.
        self._all_dim0_on_device = all(p.layout.dim == 0 and not p.offload_to_cpu for p in fsdp_params)
        self._any_tensor_parallel = any(p.tensor_parallel is not None for p in fsdp_params)
        self.modules = modules
        self.label = label
        self.mesh_info = mesh_info
        self.post_forward_mesh_info = post_forward_mesh_info
        self.device = device
        # Its own until the root's lazy init shares the root's (see [Note: stream protocol]).
        self.comm = CommContext(device)
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        # False (set_unshard_in_backward): backward needs none of the parameters (an embedding), so
        # it neither all-gathers nor prefetches them; their gradients are still reduced.
        self.unshard_in_backward = True
        # set_all_reduce_hook: runs in place on each reduced gradient buffer (the reduce-scatter
        # output, or the HSDP all-reduce output) before the post-divide and copy-out.
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: Any = None
        self.gradient_divide_factor: float | None = None
        # set_reduce_scatter_unused_params(True): a parameter without a gradient this backward is
        # reduced as zeros, so ranks that used different parameters issue the same reduce-scatter.
        self.reduce_scatter_unused_params = False
        # set_reduce_scatter_max_input_buffers: reduce-scatters in flight (each holds its input
        # buffer) before the oldest is finished; 1 finishes the previous one before issuing.
        self.reduce_scatter_max_input_buffers = 1
        # set_custom_all_gather / set_custom_reduce_scatter: FSDP2's ``Comm`` objects (allocate the
        # buffer, run the collective), used instead of the default ones.
        self.custom_all_gather: Any = None
        self.custom_reduce_scatter: Any = None
        # set_separate_reduce_scatter_group: the same ranks as the shard group, another communicator.
        self.reduce_scatter_mesh_info: MeshInfo = mesh_info
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self._pending_all_gather: PendingAllGather | PendingPackedAllGather | _OneRankUnshard | None = None
        self._reduction_in_flight: tuple[PendingReduceScatter, list[FSDPParam]] | None = None
        # Marks the post-forward shards' copy (int reshard_after_forward): the next copy-in reads them.
        self._post_forward_shard_event: object = None
        self.ran_post_backward = False
        self._reduce_spec_cache: tuple[MeshInfo, tuple, ReduceSpec] | None = None

    @property
    def reduce_spec(self) -> ReduceSpec:
        """How this group's gradients are reduced now (its settings change it). Made again only when
        one of the settings it is made of changed: making it reads the process group's name, a
        call into c10d, twice per group and step."""
        trained = self._dtype_holder
        key = (trained.reduce_dtype, trained.orig_dtype, self.gradient_divide_factor, self.comm_policy.reduce_wire_dtype)
        if torch.compiler.is_compiling():
            # A trace makes its own, as before: writing the cache would be a side effect of the
            # graph, and a spec read from it an object for Dynamo to guard on.
            return ReduceSpec.for_group(self.mesh_info, *key)
        cached = self._reduce_spec_cache
        if cached is not None and cached[0] is self.mesh_info and cached[1] == key:
            return cached[2]
        spec = ReduceSpec.for_group(self.mesh_info, *key)
        self._reduce_spec_cache = (self.mesh_info, key, spec)
        return spec

    # --- dtypes -----------------------------------------------------------------------------
    # [Note: frozen parameters of another dtype]
    # As in FSDP2, a group's parameters that require gradients share one dtype (fully_shard checks),
    # and frozen ones may have others (a bf16 frozen weight beside fp32 trained ones). The group's
    # dtypes are those of its trained parameters, which are all its reduce-scatter carries; a group
    # whose all-gather inputs differ in dtype gathers them as bytes in one buffer, the packed
    # all-gather of [Note: all-gather extensions] in param.py, as FSDP2 gathers them as uint8.
    @property
    def _dtype_holder(self) -> FSDPParam:
        """The parameter whose dtypes are the group's: the first that requires gradients."""
        return next((p for p in self.fsdp_params if p.sharded_param.requires_grad), self.fsdp_params[0])

    @property
    def param_dtype(self) -> torch.dtype:
        return self._dtype_holder.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self._dtype_holder.reduce_dtype

    @property
    def gathers_several_dtypes(self) -> bool:
        return len({p.param_dtype for p in self.fsdp_params}) > 1

    @property
    def uses_all_gather_extension(self) -> bool:
        """Whether a parameter's local shard has an all-gather extension ([Note: all-gather extensions] in param.py)."""
        return any(p.uses_all_gather_extension for p in self.fsdp_params)

    @property
    def needs_packed_all_gather(self) -> bool:
        """Whether the all-gather sends bytes: an all-gather extension, or several dtypes (see
        [Note: frozen parameters of another dtype])."""
        return self.gathers_several_dtypes or self.uses_all_gather_extension

    # --- unshard / reshard ----------------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state == ShardedState.UNSHARDED

    @property
    def has_unshard_in_flight(self) -> bool:
        return self._pending_all_gather is not None

    @_eager_only
    def unshard(self, reason: str = "explicit") -> None:
        """Issue the all-gather (no wait); a no-op when unsharded or already in flight."""
        if self.is_unsharded or self._pending_all_gather is not None:
            return
        if self.needs_packed_all_gather:
            self._unshard_packed(reason)
            return
        policy = self.comm_policy
        if self._copies_at_one_rank():
            self._pending_all_gather = _OneRankUnshard()
            return
        if policy.quantizes_all_gather:
            self._pending_all_gather = collectives.issue_quantized_all_gather(
                self._all_gather_inputs(reason), [p.padded_shard_numel for p in self.fsdp_params],
                policy.all_gather_dtype, policy.block_size, self.mesh_info, self.comm, self.label, reason,
            )
            return
        if self.sharded_state == ShardedState.SHARDED_POST_FORWARD:
            group = self.post_forward_mesh_info
            assert group is not None
            padded = [p.padded_post_forward_numel for p in self.fsdp_params]
            self.comm.all_gather_streams_wait(self._post_forward_shard_event)
            self._post_forward_shard_event = None
        else:
            group = self.mesh_info
            padded = [p.padded_shard_numel for p in self.fsdp_params]
        self._pending_all_gather = collectives.issue_all_gather(
            self._all_gather_inputs(reason), padded, self.param_dtype, group, self.comm, self.label, reason,
            self.custom_all_gather,
        )

    def _copies_at_one_rank(self) -> bool:
        """Whether this unshard copies each shard straight into its unsharded parameter.

        [Note: an unshard over a shard group of one rank]
        Over one rank (world size 1, or HSDP with shard groups of one) a shard is its whole
        parameter: no all-gather runs, and the copy-in into a flat buffer and the copy-out from it
        would copy every parameter twice with a Python loop each. One ``torch._foreach_copy_``
        (which casts to the parameter dtype) into the unsharded parameters does it instead, as the
        group is waited on. Not for what needs the buffer: a custom all-gather, a quantized or
        packed all-gather, a post-forward shard, a parameter sharded on a dim > 0 (its dim-0 view
        is a copy), CPU offload (its copy to the device goes on the copy-in stream).
        """
        if (
            self.mesh_info.shard_size != 1 or self.custom_all_gather is not None or self.sharded_state != ShardedState.SHARDED
            or self.comm_policy.quantizes_all_gather
        ):
            return False
        return self._all_dim0_on_device

    def _all_gather_inputs(self, reason: str, packed: bool = False) -> list:
        """Each member's all-gather input(s), on the device.

        [Note: offloaded shards are copied on the copy-in stream] A CPU-offloaded shard's copy to the
        device is asynchronous from pinned memory. Made on the current stream, the copy-in stream of
        an overlapped all-gather (which does not wait on it) read the device tensor before the copy
        landed, and the allocator could hand its memory on while the copy-in still read it: an H200
        trained 4.6e-2 off the run without offload, pinned only. The copies go on the copy-in stream.
        """
        read = FSDPParam.all_gather_inputs if packed else FSDPParam.all_gather_input
        if not self.fsdp_params[0].offload_to_cpu:
            return [read(p) for p in self.fsdp_params]
        with self.comm.handle.on_stream(self.comm.all_gather_streams(reason)[0], "all_gather_inputs_to_device"):
            return [read(p) for p in self.fsdp_params]

    def _unshard_packed(self, reason: str) -> None:
        """The all-gather of a group with an all-gather extension; see [Note: all-gather extensions]."""
        if self.comm_policy.quantizes_all_gather:
            raise NotImplementedError(
                f"fsdp_compile: group '{self.label}' has a parameter with an all-gather extension (fsdp_pre_all_gather), "
                "which sends its own representation, or parameters of several dtypes; CommPolicy.all_gather_dtype cannot "
                "quantize them. Leave all_gather_dtype unset."
            )
        if self.sharded_state != ShardedState.SHARDED:
            raise NotImplementedError(
                f"fsdp_compile: group '{self.label}' has a parameter with an all-gather extension or parameters of several "
                "dtypes, which an int reshard_after_forward cannot re-gather from its post-forward shard; use True or False."
            )
        self._pending_all_gather = collectives.issue_packed_all_gather(
            self._all_gather_inputs(reason, packed=True), self.mesh_info, self.comm, self.label, reason,
            self.custom_all_gather,
        )

    @_eager_only
    def adopt_all_gather(self, gathered: torch.Tensor) -> bool:
        """Take ``gathered``, the ``[world, group_numel]`` output of this group's all-gather issued
        elsewhere and complete on the current stream (a block frame's prefetch, which its eager hooks
        then read: [Note: frames Dynamo runs eagerly] in module.py), as the all-gather in flight.
        Returns False, taking nothing, where the group would gather otherwise (already unsharded or
        gathering, an all-gather extension, CommPolicy's quantized all-gather or a custom all-gather,
        its post-forward shard)."""
        if (
            self.is_unsharded or self._pending_all_gather is not None or self.sharded_state != ShardedState.SHARDED
            or self.comm_policy.quantizes_all_gather or self.custom_all_gather is not None
            or self.needs_packed_all_gather
        ):
            return False
        self._pending_all_gather = collectives.PendingAllGather(None, gathered, self.label, None, False)
        return True

    @_eager_only
    def read_gathered(self, read: Callable[[list[FSDPParam]], torch.Tensor], reason: str) -> torch.Tensor:
        """``read(self.fsdp_params)`` while the parameters hold what this group's unshard gathers (its
        all-gather extensions run, as in [Note: all-gather extensions] in param.py), not exposed on the
        modules, freed again after: for a caller that hands the gathered values on. ``reason`` names
        the all-gather in ``record_collectives`` and picks its streams (a reason that is not an
        overlapped one keeps it on the current stream). A group already unsharded or gathering (an
        explicit ``unshard()``) is waited on, read as it is, as its next forward would, and resharded:
        no post-forward hook runs after the caller's graph to do it, and a group left unsharded would
        serve its values from before the next optimizer step."""
        if self.is_unsharded or self._pending_all_gather is not None:
            self.wait_for_unshard()
            try:
                return read(self.fsdp_params)
            finally:
                self.reshard()
        self.unshard(reason)
        pending, self._pending_all_gather = self._pending_all_gather, None
        assert pending is not None
        try:
            self.comm.after_copy_out(self._copy_out(pending), False)
            return read(self.fsdp_params)
        finally:
            for fsdp_param in self.fsdp_params:
                fsdp_param.free_unsharded()

    @_eager_only
    def wait_for_unshard(self) -> None:
        """Finish the in-flight all-gather and expose the unsharded parameters on the modules."""
        if self.is_unsharded:
            return
        if self._pending_all_gather is None:
            self.unshard()
        pending = self._pending_all_gather
        assert pending is not None
        self._pending_all_gather = None
        in_forward = self.training_state == TrainingState.FORWARD
        self.comm.before_copy_out(in_forward)
        self.comm.after_copy_out(self._copy_out(pending), in_forward)
        self._expose_unsharded()

    def _copy_out(
        self, pending: PendingAllGather | PendingPackedAllGather | PendingQuantizedAllGather | _OneRankUnshard
    ) -> InFlightAllGather:
        """Wait on ``pending`` and copy what it gathered into every parameter's unsharded data;
        returns the all-gather whose copy-out the comm context records."""
        if isinstance(pending, PendingPackedAllGather):
            with torch.no_grad():
                outputs = [p.all_gather_output_buffers(sent) for p, sent in zip(self.fsdp_params, pending.inputs)]
                pending.wait_into(outputs, self.comm)
                for fsdp_param, gathered_outputs in zip(self.fsdp_params, outputs):
                    fsdp_param.finish_unshard_from_outputs(gathered_outputs)
            return pending.pending
        if isinstance(pending, PendingQuantizedAllGather):
            data, scales = pending.wait(self.comm)
            with torch.no_grad():
                outs = [p.unsharded_data_for_copy_out() for p in self.fsdp_params]
                quantized.quantized_all_gather_copy_out(
                    data, scales, [p.padded_shard_numel for p in self.fsdp_params], outs, self.comm_policy.block_size
                )
                for fsdp_param, out in zip(self.fsdp_params, outs):
                    fsdp_param.finish_copy_out(out)
            return pending.data
        if isinstance(pending, _OneRankUnshard):
            with torch.no_grad():
                outs = [p.unsharded_data_for_copy_out() for p in self.fsdp_params]
                # One op for the group, casting as it copies: the shard is the whole parameter.
                # A shard over one rank sharded on dim 0 and on the device (_copies_at_one_rank) is
                # its all-gather input as it is, with its parameter's shape: no view, move or copy.
                torch._foreach_copy_(outs, [p.local_shard() for p in self.fsdp_params])
            return pending
        gathered = pending.wait(self.comm)
        padded = [
            p.padded_post_forward_numel if p.sharded_state == ShardedState.SHARDED_POST_FORWARD else p.padded_shard_numel
            for p in self.fsdp_params
        ]
        with torch.no_grad():
            outs = [p.unsharded_data_for_copy_out() for p in self.fsdp_params]
            ops.all_gather_copy_out(gathered, padded, outs)
            for fsdp_param, out in zip(self.fsdp_params, outs):
                fsdp_param.finish_copy_out(out)
        return pending

    def _expose_unsharded(self) -> None:
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    @_eager_only
    def reshard(self) -> None:
        """Back to the sharded parameters; a prefetched all-gather still in flight is finished first."""
        if self._pending_all_gather is not None:
            self.wait_for_unshard()
        if self.sharded_state == ShardedState.SHARDED:
            return
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_sharded()
        self.sharded_state = ShardedState.SHARDED

    def reshard_post_forward(self) -> None:
        """After forward: keep the smaller post-forward shard when configured, else fully reshard."""
        if self.post_forward_mesh_info is not None and self.is_unsharded:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_sharded_post_forward()
            self.sharded_state = ShardedState.SHARDED_POST_FORWARD
            handle = self.comm.handle
            self._post_forward_shard_event = handle.record_event(handle.current_stream(), "post_forward_shard")
        else:
            self.reshard()

    # --- hooks' work ------------------------------------------------------------------------------
    def pre_forward(self) -> None:
        self.training_state = TrainingState.FORWARD
        self.unshard("forward")

    def post_forward(self) -> None:
        if self.reshard_after_forward:
            self.reshard_post_forward()
        self.training_state = TrainingState.IDLE

    @_eager_only
    def pre_backward(self) -> None:
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard("backward")

    @_eager_only
    def post_backward(self) -> None:
        """Reduce this step's gradients (or keep them unsharded when not syncing), then reshard."""
        self.training_state = TrainingState.POST_BACKWARD
        self.ran_post_backward = True
        if self._pending_all_gather is not None:
            self.wait_for_unshard()
        if not self.requires_gradient_sync:
            for fsdp_param in self.fsdp_params:
                fsdp_param.accumulate_unsharded_grad()
        else:
            self._issue_reduction()
        if self.reshard_after_backward:
            self.reshard()

    def _issue_reduction(self) -> None:
        params, grads = [], []
        for fsdp_param in self.fsdp_params:
            grad = fsdp_param.take_unsharded_grad()
            if grad is None and self.reduce_scatter_unused_params and fsdp_param.sharded_param.requires_grad:
                grad = torch.zeros(fsdp_param.layout.shape, dtype=fsdp_param.reduce_dtype, device=self.device)
            if grad is not None:
                params.append(fsdp_param)
                grads.append(fsdp_param.layout.to_dim0(grad).contiguous())
        if not params:
            return
        if self._reduces_on_one_rank():
            self._write_reduced_on_one_rank(params, grads)
            return
        # Older reductions finish now: a bounded number in flight bounds the reduce buffers' memory.
        self.comm.finish_reductions(keep=self.reduce_scatter_max_input_buffers - 1)
        pending = collectives.issue_reduce_scatter(
            grads, [p.padded_shard_numel for p in params], self.reduce_spec, self.reduce_scatter_mesh_info, self.comm,
            self.label, self.custom_reduce_scatter,
        )
        self._reduction_in_flight = (pending, params)
        self.comm.reducing_groups.append(self)

    def _reduces_on_one_rank(self) -> bool:
        """Whether this reduction is over a shard group of one rank and nothing needs its buffer.

        [Note: a reduction over a shard group of one rank]
        Over one rank (world size 1) a reduce-scatter issues no collective, and its copy-in into a
        flat buffer and copy-out from it copy every gradient twice, with a Python loop each, to
        compute ``grad / pre / post`` in the reduce dtype: ``collectives.reduce_on_one_rank``
        computes the same values (bit for bit, so the compiled reduction still matches) straight
        into the sharded gradient, written as the group's post-backward runs rather than when the
        next group's reduction finishes it. Not where the buffer is needed: HSDP's all-reduce (its
        replicas are other ranks), an all-reduce hook (it runs on the buffer), a custom reduce-
        scatter, CommPolicy's gradient wire, a parameter sharded on a dim > 0, tensor parallelism
        or CPU offload (their gradients take another layout or device).
        """
        return (
            self.reduce_scatter_mesh_info.shard_size == 1 and self.mesh_info.replicate_group is None
            and self.all_reduce_hook is None and self.custom_reduce_scatter is None
            and self.comm_policy.reduce_wire_dtype is None and self._all_dim0_on_device and not self._any_tensor_parallel
        )

    def _write_reduced_on_one_rank(self, params: list[FSDPParam], grads: list[torch.Tensor]) -> None:
        """See [Note: a reduction over a shard group of one rank]."""
        spec = self.reduce_spec
        collectives.record_reduction_on_one_rank(lambda: [p.padded_shard_numel for p in params], spec, self.label)
        with torch.no_grad():
            for fsdp_param, grad in zip(params, grads):
                reduced = collectives.reduce_on_one_rank(grad, spec)
                existing = fsdp_param.sharded_param.grad
                if existing is None:
                    fsdp_param.set_sharded_grad(reduced)
                else:
                    existing._local_tensor.add_(reduced)
        for fsdp_param in params:
            fsdp_param.run_post_accumulate_grad_hooks()

    def hold_reduction(self, params: list[FSDPParam], pending: collectives.PendingReduceScatter) -> None:
        """Keep a reduce-scatter a compiled backward issued for ``params`` (this group's) until
        ``finish_reduction``; see [Note: late reduce-scatter wait across block frames] in frames.py."""
        if self._reduction_in_flight is not None:
            self.finish_reduction()
        self._reduction_in_flight = (pending, params)

    def finish_reduction(self) -> None:
        """Wait for this group's reduce-scatter (and HSDP all-reduce) and write the sharded gradients."""
        assert self._reduction_in_flight is not None, f"group '{self.label}' has no reduction in flight"
        pending, params = self._reduction_in_flight
        self._reduction_in_flight = None
        reduced = pending.wait(self.comm)
        spec = self.reduce_spec
        own = {} if pending.own_row is None else {"own_row": pending.own_row, "own_rank": pending.own_rank}
        padded = [p.padded_shard_numel for p in params]
        hybrid = self.mesh_info.replicate_group is not None
        if reduced.dim() == 2 and (hybrid or self.all_reduce_hook is not None):
            # The gradient wire's rows, summed in float32 here when more follows; else in the copy-out.
            reduced = quantized_reference.sum_rows(reduced, **own)
        if hybrid:
            # See [Note: deferred all-reduce] in param.py.
            segments = [
                segment.view(p.deferred_all_reduce_sink.shape) for p, segment in zip(params, reduced.split(padded))
            ]
            for fsdp_param, segment in zip(params, segments):
                deferred = fsdp_param.pop_deferred_all_reduce()
                if deferred is not None:
                    segment += deferred
            if not self.requires_all_reduce:
                for fsdp_param, segment in zip(params, segments):
                    fsdp_param.deferred_all_reduce_sink.grad = segment.to(fsdp_param.deferred_all_reduce_sink.dtype, copy=True)
                return
            collectives.all_reduce_replicas(reduced, self.mesh_info.replicate_group, self.label)
        if self.all_reduce_hook is not None:
            self._run_all_reduce_hook(reduced)
        self.write_sharded_grads(params, reduced, spec.post_divide, own)

    def write_sharded_grads(
        self, params: list[FSDPParam], reduced: torch.Tensor, post_divide: float, own: dict[str, Any] | None = None,
    ) -> None:
        """Write (or add) ``reduced``, the members' padded shards in order (or the gradient wire's rows),
        divided by ``post_divide``, into ``params``' sharded gradients, then run their post-accumulate-grad hooks."""
        own = own or {}
        padded = [p.padded_shard_numel for p in params]
        outs, had_grad = zip(*(p.sharded_grad_out() for p in params))
        accumulate = any(had_grad)
        if accumulate and not all(had_grad):
            outs = tuple(out if had else out.zero_() for out, had in zip(outs, had_grad))
        # The copy-out writes each shard in the dim-0 view on the device: straight into the gradient
        # when that is where it lives, else into a temporary moved in afterwards (CPU offload, a
        # parameter sharded on a dim > 0).
        # A temporary starts at zero when accumulating, so one accumulating copy-out serves both kinds.
        new_temporary = torch.zeros if accumulate else torch.empty
        targets = [
            out if out.device == self.device and p.layout.dim == 0
            else new_temporary(p.layout.dim0_shape(tuple(out.shape)), dtype=out.dtype, device=self.device)
            for p, out in zip(params, outs)
        ]
        with torch.no_grad():
            if reduced.dim() == 2:  # the gradient wire's rows: sum in float32, divide, write, one op
                quantized.sum_rows_copy_out(reduced, padded, targets, post_divide, accumulate, **own)
            else:
                ops.reduce_scatter_copy_out(reduced, padded, targets, post_divide, accumulate)
            for fsdp_param, out, target in zip(params, outs, targets):
                # Identity, not ``==``: a compare would fall back to elementwise tensor equality.
                if target is not out:
                    value = fsdp_param.layout.from_dim0(target).to(out.device)
                    out.add_(value) if accumulate else out.copy_(value)
                fsdp_param.set_sharded_grad(out)
        for fsdp_param in params:
            fsdp_param.run_post_accumulate_grad_hooks()

    def _run_all_reduce_hook(self, reduced: torch.Tensor) -> None:
        hook, stream = self.all_reduce_hook, self.all_reduce_hook_stream
        assert hook is not None
        if stream is None:
            hook(reduced)
            return
        handle, current = self.comm.handle, self.comm.handle.current_stream()
        handle.wait_stream(stream, current)
        with handle.on_stream(stream, "all_reduce_hook"):
            hook(reduced)
        handle.keep_alive(reduced, stream)
        handle.wait_stream(current, stream)

    @_eager_only
    def finalize_backward(self) -> None:
        """End of backward (root callback): reduce what post-backward missed, wait, reset."""
        if self._pending_all_gather is not None:
            # Prefetched but never used in this backward.
            self.wait_for_unshard()
        # Gradients that arrived after this group's post-backward (a module of the group whose
        # backward ran after the trigger fired) are reduced now rather than left for the next step.
        if self._has_unsharded_grads() or (not self.ran_post_backward and self.training_state == TrainingState.PRE_BACKWARD):
            self.post_backward()
        elif self.is_unsharded and self.reshard_after_backward:
            self.reshard()
        self.ran_post_backward = False
        self.training_state = TrainingState.IDLE

    @_eager_only
    def reset_after_failed_step(self) -> None:
        """After an exception mid-step: let the collectives in flight complete, drop their results and
        this step's gradients (also no-sync sums and HSDP's deferred all-reduce), reshard."""
        pending, self._pending_all_gather = self._pending_all_gather, None
        if pending is not None:
            collectives.wait_and_drop(pending.pending if isinstance(pending, PendingPackedAllGather) else pending, self.comm)
        if self._reduction_in_flight is not None:
            collectives.wait_and_drop(self._reduction_in_flight[0], self.comm)
            self._reduction_in_flight = None
        for fsdp_param in self.fsdp_params:
            fsdp_param.take_unsharded_grad()
            fsdp_param.pop_deferred_all_reduce()
        if self.sharded_state != ShardedState.SHARDED:
            for fsdp_param in self.fsdp_params:
                fsdp_param.to_sharded()
            self.sharded_state = ShardedState.SHARDED
        self._post_forward_shard_event = None
        self.ran_post_backward = False
        self.training_state = TrainingState.IDLE

    def _has_unsharded_grads(self) -> bool:
        return any(p._unsharded_param is not None and p._unsharded_param.grad is not None for p in self.fsdp_params)

    def unsharded_storage_bytes(self) -> int:
        return sum(p.unsharded_storage_bytes() for p in self.fsdp_params)


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` makes the parameters usable."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []
