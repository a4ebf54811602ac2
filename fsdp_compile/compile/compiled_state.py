"""``CompiledFSDPState``: the hooks of one ``fully_shard`` call as torch.compile sees them.

The eager runtime's ``FSDPState`` (runtime/state.py) knows nothing of Dynamo; ``fully_shard`` builds
this subclass, which adds what the compile layer needs of a module: whether its forward compiles as
a block frame, a nested region or inline; the hooks standing aside while Dynamo traces (the traced
parameter reads gather instead, [Note: parameter reads under torch.compile] in param_reads.py); the
traced unshard of its group; and, mixed in from frames.py, the block-frame side (what happens when
a block frame is entered).
"""
from __future__ import annotations

import functools
import itertools
import types
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from fsdp_compile import config
from fsdp_compile.annotations import BLOCK_FRAME_TOKEN
from fsdp_compile.compile import backend  # noqa: F401  registers backend="fsdp_aot_eager" for _gather_group_in_a_graph
from fsdp_compile.compile.frames import BlockFrameFSDPState, blocks_as_frames_in_this_trace
from fsdp_compile.compile.param_reads import trace_annotation, unshard_for_trace
from fsdp_compile.compile.policy import settings_refused_when_compiled
from fsdp_compile.compile.trace_context import (
    call_forward_breaking_at_block_frames, call_with_forwards_not_traced, compiled_call_may_break_graphs, copy_dynamo_skips, names_a_checkpoint,
    inside_a_compiled_call, traced_for_an_fsdp_backend, traced_in_a_block_frame,
    traced_in_a_callers_higher_order_op, traced_under_compiled_autograd,
)
from fsdp_compile.runtime.param_group import TrainingState
from fsdp_compile.runtime.state import FSDPState

if TYPE_CHECKING:
    from fsdp_compile.runtime.param import FSDPParam

__all__ = ["CompiledFSDPState", "forward_in_a_frame_of_its_own"]

_trace_tokens = itertools.count()


@torch.compile(backend="fsdp_aot_eager", dynamic=False)
def _gather_group_in_a_graph(state: "CompiledFSDPState") -> list[torch.Tensor]:
    """A group's first read under blocks compiled as frames, where that read runs eagerly (Dynamo gave
    up on its frame, or skips the read's code for good: a trace of it under the eager fallback held
    no op): its traced unshard in a graph of its own, whose passes bucket it into the group's one
    all-gather and, in backward, one reduce-scatter, as in any graph (run eagerly, each parameter's
    op gathered and reduced alone). No code generation: the graph holds only the collectives and
    their copies. Its passes are ``fsdp_compile.config.passes``, not the ``PassConfig`` of the backend
    that compiled the model (``fsdp_inductor_with``): this function knows no model's backend."""
    group = state.group
    assert group is not None
    return state.traced_unshard(group.fsdp_params)


