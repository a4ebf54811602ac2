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

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook

from fsdp_compile import config
from fsdp_compile.api import BackwardPrefetch, MixedPrecisionPolicy
from fsdp_compile.runtime.comm_context import CommContext
from fsdp_compile.runtime.param_group import FSDPParamGroup, TrainingState
from fsdp_compile.runtime.structures import map_tensors, tensors_in

__all__ = ["FSDPState", "state_of", "all_states_under", "live_states"]

_STATE_ATTR = "_fsdp_compile_state"
# Bumped by every new FSDPState: a cached walk of a model's states is stale after it.
_states_generation = 0


class _LiveStates:
    """The registry of every FSDP state of a model still alive in this process (held weakly: a model
    that is dropped leaves it)."""

    def __init__(self) -> None:
        self._states: "weakref.WeakSet[FSDPState]" = weakref.WeakSet()

    def add(self, state: "FSDPState") -> None:
        self._states.add(state)

    def all(self) -> list["FSDPState"]:
        return list(self._states)


_live = _LiveStates()


def live_states() -> list["FSDPState"]:
    """Every FSDP state of a model still alive in this process."""
    return _live.all()


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
        self._in_forward_order: set[int] = set()  # ids of forward_order's groups: a membership test per hook
        self.post_forward_order: list[FSDPParamGroup] = []
        self.next_in_forward: dict[int, FSDPParamGroup] = {}
        self.final_callback_queued = False

    def begin_step(self) -> None:
        if self.forward_order:
            self.previous_forward_order = self.forward_order
        self.forward_order = []
        self._in_forward_order = set()
        self.post_forward_order = []
        order = self.previous_forward_order
        self.next_in_forward = {id(group): order[i + 1] for i, group in enumerate(order[:-1])}

    def record_forward(self, group: FSDPParamGroup) -> None:
        """``group`` ran forward in this step (its first forward sets its place in the order)."""
        if id(group) not in self._in_forward_order:
            self._in_forward_order.add(id(group))
            self.forward_order.append(group)

    def ran_forward(self, group: FSDPParamGroup) -> bool:
        return id(group) in self._in_forward_order

    def forget_forward_order(self) -> None:
        self.forward_order = []
        self._in_forward_order = set()


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

    @classmethod
    def hook(cls, state: "FSDPState", inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The trigger applied to ``inputs``: this Function inside a functorch transform or a trace,
        the same trigger without ``setup_context`` elsewhere.

        [Note: applying the post-backward trigger]
        ``autograd.Function.apply`` of a Function with ``setup_context`` binds its arguments to
        ``forward``'s signature (``inspect.signature``, every call) to fill in defaults, which this
        ``forward`` has none of: four fifths of the trigger's cost, paid once per module and step.
        torch 2.13 binds in the Python ``Function.apply``, torch 2.14 in the C++ apply it became, so
        no way of calling this class skips it on both. A Function in the combined form
        (``forward(ctx, ...)``) is never bound, on any version; functorch accepts only the
        ``setup_context`` form and Dynamo traces either, so transforms and traces take this class
        and the plain eager step takes ``_EagerPostBackwardTrigger``.
        """
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return cls.apply(state, *inputs)
        return _EagerPostBackwardTrigger.apply(state, *inputs)


class _EagerPostBackwardTrigger(torch.autograd.Function):
    """``_PostBackwardTrigger`` in the combined form, which ``apply`` does not bind to a signature
    ([Note: applying the post-backward trigger])."""

    @staticmethod
    def forward(ctx: Any, state: "FSDPState", *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple(x.view_as(x) for x in inputs)

    backward = staticmethod(_PostBackwardTrigger.backward)


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
        # Set on the root by the compile layer when its model runs compiled (a graph reading its
        # parameters compiles, or a block frame is entered); an eager module call then initializes
        # from the root.
        self.runs_compiled = False
        # Structure flags set by fully_shard: an enclosing fully_shard module, none inside.
        self.has_outer = False
        self.is_leaf = True  # no fully_shard module inside
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
        for module in modules:
            module.__dict__[_STATE_ATTR] = self
            module.register_forward_pre_hook(self._pre_forward_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(self._post_forward_hook, prepend=False)
        _live.add(self)
        global _states_generation
        _states_generation += 1
        self._tree_states: tuple[int, list[FSDPState]] | None = None

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

    # --- forward --------------------------------------------------------------------------------
    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._pre_forward(module, args, kwargs)

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
            ctx.record_forward(group)
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
            if state.group is not None and state.group.has_unshard_in_flight and not ctx.ran_forward(state.group):
                state.group.reshard()

    # --- backward -------------------------------------------------------------------------------
    def _hook_post_backward_to_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        needing_grad = list({id(x): x for x in tensors_in((args, kwargs)) if x.requires_grad}.values())
        if not needing_grad or self.group is None:
            return args, kwargs
        hooked = dict(zip((id(x) for x in needing_grad), _PostBackwardTrigger.hook(self, needing_grad)))
        self._unfired_post_backward_triggers += 1
        return map_tensors(lambda x: hooked.get(id(x), x), (args, kwargs))

    def _hook_pre_backward_to_outputs(self, output: Any) -> Any:
        tensors = [x for x in tensors_in(output) if x.requires_grad]
        if len(tensors) == 1:
            # A hook on the one tensor fires once per backward through it, as a multi-grad hook
            # ("any") over one tensor does, at a third of the cost of registering one.
            tensors[0].register_hook(self._pre_backward_hook)
        elif tensors:
            register_multi_grad_hook(tensors, self._pre_backward_hook, mode="any")
        if torch._C._are_functorch_transforms_active():  # see [Note: pre-backward hooks under torch.func]
            return map_tensors(
                lambda x: x if x.requires_grad or not (x.is_floating_point() or x.is_complex()) else _PreBackwardTrigger.apply(self, x),
                output,
            )
        return output

    def _pre_backward_hook(self, grad: Any) -> None:
        self._pre_backward()

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
            self.root_ctx.forget_forward_order()
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
    def share_comm_of(self, other: "FSDPState") -> None:
        """Every state under this root takes ``other``'s communication context (``share_comm_ctx``)."""
        shared = other.comm
        for state in all_states_under(self.modules):
            state.comm = shared
            if state.group is not None:
                state.group.comm = shared
            if state.root_ctx is not None:
                state.root_ctx.comm = shared

    def states_under(self, recurse: bool) -> list["FSDPState"]:
        return self.states_in_tree() if recurse else [self]

