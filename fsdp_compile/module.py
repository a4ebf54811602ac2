"""``fully_shard`` and ``FSDPModule``: the composition root, the one place that wires the eager runtime
(``fsdp_compile.runtime``) and the compile layer (``fsdp_compile.compile``) together: it builds a
call's parameters, group and state, swaps the module's class (``FSDPModule.forward`` decides, under
a trace, whether a block is a frame, a region or inline), routes parameter reads through the compile
layer and installs the torch patches (docs/design.md section 2)."""
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

from fsdp_compile import config
from fsdp_compile.api import BackwardPrefetch, CommPolicy, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from fsdp_compile.compile import torch_patches
from fsdp_compile.compile.compiled_state import CompiledFSDPState, forward_in_a_frame_of_its_own
from fsdp_compile.compile.graph_check import EAGER_FRAME_MARK
from fsdp_compile.compile.param_reads import install_traced_param_access
from fsdp_compile.compile.per_block import compile_blocks_forward_alone, compile_forward_alone, compiled_before_sharding
from fsdp_compile.compile.regions import (
    COMPOSABLE_CHECKPOINT_ATTR, checkpointed, may_checkpoint_itself, reuse_marker, take_over_composable_checkpoint, takes_flat_arguments,
)
from fsdp_compile.compile.torch_patches import fsdp_frames_recompile_limit_reached
from fsdp_compile.compile.trace_context import inside_a_compiled_call, inside_a_forward_breaking_at_block_frames, traced_in_a_block_call_frame
from fsdp_compile.runtime.fully_shard_args import (
    OWNER_ATTR, check_comm, check_comm_policy, check_params, check_reshard_after_forward, collect_params, label_groups,
    move_buffers, shard_dim, tensor_parallel_layout_of,
)
from fsdp_compile.runtime.mesh import DataParallelMeshDims, default_mesh, mesh_device, mesh_info_for, post_forward_mesh_info_for, separate_group_of
from fsdp_compile.runtime.optimizer_check import install_optimizer_check, mark_replaced
from fsdp_compile.runtime.param import FSDPParam, parameters_placed_for_trace
from fsdp_compile.runtime.param_group import FSDPParamGroup, TrainingState, UnshardHandle
from fsdp_compile.runtime.state import all_states_under, state_of
from fsdp_compile.runtime.state_dict import register_state_dict_hooks
from fsdp_compile.runtime.structures import map_tensors

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]

