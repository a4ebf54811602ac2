"""FSDPState: the hooks of one ``fully_shard`` call, root lazy init and prefetching.

[Note: hook order in one step]
Forward: root pre-forward (lazy init, move inputs to the device) -> for each module, pre-forward
unshards its group and prefetches the next one (explicit list, else the order recorded in the
previous step) -> post-forward reshards per ``reshard_after_forward`` and hooks the outputs.
Backward: the first output gradient of a module runs its pre-backward (unshard + prefetch the
group that ran just before it in forward) -> when gradients reach the module's inputs,
post-backward reduce-scatters and reshards -> the root's end-of-backward callback reduces what
post-backward missed (modules whose inputs need no grad), waits and resets the step.
"""
from __future__ import annotations

import itertools
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from fsdp_compile import config
from fsdp_compile.annotations import BLOCK_FRAME_TOKEN
from fsdp_compile.api import BackwardPrefetch, MixedPrecisionPolicy
from fsdp_compile.compile.backend import (
    traced_for_an_fsdp_backend, traced_in_a_callers_higher_order_op, traced_under_compiled_autograd, traced_without_graph_breaks,
)
from fsdp_compile.runtime.collectives import pending_functional_reduce_scatter
from fsdp_compile.runtime.comm_context import CommContext
from fsdp_compile.compile.graph_check import END_OF_FORWARD, block_frames_fingerprint, check_block_frames_match_across_ranks
from fsdp_compile.runtime.param_group import FSDPParamGroup, TrainingState, owner_of_late_gradient_sink
from fsdp_compile.runtime.structures import map_tensors, tensors_in
from fsdp_compile.compile.param_reads import issue_frame_prefetch, trace_annotation, unshard_for_trace

if TYPE_CHECKING:
    from fsdp_compile.runtime.param import FSDPParam

__all__ = ["FSDPState", "state_of", "all_states_under", "live_states", "inside_a_compiled_call"]

_STATE_ATTR = "_fsdp_compile_state"
_live_states: "weakref.WeakSet[FSDPState]" = weakref.WeakSet()
_trace_tokens = itertools.count()
# Bumped by every new FSDPState: a cached walk of a model's states is stale after it.
_states_generation = 0

# Which block's frame Dynamo traces now is ``block_frame_in_trace()`` (set eagerly by
# FSDPState.enter_block_frame); every such frame's trace token is BLOCK_FRAME_TOKEN.
_block_frame_in_trace: "weakref.ref[FSDPState] | None" = None


def _blocks_as_frames_in_this_trace() -> bool:
    """``config.compile_blocks_as_frames``, unless the trace may not break the graph (fullgraph=True),
    where blocks are regions as before ([Note: blocks compiled as frames] in module.py)."""
    return config.compile_blocks_as_frames and not traced_without_graph_breaks()


@torch.compile(backend="fsdp_aot_eager", dynamic=False)
def _gather_group_in_a_graph(state: "FSDPState") -> list[torch.Tensor]:
    """A group's first read under blocks compiled as frames, where that read runs eagerly (Dynamo gave
    up on its frame, or skips the read's code for good: a trace of it under the eager fallback held
    no op): its traced unshard in a graph of its own, whose passes bucket it into the group's one
    all-gather and, in backward, one reduce-scatter, as in any graph (run eagerly, each parameter's
    op gathered and reduced alone). No code generation: the graph holds only the collectives and
    their copies."""
    group = state.group
    assert group is not None
    return state.traced_unshard(group.fsdp_params)


def inside_a_compiled_call() -> bool:
    """Whether this eager code runs inside a torch.compile'd call, in a frame Dynamo did not compile:
    one it gave up on, or one whose code it skips for good because an earlier trace of it held no op
    (the eager fallback's hooks, which stand aside when traced, leave that mark on code every model
    shares). The model runs compiled there, even before any of its own graphs said so."""
    return bool(torch._C._dynamo.eval_frame.get_eval_frame_callback())


# The blocks whose compiled frames were entered, by their shards' addresses: a block frame's graph,
# shared by every block of its structure, names no block ([Note: prefetch across block frames] in
# module.py).
_frame_blocks_by_shard: "dict[int, weakref.ref[FSDPState]]" = {}


class _FrameGather:
    """One direction's all-gather of a block frame's group (forward's or backward's), as its graph's
    ``fsdp_compile::frame_all_gather`` asks for it: what that graph gathers (learned as it first runs:
    indices of the group's parameters, padded numels, dtype, shard size, process group), whether the
    block's compiled frame was entered for it since it last ran (forward: entered; backward: entered
    with gradients on), and the all-gather issued for it ahead, with what it was issued on. See [Note:
    prefetch across block frames] in module.py."""

    def __init__(self) -> None:
        self.learned: tuple | None = None
        self.pending = False
        self.in_flight: torch.Tensor | None = None
        self._issued_from: tuple | None = None

    def take(self, shards: list[torch.Tensor]) -> torch.Tensor | None:
        """The all-gather issued ahead on exactly ``shards`` as they are now, or None (any other is let go)."""
        in_flight, issued_from = self.in_flight, self._issued_from
        self.in_flight, self._issued_from = None, None
        if in_flight is None:
            return None
        if issued_from != (self.learned, _addresses_and_versions(shards)):
            torch.ops._c10d_functional.wait_tensor(in_flight)
            return None
        return in_flight

    def issue_ahead(self, group: "FSDPParamGroup | None") -> None:
        """The all-gather this graph issued last time, on ``group``'s shards as they are now."""
        if self.learned is None or group is None or self.in_flight is not None:
            return
        indices, padded_numels, param_dtype, shard_size, shard_group_name = self.learned
        shards = [group.fsdp_params[index].local_shard() for index in indices]
        self.in_flight = issue_frame_prefetch(shards, padded_numels, param_dtype, shard_size, shard_group_name)
        self._issued_from = (self.learned, _addresses_and_versions(shards))

    def is_whole_group_of(self, group: "FSDPParamGroup") -> bool:
        """Whether what it gathers is ``group``'s eager all-gather, in its layout (its eager hooks can take it)."""
        if self.learned is None:
            return False
        indices, padded_numels, param_dtype, shard_size, shard_group_name = self.learned
        spec = group.reduce_spec
        return (
            indices == tuple(range(len(group.fsdp_params))) and param_dtype == group.param_dtype
            and padded_numels == [p.padded_shard_numel for p in group.fsdp_params]
            and (shard_size, shard_group_name) == (spec.shard_size, spec.shard_group_name)
        )

    def drop(self) -> None:
        """Let go of an all-gather issued ahead that no graph will read, once it completed (its buffer is
        in use until then, and a collective's tensor is waited on before it is freed)."""
        if self.in_flight is not None:
            torch.ops._c10d_functional.wait_tensor(self.in_flight)
        self.in_flight, self._issued_from = None, None


