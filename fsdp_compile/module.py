"""``fully_shard`` and ``FSDPModule``: the user-facing entry of the eager runtime."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings
from typing import Any, Callable, overload

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_compile.api import BackwardPrefetch, CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp_compile.compile.backend import fsdp_frames_recompile_limit_reached, traced_in_a_block_call_frame
from fsdp_compile.compile.graph_check import EAGER_FRAME_MARK
from fsdp_compile.runtime.mesh import (
    DataParallelMeshDims, MeshInfo, TensorParallelLayout, default_mesh, mesh_device, mesh_info_for, post_forward_mesh_info_for,
    separate_group_of, tensor_parallel_layout,
)
from fsdp_compile.runtime.optimizer_check import install_optimizer_check, mark_replaced
from fsdp_compile.runtime.param import FSDPParam, ParamRef, parameters_placed_for_trace
from fsdp_compile.runtime.param_group import FSDPParamGroup, TrainingState
from fsdp_compile.runtime.state import FSDPState, all_states_under, inside_a_compiled_call, state_of
from fsdp_compile.runtime.structures import map_tensors, tensors_in
from fsdp_compile.runtime.state_dict import register_state_dict_hooks
from fsdp_compile import config
from fsdp_compile.compile.param_reads import install_traced_param_access

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]

# Set on each original parameter a fully_shard call takes: the call's label. An attribute, not a
# weak mapping: tensors compare elementwise, and weak references block torch.utils.swap_tensors.
_OWNER_ATTR = "_fsdp_compile_owner"
_fsdp_classes: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` makes the parameters usable."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []


class FSDPModule:
    """Mixed into every module ``fully_shard`` was applied to (``isinstance(m, FSDPModule)``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A new instance of a sharded module's class (nn.Sequential's slicing builds one with
        # self.__class__(...)) has no FSDP state: it is built as the user's own class.
        original = _user_class(cls)
        instance = original.__new__(original) if original.__new__ is object.__new__ else original.__new__(original, *args, **kwargs)
        instance.__init__(*args, **kwargs)
        return instance

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and config.skip_fsdp_hooks:
            # [Note: the eager fallback's graph breaks]
            # The fallback runs the FSDP hooks eagerly, each a graph break. Breaking inside the
            # forward-hook loop of nn.Module._call_impl would make Dynamo skip that frame's code,
            # which every module shares, for the rest of the process (degrading any other compiled
            # model); breaking here, outside any loop, leaves it alone. The hooks proper stand aside.
            state = self._fsdp_state()
            args, kwargs = state.eager_pre_forward(self, args, kwargs)
            output = super().forward(*args, **kwargs)  # type: ignore[misc]
            return state.eager_post_forward(self, args, output)
        # See [Note: compile once per block].
        if torch.compiler.is_compiling():
            state = self._fsdp_state()
            if traced_in_a_block_call_frame():  # the frame its __call__ entered: [Note: a block that checkpoints itself in __call__]
                return super().forward(*args, **kwargs)  # type: ignore[misc]
            if state.compiles_as_frame and state.training_state is TrainingState.IDLE:  # [Note: blocks compiled as frames]
                state.eager_enter_block_frame()  # a graph break: the rest is the block's own frame
                if not torch.compiler.is_compiling():  # Dynamo runs that frame eagerly
                    return self._forward_with_eager_hooks(args, kwargs)
                if _COMPOSABLE_CHECKPOINT_ATTR in self.__dict__:  # [Note: PyTorch's composable checkpoint, compiled]
                    return _checkpointed(self, super().forward, args, kwargs)  # type: ignore[misc]
                return super().forward(*args, **kwargs)  # type: ignore[misc]
            if _COMPOSABLE_CHECKPOINT_ATTR in self.__dict__:  # [Note: PyTorch's composable checkpoint, compiled]
                for inner in state.states_in_tree():
                    if inner.gathers_once_across_frames:  # its first read writes the handoff: not in the checkpoint
                        inner.unsharded_across_frames(inner.group.fsdp_params[0])
                return _checkpointed(self, self._traced_forward, args, kwargs)
            if state.compiles_as_region:
                unsharded = state.traced_unshard(state.group.fsdp_params)
                if _takes_flat_arguments(args, kwargs):  # [Note: a block region's flat arguments]
                    return _flat_block_region(self, len(unsharded), *unsharded, *args)
                return _block_region(self, unsharded, args, kwargs, _reuse_marker(args, kwargs))
        elif self._fsdp_state().hooks_stood_aside():
            return self._forward_with_eager_hooks(args, kwargs)
        return super().forward(*args, **kwargs)  # type: ignore[misc]

    def _traced_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The traced forward of a module not compiled as a block frame (a block region, or inline),
        inside the composable checkpoint's torch.utils.checkpoint (as ``forward`` traces it outside)."""
        state = self._fsdp_state()
        if state.compiles_as_region:
            unsharded = state.traced_unshard(state.group.fsdp_params)
            if _takes_flat_arguments(args, kwargs):  # [Note: a block region's flat arguments]
                return _flat_block_region(self, len(unsharded), *unsharded, *args)
            return _block_region(self, unsharded, args, kwargs, _reuse_marker(args, kwargs))
        return super().forward(*args, **kwargs)  # type: ignore[misc]

    def _forward_with_eager_hooks(self, args: tuple, kwargs: dict) -> Any:
        # [Note: frames Dynamo runs eagerly]
        # Under a compiled model the FSDP hooks are traced into the caller's graph, where they
        # stand aside for the traced parameter reads. If Dynamo then runs this forward eagerly
        # (torch.compiler.disable on it, the recompile limit, a skipped frame), its parameters
        # would be the sharded DTensors: run the eager hooks around it instead, which all-gather,
        # reshard and reduce-scatter as in eager training. A block compiled as a frame, whose
        # all-gather the block before it issued ahead ([Note: prefetch across block frames]), hands
        # it to the eager hooks (FSDPParamGroup.adopt_all_gather) rather than letting it go and
        # gathering again, which would issue one all-gather a step more than eager training.
        state = self._fsdp_state()
        root = state.outermost()
        # A module called on its own, outside the compiled model's call (FSDP2's non-root forward
        # and backward after the root's), runs its eager hooks as in eager training: nothing to warn of.
        inside_the_compiled_model = inside_a_compiled_call() or root.frames_forward_running
        if inside_the_compiled_model and not state.told_it_ran_eagerly:
            state.told_it_ran_eagerly = True
            why = fsdp_frames_recompile_limit_reached() or (
                "torch.compiler.disable, a recompile limit, a skipped frame, or a backend that failed on the graph, "
                "which the backend's warning names"
            )
            warnings.warn(
                f"fsdp_compile: the forward of '{state.label}' ran eagerly inside a compiled model (Dynamo did not "
                f"compile this frame: {why}); its FSDP hooks run eagerly around it. "
                "Numerics are unchanged; its collectives are not part of the compiled graph.",
                stacklevel=2,
            )
        if config.compile_blocks_as_frames and root.frames_forward_running:
            # A frame one rank runs eagerly while another runs it compiled gathers and reduces at other
            # points (the root's group, the backward prefetch): told apart here, before its collectives,
            # as ranks entering different blocks are ([Note: ranks entering different block frames] in
            # graph_check.py); ranks that all run it eagerly agree.
            root._check_frames_entered_across_ranks(state.label + EAGER_FRAME_MARK)
        # The all-gather issued ahead for it serves the eager hooks: none is issued twice.
        state.hand_frame_prefetch_to_eager_hooks()
        args, kwargs = state._pre_forward(self, args, kwargs)
        output = super().forward(*args, **kwargs)  # type: ignore[misc]
        return state._post_forward(self, args, output)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``module.compile(...)`` (``torch.compile``'s arguments).

        On the root (the whole model): each block compiled as a Dynamo frame of its own, one graph
        for all identical blocks (see [Note: blocks compiled as frames]; with
        ``config.compile_blocks_as_frames = False`` or ``fullgraph=True``, one graph with the
        all-gathers and reduce-scatters in it and a nested compile region per block, see
        [Note: compile once per block]). On a block (torchtitan's per-block recipe,
        ``for block in model.layers: block.compile(backend="fsdp_inductor")``): the block's forward
        is compiled alone and its FSDP hooks run eagerly around it, as with PyTorch FSDP2, so
        nothing in the graph tells blocks apart and every identical block shares one graph.
        ``fully_shard(torch.compile(block))``, and ``block.compile()`` before ``fully_shard``
        (torchtitan's ``apply_compile``), do the same: see [Note: every way of compiling a block,
        one form].

        Example::

            for block in model.layers:
                fully_shard(block)
                block.compile(backend="fsdp_inductor")
            fully_shard(model)
        """
        state = self._fsdp_state()
        if not state.has_outer:
            super().compile(*args, **kwargs)  # type: ignore[misc]
            return
        _compile_forward_alone(self, torch.compile(*args, **kwargs))

    def __deepcopy__(self, memo: dict) -> Any:
        raise AssertionError(  # FSDP2's exception type and words, then why and the fix
            f"FSDP does not support deepcopy: copy.deepcopy of a fully_shard module ({type(self).__name__}): its "
            "parameters are shards tied to process groups. Deep-copy the model before fully_shard, or build a new "
            "model and load this one's state_dict() into it."
        )

    def _fsdp_state(self) -> FSDPState:
        state = state_of(self)  # type: ignore[arg-type]
        assert state is not None, "FSDPModule without fully_shard state"
        return state

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [s.group for s in self._fsdp_state().states_under(recurse) if s.group is not None]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters ahead of use (e.g. before a custom forward).

        With ``async_op=True`` returns a handle; call ``handle.wait()`` before using them.
        """
        groups = self._groups(recurse=False)
        for group in groups:
            group.unshard("explicit")
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the sharded ones."""
        for group in self._groups(recurse=False):
            group.reshard()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """On the root: whether this backward should wait for its gradient reductions at its end.

        ``False`` lets microbatch backward passes overlap the next step's start; the reductions
        land at the next forward of the root.
        """
        self._fsdp_state().is_last_backward = is_last_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False`` accumulates unsharded gradients locally without reduce-scatter (FSDP1's ``no_sync``).

        Example::

            model.set_requires_gradient_sync(False)
            for micro in microbatches[:-1]:
                loss_fn(model(micro)).backward()
            model.set_requires_gradient_sync(True)
            loss_fn(model(microbatches[-1])).backward()
        """
        for group in self._groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters but defers the all-reduce across replicas (accumulating)."""
        for group in self._groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Change whether parameters are freed after forward (re-all-gathered in backward)."""
        for state in self._fsdp_state().states_under(recurse):
            if state.group is not None:
                state.group.reshard_after_forward = reshard_after_forward
                if not reshard_after_forward:
                    state.group.post_forward_mesh_info = None
                state.auto_reshard_after_forward = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False`` keeps parameters unsharded after backward (e.g. between accumulation microbatches)."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather these modules' parameters when this module's forward starts (replaces implicit prefetch)."""
        self._fsdp_state().forward_prefetch = [_state_of_fsdp_module(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather these modules' parameters when this module's backward starts (replaces implicit prefetch)."""
        self._fsdp_state().backward_prefetch = [_state_of_fsdp_module(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_backward_prefetch(self, mode: BackwardPrefetch | None, *, recurse: bool = True) -> None:
        """FSDP1's ``backward_prefetch``: where backward issues the next group's all-gather.

        ``BackwardPrefetch.BACKWARD_PRE`` (default) in pre-backward, ``BACKWARD_POST`` in
        post-backward right before this group's reduce-scatter, ``None`` never (see ``BackwardPrefetch``).
        """
        if mode is not None and not isinstance(mode, BackwardPrefetch):
            raise ValueError(f"set_backward_prefetch takes a BackwardPrefetch member or None, got {mode!r}")
        for state in self._fsdp_state().states_under(recurse):
            state.backward_prefetch_mode = mode

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next step's all-gathers wait for ``event`` (recorded after ``optimizer.step()``) instead of
        for everything queued on the compute stream (see [Note: stream protocol] in comm_context.py)."""
        self._fsdp_state().comm.post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: backward needs none of this module's parameters (an embedding, whose gradient
        needs only the indices), so it does not all-gather them; their gradients are still reduced."""
        for group in self._groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2: reduce with ``ReduceOp.SUM`` only, scaling before and after. Ours always does
        (``ReduceSpec``'s pre- and post-divide around a SUM reduce-scatter), so either value
        keeps that; accepted for scripts written for FSDP2."""
        if not isinstance(enable, bool):
            raise TypeError(f"set_force_sum_reduction_for_comms takes a bool, got {enable!r}")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """FSDP2's symmetric-memory all-gather buffers (NCCL only): not supported by fsdp_compile."""
        self._refuse_nccl_buffers("set_symm_mem_for_comm")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2's process-group-allocated staging buffers (NCCL zero-copy): not supported by fsdp_compile."""
        if enable:
            self._refuse_nccl_buffers("set_allocate_memory_from_process_group_for_comm")

    def _refuse_nccl_buffers(self, method: str) -> None:
        backend = dist.get_backend() if dist.is_initialized() else "none"
        reason = (
            f"it needs the NCCL backend and this job runs '{backend}'" if backend != "nccl"
            else "fsdp_compile allocates its own all-gather and reduce-scatter buffers (not yet verified with NCCL's)"
        )
        raise NotImplementedError(
            f"fsdp_compile: {method}() on '{self._fsdp_state().label}' is not supported: {reason}. "
            "Leave it out; communication buffers come from the caching allocator."
        )

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """``hook(reduced)`` runs in place on this module's reduced gradients, once per backward:
        on the reduce-scatter output (FSDP) or the all-reduce output (HSDP), before the divide by
        the post-divide factor and the copy into ``.grad`` (for example a tensor-parallel all-reduce).

        ``stream`` (CUDA, not with HSDP): run the hook on that stream, ordered after the reduction
        and before the copy-out.
        """
        for group in self._groups(recurse=False):
            if stream is not None and group.mesh_info.replicate_group is not None:
                # FSDP2's words first (_fully_shard.py), then ours.
                raise ValueError(
                    f"stream cannot be set when using native HSDP: set_all_reduce_hook on '{self._fsdp_state().label}' "
                    "runs the hook after the replicas' all-reduce, on that all-reduce's stream. Leave stream=None."
                )
            group.all_reduce_hook, group.all_reduce_hook_stream = hook, stream

    def reset_iter_state(self) -> None:
        """On the root, after an exception aborted a forward or backward: wait for the collectives
        in flight, reshard every group and clear the step's bookkeeping, so the next step runs
        normally. The failed step's gradients are dropped, including no-sync sums and HSDP's deferred
        all-reduce: restart an accumulation sequence after calling this.

        Example::

            try:
                loss_fn(model(batch)).backward()
            except RuntimeError:
                model.reset_iter_state()
        """
        state = self._fsdp_state()
        if state.outer is not None:
            raise RuntimeError(
                f"fsdp_compile: reset_iter_state() on '{state.label}', which is not the root; call it on the outermost "
                f"fully_shard module ('{state.outermost().label}')."
            )
        state.reset_iter_state()

    def set_custom_all_gather(self, comm: Any) -> None:
        """Run this module's all-gathers with ``comm``, an FSDP2 ``AllGather``: ``comm.allocate(size,
        dtype=, device=)`` makes the ``[world, numel]`` buffer and ``comm(output, input, group=,
        async_op=)`` gathers into it, returning a ``Work`` or None."""
        _check_comm(comm, "set_custom_all_gather", self._fsdp_state().label)
        for group in self._groups(recurse=False):
            group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Run this module's reduce-scatters with ``comm``, an FSDP2 ``ReduceScatter``: ``allocate``
        makes the input and output buffers and ``comm(output, input, group=, op=, async_op=)``
        reduces (``op`` is always ``SUM``; the divide factors are applied around it)."""
        label = self._fsdp_state().label
        _check_comm(comm, "set_custom_reduce_scatter", label)
        for group in self._groups(recurse=False):
            if group.comm_policy.reduce_wire_dtype is not None:
                raise ValueError(
                    f"set_custom_reduce_scatter on '{label}': its CommPolicy sends gradients over the wire as an all-to-all "
                    f"(reduce_wire_dtype={group.comm_policy.reduce_wire_dtype}), not a reduce-scatter; use one of the two."
                )
            group.custom_reduce_scatter = comm

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """``True``: a parameter that got no gradient this backward is reduced as zeros, so ranks that
        used different parameters (mixture of experts, multi-modal branches) still issue the same
        reduce-scatter; its gradient becomes the average over the ranks that used it."""
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reduce-scatters (each holding its input buffer) may be in flight before backward
        waits for the oldest: 1 (default) bounds memory; more lets an exposed reduce-scatter overlap
        the next groups' backward at the cost of their buffers."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers takes an int >= 1, got {max_input_buffers!r}")
        for group in self._groups(recurse):
            group.reduce_scatter_max_input_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """``True``: reduce-scatter over a process group of its own (the shard group's ranks, another
        communicator), so on NCCL it can run beside the backward all-gathers instead of after them.
        Collective over each shard group's ranks: call it on every rank alike."""
        for group in self._groups(recurse):
            info = group.mesh_info
            group.reduce_scatter_mesh_info = (
                dataclasses.replace(info, shard_group=separate_group_of(info.shard_group)) if enable else info
            )

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide summed gradients by ``factor`` instead of the data-parallel world size."""
        for state in self._fsdp_state().states_under(recurse=True):
            if state.group is not None:
                state.group.gradient_divide_factor = factor

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # module.to(...) / to_empty(...) replace the local shards; parameters must be sharded for that.
        groups = self._groups(recurse=True)
        for group in groups:
            group.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for group in groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.reset_after_module_apply()
        return result


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` run like ``forward`` for FSDP: the parameters are all-gathered
    before it and resharded after it, and its backward reduces their gradients (FSDP2's
    ``register_fsdp_forward_method``, for methods such as ``generate`` that use parameters without
    calling ``forward``).

    Example::

        fully_shard(model)
        register_fsdp_forward_method(model, "generate")
        model.generate(prompt)
    """
    if not isinstance(module, FSDPModule):
        raise ValueError(
            f"register_fsdp_forward_method: {type(module).__name__} is not managed by fully_shard; call "
            "fully_shard(module) first."
        )
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method '{method_name}'.")

    @functools.wraps(method)
    def run_as_forward(*args: Any, **kwargs: Any) -> Any:
        state = module._fsdp_state()
        args, kwargs = state._pre_forward_hook(module, args, kwargs)
        output = method(*args, **kwargs)
        return state._post_forward_hook(module, args, output)

    module.__dict__[method_name] = run_as_forward


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Make these roots (e.g. the model chunks of pipeline parallelism, each its own root) share
    one communication context: the same side streams and reductions in flight, so their
    collectives are ordered on one set of streams and their buffers do not fragment memory.

    Example::

        share_comm_ctx([stage0, stage1])
    """
    states = [_state_of_fsdp_module(module, "share_comm_ctx") for module in modules]
    if not states:
        return
    shared = states[0].comm
    for root in states[1:]:
        for state in all_states_under(root.modules):
            state.comm = shared
            if state.group is not None:
                state.group.comm = shared
            if state.root_ctx is not None:
                state.root_ctx.comm = shared


def _check_comm(comm: Any, method: str, label: str) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{method} on '{label}' takes an FSDP2 Comm object (torch.distributed.fsdp's AllGather / ReduceScatter, "
            f"or any object with allocate(size, *, dtype, device) and __call__), got {type(comm).__name__}"
        )


def _run_block_with(module: nn.Module, unsharded: list[torch.Tensor], args: tuple, kwargs: dict, reuse: object) -> Any:
    """The block's own forward, with its parameter reads returning ``unsharded`` (see the note).
    ``reuse`` is ``_reuse_marker()``'s: it only steers Dynamo's reuse of the traced body."""
    # One entry per submodule registering group parameters (a tied parameter under each name).
    placements: dict[nn.Module, dict[str, torch.Tensor]] = {}
    for fsdp_param in module._fsdp_state().group.fsdp_params:  # type: ignore[operator]
        for ref in fsdp_param.refs:
            placements.setdefault(ref.module, {})[ref.name] = unsharded[fsdp_param.index_in_group]
    output = _forward_reparametrized(module, list(placements.items()), args, kwargs)
    # A region may not return its inputs or views of them (a residual passed through, a skip
    # connection in a returned structure): fresh outputs, which Inductor writes in the producing
    # kernel rather than as a separate copy where it can.
    return map_tensors(torch.clone, output)


def _forward_reparametrized(
    module: nn.Module, placements: list[tuple[nn.Module, dict[str, torch.Tensor]]], args: tuple, kwargs: dict
) -> Any:
    """``module``'s own forward with each submodule's parameters replaced by the given tensors;
    nested contexts, one per submodule, because Dynamo exempts only the reparametrized module's
    own parameter dict from its side-effect check."""
    if not placements:
        return super(FSDPModule, module).forward(*args, **kwargs)  # type: ignore[misc]
    owner, tensors = placements[0]
    with parameters_placed_for_trace(owner, tensors):
        return _forward_reparametrized(module, placements[1:], args, kwargs)


# [Note: compile once per block]
# A whole-model torch.compile would trace every block into one graph and compile each block's
# kernels again. Instead, the forward of a block (a fully_shard module with an enclosing one and
# none inside it) is a nested compile region (torch.compiler.nested_compile_region): Dynamo traces
# its body once, and every structurally identical block reuses it (invoke_subgraph), through
# AOTAutograd and Inductor. The block's all-gathers stay in the outer graph: the block forward
# first traces each parameter's unshard (annotated all-gather) there, then calls the region with
# the unsharded parameters as inputs; inside, the parameter reads return those inputs. So the
# region holds no collective and nothing that tells blocks apart, and the graph passes still bucket
# and reorder every all-gather and reduce-scatter across blocks.
#
# The inputs are placed with torch.nn.utils.stateless._reparametrize_module (param.py's
# parameters_placed_for_trace), once per submodule that
# registers a group parameter (the read's property returns a registered tensor that is not an
# nn.Parameter as is). Dynamo knows that context: it swaps the module's parameter dict for the
# body's trace and does not count it as a side effect, so the traced body is eligible for Dynamo's
# own reuse. Each later block re-evaluates the body's guards on its own sources (its submodules'
# attributes, training flags, parameter names) and, when they hold, stamps out the traced body
# instead of tracing it again; a block that differs is traced on its own. Writing the inputs onto
# the module any other way (an attribute, a global) is a side effect, and Dynamo then traces the
# body once per block.
#
# A resharding block (reshard_after_forward=True, the default) is a region too. The region's own
# partition saves the unsharded parameters its backward needs by returning them (or views of them)
# from its forward, which would keep every block's parameters alive until backward. The joint-graph
# pass (passes/recompute.py, read_region_saved_inputs_directly) lets the region's backward read the
# region's input instead (the view taken outside), so the outer partition sees the unshard chain
# feed that backward and replays it there, re-all-gathering in backward as an inlined block does
# (tests/test_compile_blocks.py checks what is saved and what is gathered again).
#
# Dynamo's reuse has two limits that would crash a training job, so the region steers around them
# ([Note: where Dynamo's body reuse stops]).


# [Note: blocks compiled as frames]
# A region still costs the whole-model trace something per block: Dynamo traces each block's parameter
# reads and checks the reuse of its body, AOTAutograd partitions a joint graph holding every block's
# collectives, Inductor lowers them; the 16-layer benchmark model compiled in 2.6x the time of PyTorch
# FSDP2's per-block compile, growing 0.65 s per layer. With config.compile_blocks_as_frames, a block's
# forward instead breaks the caller's graph (state.eager_enter_block_frame, a torch.compiler.disable'd
# call) and the rest of it is a Dynamo frame of its own: its graph reads the block's shards,
# all-gathers the group before the body (a graph node that takes the prefetch across frames:
# [Note: prefetch across block frames]), and its backward holds the group's reduce-scatter, with a
# resharding block gathering again in backward (passes/recompute.py, as for any graph). Dynamo keys
# compiled frames by code object, and this code is every block's: a block whose guards hold on the
# first one's graph runs that graph, so compile time stays flat with depth; blocks that differ compile
# a graph per structure, each structure with its own recompile budget
# ([Note: a recompile limit per block structure] in backend.py). Nothing in the trace may then tell
# blocks apart: the annotations name the block's class (frame_label) and a shared token rather than
# the group's label and state, and the backend learns which block it admits from the eager call that
# entered the frame (block_frame_in_trace). The groups outside blocks (the root) are read in several
# graphs, the frames splitting their forward: the first read in a forward gathers the whole group and
# hands the unsharded parameters to later graphs (FSDPState.unsharded_across_frames), so each group
# still gathers and reduces once per step. The root's own hooks hand their bookkeeping (staging
# no-sync sums, the handoff) to an eager call as well: traced, their walk over every group cost
# compile time and guards per block. A frame Dynamo gives up on (recompile limit, a skipped frame)
# runs with the eager hooks, as any block ([Note: frames Dynamo runs eagerly]). A read of a group
# outside blocks that runs eagerly under the compiled model (Dynamo skips the read's code once a trace
# of it held no op, as the eager fallback's does) gathers that group in a small graph of its own
# (state._gather_group_in_a_graph), bucketed as in any graph. Frames are the default: they keep
# compile time flat with depth, where the regions below grow with it. Not a frame: a block called
# inside a higher-order op of its caller's graph (checkpoint(block, x), as Hugging Face's gradient
# checkpointing calls its layers), whose graph cannot break there (backend.
# traced_in_a_callers_higher_order_op): it compiles as a region of that graph, or inline where regions
# are not used (a block whose class checkpoints itself in its own __call__, as Hugging Face's layers
# do now, enters its frame there instead: [Note: a block that checkpoints itself in __call__]); and
# every block under fullgraph=True. Ranks whose control flow enters different blocks are caught before
# the block's collectives ([Note: ranks entering different block frames] in graph_check.py), since
# every rank compiles the same frames.
#
# [Note: prefetch across block frames]
# A block frame's graph reads its parameters as any graph does: each read traces its unshard, the bucket
# pass makes the group's all-gather one node, the reorder pass puts it at the graph's start. Left as it
# is, that all-gather could only overlap the block's own first ops; one traced into the previous block's
# graph instead (to prefetch) would make the last block's graph differ from the others' (it has no next
# block), so a chain of identical blocks would compile two frames. The graph cannot name the block (one
# graph serves them all) nor take an input for the block after it. So the post-grad pass
# (passes/recompute.gather_frames_through_prefetch) turns the bucket's copy-in + all-gather into one
# opaque call, fsdp_compile::frame_all_gather, on the same shards, in the same place, its result waited
# on where the reorder pass put the wait; a graph node still, after bucketing and placing. At run time
# (state.gather_in_frame) the call finds its block by the shards' addresses (registered as the block's
# compiled frame was entered, enter_block_frame), takes the all-gather the block before it issued for
# it if one was issued on exactly these shards at these versions (else issues its own), and issues that
# of the block after it (the order the last forward entered them in: FSDPState._learn_frame_order, the
# module tree's at the first), with the shards that block's graph gathered last time. So block i+1's
# all-gather is in flight before block i's first matmul and runs while block i computes, as FSDP2's
# eager forward prefetch; every block's graph is the same, the first, the last and the others; at most
# two blocks are unsharded at once in forward (a frame lets go of its parameters at its end). A
# resharding block's backward graph gathers again, as any graph's (passes/recompute.py), nothing
# unsharded saved. Every rank decides alike: the order, the registration (on every rank, or, where a
# parameter has no rows on some rank and so no address of its own, on none) and the learned gathers
# are the same on all ranks. Not prefetched: a block's first forward (what its graph gathers is learned
# then), a block with CommPolicy's quantized all-gather or tensor-parallel parameters (they gather in
# their own graph), the groups outside blocks. A prefetch is never read stale: one whose shards were
# written since (the optimizer's step) is waited on and let go where the block's graph asks for its
# all-gather; one no frame took (a block skipped on a step) is let go as the next forward's first frame
# is entered (FSDPState.drop_frame_prefetch); a frame Dynamo runs eagerly hands it to its eager hooks
# ([Note: frames Dynamo runs eagerly]).
#
# [Note: backward prefetch across block frames]
# A resharding block's backward graph gathers its shards again (a bucketed graph all-gather, which the
# reorder pass hoists to the graph's start), and the same pass makes it the same opaque call as in
# forward ([Note: prefetch across block frames]), run the other way: it takes the all-gather the block
# after it issued for it and issues that of the block before it, the one that ran forward before it and
# so runs backward next, with the shards that block's backward graph gathered last time. So block i-1's
# all-gather runs while block i's backward computes, as FSDP2's eager backward prefetch does; at most
# two blocks are unsharded at once in backward. A block is registered for its backward's gather where
# its compiled frame ran forward with gradients on. Not prefetched: a block whose compiled frame did not
# run forward with gradients on since its backward last ran (a frame Dynamo ran eagerly: its eager hooks
# gather; a no-grad forward), a block's first backward (its gather is learned then), the groups outside
# blocks. One that no backward took (a backward that stops early) is let go as the next forward's first
# frame is entered, as a forward prefetch is.
# The reduce-scatters are issued in the block's graph and waited after it ([Note: late reduce-scatter
# wait across block frames]).
#
# [Note: late reduce-scatter wait across block frames]
# A block frame's backward graph ends where the block's backward ends, so a reduce-scatter waited in
# it overlaps only the rest of that block's backward: the block's bucket, issued after its last
# gradient, hardly anything. FSDP2's eager backward waits on a block's reduce-scatter in the next
# block's post-backward instead, and so do we. The traced reduction of a block frame's parameter
# (all_gather_shard's autograd formula, given the parameter's ``late_gradient_sink``) returns no
# gradient for the shard: it passes the reduced, divided and cast padded shard with the sink to
# fsdp_compile::deliver_reduced_gradient, which writes it into the sharded ``.grad`` and runs the
# post-accumulate-grad hooks (the eager copy-out, FSDPParamGroup.write_sharded_grads), and returns
# the sink's gradient: zeros, one element, a graph output, so the call is never dead code. The sink
# (a graph input) says whose gradient it is (param_group.owner_of_late_gradient_sink, by address),
# so the graph still names no block. After bucketing and reordering, the post-grad pass
# (passes/recompute.deliver_frame_reductions_late) replaces the wait, copy-out and deliveries of
# each bucket whose reduced shard only its parameters' deliveries read with one
# fsdp_compile::deliver_reduce_scatter_late(in flight, its input, sinks) at the graph's end. At run
# time (state.deliver_gradients_late) that call first lands the reduce-scatters handed over before
# it (the block after this one's: wait, copy-out, .grad, hooks, in FSDPParamGroup.finish_reduction,
# the eager runtime's own), then holds its own as the group's reduction in flight, landed by the
# next hand-over or when the backward ends (a callback queued on autograd's engine). So block i's
# reduce-scatter runs while block i-1's backward computes; two are in flight at most, as in FSDP2.
# The hand-over is the graph's last call because a collective's buffers may not be reused before its
# wait, and Inductor knows only of waits in its graph: after the last call it allocates nothing;
# the runtime keeps both buffers until the wait. Waited in the graph as before: HSDP (an all-reduce
# follows), CommPolicy's gradient wire, tensor-parallel parameters, the groups outside blocks, a
# bucket whose reduced shard something else reads, and any graph another backend compiles (there
# the first call delivers where the graph computed the gradient). Under compiled autograd, which
# traces the whole backward into one graph of its own, no frame takes a sink: its reductions return
# their gradients, as outside frames (backend.traced_under_compiled_autograd). ``.grad`` is complete
# when ``backward()`` returns, as before.
_UNBOUNDED_REUSE = (
    {"max_reuse_entries": sys.maxsize} if "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters else {}
)
_block_region = torch.compiler.nested_compile_region(_run_block_with, **_UNBOUNDED_REUSE)


# [Note: a block region's flat arguments]
# Before Dynamo reuses a traced body it fingerprints the region call's inputs. Inputs that are all
# tensors, modules or constants, positional, take its fast path; any container (the list of unsharded
# parameters, the args tuple, the kwargs dict) makes it flatten them by tracing torch's Python pytree,
# about 1,750 bytecode steps per block (28% of Dynamo's steps for the 16-layer benchmark model).
# A block called with positional tensors only (``layer(h, cos, sin)``) therefore enters a second
# region whose inputs are the block, the parameter count and the tensors, all flat; it runs the same
# body. Other calls (keyword arguments, nested or non-tensor arguments, a symbolic size that needs
# the marker of [Note: where Dynamo's body reuse stops]) keep the general region.
def _run_block_with_flat(module: nn.Module, parameter_count: int, *tensors: torch.Tensor) -> Any:
    """``_run_block_with`` on ``tensors``: the unsharded parameters, then the block's arguments."""
    return _run_block_with(module, list(tensors[:parameter_count]), tensors[parameter_count:], {}, None)


_flat_block_region = torch.compiler.nested_compile_region(_run_block_with_flat, **_UNBOUNDED_REUSE)


def _takes_flat_arguments(args: tuple, kwargs: dict) -> bool:
    """Whether a block call can enter the flat region: positional tensors of static sizes only."""
    if kwargs:
        return False
    for arg in args:  # plain loops: Dynamo traces any() and generators in more steps
        if not isinstance(arg, torch.Tensor) or _has_symbolic_size(arg):
            return False
    return True


def _has_symbolic_size(tensor: torch.Tensor) -> bool:
    for size in tensor.shape:
        if isinstance(size, torch.SymInt):
            return True
    return False


# [Note: where Dynamo's body reuse stops]
# 1. Dynamo keeps one reuse entry per distinct block structure it traced and raises once a region
#    has more than ``max_reuse_entries`` (8 by default): a model whose blocks differ in anything
#    their forward reads (a per-layer index or window, say) would fail at its ninth block. A model
#    has at most as many structures as blocks, so the region takes no bound.
# 2. torch 2.13's stamp-out of a reused body fails on symbolic sizes: after a sequence length
#    changed under the default ``dynamic=None``, a block called under activation checkpointing fails
#    (``KeyError: s50``: the checkpoint's tracer does not hold the symbol). So a block whose inputs
#    have a symbolic size passes a marker object, an argument kind Dynamo's reuse does not take: its
#    body is traced on its own, as before reuse, and AOTAutograd and Inductor still compile
#    identical bodies once. Static shapes, the usual training step, keep the reuse.
# 3. Under ``dynamic=True`` Dynamo also makes every float a block reads (a norm's ``eps``) a graph
#    input, read with ``.item()`` inside the body, and AOTAutograd cannot trace that inside a region
#    (``DataDependentOutputException: aten._local_scalar_dense``): the backend failed and Dynamo ran
#    the model's forward eagerly, every block with the eager hooks (the Transformer, from 3 blocks
#    on; with 2 a body used once is inlined). So under ``dynamic=True`` a block is no region:
#    it is traced inline, as with ``config.compile_blocks_once = False`` (correct, one graph,
#    compiled per block).
class _TraceOnItsOwn:
    """Passed to a block region: Dynamo does not reuse a traced body across calls taking one."""


_TRACE_ON_ITS_OWN = _TraceOnItsOwn()


def _reuse_marker(args: tuple, kwargs: dict) -> object:
    """``None`` (reuse the traced body) or the marker; see [Note: where Dynamo's body reuse stops]."""
    symbolic = any(_has_symbolic_size(tensor) for tensor in tensors_in((args, kwargs)))
    return _TRACE_ON_ITS_OWN if symbolic else None


def _let_a_block_body_graph_break() -> None:
    """See [Note: a block whose body graph-breaks]; once per process, a no-op on a torch without
    the hook it relies on."""
    try:
        from torch._dynamo.variables.invoke_subgraph import InvokeSubgraphHigherOrderVariable, get_fn_code
    except ImportError:
        return
    traced = InvokeSubgraphHigherOrderVariable.call_function
    if getattr(traced, "_fsdp_compile_block_fallback", False) or not hasattr(InvokeSubgraphHigherOrderVariable, "_ALLOW_FALLBACK_TO_EAGER"):
        return

    def call_function(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        if args and get_fn_code(args[0]) in (_run_block_with.__code__, _run_block_with_flat.__code__):
            self._ALLOW_FALLBACK_TO_EAGER = True  # this call only: other regions keep torch's hard error
        return traced(self, tx, args, kwargs)

    call_function._fsdp_compile_block_fallback = True  # type: ignore[attr-defined]
    InvokeSubgraphHigherOrderVariable.call_function = call_function


# [Note: a block whose body graph-breaks]
# Dynamo refuses a graph break inside a nested compile region outright (UncapturedHigherOrderOpError:
# torch 2.13 gives invoke_subgraph no fallback), so a block whose forward breaks (a print, a
# data-dependent .item() branch, an unsupported call) would crash a whole-model compile that traces
# the same block inline without trouble. For our block region alone, Dynamo is let to do what it does
# for a break anywhere else: break the graph at the region's call, run that call eagerly and compile
# the frames inside it on their own. The block then runs as an inlined block with a graph break does
# (its parameters gathered in the graph before the break, read as plain tensors after it), which
# trains like eager (tests/test_compile_blocks.py); it is not compiled once for all blocks.
_let_a_block_body_graph_break()


# [Note: a block that checkpoints itself in __call__]
# Hugging Face's decoder layers (GradientCheckpointingLayer) checkpoint themselves under
# gradient_checkpointing_enable(): in 4.x in their own __call__
# (checkpoint(partial(nn.Module.__call__, layer), ...)), in 5.x in their forward, which the class
# wraps for every subclass, our FSDP class included (checkpoint(FSDPModule.forward, ...)). Either way
# our forward runs inside the checkpoint's higher-order op, where a block frame's graph break cannot
# happen, and every such block compiled as a region of its caller's graph, whose compile time grows
# with depth (transformers 5.24's Llama: one backward graph holding every layer's reduce-scatter). For
# such a class (_may_checkpoint_itself), the FSDP class enters the block's frame in __call__ instead,
# before the user's __call__ (and the checkpoint) runs: the frame's graph then holds the checkpoint,
# the forward and the parameter reads inside it, as for a block that checkpoints inside its forward
# (torchtitan's recipe). The forward, reached inside that frame
# (backend.traced_in_a_block_call_frame), runs the body as it is. A frame Dynamo runs eagerly runs the
# user's __call__ eagerly, whose forward takes the eager hooks ([Note: frames Dynamo runs eagerly]).
def _may_checkpoint_itself(cls: type) -> bool:
    """Whether a block of ``cls`` may checkpoint itself around its forward, inside its own call: its
    class has a ``__call__`` of its own (Hugging Face's GradientCheckpointingLayer until 4.x), or is a
    Hugging Face GradientCheckpointingLayer, which from 5.x wraps every subclass's forward (the FSDP
    class's too) in the checkpoint."""
    if cls.__call__ is not nn.Module.__call__:
        return True
    return any(klass.__name__ == "GradientCheckpointingLayer" and klass.__module__.startswith("transformers.") for klass in cls.__mro__)


# [Note: PyTorch's composable checkpoint, compiled]
# torch.distributed._composable.checkpoint(block) checkpoints through the block's forward hooks: its
# pre-hook enters torch.utils.checkpoint's non-reentrant context (saved-tensor hooks) eagerly, its
# post-hook leaves it, and backward recomputes by calling the block again, eagerly. Under a compiled
# model Dynamo cannot trace that pre-hook (a graph break) and runs the block's forward as graphs
# (its frame, or the caller's graph resumed after the break): the original forward saves what those
# graphs save (AOTAutograd's saved tensors, the unsharded parameters among them), the eager
# recompute what eager ops save, and torch.utils.checkpoint raised CheckpointError ("a different
# number of tensors was saved"; "different metadata" under HSDP). So for a block fully_shard finds
# so checkpointed (_take_over_composable_checkpoint, at fully_shard: its own call's or, checkpointed
# after, an enclosing module's), the checkpoint's hooks stand
# aside while Dynamo traces, and the block's traced forward runs in torch.utils.checkpoint.
# checkpoint with the composable call's options instead: Dynamo traces it as a higher-order op,
# inside the block's frame (parameter reads and all, as torchtitan's blocks that checkpoint in their
# forward) or, for a module that is not a frame (one with fully_shard modules inside), in its
# caller's graph, where those inner blocks compile as regions of it (its groups outside blocks
# gather before the checkpoint: their first read writes the frames' handoff, which Dynamo refuses
# inside a higher-order op, unsharded_across_frames); AOTAutograd recomputes the
# block's forward in the backward graph, as the eager checkpoint recomputes it in backward. Eagerly
# (the eager runtime, per-block compile, the eager fallback) the hooks run as before; a block frame
# Dynamo runs eagerly after its hooks were traced runs without the checkpoint (same numerics).
_COMPOSABLE_CHECKPOINT_ATTR = "_fsdp_compile_composable_checkpoint"
_COMPOSABLE_CHECKPOINT_HOOKS = ("checkpoint.<locals>.forward_pre_hook", "checkpoint.<locals>.forward_hook")


def _take_over_composable_checkpoint(module: nn.Module) -> None:
    """If ``torch.distributed._composable.checkpoint`` was applied to ``module``: let its hooks stand
    aside under Dynamo and keep its options for the traced forward's checkpoint."""
    try:
        from torch.distributed._composable import checkpoint_activation
        from torch.distributed._composable.contract import _get_registry
    except ImportError:
        return
    registry = _get_registry(module)
    if not registry or "checkpoint" not in registry or _COMPOSABLE_CHECKPOINT_ATTR in module.__dict__:
        return
    options: dict[str, Any] | None = None
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in list(hooks.items()):
            if getattr(hook, "__module__", None) != checkpoint_activation.__name__ or getattr(hook, "__qualname__", None) not in _COMPOSABLE_CHECKPOINT_HOOKS:
                continue
            if hook.__qualname__ == _COMPOSABLE_CHECKPOINT_HOOKS[0]:
                closure = dict(zip(hook.__code__.co_freevars, (cell.cell_contents for cell in hook.__closure__ or ())))
                options = {"preserve_rng_state": closure.get("preserve_rng_state", True)}
                for name in ("determinism_check", "debug"):
                    if name in closure:
                        options[name] = closure[name]
                if closure.get("user_context_fns") is not None:
                    options["context_fn"] = closure["user_context_fns"]
                hooks[key] = _standing_aside_when_traced(hook)
            else:
                hooks[key] = _standing_aside_without_a_context(hook)
    if options is not None:
        module.__dict__[_COMPOSABLE_CHECKPOINT_ATTR] = options


def _standing_aside_when_traced(pre_hook: Callable[..., Any]) -> Callable[..., Any]:
    def composable_checkpoint_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if torch.compiler.is_compiling() and not config.skip_fsdp_hooks:
            return None  # the traced forward checkpoints itself: _checkpointed
        return pre_hook(module, args, kwargs)

    return composable_checkpoint_pre_hook


def _standing_aside_without_a_context(post_hook: Callable[..., Any]) -> Callable[..., Any]:
    from torch.distributed._composable import checkpoint_activation

    def composable_checkpoint_post_hook(module: nn.Module, inputs: Any, output: Any) -> Any:
        # Its pre-hook stood aside (traced), whether or not this one runs in a graph: a break in the
        # block's forward may leave it to run eagerly.
        if getattr(checkpoint_activation.checkpoint.state(module), "_ac_generator", None) is None:
            return None
        return post_hook(module, inputs, output)

    return composable_checkpoint_post_hook


def _checkpointed(module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``forward(*args, **kwargs)`` in torch.utils.checkpoint with the options of the composable
    checkpoint on ``module``: see [Note: PyTorch's composable checkpoint, compiled]."""
    from torch.utils.checkpoint import checkpoint

    options = module.__dict__[_COMPOSABLE_CHECKPOINT_ATTR]
    if kwargs:
        forward = functools.partial(forward, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **options)


def _entering_block_frame_before(user_call: Callable[..., Any]) -> Callable[..., Any]:
    """The FSDP class's ``__call__`` over the user's ``user_call``; one code object for every class,
    so one compiled frame serves every block whose guards hold."""

    def _call_entering_block_frame(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The eager fallback (config.skip_fsdp_hooks) breaks the graph in forward, as for any block.
        if torch.compiler.is_compiling() and not config.skip_fsdp_hooks and not traced_in_a_block_call_frame():
            state = self._fsdp_state()
            if state.compiles_as_frame and state.training_state is TrainingState.IDLE:
                # A graph break: the rest is the block's frame, Dynamo's resume function named after
                # this function (traced_in_a_block_call_frame).
                state.eager_enter_block_frame()
        return user_call(self, *args, **kwargs)

    return _call_entering_block_frame


def _user_class(cls: type) -> type:
    """The class the user wrote, under our FSDP class and our traced-parameter class."""
    for klass in cls.__mro__:
        if klass is FSDPModule or issubclass(klass, FSDPModule) or "_fsdp_compile_property_base" in klass.__dict__:
            continue
        return klass
    raise AssertionError(f"no user class in {cls.__mro__}")


def _state_of_fsdp_module(module: Any, caller: str) -> FSDPState:
    state = state_of(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(f"{caller} takes modules that fully_shard was applied to; got {type(module).__name__}")
    return state


# --- fully_shard ---------------------------------------------------------------------------------


@overload
def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module: ...
@overload
def fully_shard(module: list[nn.Module], **kwargs: Any) -> list[nn.Module]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    comm_policy: CommPolicy = CommPolicy(),
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters on dim 0 across ``mesh``; one all-gather / reduce-scatter group.

    A drop-in for ``torch.distributed.fsdp.fully_shard``. Call it bottom-up: each call takes the
    parameters of ``module`` not already taken by a call on a submodule. The module's class
    becomes a subclass of :class:`FSDPModule`; its parameters become ``DTensor`` shards.

    Args:
        module: a module, or a list of modules sharing one group (e.g. ``[norm, head]``).
        mesh: 1-D mesh (FSDP) or 2-D ``(replicate, shard)`` mesh (HSDP). Default: all ranks of
            the default process group, on CUDA for NCCL and CPU for gloo.
        reshard_after_forward: ``True`` frees parameters after forward (re-all-gathered in
            backward); ``False`` keeps them; an ``int`` keeps them sharded over blocks of that
            many ranks; ``None``: ``True`` except for the root module.
        shard_placement_fn: ``fn(param) -> Shard(dim) | None`` picks each parameter's sharded dim
            (``None``: dim 0), as in FSDP2. A dim > 0 must split evenly over the shard mesh.
        mp_policy: mixed-precision dtypes, see :class:`MixedPrecisionPolicy`.
        offload_policy: :class:`CPUOffloadPolicy` keeps shards and gradients on CPU.
        ignored_params: parameters left alone (not sharded, not reduced).
        dp_mesh_dims: FSDP2's :class:`DataParallelMeshDims`: ``mesh`` is the full mesh the
            parameters are DTensors on (replicated on the data-parallel dims) and this names its
            shard dim (and replicate dim, for HSDP).
        comm_policy: what goes on the wire: block-quantized all-gathers, a low-precision
            gradient wire with float32 sums; see :class:`CommPolicy`.

    Parameters that are already DTensors (tensor parallel, e.g. from ``parallelize_module`` on a
    sibling ``tp`` mesh) are sharded on the data-parallel mesh too; see
    [Note: FSDP over tensor-parallel parameters] in mesh.py.

    Example::

        for block in model.layers:
            fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        fully_shard(model)

        # With tensor parallelism on a (dp, tp) mesh:
        mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
        for block in model.layers:
            parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    """
    modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard takes an nn.Module or a list of them, got {type(m).__name__}")
        if type(m).forward is nn.Module.forward and not _compiled_before_sharding(m):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: fully_shard({type(m).__name__}): "
                "this container has no forward(), so the hooks that all-gather "
                "its parameters would never run when its items do. Apply fully_shard to each item "
                "(for block in model.layers: fully_shard(block)) or to the module whose forward calls them."
            )
        if state_of(m) is not None:
            # FSDP2's exception type and words (torch.distributed._composable.contract), then the fix.
            raise AssertionError(
                "Each distinct composable distributed API can only be applied to a module once: "
                f"fully_shard was already applied to this {type(m).__name__}; apply it once per module "
                "(bottom-up: blocks first, then the model)"
            )
    if dp_mesh_dims is not None and mesh is None:
        raise ValueError("fully_shard: dp_mesh_dims names dims of a mesh; pass that mesh too (mesh=..., dp_mesh_dims=...)")
    mesh = mesh if mesh is not None else default_mesh()
    info = mesh_info_for(mesh, dp_mesh_dims)
    if mesh.device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "fully_shard got a 'cuda' mesh but CUDA is not available; on CPU use "
            "init_device_mesh('cpu', ...) with the gloo backend"
        )
    device = mesh_device(mesh)
    label = type(modules[0]).__name__
    post_forward_size = _check_reshard_after_forward(reshard_after_forward, info, label)
    params, refs = _collect_params(modules, {id(p) for p in ignored_params or ()}, label)
    _check_params(params, refs, device, label)
    _check_comm_policy(comm_policy, post_forward_size, label)
    shard_dims = [_shard_dim(param, refs[id(param)][0].fqn, shard_placement_fn, info, label) for param in params]
    tp_layouts = [
        _tensor_parallel_layout(param, refs[id(param)][0].fqn, shard_dim, info, label, post_forward_size)
        for param, shard_dim in zip(params, shard_dims)
    ]
    post_forward_info = post_forward_mesh_info_for(info, post_forward_size) if post_forward_size else None
    _move_buffers(modules, device)

    offload = isinstance(offload_policy, CPUOffloadPolicy)
    fsdp_params = [
        FSDPParam(
            param, refs[id(param)], info, post_forward_info, device, mp_policy,
            offload_to_cpu=offload, pin_memory=offload and offload_policy.pin_memory, shard_dim=shard_dim,
            tensor_parallel=tp_layout,
        )
        for param, shard_dim, tp_layout in zip(params, shard_dims, tp_layouts)
    ]
    for param in params:
        setattr(param, _OWNER_ATTR, label)
        mark_replaced(param, f"fully_shard({label})")
    for fsdp_param in fsdp_params:
        setattr(fsdp_param.sharded_param, _OWNER_ATTR, label)
    install_optimizer_check()
    group = None
    if fsdp_params:
        group = FSDPParamGroup(
            fsdp_params, modules, label, info, post_forward_info, device,
            reshard_after_forward=reshard_after_forward is not False, comm_policy=comm_policy,
        )
    state = FSDPState(modules, group, mp_policy, device, auto_reshard_after_forward=reshard_after_forward is None)
    state.per_block_compiled = any(_compiled_before_sharding(m) for m in modules)
    register_state_dict_hooks(state)
    for fsdp_param in fsdp_params:
        for ref in fsdp_param.refs:
            install_traced_param_access(ref.module, ref.name, fsdp_param, state)
    states = state.states_in_tree()
    for inner in states:
        inner.outer = None if inner is state else state
        inner.has_outer = inner.outer is not None
        inner.is_leaf = len(all_states_under(inner.modules)) == 1
    _label_groups(modules)
    for m in modules:
        for sub in m.modules():  # this module's and those sharded before, checkpointed since
            if state_of(sub) is not None:  # [Note: PyTorch's composable checkpoint, compiled]
                _take_over_composable_checkpoint(sub)
        cls = type(m)
        if cls not in _fsdp_classes:
            namespace: dict[str, Any] = {"__module__": cls.__module__}
            if _may_checkpoint_itself(cls):  # [Note: a block that checkpoints itself in __call__]
                namespace["__call__"] = _entering_block_frame_before(cls.__call__)
            _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), namespace)
        m.__class__ = _fsdp_classes[cls]
    _compile_blocks_forward_alone(modules, states)
    return module


# [Note: every way of compiling a block, one form]
# A block is compiled in one of four ways: torch.compile(block) registered back in its place (an
# OptimizedModule) before or after fully_shard(block), block.compile() in place before any
# fully_shard (torchtitan's apply_compile: nn.Module.compile keeps torch.compile(block._call_impl)
# in _compiled_call_impl), or block.compile() once the block is sharded. Dynamo skips nn.Module's
# __call__ and _call_impl (torch/nn is in its skip files) but compiles every frame they call under
# the compile's callback. FSDP2's hooks are Dynamo-disabled, so they run eagerly and only the
# block's forward compiles. Ours are traceable (a whole-model compile traces them), so Dynamo
# compiled each hook as a frame of its own, where it stood aside as under a compiled model, and the
# forward then traced the all-gathers into the user's graph: under Inductor, AOTAutograd refused
# the DeviceMesh they save ("expected all tensors_saved_with_vc_check to be Tensors").
#
# So every form becomes the one FSDPModule.compile makes: the block's forward compiled alone, with
# the user's own compile context (backend, fullgraph, dynamic, options), and the hooks eager around
# it, as with FSDP2. The fully_shard call that encloses the block does it (the block's own call
# cannot know it is a block), whichever came first, the compile or fully_shard(block). A module
# compiled in place that nothing encloses is the whole model, compiled with its hooks traced. An
# OptimizedModule given to fully_shard itself is already this form: its hooks run outside the
# compile, around the compiled block (_compiled_before_sharding).
def _compile_blocks_forward_alone(modules: tuple[nn.Module, ...], states: list[FSDPState]) -> None:
    """See [Note: every way of compiling a block, one form]."""
    for state in states:
        if not state.has_outer:
            continue
        for block in state.modules:
            if block._compiled_call_impl is not None:
                context = _dynamo_context_of(block._compiled_call_impl, state.label)
                block._compiled_call_impl = None
                _compile_forward_alone(block, context)
    for root in modules:
        for wrapper in root.modules():
            block = getattr(wrapper, "_orig_mod", None) if _compiled_before_sharding(wrapper) else None
            state = state_of(block) if isinstance(block, FSDPModule) else None
            if state is not None and state.has_outer and block.__dict__.get("forward") is None:
                _compile_forward_alone(block, wrapper.dynamo_ctx)
                wrapper.forward = block.__call__  # the wrapper now calls the block, whose forward is compiled


def _compile_forward_alone(block: nn.Module, context: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """The block's forward compiled by ``context`` (what ``torch.compile(...)`` returns), its FSDP
    hooks eager around it."""
    state = state_of(block)
    assert state is not None
    state.per_block_compiled = True
    block.__dict__["forward"] = context(type(block).forward.__get__(block))


def _dynamo_context_of(compiled_call: Callable[..., Any], label: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``torch.compile`` context (backend, fullgraph, options) that ``nn.Module.compile`` wrapped
    around the module's ``_call_impl``: torch keeps no public handle to it, only the wrapper's closure."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for cell in getattr(compiled_call, "__closure__", None) or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(contents, _TorchDynamoContext):
            return contents
    raise RuntimeError(
        f"fsdp_compile: '{label}' was compiled in place (module.compile()) before fully_shard, and this torch "
        "keeps its compile settings where fsdp_compile cannot find them. Call module.compile(...) after "
        "fully_shard on the whole model instead, or register torch.compile(module) in its place."
    )


def _compiled_before_sharding(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(block)`` (torchtitan's ``apply_compile`` runs before
    ``fully_shard``): its forward is the compiled block, and the FSDP hooks run eagerly around it."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def _check_comm_policy(policy: CommPolicy, post_forward_size: int, label: str) -> None:
    if not isinstance(policy, CommPolicy):
        raise TypeError(f"fully_shard({label}): comm_policy takes a fsdp_compile.CommPolicy, got {type(policy).__name__}")
    policy.check(label)  # integer parameters are refused for every policy by _check_params
    if post_forward_size and policy.quantizes_all_gather:
        raise ValueError(
            f"fully_shard({label}): an int reshard_after_forward re-gathers full-precision post-forward shards, which "
            "CommPolicy's quantized all-gather does not do; pass reshard_after_forward=True or False"
        )


def _shard_dim(param: nn.Parameter, name: str, shard_placement_fn: Callable | None, info: MeshInfo, label: str) -> int:
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


def _tensor_parallel_layout(
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


def _label_groups(modules: tuple[nn.Module, ...]) -> None:
    """Name groups by their path from the outermost fully_shard module ("layers.3"), for logs and errors."""
    for root in modules:
        for name, module in root.named_modules():
            state = state_of(module)
            if name and state is not None and state.group is not None and state.group.modules[0] is module:
                state.group.label = name


def _check_reshard_after_forward(value: bool | int | None, info: MeshInfo, label: str) -> int:
    """The post-forward group size for an int ``reshard_after_forward``, else 0."""
    if value is None or isinstance(value, bool):
        return 0
    if not isinstance(value, int) or value < 1 or info.shard_size % value != 0:
        raise ValueError(
            f"fully_shard({label}): reshard_after_forward={value!r} must divide the shard mesh size "
            f"{info.shard_size} (e.g. the ranks per node); use True or False otherwise"
        )
    return 0 if value in (1, info.shard_size) else value


def _collect_params(
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


def _check_params(params: list[nn.Parameter], refs: dict[int, list[ParamRef]], device: torch.device, label: str) -> None:
    """Everything that would make a later collective hang or compute garbage, said up front."""
    for param in params:
        name = refs[id(param)][0].fqn
        owner = getattr(param, _OWNER_ATTR, None)
        # A DTensor without an owner is the user's (tensor parallel): _tensor_parallel_layout checks it.
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


def _move_buffers(modules: tuple[nn.Module, ...], device: torch.device) -> None:
    for module in modules:
        for submodule in module.modules():
            for name, buffer in submodule._buffers.items():
                if buffer is not None and buffer.device != device and buffer.device.type != "meta":
                    submodule._buffers[name] = buffer.to(device)


def _fully_shard_state(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``: the state ``fully_shard`` attached to ``module`` (FSDP2's accessor), or None."""
    return state_of(module)


fully_shard.state = _fully_shard_state  # type: ignore[attr-defined]
