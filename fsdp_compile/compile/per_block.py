"""Per-block compile: every way a user compiles one block (``block.compile()``, ``torch.compile(block)``
before or after ``fully_shard``) made one form, the block's forward compiled alone with its FSDP
hooks eager around it, as with PyTorch FSDP2 (docs/design.md section 5.6).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from fsdp_compile.runtime.state import state_of

if TYPE_CHECKING:
    from fsdp_compile.compile.compiled_state import CompiledFSDPState

__all__ = ["compile_blocks_forward_alone", "compile_forward_alone", "compiled_before_sharding"]


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
# compile, around the compiled block (compiled_before_sharding).
def compile_blocks_forward_alone(modules: tuple[nn.Module, ...], states: list[CompiledFSDPState]) -> None:
    """See [Note: every way of compiling a block, one form]."""
    for state in states:
        if not state.has_outer:
            continue
        for block in state.modules:
            if block._compiled_call_impl is not None:
                context = _dynamo_context_of(block._compiled_call_impl, state.label)
                block._compiled_call_impl = None
                compile_forward_alone(block, context)
    for root in modules:
        for wrapper in root.modules():
            block = getattr(wrapper, "_orig_mod", None) if compiled_before_sharding(wrapper) else None
            state = state_of(block) if isinstance(block, nn.Module) else None  # a fully_shard module
            if state is not None and state.has_outer and block.__dict__.get("forward") is None:
                compile_forward_alone(block, wrapper.dynamo_ctx)
                wrapper.forward = block.__call__  # the wrapper now calls the block, whose forward is compiled


def compile_forward_alone(block: nn.Module, context: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
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


def compiled_before_sharding(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(block)`` (torchtitan's ``apply_compile`` runs before
    ``fully_shard``): its forward is the compiled block, and the FSDP hooks run eagerly around it."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)