def gather_in_frame(
    shards: list[torch.Tensor], padded_numels: list[int], param_dtype: torch.dtype, shard_size: int, shard_group_name: str,
    backward: bool,
) -> torch.Tensor:
    """``fsdp_compile::frame_all_gather`` run in a block frame's forward or backward graph: the group's
    all-gather in flight (issued ahead by the block that ran before it, or issued now), after issuing
    that of the block that runs next (forward: the next block; backward: the block before it); see
    [Note: prefetch across block frames] in module.py."""
    state, indices = _frame_block_of(shards, backward)
    in_flight = None
    if state is not None:
        gather = state.frame_gathers[backward]
        gather.learned = (indices, list(padded_numels), param_dtype, shard_size, shard_group_name)
        gather.pending = False
        in_flight = gather.take(shards)
    if in_flight is None:
        in_flight = issue_frame_prefetch(shards, padded_numels, param_dtype, shard_size, shard_group_name)
    if state is not None:
        state._gather_next_frame_ahead(backward)
    return in_flight


class _HandedOverReductions:
    """The groups holding a reduce-scatter a block frame's backward graph handed over in flight, oldest
    first, and the backward (autograd graph task) whose end lands them ([Note: late reduce-scatter
    wait across block frames] in module.py)."""

    def __init__(self) -> None:
        self.groups: list[FSDPParamGroup] = []
        self.landed_at_end_of_backward: int | None = None


_handed_over = _HandedOverReductions()


def deliver_gradient_now(reduced: torch.Tensor, late_sink: torch.Tensor) -> None:
    """``fsdp_compile::deliver_reduced_gradient``: one parameter's reduced, divided and cast padded
    shard, written into its sharded ``.grad`` now."""
    group, fsdp_param = owner_of_late_gradient_sink(late_sink)
    group.write_sharded_grads([fsdp_param], reduced.reshape(-1).contiguous(), 1.0)


def deliver_gradients_late(in_flight: torch.Tensor, reduce_input: torch.Tensor, late_sinks: list[torch.Tensor]) -> None:
    """``fsdp_compile::deliver_reduce_scatter_late``: land the reduce-scatters handed over before (the
    block after this one's), then hold this one until the next hand-over or the backward's end."""
    owners = [owner_of_late_gradient_sink(sink) for sink in late_sinks]
    group = owners[0][0]
    if any(owner is not group for owner, _ in owners):
        raise RuntimeError(f"fsdp_compile: a compiled backward handed over one reduce-scatter for the parameters of several groups ({group.label}, ...)")
    land_late_reductions()
    group.hold_reduction([fsdp_param for _, fsdp_param in owners], pending_functional_reduce_scatter(in_flight, reduce_input, group.label))
    backward = torch._C._current_graph_task_id()
    if backward == -1:  # not inside autograd's backward: nothing would land it later
        group.finish_reduction()
        return
    _handed_over.groups.append(group)
    if _handed_over.landed_at_end_of_backward != backward:
        _handed_over.landed_at_end_of_backward = backward
        torch.autograd.Variable._execution_engine.queue_callback(land_late_reductions)


def land_late_reductions() -> None:
    """Wait on every reduce-scatter handed over and write its gradients, oldest first."""
    while _handed_over.groups:
        group = _handed_over.groups.pop(0)
        if group._reduction_in_flight is not None:  # else a failed step let it go (reset_iter_state)
            group.finish_reduction()


def _frame_block_of(shards: list[torch.Tensor], backward: bool) -> "tuple[FSDPState | None, tuple[int, ...] | None]":
    """The registered block whose parameters' shards ``shards`` are (every one of them), its frame
    entered for this direction's gather, with their indices in its group, or (None, None)."""
    if not shards:
        return None, None
    reference = _frame_blocks_by_shard.get(shards[0].data_ptr())
    state = reference() if reference is not None else None
    if state is None or not state.frame_gathers[backward].pending:
        return None, None
    indices = _indices_in_group(state, shards)
    return (state, indices) if indices is not None else (None, None)


def _addresses_and_versions(shards: list[torch.Tensor]) -> list[tuple[int, int]]:
    """What a frame's all-gather was issued on: a later read of other or since-written shards differs."""
    return [(shard.data_ptr(), shard._version) for shard in shards]


def _indices_in_group(state: "FSDPState", shards: list[torch.Tensor]) -> "tuple[int, ...] | None":
    group = state.group
    if group is None:
        return None
    index_by_address = {p.local_shard().data_ptr(): i for i, p in enumerate(group.fsdp_params)}
    indices = tuple(index_by_address.get(shard.data_ptr(), -1) for shard in shards)
    return None if -1 in indices else indices


def block_frame_in_trace() -> "FSDPState | None":
    """The block whose frame was entered last (``FSDPState.enter_block_frame``), if it is alive."""
    return _block_frame_in_trace() if _block_frame_in_trace is not None else None


def live_states() -> list["FSDPState"]:
    """Every FSDP state of a model still alive in this process."""
    return list(_live_states)


def state_of(module: nn.Module) -> "FSDPState | None":
    return module.__dict__.get(_STATE_ATTR)


def all_states_under(modules: tuple[nn.Module, ...] | list[nn.Module]) -> list["FSDPState"]:
    """Every FSDP state in these modules' trees, in pre-order, each once."""
    seen: dict[int, FSDPState] = {}
    for root in modules:
        for module in root.modules():
            state = state_of(module)
            if state is not None and id(state) not in seen:
                seen[id(state)] = state
    return list(seen.values())


class _RootContext:
    """What the root shares with every state under it for one model."""

    def __init__(self, root: "FSDPState", states: list["FSDPState"]) -> None:
        self.root = root
        self.states = states
        self.comm = root.comm
        self.previous_forward_order: list[FSDPParamGroup] = []
        self.forward_order: list[FSDPParamGroup] = []
        self.post_forward_order: list[FSDPParamGroup] = []
        self.next_in_forward: dict[int, FSDPParamGroup] = {}
        self.final_callback_queued = False

    def begin_step(self) -> None:
        if self.forward_order:
            self.previous_forward_order = self.forward_order
        self.forward_order = []
        self.post_forward_order = []
        order = self.previous_forward_order
        self.next_in_forward = {id(group): order[i + 1] for i, group in enumerate(order[:-1])}