# The FSDP subclass of each user class, made once per class (one code object for all its modules).
_fsdp_classes: dict[type, type] = {}


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
        # See [Note: compile once per block] in compile/regions.py.
        if torch.compiler.is_compiling():
            state = self._fsdp_state()
            if traced_in_a_block_call_frame():  # the frame its __call__ entered: [Note: a block that checkpoints itself in __call__] in compile/regions.py
                return super().forward(*args, **kwargs)  # type: ignore[misc]
            if state.compiles_as_frame and state.training_state is TrainingState.IDLE:  # [Note: blocks compiled as frames] in compile/frames.py
                state.eager_enter_block_frame()  # a graph break: the rest is the block's own frame
                if not torch.compiler.is_compiling():  # Dynamo runs that frame eagerly
                    return self._forward_with_eager_hooks(args, kwargs)
                if COMPOSABLE_CHECKPOINT_ATTR in self.__dict__:  # [Note: PyTorch's composable checkpoint, compiled] in compile/regions.py
                    return checkpointed(self, super().forward, args, kwargs)  # type: ignore[misc]
                return super().forward(*args, **kwargs)  # type: ignore[misc]
            if COMPOSABLE_CHECKPOINT_ATTR in self.__dict__:  # [Note: PyTorch's composable checkpoint, compiled] in compile/regions.py
                for inner in state.states_in_tree():
                    if inner.gathers_once_across_frames:  # its first read writes the handoff: not in the checkpoint
                        inner.unsharded_across_frames(inner.group.fsdp_params[0])
                return checkpointed(self, self._traced_forward, args, kwargs)
            if state.compiles_as_region:
                unsharded = state.traced_unshard(state.group.fsdp_params)
                if takes_flat_arguments(args, kwargs):  # [Note: a block region's flat arguments] in compile/regions.py
                    return _flat_block_region(self, len(unsharded), *unsharded, *args)
                return _block_region(self, unsharded, args, kwargs, reuse_marker(args, kwargs))
            if state.forward_breaks_at_inner_block_frames:  # [Note: a forward that breaks at its blocks' frames] in compile/compiled_state.py
                return forward_in_a_frame_of_its_own(self, FSDPModule, args, kwargs)
        elif self._fsdp_state().runs_eagerly_inside_compiled_model():
            return self._forward_with_eager_hooks(args, kwargs)
        return super().forward(*args, **kwargs)  # type: ignore[misc]

    def _traced_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The traced forward of a module not compiled as a block frame (a block region, or inline),
        inside the composable checkpoint's torch.utils.checkpoint (as ``forward`` traces it outside)."""
        state = self._fsdp_state()
        if state.compiles_as_region:
            unsharded = state.traced_unshard(state.group.fsdp_params)
            if takes_flat_arguments(args, kwargs):  # [Note: a block region's flat arguments] in compile/regions.py
                return _flat_block_region(self, len(unsharded), *unsharded, *args)
            return _block_region(self, unsharded, args, kwargs, reuse_marker(args, kwargs))
        return super().forward(*args, **kwargs)  # type: ignore[misc]

    def _forward_with_eager_hooks(self, args: tuple, kwargs: dict) -> Any:
        # [Note: frames Dynamo runs eagerly]
        # Under a compiled model the FSDP hooks are traced into the caller's graph, where they
        # stand aside for the traced parameter reads. If Dynamo then runs this forward eagerly
        # (torch.compiler.disable on it, the recompile limit, a skipped frame), its parameters
        # would be the sharded DTensors: run the eager hooks around it instead, which all-gather,
        # reshard and reduce-scatter as in eager training. A block compiled as a frame, whose
        # all-gather the block before it issued ahead ([Note: prefetch across block frames] in compile/frames.py), hands
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
            if inside_a_forward_breaking_at_block_frames() and config.graphs_outside_blocks_is("eager"):
                why += "; or a checkpoint() in an untraced forward around it: fsdp_compile.config.graphs_outside_blocks = \"inductor\" traces it"
            warnings.warn(
                f"fsdp_compile: the forward of '{state.label}' ran eagerly inside a compiled model (Dynamo did not "
                f"compile this frame: {why}); its FSDP hooks run eagerly around it. "
                "Numerics are unchanged; its collectives are not part of the compiled graph.",
                stacklevel=2,
            )
        if config.block_compile_is("frames") and root.frames_forward_running:
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
        for all identical blocks (see [Note: blocks compiled as frames] in compile/frames.py; with
        ``config.block_compile = "regions"`` or ``fullgraph=True``, one graph with the
        all-gathers and reduce-scatters in it and a nested compile region per block, see
        [Note: compile once per block] in compile/regions.py). On a block (torchtitan's per-block recipe,
        ``for block in model.layers: block.compile(backend="fsdp_inductor")``): the block's forward
        is compiled alone and its FSDP hooks run eagerly around it, as with PyTorch FSDP2, so
        nothing in the graph tells blocks apart and every identical block shares one graph.
        ``fully_shard(torch.compile(block))``, and ``block.compile()`` before ``fully_shard``
        (torchtitan's ``apply_compile``), do the same: see [Note: every way of compiling a block,
        one form] in compile/per_block.py.

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
        compile_forward_alone(self, torch.compile(*args, **kwargs))

    def __deepcopy__(self, memo: dict) -> Any:
        raise AssertionError(  # FSDP2's exception type and words, then why and the fix
            f"FSDP does not support deepcopy: copy.deepcopy of a fully_shard module ({type(self).__name__}): its "
            "parameters are shards tied to process groups. Deep-copy the model before fully_shard, or build a new "
            "model and load this one's state_dict() into it."
        )

    def _fsdp_state(self) -> CompiledFSDPState:
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
        """Free this module's unsharded parameters (and a gather kept for its next forward) and register the sharded ones."""
        for group in self._groups(recurse=False):
            group.reshard()
        self._fsdp_state().let_go_of_kept_gather()

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
        check_comm(comm, "set_custom_all_gather", self._fsdp_state().label)
        for group in self._groups(recurse=False):
            group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Run this module's reduce-scatters with ``comm``, an FSDP2 ``ReduceScatter``: ``allocate``
        makes the input and output buffers and ``comm(output, input, group=, op=, async_op=)``
        reduces (``op`` is always ``SUM``; the divide factors are applied around it)."""
        label = self._fsdp_state().label
        check_comm(comm, "set_custom_reduce_scatter", label)
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
    for root in states[1:]:
        root.share_comm_of(states[0])


def _run_block_with(module: nn.Module, unsharded: list[torch.Tensor], args: tuple, kwargs: dict, reuse: object) -> Any:
    """The block's own forward, with its parameter reads returning ``unsharded`` (see the note).
    ``reuse`` is ``reuse_marker()``'s: it only steers Dynamo's reuse of the traced body."""
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


_UNBOUNDED_REUSE = (
    {"max_reuse_entries": sys.maxsize} if "max_reuse_entries" in inspect.signature(torch.compiler.nested_compile_region).parameters else {}
)
_block_region = torch.compiler.nested_compile_region(_run_block_with, **_UNBOUNDED_REUSE)


def _run_block_with_flat(module: nn.Module, parameter_count: int, *tensors: torch.Tensor) -> Any:
    """``_run_block_with`` on ``tensors``: the unsharded parameters, then the block's arguments."""
    return _run_block_with(module, list(tensors[:parameter_count]), tensors[parameter_count:], {}, None)


