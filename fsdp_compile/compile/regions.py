"""Blocks as nested compile regions: one graph for the whole model, each block's body traced once
for every identical block (docs/design.md section 5.5), and the block forms that checkpoint
(Hugging Face's layers, PyTorch's composable checkpoint) under a compiled model.

The region call itself (``_block_region`` in module.py) sits beside ``FSDPModule.forward``, whose
class it needs; what decides how a region is called, and the notes it relies on, are here.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn

from fsdp_compile import config
from fsdp_compile.runtime.structures import tensors_in

__all__ = [
    "takes_flat_arguments", "reuse_marker", "may_checkpoint_itself", "take_over_composable_checkpoint", "checkpointed",
    "COMPOSABLE_CHECKPOINT_ATTR",
]


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


# [Note: a block region's flat arguments]
# Before Dynamo reuses a traced body it fingerprints the region call's inputs. Inputs that are all
# tensors, modules or constants, positional, take its fast path; any container (the list of unsharded
# parameters, the args tuple, the kwargs dict) makes it flatten them by tracing torch's Python pytree,
# about 1,750 bytecode steps per block (28% of Dynamo's steps for the 16-layer benchmark model).
# A block called with positional tensors only (``layer(h, cos, sin)``) therefore enters a second
# region whose inputs are the block, the parameter count and the tensors, all flat; it runs the same
# body. Other calls (keyword arguments, nested or non-tensor arguments, a symbolic size that needs
# the marker of [Note: where Dynamo's body reuse stops]) keep the general region.

def takes_flat_arguments(args: tuple, kwargs: dict) -> bool:
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
#    it is traced inline, as with ``config.block_compile = "inline"`` (correct, one graph,
#    compiled per block).
class _TraceOnItsOwn:
    """Passed to a block region: Dynamo does not reuse a traced body across calls taking one."""


_TRACE_ON_ITS_OWN = _TraceOnItsOwn()


def reuse_marker(args: tuple, kwargs: dict) -> object:
    """``None`` (reuse the traced body) or the marker; see [Note: where Dynamo's body reuse stops]."""
    symbolic = any(_has_symbolic_size(tensor) for tensor in tensors_in((args, kwargs)))
    return _TRACE_ON_ITS_OWN if symbolic else None


# [Note: a block whose body graph-breaks]
# Dynamo refuses a graph break inside a nested compile region outright (UncapturedHigherOrderOpError:
# torch 2.11 to 2.14 give invoke_subgraph no fallback), so a block whose forward breaks (a print, a
# data-dependent .item() branch, an unsupported call) would crash a whole-model compile that traces
# the same block inline without trouble. For our block region alone, Dynamo is let to do what it does
# for a break anywhere else: break the graph at the region's call, run that call eagerly and compile
# the frames inside it on their own. The block then runs as an inlined block with a graph break does
# (its parameters gathered in the graph before the break, read as plain tensors after it), which
# trains like eager (tests/test_compile_blocks.py); it is not compiled once for all blocks.


# [Note: a block that checkpoints itself in __call__]
# Hugging Face's decoder layers (GradientCheckpointingLayer) checkpoint themselves under
# gradient_checkpointing_enable(): in 4.x in their own __call__
# (checkpoint(partial(nn.Module.__call__, layer), ...)), in 5.x in their forward, which the class
# wraps for every subclass, our FSDP class included (checkpoint(FSDPModule.forward, ...)). Either way
# our forward runs inside the checkpoint's higher-order op, where a block frame's graph break cannot
# happen, and every such block compiled as a region of its caller's graph, whose compile time grows
# with depth (transformers 5.24's Llama: one backward graph holding every layer's reduce-scatter). For
# such a class (may_checkpoint_itself), the FSDP class enters the block's frame in __call__ instead,
# before the user's __call__ (and the checkpoint) runs: the frame's graph then holds the checkpoint,
# the forward and the parameter reads inside it, as for a block that checkpoints inside its forward
# (torchtitan's recipe). The forward, reached inside that frame
# (trace_context.traced_in_a_block_call_frame), runs the body as it is. A frame Dynamo runs eagerly runs the
# user's __call__ eagerly, whose forward takes the eager hooks ([Note: frames Dynamo runs eagerly] in module.py).
def may_checkpoint_itself(cls: type) -> bool:
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
# so checkpointed (take_over_composable_checkpoint, at fully_shard: its own call's or, checkpointed
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
COMPOSABLE_CHECKPOINT_ATTR = "_fsdp_compile_composable_checkpoint"
_COMPOSABLE_CHECKPOINT_HOOKS = ("checkpoint.<locals>.forward_pre_hook", "checkpoint.<locals>.forward_hook")


def take_over_composable_checkpoint(module: nn.Module) -> None:
    """If ``torch.distributed._composable.checkpoint`` was applied to ``module``: let its hooks stand
    aside under Dynamo and keep its options for the traced forward's checkpoint."""
    try:
        from torch.distributed._composable import checkpoint_activation
        from torch.distributed._composable.contract import _get_registry
    except ImportError:
        return
    registry = _get_registry(module)
    if not registry or "checkpoint" not in registry or COMPOSABLE_CHECKPOINT_ATTR in module.__dict__:
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
        module.__dict__[COMPOSABLE_CHECKPOINT_ATTR] = options


def _standing_aside_when_traced(pre_hook: Callable[..., Any]) -> Callable[..., Any]:
    def composable_checkpoint_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if torch.compiler.is_compiling() and not config.skip_fsdp_hooks:
            return None  # the traced forward checkpoints itself: checkpointed
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


def checkpointed(module: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``forward(*args, **kwargs)`` in torch.utils.checkpoint with the options of the composable
    checkpoint on ``module``: see [Note: PyTorch's composable checkpoint, compiled]."""
    from torch.utils.checkpoint import checkpoint

    options = module.__dict__[COMPOSABLE_CHECKPOINT_ATTR]
    if kwargs:
        forward = functools.partial(forward, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **options)