class _PostBackwardTrigger(torch.autograd.Function):
    """Identity on a module's inputs whose backward runs once gradients reach those inputs.

    [Note: the post-backward trigger under torch.func]
    A module's forward can run inside a functorch transform while its inputs carry reverse-mode
    history: ``torch.func.jvp`` of a function that reads a tensor requiring grad, or forward-over-
    reverse (``jvp(grad(f))``). Functorch then applies this Function at the transform's level and
    accepts only the ``setup_context`` form (forward without ctx), a ``jvp`` rule and a vmap rule.
    Tangents pass through unchanged, as the values do; the backward is the one of plain autograd.
    The outputs are views of the inputs, so the tangents are returned as views too: forward-mode AD
    (``torch.autograd.forward_ad``) requires a view's tangent to be a view.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(state: "FSDPState", *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x.view_as(x) for x in inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state._post_backward()
        return (None, *grads)

    @staticmethod
    def jvp(ctx: Any, state_tangent: Any, *tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.view_as(t) for t in tangents)


class _PreBackwardTrigger(torch.autograd.Function):
    """Identity on one module output whose backward runs the module's pre-backward, for outputs a
    functorch transform reports as not requiring grad.

    [Note: pre-backward hooks under torch.func]
    Inside ``torch.func.jvp`` (or ``vmap``) a module's outputs are the transform's wrappers, and
    they report ``requires_grad=False`` even where their primals, once returned, carry the reverse-
    mode history of the parameters: a gradient hook registered on them never fires, so a backward
    through ``jvp``'s outputs would find the parameters resharded (or, kept unsharded, accumulate
    into them unreduced). Passing such outputs through this Function puts the pre-backward into
    the graph the primals carry. The tangent goes through it too, so a loss on the tangent unshards
    the same way. The group's post-backward then runs from the root's end-of-backward callback
    (``finalize_backward``), since the inputs' trigger is not attached either. FSDP2 does the same.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(state: "FSDPState", output: torch.Tensor) -> torch.Tensor:
        return output.view_as(output)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.state = inputs[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        # One call per output: the first one of a step does the work.
        if ctx.state.training_state != TrainingState.PRE_BACKWARD:
            ctx.state._pre_backward()
        return None, grad

    @staticmethod
    def jvp(ctx: Any, state_tangent: Any, tangent: torch.Tensor | None) -> torch.Tensor | None:
        return None if tangent is None else _PreBackwardTrigger.apply(ctx.state, tangent)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree)


