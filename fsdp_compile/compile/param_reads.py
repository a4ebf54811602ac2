"""What reading a managed parameter becomes under Dynamo (docs/design.md section 5.1).

[Note: parameter reads under torch.compile]
Every module holding a managed parameter gets a class with one property per parameter name
(installed by ``fully_shard``; the state-dict FQNs are untouched since the parameter stays in
``_parameters``). Eagerly the property returns whatever the hooks registered (sharded DTensor
or unsharded tensor). While Dynamo traces (and ``config.skip_fsdp_hooks`` is off) the hooks
stand aside and the property returns ``unshard(sharded)`` instead (inside a block's nested
compile region, where the unsharded parameter is registered as a plain tensor, that tensor:
[Note: compile once per block] in regions.py):

    local shard --pad--> --cast param_dtype--> all_gather --wait--> [:size] --> full parameter
    grad shard <--cast orig-- /post <--wait-- reduce_scatter(sum) <-- /pre <--cast reduce_dtype-- grad

so the graph carries one all-gather per parameter read and one reduce-scatter per gradient,
each node annotated (``node.meta["custom"]``) with its group and parameter for the passes.
The arithmetic (casts, divide factors, padding) is the eager runtime's, so the compiled path
reproduces its numerics.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx.traceback as fx_traceback

from fsdp_compile import config
from fsdp_compile.annotations import (
    FSDP_ANNOTATION_KEY, GROUP_KEY, KEEPS_GATHERED_KEY, PARAM_KEY, RESHARD_AFTER_FORWARD_KEY, STATE_KEY,
)
from fsdp_compile.compile.ops import gather_shard, pad_rows
from fsdp_compile.runtime.collectives import ReduceSpec
from fsdp_compile.runtime.layout import ShardLayout
from fsdp_compile.runtime.param_group import TrainingState

if TYPE_CHECKING:
    from fsdp_compile.runtime.mesh import TensorParallelLayout
    from fsdp_compile.runtime.param import FSDPParam
    from fsdp_compile.runtime.state import FSDPState

__all__ = ["trace_annotation", "unshard_for_trace", "install_traced_param_access", "FSDP_ANNOTATION_KEY"]


def trace_annotation(
    group: str, fqn: str, reshard_after_forward: bool, state_token: int, keeps_gathered: bool = False,
) -> dict[str, object]:
    """What each node of one parameter's traced unshard carries in ``node.meta["custom"]``.
    ``keeps_gathered``: the group's all-gather goes through the runtime, which keeps it across a
    backward ([Note: keeping parameters gathered across a backward] in kept_gathers.py); the key is left out
    otherwise, so every other graph stays as it was."""
    annotation: dict[str, object] = {
        FSDP_ANNOTATION_KEY: True,
        GROUP_KEY: group,
        PARAM_KEY: fqn,
        RESHARD_AFTER_FORWARD_KEY: reshard_after_forward,
        STATE_KEY: state_token,
    }
    if keeps_gathered:
        annotation[KEEPS_GATHERED_KEY] = True
    return annotation


class _AccumulateWithoutSync(torch.autograd.Function):
    """The full parameter of a no-sync step: its gradient goes to the accumulation sink's
    ``.grad`` (autograd sums it there) instead of a reduce-scatter; see [Note: no-sync accumulation]."""

    @staticmethod
    def forward(ctx, full: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.sink_dtype = sink.dtype
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return None, grad.to(ctx.sink_dtype)


def unshard_for_trace(
    sharded: torch.Tensor, layout: ShardLayout, param_dtype: torch.dtype, spec: ReduceSpec, annotation: dict[str, object],
    sink: torch.Tensor, requires_gradient_sync: bool, accumulated: torch.Tensor | None,
    deferred: torch.Tensor | None = None, deferred_sink: torch.Tensor | None = None,
    quantize: tuple[torch.dtype, int] | None = None, tensor_parallel: "TensorParallelLayout | None" = None,
    late_sink: torch.Tensor | None = None, offloaded_to: torch.device | None = None,
) -> torch.Tensor:
    """The full parameter from its sharded DTensor, as traceable functional collectives.

    ``sink`` is the parameter's accumulation leaf ([Note: no-sync accumulation] in param.py): a
    no-sync step's gradient goes there. A synced step reduces its gradient plus ``accumulated``
    (the sum taken from the sink, or None; Dynamo guards on which, so each case compiles once).
    HSDP: ``deferred`` is the reduce-scattered sum of steps that skipped the all-reduce, added
    before this step's; ``deferred_sink`` (when this step skips it too) receives the sum instead
    ([Note: deferred all-reduce] in param.py). ``quantize``: ``(wire dtype, block size)`` of
    CommPolicy's quantized all-gather, or None. ``tensor_parallel``: a tensor-parallel parameter's
    layout ([Note: FSDP over tensor-parallel parameters] in mesh.py): the gather over dp gives this
    rank's TP piece, returned as the user's DTensor, whose operations trace TP's own collectives.
    ``late_sink``: the parameter's ``gradient_handover_sink`` where its reduced gradient is handed to the
    runtime, not returned ([Note: late reduce-scatter wait across block frames] in frames.py).
    ``offloaded_to``: the device a CPU-offloaded shard is gathered on ([Note: offloaded shards under
    whole-model compile]), or None.
    """
    full = _unshard_local(
        sharded, layout, param_dtype, spec, annotation, sink, requires_gradient_sync, accumulated, deferred, deferred_sink,
        quantize, late_sink, offloaded_to,
    )
    return full if tensor_parallel is None else tensor_parallel.unsharded(full)


def _unshard_local(
    sharded: torch.Tensor, layout: ShardLayout, param_dtype: torch.dtype, spec: ReduceSpec, annotation: dict[str, object],
    sink: torch.Tensor, requires_gradient_sync: bool, accumulated: torch.Tensor | None,
    deferred: torch.Tensor | None, deferred_sink: torch.Tensor | None, quantize: tuple[torch.dtype, int] | None,
    late_sink: torch.Tensor | None, offloaded_to: torch.device | None,
) -> torch.Tensor:
    with fx_traceback.annotate(annotation):
        local = sharded.to_local()
        if offloaded_to is not None:
            local = local.to(offloaded_to)
        local = layout.to_dim0(local)
        # Always pad (possibly by 0 rows): every rank must trace the same ops (fingerprint check).
        padded = pad_rows(local, layout.chunk - local.shape[0])
        if not requires_gradient_sync:
            gathered = gather_shard(padded.detach(), param_dtype, spec.shard_size, spec.shard_group_name, quantize)
            return _AccumulateWithoutSync.apply(layout.full_from_gathered(gathered), sink)
        if accumulated is not None:
            accumulated = layout.to_dim0(accumulated)
        quantize_dtype, quantize_block_size = quantize if quantize is not None else (None, 0)
        gathered = torch.ops.fsdp_compile.all_gather_shard(
            padded, accumulated, deferred, deferred_sink, param_dtype, spec.reduce_dtype, spec.grad_dtype, spec.pre_divide,
            spec.post_divide, spec.shard_size, spec.wire_dtype, quantize_dtype, quantize_block_size, spec.shard_group_name,
            spec.replicate_group_name, late_sink,
        )
        return layout.full_from_gathered(gathered)


# [Note: offloaded shards under whole-model compile]
# A CPU-offloaded shard lives in host memory, its gradient too; eagerly the unshard copies it to the
# device on the copy-in stream ([Note: offloaded shards are copied on the copy-in stream] in
# runtime/param_group.py) and the reduce-scatter's copy-out writes the gradient back to host memory.
# Traced, the read moves the shard to the device before padding it, so the graph computes on the
# device and its gradient flows back to the host shard through that copy's backward. Under blocks
# compiled as frames the copy is not the graph's: the post-grad pass that makes a group's all-gather
# the runtime's frame_all_gather (passes/recompute.gather_frames_through_prefetch) hands it the host
# shard, and the runtime copies it to the device as it issues the all-gather (frames.py:
# _issue_frame_all_gather), so ahead of use where the block before prefetches it. The copy, the
# copy-in and the all-gather go in that order on the stream the graph runs on, so the copy-in never
# reads a device copy before it landed. That holds for each block and, routed as a group kept
# gathered (KEEPS_GATHERED_KEY, [Note: keeping parameters gathered across a backward] in
# kept_gathers.py), for an offloaded group outside blocks. A block's reduced gradient goes to the
# runtime too (late delivery), whose copy-out writes the host gradient as eagerly; where a gradient
# comes out of the graph (the root's, or any over one rank) its copy back to the host is the graph's,
# a blocking copy, done before autograd accumulates it. Those copies back being blocking, no copy of a
# host shard is still in flight once backward returns, when the optimizer steps the shards on the
# CPU (eagerly, copies into pinned memory are waited on instead: [Note: offloaded gradients are read
# by the host] in runtime/state.py). Elsewhere (regions, inline, fullgraph=True)
# the all-gather and the copy would be graph nodes, with no prefetch: refused (compile/policy.py).


_TRACED_PARAMS_ATTR = "_fsdp_compile_traced_params"
# The traced-read class of each (user class, parameter names): a process-wide cache of classes, made once each.
_property_classes: dict[tuple[type, frozenset[str]], type] = {}


def _param_property(name: str) -> property:
    def read(module: torch.nn.Module) -> torch.Tensor:
        fsdp_param, state, first_place = module.__dict__[_TRACED_PARAMS_ATTR][name]
        if (state.per_block_compiled or config.block_compile_is("frames")) and state.training_state is not TrainingState.IDLE:
            # FSDP2's recipe: the eager hooks around the block's graph registered the unsharded
            # parameter (so did hooks Dynamo ran eagerly around a frame of blocks compiled as frames).
            # IDLE: a compiled caller traced this block with its hooks standing aside (the whole model
            # compiled over compiled blocks), so its reads trace the unshard below.
            return module._parameters[name]
        if torch.compiler.is_compiling() and not config.skip_fsdp_hooks and state.compiles_as_frame:
            # A block compiled as a frame holds its sharded Parameters (only a region's body holds
            # other tensors): not read, they cost its frame no guards ([Note: a block frame's guards]
            # in compiled_state.py).
            return state.traced_unshard([fsdp_param], first_place=first_place)[0]
        registered = module._parameters[name]
        if not isinstance(registered, torch.nn.Parameter):  # a block region's input, see module.py
            return registered
        if torch.compiler.is_compiling():
            if config.skip_fsdp_hooks:
                return registered
            if state.gathers_once_across_frames:
                return state.unsharded_across_frames(fsdp_param)
            return state.traced_unshard([fsdp_param], first_place=first_place)[0]
        if state.outermost().frames_forward_running:
            return _read_eagerly(state, fsdp_param, registered)
        return registered

    return property(read, doc=f"FSDP-managed parameter '{name}' (see [Note: parameter reads under torch.compile])")


@torch._dynamo.disable(recursive=True)
def _read_eagerly(state: "FSDPState", fsdp_param: "FSDPParam", registered: torch.Tensor) -> torch.Tensor:
    # A read that runs eagerly under a compiled model (Dynamo gave up on its frame, or skips this
    # property's code: a frame of it compiled to no graph before, under the eager fallback) is not
    # compiled piecewise either: its frames would split the group's gather over several graphs.
    if state.reads_across_frames_eagerly():
        # The model runs compiled: what a graph gathered before it, or the group gathered in a small
        # graph of its own (bucketed as the model's graphs are).
        return state.unsharded_across_frames(fsdp_param)
    return registered


def _assign_managed(module: torch.nn.Module, name: str, value: object) -> None:
    """``module.<name> = value``: a managed parameter's new value is sharded in place of the old one
    (``FSDPParam.replace_sharded_param``), so eager and compiled runs both see it."""
    managed = module.__dict__.get(_TRACED_PARAMS_ATTR, {})
    if name in managed and isinstance(value, torch.Tensor):
        fsdp_param, _, _ = managed[name]
        fsdp_param.replace_sharded_param(value)
        return
    type(module)._fsdp_compile_property_base.__setattr__(module, name, value)


def install_traced_param_access(module: torch.nn.Module, name: str, fsdp_param: "FSDPParam", state: object) -> None:
    """Route ``module.<name>`` through the property above; see [Note: parameter reads under torch.compile].

    ``state`` (the parameter's ``FSDPState``) builds the traced unshard from the group's settings at
    trace time, so Dynamo guards on them: a changed setting recompiles.
    """
    managed = module.__dict__.setdefault(_TRACED_PARAMS_ATTR, {})
    # Whether this is the parameter's first registered name, the one read that adds the no-sync sum (a
    # tied parameter is read once per name): a fact of fully_shard's references, kept here so that a
    # traced read guards on one flag, not on the references ([Note: a block frame's guards] in compiled_state.py).
    first = fsdp_param.refs[0]
    managed[name] = (fsdp_param, state, first.module is module and first.name == name)
    base = type(module)
    if getattr(base, "_fsdp_compile_property_base", None) is not None:
        base = base._fsdp_compile_property_base
    key = (base, frozenset(managed))
    if key not in _property_classes:
        namespace = {param_name: _param_property(param_name) for param_name in managed}
        namespace["_fsdp_compile_property_base"] = base
        namespace["__setattr__"] = _assign_managed
        namespace["__module__"] = base.__module__
        namespace["__qualname__"] = base.__qualname__
        # Same name as the user's class: printed models and error messages stay familiar.
        _property_classes[key] = type(base.__name__, (base,), namespace)
    module.__class__ = _property_classes[key]