_flat_block_region = torch.compiler.nested_compile_region(_run_block_with_flat, **_UNBOUNDED_REUSE)


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


def _state_of_fsdp_module(module: Any, caller: str) -> CompiledFSDPState:
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
        if type(m).forward is nn.Module.forward and not compiled_before_sharding(m):
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
    post_forward_size = check_reshard_after_forward(reshard_after_forward, info, label)
    params, refs = collect_params(modules, {id(p) for p in ignored_params or ()}, label)
    check_params(params, refs, device, label)
    check_comm_policy(comm_policy, post_forward_size, label)
    shard_dims = [shard_dim(param, refs[id(param)][0].fqn, shard_placement_fn, info, label) for param in params]
    tp_layouts = [
        tensor_parallel_layout_of(param, refs[id(param)][0].fqn, shard_dim, info, label, post_forward_size)
        for param, shard_dim in zip(params, shard_dims)
    ]
    post_forward_info = post_forward_mesh_info_for(info, post_forward_size) if post_forward_size else None
    move_buffers(modules, device)

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
        setattr(param, OWNER_ATTR, label)
        mark_replaced(param, f"fully_shard({label})")
    for fsdp_param in fsdp_params:
        setattr(fsdp_param.sharded_param, OWNER_ATTR, label)
    install_optimizer_check()
    group = None
    if fsdp_params:
        group = FSDPParamGroup(
            fsdp_params, modules, label, info, post_forward_info, device,
            reshard_after_forward=reshard_after_forward is not False, comm_policy=comm_policy,
        )
    state = CompiledFSDPState(modules, group, mp_policy, device, auto_reshard_after_forward=reshard_after_forward is None)
    state.per_block_compiled = any(compiled_before_sharding(m) for m in modules)
    register_state_dict_hooks(state)
    torch_patches.apply("state-dict names of torch.compile(model)")  # else torch's prefixed keys, as nn.Module makes them
    for fsdp_param in fsdp_params:
        for ref in fsdp_param.refs:
            install_traced_param_access(ref.module, ref.name, fsdp_param, state)
    states = state.states_in_tree()
    for inner in states:
        inner.outer = None if inner is state else state
        inner.has_outer = inner.outer is not None
        inner.is_leaf = len(all_states_under(inner.modules)) == 1
    label_groups(modules)
    for m in modules:
        for sub in m.modules():  # this module's and those sharded before, checkpointed since
            if state_of(sub) is not None:  # [Note: PyTorch's composable checkpoint, compiled] in compile/regions.py
                take_over_composable_checkpoint(sub)
        cls = type(m)
        if cls not in _fsdp_classes:
            namespace: dict[str, Any] = {"__module__": cls.__module__}
            if may_checkpoint_itself(cls):  # [Note: a block that checkpoints itself in __call__] in compile/regions.py
                namespace["__call__"] = _entering_block_frame_before(cls.__call__)
            _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), namespace)
        m.__class__ = _fsdp_classes[cls]
    compile_blocks_forward_alone(modules, states)
    return module


def _fully_shard_state(module: nn.Module) -> CompiledFSDPState | None:
    """``fully_shard.state(module)``: the state ``fully_shard`` attached to ``module`` (FSDP2's accessor), or None."""
    return state_of(module)


fully_shard.state = _fully_shard_state  # type: ignore[attr-defined]

torch_patches.install(region_codes=(_run_block_with.__code__, _run_block_with_flat.__code__))