class FSDPState:
    """Hooks and per-step bookkeeping for the module(s) of one ``fully_shard`` call."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        group: FSDPParamGroup | None,
        mp_policy: MixedPrecisionPolicy,
        device: torch.device,
        auto_reshard_after_forward: bool,
    ) -> None:
        self.modules = modules
        self.group = group
        self.mp_policy = mp_policy
        self.device = device
        self.auto_reshard_after_forward = auto_reshard_after_forward
        # Its own until the root's lazy init shares the root's; see [Note: stream protocol].
        self.comm = group.comm if group is not None else CommContext(device)
        self.is_root: bool | None = None  # decided at lazy init
        # The outermost fully_shard call applied to an ancestor so far (None: this one is the root).
        # Known without running forward, which the compiled path needs (it never runs the eager
        # lazy init).
        self.outer: FSDPState | None = None
        # Set by fsdp_inductor on the root when a graph reading the model's parameters compiles.
        self.runs_compiled = False
        # Said once per module: its forward ran eagerly inside the compiled model ([Note: frames
        # Dynamo runs eagerly] in module.py); on a root, that its explicit prefetch lists do not
        # place a block frame's all-gathers.
        self.told_it_ran_eagerly = False
        self.told_of_frames_prefetch = False
        # Structure flags the compiled path reads (see compiles_as_region), set by fully_shard.
        self.has_outer = False
        self.is_leaf = True  # no fully_shard module inside
        # A norm layer keeping running statistics (BatchNorm): in training its forward writes its
        # buffers in place, which a nested compile region refuses (see compiles_as_region).
        self.keeps_running_stats = any(
            isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats
            for module in modules for sub in module.modules()
        )
        self.has_group = group is not None
        self.single_module = len(modules) == 1
        # block.compile(): the forward compiled alone, the hooks eager around it (FSDPModule.compile).
        self.per_block_compiled = False
        self.root_ctx: _RootContext | None = None
        self.training_state = TrainingState.IDLE
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        # Where backward prefetches are issued; see BackwardPrefetch (None: never).
        self.backward_prefetch_mode: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
        self._modules_to_run_forward: set[int] = set()
        self._post_forward_indices: list[int] = []
        # Post-backward triggers attached this step but not yet fired: a group used by several
        # modules or forward calls reduces once, after the last of them (no repeated collectives).
        self._unfired_post_backward_triggers = 0
        self.is_last_backward = True  # read on the root only (set_is_last_backward)
        # What state_dict() / load_state_dict() produce and take (fsdp_compile.state_dict_type);
        # None: the default, a sharded state dict.
        self.state_dict_settings: Any = None
        # Inside unshard_params(): the modules hold temporary full parameters.
        self.summoned = False
        # skip_fsdp_hooks: see [Note: the eager fallback's graph breaks] in module.py.
        self.eager_pre_forward = torch._dynamo.disable(self._pre_forward, recursive=True)
        self.eager_post_forward = torch._dynamo.disable(self._post_forward, recursive=True)
        self.eager_enter_block_frame = torch._dynamo.disable(self.enter_block_frame, recursive=True)
        self.eager_frames_root_pre_forward = torch._dynamo.disable(self._frames_root_pre_forward, recursive=True)
        self.eager_frames_root_post_forward = torch._dynamo.disable(self._frames_root_post_forward, recursive=True)
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward_hook, prepend=False)
        _live_states.add(self)
        global _states_generation
        _states_generation += 1
        self._tree_states: tuple[int, list[FSDPState]] | None = None
        # Names this state in the annotations of traced nodes (admit_traced_parameters in backend.py).
        self.trace_token = next(_trace_tokens)
        # Names a block compiled as a frame in its graph: the same for every block of its class, so
        # one graph serves them all ([Note: blocks compiled as frames] in module.py).
        self.frame_label = f"{type(modules[0]).__name__} (block frame)"
        # The unsharded parameters of this forward's first read, by FQN (unsharded_across_frames).
        self.frame_handoff: dict[str, torch.Tensor] = {}
        # [Note: prefetch across block frames] in module.py. The block whose frame runs after this
        # one's (learned eagerly by enter_block_frame); previous_frame_block: the block entered just
        # before this one in the last forward that entered it (its backward runs after this one's), or
        # None where this one came first. This block's forward and backward all-gathers, by
        # ``backward`` (False, True), each with the one issued for it ahead.
        self.next_frame_block: FSDPState | None = None
        self.previous_frame_block: FSDPState | None = None
        self.frame_gathers = (_FrameGather(), _FrameGather())
        # On a root whose blocks compile as frames: between its (eager) pre- and post-forward.
        self.frames_forward_running = False
        # On a root: the first block frame entered at the first forward (entered again, a new forward
        # began), and the last block frame entered.
        self._first_frame_block: FSDPState | None = None
        self._last_frame_block: FSDPState | None = None
        # On a root: the blocks this forward entered so far and their fingerprint, checked against the
        # other ranks' ([Note: ranks entering different block frames] in graph_check.py).
        self._frames_entered: list[str] = []
        self._frames_entered_fingerprint = ""

    @property
    def reshards_after_forward(self) -> bool:
        """Whether the group frees its parameters after forward; the compiled path reads it at trace
        time (it never runs the eager lazy init, which settles the default for the root)."""
        if self.auto_reshard_after_forward:
            return self.has_outer  # the root keeps its parameters, as in eager
        return self.group is not None and self.group.reshard_after_forward

    @property
    def compiles_as_region(self) -> bool:
        """Whether this module's forward is a nested compile region: a block with an enclosing
        fully_shard module, no fully_shard module inside and one module in its group (see
        [Note: compile once per block] in module.py); under ``torch.compile(dynamic=True)`` none is
        ([Note: where Dynamo's body reuse stops], 3). Nor is a block keeping running statistics
        while it trains: a region's body may not write its buffers in place under autograd (torch
        2.13's invoke_subgraph refuses it, and the compile failed); that block is traced inline.
        Only our backends compile regions correctly (``backend.traced_for_an_fsdp_backend``)."""
        return (
            config.compile_blocks_once and not self.compiles_as_frame and self._is_block()
            and torch._dynamo.config.assume_static_by_default and not (self.keeps_running_stats and self.modules[0].training)
            and traced_for_an_fsdp_backend()
        )

    @property
    def compiles_as_frame(self) -> bool:
        """Whether this block's forward is compiled as a Dynamo frame of its own, with its group's
        collectives in its graph and nothing in the trace that tells blocks apart
        (``config.compile_blocks_as_frames``; see [Note: blocks compiled as frames] in module.py)."""
        return (
            _blocks_as_frames_in_this_trace() and self._is_block() and traced_for_an_fsdp_backend()
            and not traced_in_a_callers_higher_order_op()
        )

    def _is_block(self) -> bool:
        """A fully_shard module inside another, with none inside it and one module in its group, not
        compiled per block. Plain flags set by fully_shard: read under Dynamo, they guard on values
        that are the same for every block, never on a block's identity."""
        return self.has_group and self.has_outer and self.single_module and self.is_leaf and not self.per_block_compiled

    @property
    def gathers_once_across_frames(self) -> bool:
        """Whether this group's reads trace ``unsharded_across_frames``: a group other than a block
        (the root) while blocks compile as frames, whose forward those frames split into several graphs."""
        return _blocks_as_frames_in_this_trace() and self._is_outside_blocks() and traced_for_an_fsdp_backend()

    def reads_across_frames_eagerly(self) -> bool:
        """Whether an eager read of this group's parameter (its frame run eagerly, its hooks standing
        aside in a compiled graph) takes ``unsharded_across_frames``, blocks compiled as frames: only
        during the compiled forward (``model.weight.grad`` read after it is the parameter's)."""
        return (
            config.compile_blocks_as_frames and self._is_outside_blocks() and self.outermost().frames_forward_running
            and self.hooks_stood_aside()
        )

    def _is_outside_blocks(self) -> bool:
        """A group that is no block (the root, a group of several modules, one with blocks inside):
        blocks compiled as frames split its forward into several graphs."""
        return self.has_group and not self._is_block()

    def stands_aside_for_frames(self) -> bool:
        """Whether a hook Dynamo runs eagerly (it gave up on the hook's own frame, which blocks
        compiled as frames make of each hook) does what its traced form does: the model runs
        compiled (its root's hooks stood aside), no eager hook ran for this group in this forward,
        and this is not a checkpoint's recompute in backward. The block's frame, or the reads of the
        groups outside blocks (``unsharded_across_frames``), gather and reduce instead."""
        root = self.outermost()
        return (
            config.compile_blocks_as_frames and not config.skip_fsdp_hooks and self.training_state is TrainingState.IDLE
            and (root.runs_compiled or inside_a_compiled_call()) and root.training_state is TrainingState.IDLE
            and torch._C._current_graph_task_id() == -1
        )

    def unsharded_across_frames(self, fsdp_param: "FSDPParam") -> torch.Tensor:
        """``fsdp_param``'s unsharded parameter under ``compile_blocks_as_frames``: the group's first
        read in a forward traces the whole group's unshard (one all-gather, and in backward one
        reduce-scatter, as eagerly), and every later read takes what it gathered, in whichever graph
        it comes. The root's pre- and post-forward empty ``frame_handoff``; see [Note: blocks compiled
        as frames] in module.py."""
        handoff = self.frame_handoff
        if fsdp_param.fqn not in handoff:
            group = self.group
            assert group is not None
            gathered = self.traced_unshard(group.fsdp_params) if torch.compiler.is_compiling() else _gather_group_in_a_graph(self)
            for member, unsharded in zip(group.fsdp_params, gathered):
                handoff[member.fqn] = unsharded
        return handoff[fsdp_param.fqn]

    def _begin_frame_handoff(self) -> None:
        """Root pre- and post-forward under ``compile_blocks_as_frames``, traced or run eagerly (a hook
        Dynamo gave up on): each group gathers afresh in the next forward, and nothing holds this one's
        unsharded parameters past it. (A prefetch no frame took is let go eagerly: see _learn_frame_order.)"""
        for state in self.states_in_tree():
            if state._is_outside_blocks():
                state.frame_handoff = {}

    def _learn_frame_order(self) -> None:
        """Eagerly, as this block's frame is entered: the block entered before it in this forward
        prefetches this one from the next step on. The first forward takes the module tree's order
        of blocks; a block entered when the first block is entered again ended the last forward."""
        root = self.outermost()
        previous = root._last_frame_block
        if root._first_frame_block is None:
            root._first_frame_block = self
            blocks = [state for state in root.states_in_tree() if state._is_block()]
            for block, following in zip(blocks, blocks[1:]):
                block.next_frame_block = following
            if blocks:
                blocks[-1].next_frame_block = None
        elif self is root._first_frame_block:
            if previous is not None and previous.next_frame_block is not None and previous is not self:
                previous.next_frame_block = None  # it ended the last forward
            for state in root.states_in_tree():
                if state is not self:
                    state.drop_frame_prefetch()  # a block the last forward prefetched and did not run
        elif previous is not None and previous.next_frame_block is not self:
            previous.next_frame_block = self
        self.previous_frame_block = None if self is root._first_frame_block else previous
        root._last_frame_block = self

    def hand_frame_prefetch_to_eager_hooks(self) -> None:
        """Eagerly, where Dynamo runs this block's frame eagerly: the all-gather the block before it
        issued for it ahead is the one its eager hooks read, not one more; see [Note: frames Dynamo runs
        eagerly] in module.py. A stale one, or one the group cannot take, is let go."""
        forward, backward = self.frame_gathers
        forward.pending = backward.pending = False  # the eager hooks gather, forward and backward
        group = self.group
        if forward.in_flight is not None and group is not None and forward.is_whole_group_of(group):
            in_flight = forward.take([p.local_shard() for p in group.fsdp_params])
            if in_flight is not None:
                gathered = torch.ops._c10d_functional.wait_tensor(in_flight).view(group.reduce_spec.shard_size, -1)
                if group.adopt_all_gather(gathered):
                    return
        self.drop_frame_prefetch()

    def drop_frame_prefetch(self) -> None:
        """Eagerly: let go of the all-gathers issued ahead for this block that no frame will read
        ([Note: prefetch across block frames] in module.py)."""
        for gather in self.frame_gathers:
            gather.drop()

    def _gathers_identifiably_in_frames(self) -> bool:
        """Whether ``gather_in_frame`` can tell this block by its shards' addresses on every rank: each
        parameter holds rows on every rank (a rank's empty shard has no address of its own), a fact of
        the shapes alone, the same on all ranks."""
        group = self.group
        return group is not None and all(
            p.layout.row_numel > 0 and p.layout.rows(p.layout.world_size - 1) > 0 for p in group.fsdp_params
        )

    def _register_for_frame_gathers(self) -> None:
        """Eagerly, as this block's compiled frame is entered: its graphs' all-gathers will find it by
        its shards (``gather_in_frame``), its backward's where the forward runs with gradients on."""
        forward, backward = self.frame_gathers
        group = self.group
        identifiable = group is not None and self._gathers_identifiably_in_frames()
        forward.pending = identifiable
        backward.pending = identifiable and torch.is_grad_enabled()
        if identifiable:
            for fsdp_param in group.fsdp_params:
                _frame_blocks_by_shard[fsdp_param.local_shard().data_ptr()] = weakref.ref(self)

    def _gather_next_frame_ahead(self, backward: bool) -> None:
        """In this block's forward (backward) graph: issue the all-gather of the block whose forward
        (backward) runs next, the block after it in the last forward (the one before it), as its graph
        gathered last time. Backward: where its compiled frame ran forward with gradients on since its
        backward last ran; forward: where its frame will take it (compiled as a frame, its hooks idle)."""
        if backward:
            previous = self.previous_frame_block
            if previous is not None and previous.frame_gathers[True].pending:
                previous.frame_gathers[True].issue_ahead(previous.group)
            return
        following = self.next_frame_block
        if following is not None and following.takes_prefetched_frame_gathers():
            following.frame_gathers[False].issue_ahead(following.group)

    def takes_prefetched_frame_gathers(self) -> bool:
        """Whether this block's frame takes the all-gathers issued for it ahead ([Note: prefetch across
        block frames] in module.py): a block compiled as a frame, not training its hooks eagerly nor
        recomputing in backward, without CommPolicy's quantized all-gather or tensor-parallel
        parameters (those gather in their own frame's graph, unprefetched)."""
        group = self.group
        return (
            config.compile_blocks_as_frames and self._is_block() and self.training_state is TrainingState.IDLE
            and torch._C._current_graph_task_id() == -1 and group is not None
            and not group.comm_policy.quantizes_all_gather and not any(p.tensor_parallel is not None for p in group.fsdp_params)
        )

    def enter_block_frame(self) -> None:
        """Run eagerly where a block compiled as a frame breaks the caller's graph: names the block
        whose frame Dynamo traces next, for the backend's checks (``admit_traced_parameters``), whose
        graph carries no block's identity. See [Note: blocks compiled as frames] in module.py."""
        global _block_frame_in_trace
        _block_frame_in_trace = weakref.ref(self)
        root = self.outermost()
        # Only a compiled forward enters a block frame: its model runs compiled, also where this is the
        # first of its groups Dynamo meets (no graph admitted the root's yet) and runs the frame eagerly.
        root.runs_compiled = True
        root._check_frames_entered_across_ranks(self.label)
        if self.group is not None:
            for fsdp_param in self.group.fsdp_params:
                fsdp_param.refresh_detached_sharded_param()
        self._learn_frame_order()
        if self.takes_prefetched_frame_gathers():
            self._register_for_frame_gathers()
        if not root.told_of_frames_prefetch:
            root.told_of_frames_prefetch = True
            explicit = [s.label for s in root.states_in_tree() if s.forward_prefetch or s.backward_prefetch]
            if explicit:
                warnings.warn(
                    f"fsdp_compile: set_modules_to_forward_prefetch / set_modules_to_backward_prefetch on {explicit} have "
                    "no effect while fsdp_compile.config.compile_blocks_as_frames is on: each block's frame prefetches "
                    "the block that ran after it in the last forward, whatever the lists say. Turn compile_blocks_as_frames "
                    "off to have the whole-model graph place them, or compile per block (block.compile()), where the eager "
                    "hooks honour them.",
                    stacklevel=2,
                )

    def hooks_stood_aside(self) -> bool:
        """Whether this module's forward runs eagerly while its FSDP hooks were traced into a
        compiled caller's graph, where they stand aside (see [Note: frames Dynamo runs eagerly] in
        module.py): its model runs compiled and its pre-forward hook did not run eagerly."""
        return (
            self.training_state == TrainingState.IDLE and self.outermost().runs_compiled and self.has_group
            and not self.per_block_compiled and not config.skip_fsdp_hooks and torch._C._current_graph_task_id() == -1
        )

    def settings_refused_when_compiled(self) -> list[str]:
        """This group's settings a traced graph cannot honour, each with the way out.

        Read while a parameter read is traced, so Dynamo guards on every one: setting one after the
        first compile recompiles, and the backend (``admit_traced_parameters``) refuses it then.
        """
        group = self.group
        if group is None:
            return []
        refused = []
        # Each refused setting's way out is tested to train as eagerly (test_compiled_settings.py).
        alternative = (
            "per-block compile honours it: block.compile(backend=\"fsdp_inductor\") on each block, the root left "
            "uncompiled (FSDP2's and torchtitan's recipe), whose eager hooks around each compiled block do what the "
            "setting asks; or the eager runtime"
        )
        if not group.reshard_after_backward:
            refused.append(
                "set_reshard_after_backward(False): a compiled forward's all-gathers are nodes of its graph and run on "
                "every call; they cannot be skipped because an earlier backward left the parameters gathered, so the "
                f"compiled step would send the bytes this setting saves; {alternative}"
            )
        if group.post_forward_mesh_info is not None:
            refused.append(f"an int reshard_after_forward: the compiled graph re-gathers from the full shard group; pass True or False, or {alternative}")
        if group.all_reduce_hook is not None:
            refused.append(f"set_all_reduce_hook: the compiled graph's reductions cannot call a Python hook; {alternative}")
        if group.fsdp_params[0].offload_to_cpu:
            refused.append(
                "CPUOffloadPolicy: the compiled graph's all-gathers read the shards as device tensors and its "
                "reduce-scatters write device gradients, while offloaded shards and gradients live in host memory "
                f"(copied on the all-gather's stream and stepped on the CPU by the eager hooks); {alternative}"
            )
        if group.custom_all_gather is not None or group.custom_reduce_scatter is not None:
            refused.append(f"set_custom_all_gather / set_custom_reduce_scatter: the compiled graph's collectives are functional ops, not Python objects; {alternative}")
        if group.reduce_scatter_unused_params:
            refused.append(
                "set_reduce_scatter_unused_params(True): the compiled graph reduces the parameters its trace reads, the same "
                f"on every rank (a rank-dependent trace is caught by the cross-rank graph check); {alternative}"
            )
        if group.reduce_scatter_max_input_buffers != 1:
            refused.append(f"set_reduce_scatter_max_input_buffers: in the compiled graph the reorder pass places the reduce-scatters; {alternative}")
        if any(p.tensor_parallel is not None and p.tensor_parallel.dp_dims for p in group.fsdp_params):
            refused.append(
                "dp_mesh_dims (parameters that are DTensors on the full mesh): the traced DTensor's backward would "
                "all-reduce their gradients over the data-parallel dims before FSDP reduce-scatters them (gradients "
                "2x per dp rank); put the parameters on the tensor-parallel mesh and pass fully_shard(mesh=mesh['dp']), "
                f"which compiles, or {alternative}"
            )
        if group.reduce_scatter_mesh_info is not group.mesh_info:
            refused.append(f"set_separate_reduce_scatter_group: the compiled graph reduce-scatters over the shard group; {alternative}")
        return refused

    def traced_unshard(self, fsdp_params: "list[FSDPParam]", first_place: bool = True) -> list[torch.Tensor]:
        """What reads of ``fsdp_params`` (this group's) trace to under torch.compile; see traceable.py.

        A block's forward traces its whole group at once, so the group's settings are read (and
        guarded) once per block rather than once per parameter. ``first_place``: the reads are
        through each parameter's first registered name, the one read that adds the no-sync sum (a
        tied parameter is read once per name).
        """
        group = self.group
        assert group is not None
        if self.settings_refused_when_compiled():
            pass  # the branch makes Dynamo guard on the settings; admit_traced_parameters refuses them
        traced_for_an_fsdp_backend()  # another backend is told once what it skips
        spec = group.reduce_spec
        hybrid = group.mesh_info.replicate_group is not None
        takes_sums = group.requires_gradient_sync and first_place
        adds_deferred = takes_sums and hybrid and group.requires_all_reduce  # [Note: deferred all-reduce] in param.py
        sinks_deferred = hybrid and not group.requires_all_reduce  # every read's sum adds up in the sink's .grad
        policy = group.comm_policy
        quantize = (policy.all_gather_dtype, policy.block_size) if policy.quantizes_all_gather else None
        reshards = self.reshards_after_forward
        if self.compiles_as_frame:
            group_name, token = self.frame_label, BLOCK_FRAME_TOKEN  # one graph for every such block
        else:
            group_name, token = group.label, self.trace_token
        delivers_late = (
            self.compiles_as_frame and group.requires_gradient_sync and not hybrid and spec.wire_dtype is None
            and not traced_under_compiled_autograd()
        )
        unsharded = []
        for fsdp_param in fsdp_params:
            late = (
                delivers_late and fsdp_param.tensor_parallel is None and fsdp_param.sharded_param.requires_grad
                and fsdp_param.detached_sharded_param is not None
            )
            accumulated = deferred = None
            if takes_sums:
                accumulated = fsdp_param.staged_accumulated_grad
                if accumulated is None:
                    # Compiled without its root (which stages the sums): take it here, which Dynamo
                    # allows outside higher-order ops such as activation checkpointing.
                    accumulated = fsdp_param.pop_accumulated_grad()
            if adds_deferred:
                deferred = fsdp_param.staged_deferred_all_reduce
                if deferred is None:
                    deferred = fsdp_param.pop_deferred_all_reduce()
            unsharded.append(unshard_for_trace(
                fsdp_param.detached_sharded_param if late else fsdp_param.sharded_param, fsdp_param.layout, fsdp_param.param_dtype, spec,
                trace_annotation(group_name, fsdp_param.fqn, reshards, token), fsdp_param.accumulation_sink,
                group.requires_gradient_sync, accumulated, deferred,
                fsdp_param.deferred_all_reduce_sink if sinks_deferred else None, quantize, fsdp_param.tensor_parallel,
                fsdp_param.late_gradient_sink if late else None,
            ))
        return unsharded

    @property
    def label(self) -> str:
        return self.group.label if self.group is not None else type(self.modules[0]).__name__

    # --- lazy init ------------------------------------------------------------------------------
    def outermost(self) -> "FSDPState":
        """The root this state initializes under: the outermost enclosing fully_shard call's state."""
        return self if self.outer is None else self.outer.outermost()

    def _lazy_init(self) -> None:
        root = self.outermost()
        if root is not self and root.runs_compiled and root.is_root is None:
            # The model runs compiled (its root never ran the eager hooks), and this module runs
            # eagerly: a loss head called after the compiled forward, or a frame Dynamo gave up on.
            root._lazy_init()
            return
        if self.outer is not None:
            raise RuntimeError(
                f"fsdp_compile: forward ran on '{self.label}' before its root '{self.outer.label}'. FSDP initializes "
                "lazily from the root: run the forward of the outermost fully_shard module (the model) first."
            )
        states = self.states_in_tree()
        for state in states:
            if state.root_ctx is not None and state is not self:
                raise RuntimeError(
                    f"fsdp_compile: '{state.label}' already ran forward as part of another root; run forward "
                    f"through '{self.label}' first, before any of its submodules"
                )
        ctx = _RootContext(self, states)
        for state in states:
            state.is_root = state is self
            state.root_ctx = ctx
            state.comm = ctx.comm  # one context per root: see [Note: stream protocol]
            if state.group is None:
                continue
            state.group.comm = ctx.comm
            if state.auto_reshard_after_forward:
                # The root's parameters are needed first in backward: keep them (FSDP2's default).
                state.group.reshard_after_forward = not state.is_root
            for fsdp_param in state.group.fsdp_params:
                fsdp_param.adopt_registered_param()
        on_meta = [p.fqn for state in states if state.group is not None for p in state.group.fsdp_params if p.local_shard().device.type == "meta"]
        if on_meta:
            # FSDP2's words first (_fsdp_param_group.py), every such parameter named, then the fix.
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the following were "
                f"still on meta device: {on_meta}. fsdp_compile: materialize them after fully_shard: call "
                "model.to_empty(device=...) then re-initialize (e.g. model.reset_parameters() on each submodule)."
            )

    # --- forward --------------------------------------------------------------------------------
    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        compiling = torch.compiler.is_compiling()
        if compiling and config.skip_fsdp_hooks:  # FSDPModule.forward runs the hook eagerly
            return args, kwargs
        if compiling or self.stands_aside_for_frames():
            # See [Note: parameter reads under torch.compile] in traceable.py.
            if self.outer is None:
                if self._root_hooks_run_eagerly_for_frames(compiling):
                    self.eager_frames_root_pre_forward()
                elif torch.is_grad_enabled():
                    self._stage_accumulated_grads()
            return self._cast_forward_inputs(args, kwargs)
        return self._pre_forward(module, args, kwargs)

    @staticmethod
    def _root_hooks_run_eagerly_for_frames(compiling: bool) -> bool:
        """Whether the root's hooks hand their work (staging the no-sync sums, the frames' handoff) to
        an eager call: blocks compiled as frames break the root's forward anyway, and Dynamo's trace of
        those walks over every group would cost compile time per block (and guards on each)."""
        return config.compile_blocks_as_frames and (not compiling or _blocks_as_frames_in_this_trace())

    def _check_frames_entered_across_ranks(self, label: str) -> None:
        """On the root, eagerly, as its compiled forward enters the block ``label`` (or ends): see
        [Note: ranks entering different block frames] in graph_check.py."""
        self._frames_entered.append(label)
        self._frames_entered_fingerprint = block_frames_fingerprint(self._frames_entered_fingerprint, label)
        check_block_frames_match_across_ranks(self.label, self._frames_entered, self._frames_entered_fingerprint)

    def _frames_root_pre_forward(self) -> None:
        # Called for a compiled forward (or one whose hooks stand aside for it): the model runs compiled,
        # also where a block runs eagerly before any graph read a parameter (a disabled checkpoint call).
        self.runs_compiled = True
        self.frames_forward_running = True
        self._frames_entered, self._frames_entered_fingerprint = [], ""
        if torch.is_grad_enabled():
            self._stage_accumulated_grads()
        self._begin_frame_handoff()

    def _frames_root_post_forward(self) -> None:
        self.frames_forward_running = False
        self._check_frames_entered_across_ranks(END_OF_FORWARD)
        self._release_staged_grads()
        self._begin_frame_handoff()

    def states_in_tree(self) -> list["FSDPState"]:
        """``all_states_under(self.modules)``, walked again only after a later fully_shard call: the
        root's traced pre/post-forward read it, and Dynamo's trace of a walk over every module costs
        compile time per layer (fully_shard fills it eagerly). Shared, not copied: read it only."""
        cached = self._tree_states
        if cached is None or cached[0] != _states_generation:
            cached = self._tree_states = (_states_generation, all_states_under(self.modules))
        return cached[1]

    def _stage_accumulated_grads(self) -> None:
        """Root pre-forward under torch.compile: hand each synced parameter's no-sync sum to this
        forward's traced unshard ([Note: no-sync accumulation] in param.py). Emptying the sink
        happens here, outside any higher-order op: Dynamo refuses that mutation inside one (an
        activation-checkpointed region reading the parameter). The root's post-forward lets go."""
        for state in self.states_in_tree():
            if state.group is None or not state.group.requires_gradient_sync:
                continue
            all_reduces = state.group.mesh_info.replicate_group is not None and state.group.requires_all_reduce
            for fsdp_param in state.group.fsdp_params:
                accumulated = fsdp_param.pop_accumulated_grad()
                if accumulated is not None:
                    fsdp_param.staged_accumulated_grad = accumulated
                deferred = fsdp_param.pop_deferred_all_reduce() if all_reduces else None
                if deferred is not None:
                    fsdp_param.staged_deferred_all_reduce = deferred

    def _release_staged_grads(self) -> None:
        for state in self.states_in_tree():
            for fsdp_param in state.group.fsdp_params if state.group is not None else ():
                if fsdp_param.staged_accumulated_grad is not None:
                    fsdp_param.staged_accumulated_grad = None
                if fsdp_param.staged_deferred_all_reduce is not None:
                    fsdp_param.staged_deferred_all_reduce = None

    def _cast_forward_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            return _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if config.skip_fsdp_hooks and torch._dynamo.config.compiled_autograd:
            raise RuntimeError(
                f"fsdp_compile: '{self.label}' runs its FSDP hooks eagerly (config.skip_fsdp_hooks=True), and compiled "
                "autograd cannot trace their backward part (end-of-backward callback, reduce-scatter bookkeeping). "
                "Use torch.compile(model, backend='fsdp_inductor') with compiled autograd, or turn one of the two off."
            )
        if self.training_state == TrainingState.PRE_BACKWARD or torch._C._current_graph_task_id() != -1:
            # Activation-checkpoint recompute inside backward: the parameters are unsharded (again,
            # if an earlier post-backward of the group resharded them) and stay so until this
            # group's post-backward; the inputs are cast as in forward, or recompute would see
            # other dtypes. No root step starts here.
            self._unshard_for_recompute()
            return self._cast_forward_inputs(args, kwargs)
        if self.is_root is None:
            self._lazy_init()
        ctx = self.root_ctx
        assert ctx is not None
        if self.is_root:
            self._root_pre_forward()
            args, kwargs = map_tensors(lambda x: x.to(self.device) if x.device != self.device else x, (args, kwargs))
        self.training_state = TrainingState.FORWARD
        args, kwargs = self._cast_forward_inputs(args, kwargs)
        group = self.group
        # [Note: one post-backward trigger per group forward]
        # A group of several modules (fully_shard([a, b])) hooks its post-backward onto the inputs of
        # the first of them to run, once per forward through the group: when gradients reach those
        # inputs, every module of the group has finished its backward. Hooking each module's inputs
        # would reduce after b's backward, before a's weight gradient exists.
        entering_group = not self._modules_to_run_forward
        if group is not None:
            if entering_group:
                self._modules_to_run_forward = {id(m) for m in self.modules}
            group.pre_forward()
            if group not in ctx.forward_order:
                ctx.forward_order.append(group)
            # Own copy-out first, then the next all-gather: the copy-out releases the previous
            # group's all-gather output, so at most two are alive ([Note: stream protocol]).
            group.wait_for_unshard()
            self._prefetch_forward(ctx)
        if torch.is_grad_enabled() and entering_group:
            args, kwargs = self._hook_post_backward_to_inputs(args, kwargs)
        return args, kwargs

    def _unshard_for_recompute(self) -> None:
        self.training_state = TrainingState.PRE_BACKWARD  # its post-forward then keeps the parameters
        if self.group is not None and not self.group.is_unsharded:
            self.group.pre_backward()
            self.group.wait_for_unshard()

    def _root_pre_forward(self) -> None:
        ctx = self.root_ctx
        assert ctx is not None
        # A previous step that skipped waiting (set_is_last_backward(False)) lands now.
        ctx.comm.finish_reductions()
        for state in ctx.states:
            state._unfired_post_backward_triggers = 0  # forward passes that never ran backward
        ctx.begin_step()
        ctx.comm.begin_step()

    def _prefetch_forward(self, ctx: _RootContext) -> None:
        assert self.group is not None
        if self.forward_prefetch is not None:
            targets = [s.group for s in self.forward_prefetch if s.group is not None]
        else:
            target = ctx.next_in_forward.get(id(self.group))
            targets = [target] if target is not None else []
        for target in targets:
            if target.training_state != TrainingState.FORWARD:
                target.unshard("forward-prefetch")

    def _post_forward_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        compiling = torch.compiler.is_compiling()
        if compiling and config.skip_fsdp_hooks:  # FSDPModule.forward runs the hook eagerly
            return output
        if compiling or self.stands_aside_for_frames():
            if self.outer is None:
                if self._root_hooks_run_eagerly_for_frames(compiling):
                    self.eager_frames_root_post_forward()
                else:
                    self._release_staged_grads()
            return self._cast_output(output)
        return self._post_forward(module, args, output)

    def _cast_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            return _cast_floats(output, self.mp_policy.output_dtype)
        return output

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.training_state == TrainingState.PRE_BACKWARD:  # activation-checkpoint recompute
            return self._cast_output(output)
        ctx = self.root_ctx
        assert ctx is not None
        group = self.group
        if group is not None:
            self._modules_to_run_forward.discard(id(module))
            if not self._modules_to_run_forward:
                self._finish_group_forward(ctx)
        if torch.is_grad_enabled():
            output = self._hook_pre_backward_to_outputs(output)
        output = self._cast_output(output)
        self.training_state = TrainingState.IDLE
        if self.is_root:
            self._root_post_forward(ctx)
        return output

    def _finish_group_forward(self, ctx: _RootContext) -> None:
        assert self.group is not None
        self.group.post_forward()
        self._post_forward_indices.append(len(ctx.post_forward_order))
        ctx.post_forward_order.append(self.group)

    def _root_post_forward(self, ctx: _RootContext) -> None:
        ctx.comm.release()
        # A group of several modules whose forward ran only some of them (fully_shard([embed, head])
        # with the head called per loss chunk after the model's forward) finishes its forward
        # now, as FSDP2 does: each later call of the rest is a forward through the group of its own.
        for state in ctx.states:
            if state._modules_to_run_forward and state.group is not None:
                state._modules_to_run_forward.clear()
                state._finish_group_forward(ctx)
        # Forward prefetches of modules that did not run this step would pin memory until backward.
        for state in ctx.states:
            if state.group is not None and state.group.has_unshard_in_flight and state.group not in ctx.forward_order:
                state.group.reshard()

    # --- backward -------------------------------------------------------------------------------
    def _hook_post_backward_to_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        needing_grad = list({id(x): x for x in tensors_in((args, kwargs)) if x.requires_grad}.values())
        if not needing_grad or self.group is None:
            return args, kwargs
        hooked = dict(zip((id(x) for x in needing_grad), _PostBackwardTrigger.apply(self, *needing_grad)))
        self._unfired_post_backward_triggers += 1
        return map_tensors(lambda x: hooked.get(id(x), x), (args, kwargs))

    def _hook_pre_backward_to_outputs(self, output: Any) -> Any:
        tensors = [x for x in tensors_in(output) if x.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grads: self._pre_backward(), mode="any")
        if torch._C._are_functorch_transforms_active():  # see [Note: pre-backward hooks under torch.func]
            return map_tensors(
                lambda x: x if x.requires_grad or not (x.is_floating_point() or x.is_complex()) else _PreBackwardTrigger.apply(self, x),
                output,
            )
        return output

    def _pre_backward(self) -> None:
        if torch.compiler.is_compiling():
            # Compiled autograd traces this hook; our end-of-backward callback and reduction
            # bookkeeping cannot be traced, and skipping them would leave gradients unreduced.
            raise RuntimeError(
                f"fsdp_compile: compiled autograd reached the eager FSDP backward hooks of '{self.label}' "
                "(eager model or fsdp_compile.config.skip_fsdp_hooks=True), which it cannot trace. Compile the "
                "model with torch.compile(model, backend='fsdp_inductor') so the reduce-scatters are part of the "
                "graph, or set torch._dynamo.config.compiled_autograd = False."
            )
        ctx = self.root_ctx
        assert ctx is not None
        if not ctx.final_callback_queued:
            ctx.final_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(ctx.root._end_of_backward)
        self.training_state = TrainingState.PRE_BACKWARD
        group = self.group
        if group is None:
            return
        group.pre_backward()
        if self.backward_prefetch_mode == BackwardPrefetch.BACKWARD_PRE:
            self._prefetch_backward(ctx)
        if group.unshard_in_backward:
            group.wait_for_unshard()

    def _prefetch_backward(self, ctx: _RootContext) -> None:
        if self.backward_prefetch is not None:
            targets = [s.group for s in self.backward_prefetch if s.group is not None]
        elif self._post_forward_indices:
            index = self._post_forward_indices.pop()
            targets = [ctx.post_forward_order[index - 1]] if index > 0 else []
        else:
            targets = []
        for target in targets:
            if target.training_state != TrainingState.POST_BACKWARD and target.unshard_in_backward:
                target.unshard("backward-prefetch")

    def _post_backward(self) -> None:
        self._unfired_post_backward_triggers -= 1
        if self._unfired_post_backward_triggers > 0:
            return
        if self.group is not None and self.group.training_state == TrainingState.PRE_BACKWARD:
            if self.backward_prefetch_mode == BackwardPrefetch.BACKWARD_POST:
                # The next all-gather goes out before this group's reduce-scatter (FSDP1's BACKWARD_POST).
                assert self.root_ctx is not None
                self._prefetch_backward(self.root_ctx)
            self.group.post_backward()

    def _end_of_backward(self) -> None:
        """The root's callback once autograd has finished the whole backward."""
        ctx = self.root_ctx
        assert ctx is not None and self.is_root
        for state in ctx.states:
            if state.group is not None:
                state.group.finalize_backward()
            state._forget_step()
        if self.is_last_backward:
            ctx.comm.finish_reductions()
            # [Note: offloaded gradients are read by the host] The reduce-scatter copy-out writes CPU
            # offload's gradients into pinned host memory from the device, asynchronously; the
            # optimizer steps them on the CPU right after backward. Without this wait it read them
            # half-written (an H200: losses 4.8e-2 off the run without offload; unpinned, 8.5e-5).
            if any(state.group.fsdp_params[0].offload_to_cpu for state in ctx.states if state.group is not None and state.group.fsdp_params):
                ctx.comm.handle.wait_for_host()
        ctx.comm.release()
        ctx.post_forward_order = []
        ctx.final_callback_queued = False

    def _forget_step(self) -> None:
        """This state's bookkeeping of the step that ended (or failed)."""
        self.training_state = TrainingState.IDLE
        self._post_forward_indices.clear()
        self._modules_to_run_forward.clear()
        self._unfired_post_backward_triggers = 0

    def reset_iter_state(self) -> None:
        """The root's recovery after an exception mid-step (``FSDPModule.reset_iter_state``)."""
        states = self.root_ctx.states if self.root_ctx is not None else self.states_in_tree()
        for state in states:
            if state.group is not None:
                state.group.reset_after_failed_step()
            state._forget_step()
        self.comm.reducing_groups.clear()
        self.comm.release()
        self._release_staged_grads()
        if self.root_ctx is not None:
            self.root_ctx.post_forward_order = []
            self.root_ctx.forward_order = []
            # A failed backward never runs its queued end-of-backward callback.
            self.root_ctx.final_callback_queued = False

    def reshard_for(self, action: str) -> None:
        """Make the registered parameters the sharded ones before ``action`` (a state dict, a
        load, unshard_params), or say why that is not possible now."""
        if self.summoned:
            raise RuntimeError(
                f"fsdp_compile: {action} on '{self.label}' inside unshard_params(): the module holds temporary full "
                "parameters there. Call it after the `with unshard_params(...)` block."
            )
        group = self.group
        if group is None:
            return
        if group.training_state != TrainingState.IDLE or self.training_state != TrainingState.IDLE:
            busy = group.training_state if group.training_state != TrainingState.IDLE else self.training_state
            raise RuntimeError(
                f"fsdp_compile: {action} on '{self.label}' while it is in {busy.name}: its parameters are unsharded "
                "and in use. Call it outside forward/backward (e.g. after loss.backward() or before the next forward)."
            )
        group.reshard()

    # --- used by FSDPModule -----------------------------------------------------------------------
    def states_under(self, recurse: bool) -> list["FSDPState"]:
        return self.states_in_tree() if recurse else [self]