# [Note: a forward that breaks at its blocks' frames]
# Under block frames, the forward of a fully_shard module with blocks inside (the root) breaks at its
# first block's call. Traced from FSDPModule.forward, that break lies inside the user's forward (and the
# functions it calls: Hugging Face's LlamaForCausalLM -> LlamaModel -> its loop over the layers), so
# Dynamo first traces everything down to the first block (the embedding, the root group's unshard, the
# causal mask, the rotary table), then learns the break is nested, restarts, and breaks at the call of
# the user's forward: a whole trace of the model's prefix, thrown away, in the frame of FSDPModule.forward
# (and again in each user frame the break bubbles up through, which is the user's structure, not
# ours). The graph of that frame holds nothing either way; its break only comes late. So that call is
# made through a function Dynamo does not trace (torch._dynamo.disable(recursive=False), its own frame
# skipped too): the break comes at once, and the user's forward is a frame of its own, as it was after
# the restart. Same frames, same graphs, one trace of the prefix fewer. Only where the trace may break
# (not under fullgraph=True, nor inside a caller's higher-order op) and only our backends' traces,
# where blocks are frames.
#
# Where graphs outside blocks run as traced (graphs_outside_blocks = "eager", [Note: graphs outside
# blocks run as traced] in policy.py) the user's forward is not traced at all: what Dynamo would compile
# of it, the code before its first block and after its last, would run as traced, that is as eagerly,
# and its trace costs the most of any frame outside blocks (on the Hugging Face-shaped Llama, 0.8 s of a
# warm restart's 3.8 s: it inlines the model down to the loop over the layers, learns that the break
# inside the loop cannot resume, and restarts). Its frame runs eagerly, as Dynamo runs a frame it gave up
# on, and the frames it calls are traced as before: the root group's first read (its all-gather),
# every block, the modules and functions it calls. The frame skipped is a copy of the forward with a code
# object of its own (copy_dynamo_skips), so the same class compiled elsewhere is traced as ever. So is the
# forward of each plain module between it and the fully_shard modules inside (Hugging Face's LlamaModel,
# whose loop Dynamo gives up on after tracing down to the first block: 0.4-0.8 s of a warm restart): for
# the call's duration only, each such module's forward is an instance attribute holding its untraced copy
# (call_with_forwards_not_traced), which nn.Module.__call__ finds first; outside the call the module is as
# the user left it, so it pickles, copies and runs elsewhere as before. A forward
# that calls its blocks inside checkpoint() (PyTorch's FSDP2 tests, torchtitan's per-call form) does not
# break at them: traced, each block is a region of the checkpoint's higher-order op; untraced, the
# checkpoint would run eagerly and every block in it with its eager hooks. Such a forward is still traced,
# told by its code naming a checkpoint (names_a_checkpoint: any name with "checkpoint" in it, Hugging
# Face's _gradient_checkpointing_func included), and so is every plain module under it (an instance's
# forward would be the copy, which Dynamo inlines all the same); a plain module's forward naming one is
# traced alone. A call the names hide runs its blocks eagerly, with the
# warning of [Note: frames Dynamo runs eagerly] in module.py naming the setting that traces it.
class CompiledFSDPState(BlockFrameFSDPState, FSDPState):
    """An ``FSDPState`` whose module may run under torch.compile (every state ``fully_shard`` builds)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Said once per module: its forward ran eagerly inside the compiled model ([Note: frames
        # Dynamo runs eagerly] in module.py).
        self.told_it_ran_eagerly = False
        # A norm layer keeping running statistics (BatchNorm): in training its forward writes its
        # buffers in place, which a nested compile region refuses (see compiles_as_region).
        self.keeps_running_stats = any(
            isinstance(sub, nn.modules.batchnorm._NormBase) and sub.track_running_stats
            for module in self.modules for sub in module.modules()
        )
        self.has_group = self.group is not None
        self.single_module = len(self.modules) == 1
        # block.compile(): the forward compiled alone, the hooks eager around it (FSDPModule.compile).
        self.per_block_compiled = False
        # skip_fsdp_hooks: see [Note: the eager fallback's graph breaks] in module.py.
        self.eager_pre_forward = torch._dynamo.disable(self._pre_forward, recursive=True)
        self.eager_post_forward = torch._dynamo.disable(self._post_forward, recursive=True)
        self.eager_enter_block_frame = torch._dynamo.disable(self.enter_block_frame, recursive=True)
        self.eager_frames_root_pre_forward = torch._dynamo.disable(self._frames_root_pre_forward, recursive=True)
        self.eager_frames_root_post_forward = torch._dynamo.disable(self._frames_root_post_forward, recursive=True)
        # Hooks whose frame Dynamo need not compile: [Note: hook frames under block frames].
        self.eager_pre_forward_without_a_frame = torch._dynamo.disable(self._pre_forward_without_a_frame, recursive=True)
        self.eager_post_forward_without_a_frame = torch._dynamo.disable(self._post_forward_without_a_frame, recursive=True)
        # Names this state in the annotations of traced nodes (check_parameters_read in policy.py).
        self.trace_token = next(_trace_tokens)
        # Whether its last block-frame entry found a no-sync sum for its graph: [Note: a block frame's guards].
        self.frame_sums_pending = True
        # [Note: a forward that breaks at its blocks' frames]: per forward function of its modules, the copy
        # Dynamo does not trace (None: it stays traced); the plain modules above the fully_shard modules
        # inside, with their forwards' copies (None until the first untraced call).
        self._forwards_not_traced: dict[types.FunctionType, types.FunctionType | None] = {}
        self._plain_forwards: tuple[tuple[nn.Module, Any], ...] | None = None
        self._init_block_frames()

    def forward_not_traced(self, forward: Any) -> Any:
        """Eagerly: the bound ``forward`` as a callable whose frame Dynamo runs without tracing it, nor
        the forwards of the plain modules between this one and the fully_shard modules inside it
        ([Note: a forward that breaks at its blocks' frames]); ``forward`` itself where it is no plain
        function's method or names a checkpoint."""
        function = getattr(forward, "__func__", None)
        if not isinstance(function, types.FunctionType):
            return forward
        if function not in self._forwards_not_traced:
            # Decided once per forward function (a state's modules may be of several classes), not per call:
            # one naming a checkpoint stays traced, and so do the modules it calls (an instance's forward
            # would be the copy Dynamo inlines).
            self._forwards_not_traced[function] = None if names_a_checkpoint(function) else copy_dynamo_skips(function)
        untraced = self._forwards_not_traced[function]
        if untraced is None:
            return forward
        if self._plain_forwards is None:
            self._plain_forwards = tuple((module, _untraced_method(module)) for module in self._plain_modules_above_inner_states())
        plain_forwards = self._plain_forwards
        bound = types.MethodType(untraced, forward.__self__)
        return functools.partial(call_with_forwards_not_traced, bound, plain_forwards) if plain_forwards else bound

    def _plain_modules_above_inner_states(self) -> list[nn.Module]:
        """The modules on the way from this state's modules down to the nearest fully_shard modules
        inside them, neither end included, whose forward is a plain function of their class that names
        no checkpoint: Hugging Face's LlamaModel between LlamaForCausalLM and its decoder layers."""
        managed = {id(module) for state in self.states_in_tree() for module in state.modules}
        above: dict[int, nn.Module] = {}

        def holds_managed(module: nn.Module) -> bool:
            holds = False
            for child in module.children():
                if id(child) in managed:
                    holds = True
                elif holds_managed(child):
                    holds = True
                    above.setdefault(id(child), child)
            return holds

        for top in self.modules:
            holds_managed(top)
        return [
            module for module in above.values()
            if "forward" not in module.__dict__ and isinstance(type(module).forward, types.FunctionType)
            and type(module).forward is not nn.Module.forward and not names_a_checkpoint(type(module).forward)
        ]

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
        [Note: compile once per block] in regions.py); under ``torch.compile(dynamic=True)`` none is
        ([Note: where Dynamo's body reuse stops] in regions.py, 3). Nor is a block keeping running statistics
        while it trains: a region's body may not write its buffers in place under autograd (torch
        2.13's invoke_subgraph refuses it, and the compile failed); that block is traced inline.
        Only our backends compile regions correctly (``trace_context.traced_for_an_fsdp_backend``)."""
        return (
            not config.block_compile_is("inline") and not self.compiles_as_frame and self._is_block()
            and torch._dynamo.config.assume_static_by_default and not (self.keeps_running_stats and self.modules[0].training)
            and traced_for_an_fsdp_backend()
        )

    @property
    def compiles_as_frame(self) -> bool:
        """Whether this block's forward is compiled as a Dynamo frame of its own, with its group's
        collectives in its graph and nothing in the trace that tells blocks apart
        (``config.block_compile = "frames"``; see [Note: blocks compiled as frames] in frames.py)."""
        return (
            blocks_as_frames_in_this_trace() and self._is_block() and traced_for_an_fsdp_backend()
            and not traced_in_a_callers_higher_order_op()
        )

    @property
    def forward_breaks_at_inner_block_frames(self) -> bool:
        """Whether this module's forward, with fully_shard modules inside it, is traced as a frame of
        its own from its first line (``forward_in_a_frame_of_its_own``): blocks inside it compile as
        frames, so its trace breaks anyway ([Note: a forward that breaks at its blocks' frames])."""
        return (
            not self.is_leaf and blocks_as_frames_in_this_trace() and traced_for_an_fsdp_backend()
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
        return blocks_as_frames_in_this_trace() and self._is_outside_blocks() and traced_for_an_fsdp_backend()

    def reads_across_frames_eagerly(self) -> bool:
        """Whether an eager read of this group's parameter (its frame run eagerly, its hooks standing
        aside in a compiled graph) takes ``unsharded_across_frames``, blocks compiled as frames: only
        during the compiled forward (``model.weight.grad`` read after it is the parameter's)."""
        return (
            config.block_compile_is("frames") and self._is_outside_blocks() and self.outermost().frames_forward_running
            and self.runs_eagerly_inside_compiled_model()
        )

    def _is_outside_blocks(self) -> bool:
        """A group that is no block (the root, a group of several modules, one with blocks inside):
        blocks compiled as frames split its forward into several graphs."""
        return self.has_group and not self._is_block()

    def hooks_act_as_traced(self, in_a_compiled_call: bool = False) -> bool:
        """Whether a hook Dynamo runs eagerly (it gave up on the hook's own frame, which blocks
        compiled as frames make of each hook) does what its traced form does: the model runs
        compiled (its root's hooks stood aside), no eager hook ran for this group in this forward,
        and this is not a checkpoint's recompute in backward. The block's frame, or the reads of the
        groups outside blocks (``unsharded_across_frames``), gather and reduce instead.
        ``in_a_compiled_call``: the caller saw Dynamo's callback set, asking with Dynamo off."""
        # Every eager hook asks: what tells eager training apart (no compiled call around it, a model
        # that never ran compiled) is read first, the rest only under torch.compile.
        root = self.outermost()
        return (
            (in_a_compiled_call or inside_a_compiled_call() or root.runs_compiled) and config.block_compile_is("frames")
            and not config.skip_fsdp_hooks and self.training_state is TrainingState.IDLE
            and root.training_state is TrainingState.IDLE and torch._C._current_graph_task_id() == -1
        )

    def unsharded_across_frames(self, fsdp_param: "FSDPParam") -> torch.Tensor:
        """``fsdp_param``'s unsharded parameter under block frames: the group's first
        read in a forward traces the whole group's unshard (one all-gather, and in backward one
        reduce-scatter, as eagerly), and every later read takes what it gathered, in whichever graph
        it comes. The root's pre- and post-forward empty ``frame_handoff``; see [Note: blocks compiled
        as frames] in frames.py."""
        handoff = self.frame_handoff
        if fsdp_param.fqn not in handoff:
            group = self.group
            assert group is not None
            gathered = self.traced_unshard(group.fsdp_params) if torch.compiler.is_compiling() else _gather_group_in_a_graph(self)
            for member, unsharded in zip(group.fsdp_params, gathered):
                handoff[member.fqn] = unsharded
        return handoff[fsdp_param.fqn]

    def let_go_of_kept_gather(self) -> None:
        """``FSDPModule.reshard()``: what the runtime kept of this group's all-gather for the next forward
        is freed, as eagerly the unsharded parameters are ([Note: keeping parameters gathered across a
        backward] in kept_gathers.py); the next forward gathers again."""
        block = self.outermost().root_frames.blocks.get(self)
        if block is not None:
            block.kept.let_go()

    def runs_eagerly_inside_compiled_model(self) -> bool:
        """Whether this module's forward runs eagerly while its FSDP hooks were traced into a
        compiled caller's graph, where they stand aside (see [Note: frames Dynamo runs eagerly] in
        module.py): its model runs compiled and its pre-forward hook did not run eagerly."""
        return (
            self.training_state == TrainingState.IDLE and self.outermost().runs_compiled and self.has_group
            and not self.per_block_compiled and not config.skip_fsdp_hooks and torch._C._current_graph_task_id() == -1
        )

    # [Note: a block frame's guards]
    # Dynamo guards a frame on everything its trace read, and a block frame's trace reads each parameter
    # through the block's modules, its FSDPParam and its group. On the Hugging Face-shaped Llama (9
    # parameters a block, 2 ranks) the frame held 779 guards in its tree (1338 by Dynamo's count) where
    # FSDP2's per-block graph of the same block holds 169 (193). Among them, on what the graph does not
    # take: the registered sharded Parameter of each read (a DTensor: its local tensor, spec and mesh,
    # and an identity guard per other path to it), reread only to tell a region's input apart, which a
    # block compiled as a frame never holds; each parameter's references (module and name), read to find
    # the one name of a tied parameter that adds the no-sync sum, a fact fully_shard fixes and so kept
    # with the traced read (install_traced_param_access); each parameter's no-sync sink, a tensor with
    # its guards, read to learn that it holds no sum; and each sharded Parameter, read for its
    # requires_grad. A block's frame runs right after its eager entry (enter_block_frame), which looks at
    # those instead (note_frame_entry): in its frame the trace
    # reads the sinks only where one holds a sum (or a staged one waits), behind one guarded flag, and
    # each parameter's requires_grad as the entry found it, a guarded flag too; read in another graph
    # (the root's), they are read as before. 568 guards are left in the tree (1214 by Dynamo's count):
    # the graph's inputs (each parameter's detached shard and late gradient sink, the block's
    # arguments), the module structure, and the settings the graph is built from (dtypes, layouts,
    # reshard and sync settings, the refused ones), guarded as before: a changed setting recompiles.
    def note_frame_entry(self) -> None:
        """Eagerly, as this block's frame is entered, in one walk over its group's parameters: each
        one's detached shard refreshed (``FSDPParam.refresh_detached_sharded_param``), and what its
        trace reads instead of the parameters ([Note: a block frame's guards]): each parameter's
        ``requires_grad``, and whether a parameter of its group holds a no-sync sum (staged by the
        root, or still in its sink) that its graph adds."""
        group = self.group
        assert group is not None
        sums = False
        for p in group.fsdp_params:
            p.refresh_detached_sharded_param()
            p.requires_grad_at_frame_entry = p.sharded_param.requires_grad
            sums = sums or p.staged_accumulated_grad is not None or p.accumulation_sink.grad is not None
        self.frame_sums_pending = group.requires_gradient_sync and sums

    def traced_unshard(self, fsdp_params: "list[FSDPParam]", first_place: bool = True) -> list[torch.Tensor]:
        """What reads of ``fsdp_params`` (this group's) trace to under torch.compile; see param_reads.py.

        A block's forward traces its whole group at once, so the group's settings are read (and
        guarded) once per block rather than once per parameter. ``first_place``: the reads are
        through each parameter's first registered name, the one read that adds the no-sync sum (a
        tied parameter is read once per name).
        """
        group = self.group
        assert group is not None
        as_frame, outside_blocks = self.compiles_as_frame, self.gathers_once_across_frames
        if settings_refused_when_compiled(group, gathers_through_frames=as_frame or outside_blocks):
            pass  # the branch makes Dynamo guard on the settings; check_parameters_read refuses them
        traced_for_an_fsdp_backend()  # another backend is told once what it skips
        spec = group.reduce_spec
        hybrid = group.mesh_info.replicate_group is not None
        takes_sums = group.requires_gradient_sync and first_place
        adds_deferred = takes_sums and hybrid and group.requires_all_reduce  # [Note: deferred all-reduce] in param.py
        sinks_deferred = hybrid and not group.requires_all_reduce  # every read's sum adds up in the sink's .grad
        policy = group.comm_policy
        quantize = (policy.all_gather_dtype, policy.block_size) if policy.quantizes_all_gather else None
        reshards = self.reshards_after_forward
        # [Note: keeping parameters gathered across a backward] in kept_gathers.py
        keeps_gathered = outside_blocks and self.keeps_gathered_across_frames()
        if as_frame:
            group_name, token = self.frame_label, BLOCK_FRAME_TOKEN  # one graph for every such block
        else:
            group_name, token = group.label, self.trace_token
        # Over one rank nothing is in flight to wait on late ([Note: no collective over one rank] in
        # ops.py): the gradient is returned, not handed to the runtime one parameter at a time
        # ([Note: the cost of entering a block frame] in frames.py).
        delivers_late = (
            as_frame and group.requires_gradient_sync and not hybrid and spec.wire_dtype is None
            and spec.shard_size > 1 and not traced_under_compiled_autograd()
        )
        # In its own frame a block takes what its eager entry found ([Note: a block frame's guards]): the
        # no-sync sums are read only where one waits, and no parameter is read for its requires_grad.
        in_its_frame = as_frame and traced_in_a_block_frame()
        sums_may_be_pending = not in_its_frame or self.frame_sums_pending
        unsharded = []
        for fsdp_param in fsdp_params:
            trains = fsdp_param.requires_grad_at_frame_entry if in_its_frame else fsdp_param.sharded_param.requires_grad
            late = delivers_late and fsdp_param.tensor_parallel is None and trains and fsdp_param.detached_sharded_param is not None
            accumulated = deferred = None
            if takes_sums and sums_may_be_pending:
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
                trace_annotation(group_name, fsdp_param.fqn, reshards, token, keeps_gathered), fsdp_param.accumulation_sink,
                group.requires_gradient_sync, accumulated, deferred,
                fsdp_param.deferred_all_reduce_sink if sinks_deferred else None, quantize, fsdp_param.tensor_parallel,
                fsdp_param.gradient_handover_sink if late else None, fsdp_param.device if fsdp_param.offload_to_cpu else None,
            ))
        return unsharded

    # [Note: hook frames under block frames]
    # nn.Module's __call__ and _call_impl are in Dynamo's skip files, so wherever a module's call is not
    # inlined into a trace (the root's always; each block's under block frames, whose caller's graph
    # breaks at the block), Dynamo compiles each FSDP hook as a frame of its own. Under block frames
    # those frames hold no graph: the root's hand their bookkeeping to an eager call
    # (_root_hooks_run_eagerly_for_frames), whose graph break adds a restart and a resume frame, and
    # then _cast_forward_inputs or _cast_output is a frame of its own; a block's only casts. They
    # cost 8 of the own model's 15 Dynamo frames on the first step, and every step Dynamo's lookup and
    # guards of each block's pre- and post-forward frame. So the registered hooks are frames Dynamo
    # skips (skip_code: the frame, not what it calls; a trace that inlines a hook, as a whole-model
    # graph does, still traces it). Run as a frame of its own inside a compiled call, a hook asks
    # eagerly, Dynamo off (a function it called with Dynamo on would be traced as a frame, where
    # is_compiling() is True), whether its traced form under block frames is what it does eagerly
    # (hooks_act_as_traced, in a call that may break its graphs); if so it runs that form there.
    # Elsewhere it calls its frame (_pre_forward_hook_frame, _post_forward_hook_frame), which Dynamo
    # compiles or inlines as before: regions, fullgraph=True (whose trace of a root hook stages the
    # sums in the graph instead), the eager fallback, eager training. Numerics and collectives are
    # the same either way.
    def _pre_forward_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not torch.compiler.is_compiling():
            callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
            if callback:
                ran, result = self.eager_pre_forward_without_a_frame(callback, args, kwargs)
                if ran:
                    return result
        return self._pre_forward_hook_frame(module, args, kwargs)

    def _post_forward_hook(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not torch.compiler.is_compiling():
            callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
            if callback:
                ran, result = self.eager_post_forward_without_a_frame(callback, output)
                if ran:
                    return result
        return self._post_forward_hook_frame(module, args, output)

    def _hook_needs_no_frame(self, callback: Any) -> bool:
        """Eagerly, Dynamo off, in a hook run as a frame of its own under Dynamo's ``callback``: whether
        its traced form is what it does eagerly ([Note: hook frames under block frames])."""
        return (
            config.block_compile_is("frames") and compiled_call_may_break_graphs(callback)
            and self.hooks_act_as_traced(in_a_compiled_call=True)
        )

    def _pre_forward_without_a_frame(self, callback: Any, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        if not self._hook_needs_no_frame(callback):
            return False, None
        return True, self._pre_forward_as_traced(args, kwargs, compiling=False)

    def _post_forward_without_a_frame(self, callback: Any, output: Any) -> tuple[bool, Any]:
        if not self._hook_needs_no_frame(callback):
            return False, None
        return True, self._post_forward_as_traced(output, compiling=False)

    def _pre_forward_hook_frame(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        compiling = torch.compiler.is_compiling()
        if compiling and config.skip_fsdp_hooks:  # FSDPModule.forward runs the hook eagerly
            return args, kwargs
        if compiling or self.hooks_act_as_traced():
            # See [Note: parameter reads under torch.compile] in param_reads.py.
            return self._pre_forward_as_traced(args, kwargs, compiling)
        return self._pre_forward(module, args, kwargs)

    def _pre_forward_as_traced(self, args: tuple, kwargs: dict, compiling: bool) -> tuple[tuple, dict]:
        if self.outer is None:
            if self._root_hooks_run_eagerly_for_frames(compiling):
                self.eager_frames_root_pre_forward()
            elif torch.is_grad_enabled():
                self._stage_accumulated_grads()
        return self._cast_forward_inputs(args, kwargs)

    def _post_forward_hook_frame(self, module: nn.Module, args: tuple, output: Any) -> Any:
        compiling = torch.compiler.is_compiling()
        if compiling and config.skip_fsdp_hooks:  # FSDPModule.forward runs the hook eagerly
            return output
        if compiling or self.hooks_act_as_traced():
            return self._post_forward_as_traced(output, compiling)
        return self._post_forward(module, args, output)

    def _post_forward_as_traced(self, output: Any, compiling: bool) -> Any:
        if self.outer is None:
            if self._root_hooks_run_eagerly_for_frames(compiling):
                self.eager_frames_root_post_forward()
            else:
                self._release_staged_grads()
        return self._cast_output(output)


# The registered hooks decide per call whether Dynamo compiles their frame: [Note: hook frames under
# block frames].
torch._dynamo.eval_frame.skip_code(CompiledFSDPState._pre_forward_hook.__code__)
torch._dynamo.eval_frame.skip_code(CompiledFSDPState._post_forward_hook.__code__)


def _untraced_method(module: nn.Module) -> Any:
    """``module.forward`` bound to a copy of its class's function that Dynamo does not trace."""
    return types.MethodType(copy_dynamo_skips(type(module).forward), module)


# [Note: a forward that breaks at its blocks' frames]
torch._dynamo.eval_frame.skip_code(call_forward_breaking_at_block_frames.__code__)
forward_in_a_frame_of_its_own = torch._dynamo.disable(call_forward_breaking_at_block_frames, recursive=False)
