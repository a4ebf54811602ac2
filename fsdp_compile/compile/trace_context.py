"""Where am I traced? Predicates that code run while Dynamo traces asks of the trace: by which backend,
inside a caller's higher-order op, without graph breaks, in a block's frame, under compiled autograd.

Each is kept by Dynamo as a constant of the trace (``assume_constant_result``), so a graph never
guards on them; eagerly (outside a trace) each answers False.
"""
from __future__ import annotations

import os
import sys
import types
import warnings
import weakref
from typing import Any, Callable

import torch

from fsdp_compile import config

__all__ = [
    "mark_fsdp_backend", "traced_for_an_fsdp_backend", "traced_without_graph_breaks", "traced_in_a_callers_higher_order_op",
    "traced_under_compiled_autograd", "traced_in_a_block_frame", "traced_in_a_block_call_frame", "is_block_frame_code", "inside_a_compiled_call",
    "compiled_call_may_break_graphs",
    "MODULE_FILE", "note_block_frame_entered", "block_frame_in_trace", "call_forward_breaking_at_block_frames", "call_with_forwards_not_traced",
    "inside_a_forward_breaking_at_block_frames", "copy_dynamo_skips", "names_a_checkpoint",
]

# Set on each of our backends (see traced_for_an_fsdp_backend).
_FSDP_BACKEND_ATTR = "_fsdp_compile_backend"
# The other backends a user was told of, once per process.
_warned_backends: set[str] = set()


def mark_fsdp_backend(backend: Callable[..., Any]) -> Callable[..., Any]:
    setattr(backend, _FSDP_BACKEND_ATTR, True)
    return backend


def _dynamo_tracer() -> Any:
    """Dynamo's tracer of the frame being traced, or None outside its trace (make_fx, export of a
    traced graph, eager code)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx()
    except Exception:
        return None


@torch._dynamo.assume_constant_result
def traced_without_graph_breaks() -> bool:
    """Read while Dynamo traces: whether this trace may not break the graph (``fullgraph=True``,
    ``torch._dynamo.error_on_graph_break``). Blocks compiled as frames break it at each block, so
    under such a trace they are regions instead ([Note: blocks compiled as frames] in frames.py)."""
    tx = _dynamo_tracer()
    return tx is not None and bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))


# FSDPModule.forward and the FSDP class's __call__, whose resume functions are the block frames.
MODULE_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "module.py")


@torch._dynamo.assume_constant_result
def traced_in_a_callers_higher_order_op() -> bool:
    """Read while Dynamo traces a block's call: whether it is traced inside the body of a higher-order
    op of a frame other than a block frame's own (``checkpoint(block, x)``, as Hugging Face's gradient
    checkpointing calls its layers), where the graph may not break: that block is compiled in its
    caller's graph, as a region, not as a frame of its own ([Note: blocks compiled as frames] in
    frames.py). A block frame's own higher-order ops (a checkpointed body) do not count."""
    tx = _dynamo_tracer()
    if tx is None or tx.output.current_tracer.parent is None:
        return False
    return not is_block_frame_code(tx.output.root_tx.f_code)


@torch._dynamo.assume_constant_result
def traced_under_compiled_autograd() -> bool:
    """Read while Dynamo traces a block frame's parameter reads: whether compiled autograd will trace
    the backward (``torch._dynamo.config.compiled_autograd`` was set as the compiled call began). It
    traces the whole backward into one graph of its own, not the frames' backward graphs that the
    late hand-over pass rewrites, so a late delivery would only add a copy into ``.grad`` per
    parameter there: the frames' reductions return their gradients instead ([Note: late
    reduce-scatter wait across block frames] in frames.py). Kept as a constant: a graph traced with
    it off and run under compiled autograd (or the reverse) still delivers correctly."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.compiled_autograd_enabled)


# Dynamo's resume functions of a block frame's graph break: in FSDPModule.forward, or in the FSDP
# class's __call__ ([Note: a block that checkpoints itself in __call__] in regions.py).
_BLOCK_FRAME_RESUME_NAMES = ("torch_dynamo_resume_in_forward", "torch_dynamo_resume_in__call_entering_block_frame")


def is_block_frame_code(code: Any) -> bool:
    """Whether ``code`` is the rest of a block's forward (or __call__) after its frame's graph break:
    Dynamo's resume function of FSDPModule.forward (or of the FSDP class's __call__), named after it,
    in the same file."""
    return code.co_filename == MODULE_FILE and code.co_name.startswith(_BLOCK_FRAME_RESUME_NAMES)


@torch._dynamo.assume_constant_result
def traced_in_a_block_frame() -> bool:
    """Read while Dynamo traces: whether the frame being traced is a block's frame (the rest of its
    forward or __call__ after the graph break), which runs right after that block's eager entry
    (``enter_block_frame`` in frames.py), so what the entry found holds in it."""
    tx = _dynamo_tracer()
    return tx is not None and is_block_frame_code(tx.output.root_tx.f_code)


@torch._dynamo.assume_constant_result
def traced_in_a_block_call_frame() -> bool:
    """Read while Dynamo traces: whether the frame being traced is a block's frame entered in its
    class's ``__call__`` ([Note: a block that checkpoints itself in __call__] in regions.py), where the
    block's forward runs its body as it is."""
    tx = _dynamo_tracer()
    if tx is None:
        return False
    root_code = tx.output.root_tx.f_code
    return root_code.co_filename == MODULE_FILE and root_code.co_name.startswith(_BLOCK_FRAME_RESUME_NAMES[1])


@torch._dynamo.assume_constant_result
def traced_for_an_fsdp_backend() -> bool:
    """Read while Dynamo traces FSDP parameter reads: whether the graph goes to one of our backends.

    Only those check the graph (settings it cannot honour refused, the ranks' collectives compared:
    ``check_parameters_read``, ``check_collectives_match_across_ranks``), run the passes, and
    compile nested block regions correctly: ``fsdp_inductor`` turns off Inductor's buffer reuse in
    graphs holding them ([Note: Inductor's buffer reuse across nested regions] in backend.py); under
    torch.compile's own ``backend="inductor"`` a model of region calls got gradients off by 2 to 25
    times (a 2-block Transformer, silently). Under another backend every block is traced inline, as
    with ``config.block_compile = "inline"``, and the user is told once what that backend skips.
    Dynamo runs this at trace time and keeps the answer as a constant; its own guard on the backend
    recompiles for another backend.
    """
    tx = _dynamo_tracer()
    if tx is None:
        return False
    wrapper = tx.output.compiler_fn
    while hasattr(wrapper, "_torchdynamo_orig_backend"):  # Dynamo's debug and error-catching wrappers
        wrapper = wrapper._torchdynamo_orig_backend
    backend = getattr(wrapper, "compiler_fn", wrapper)  # torch.compile's wrapper of a named backend
    if getattr(backend, _FSDP_BACKEND_ATTR, False):
        return True
    name = str(getattr(wrapper, "compiler_name", None) or getattr(backend, "__name__", type(backend).__name__))
    if name not in _warned_backends:
        _warned_backends.add(name)
        warnings.warn(
            f"fsdp_compile: torch.compile(backend={name!r}) traces this model's FSDP all-gathers and reduce-scatters "
            "as opaque ops, without fsdp_inductor's checks (a setting the graph cannot honour is not refused, the "
            "ranks' graphs are not compared), its graph passes, or its compile-once blocks. Use "
            "backend='fsdp_inductor'; or, to run the FSDP hooks eagerly around compiled code as PyTorch FSDP2 does, "
            "compile each block (block.compile()) or set fsdp_compile.config.skip_fsdp_hooks = True.",
            stacklevel=2,
        )
    return False


def inside_a_compiled_call() -> bool:
    """Whether this eager code runs inside a torch.compile'd call, in a frame Dynamo did not compile:
    one it gave up on, or one whose code it skips for good because an earlier trace of it held no op
    (the eager fallback's hooks, which stand aside when traced, leave that mark on code every model
    shares). The model runs compiled there, even before any of its own graphs said so."""
    return bool(torch._C._dynamo.eval_frame.get_eval_frame_callback())


def compiled_call_may_break_graphs(callback: Any) -> bool:
    """Eagerly: whether Dynamo's frame ``callback`` (``get_eval_frame_callback()`` in the compiled
    call) may break its graphs (not ``fullgraph=True`` nor ``error_on_graph_break``), where a hook
    traced as a frame of its own takes the block-frame form ([Note: hook frames under block frames]
    in compiled_state.py). Where torch keeps the callback in another form, False (the hook's frame
    is then compiled, as before)."""
    if not callback or torch._dynamo.utils._get_error_on_graph_break():
        return False
    convert = getattr(getattr(callback, "_torchdynamo_orig_backend", None), "_inner_convert", None)
    if getattr(convert, "_one_graph", True):
        return False
    box = getattr(convert, "_box", None)
    return not getattr(box, "error_on_graph_break", None)


# The block whose frame Dynamo traces next (set eagerly as a block frame is entered): a block frame's
# graph, shared by every block of its structure, carries no block's identity. Dynamo traces one frame
# at a time in a process, so one reference serves every model.
_block_frame_in_trace: "weakref.ref[Any] | None" = None


def note_block_frame_entered(state: Any) -> None:
    global _block_frame_in_trace
    _block_frame_in_trace = weakref.ref(state)


def block_frame_in_trace() -> Any:
    """The block whose frame was entered last (``enter_block_frame`` in frames.py), if it is alive."""
    return _block_frame_in_trace() if _block_frame_in_trace is not None else None


def call_forward_breaking_at_block_frames(module: Any, fsdp_class: type, args: tuple, kwargs: dict) -> Any:
    """``module``'s own forward (the class under ``fsdp_class``), which compiled_state's
    ``forward_in_a_frame_of_its_own`` runs with its own frame skipped by Dynamo and the frames it
    calls compiled ([Note: a forward that breaks at its blocks' frames] in compiled_state.py). Where
    graphs outside blocks run eagerly, the forward itself is not traced either
    (``CompiledFSDPState.forward_not_traced``)."""
    return _forward_to_call(module, fsdp_class)(*args, **kwargs)


@torch._dynamo.disable(recursive=True)  # bookkeeping, not a frame of its own to trace
def _forward_to_call(module: Any, fsdp_class: type) -> Callable[..., Any]:
    forward = super(fsdp_class, module).forward
    state_of = getattr(module, "_fsdp_state", None)
    if state_of is not None and config.graphs_outside_blocks_is("eager"):
        return state_of().forward_not_traced(forward)
    return forward


def call_with_forwards_not_traced(forward: Callable[..., Any], plain_forwards: tuple[tuple[Any, Any], ...], *args: Any, **kwargs: Any) -> Any:
    """``forward(*args, **kwargs)`` with each module of ``plain_forwards`` calling, for the call's
    duration, its paired method (a copy Dynamo skips) as its forward: an instance attribute that
    ``nn.Module.__call__`` finds before the class's, set only where the module has none, and removed
    after, so the module is as the user left it outside the call (pickled, copied, called elsewhere)."""
    installed = []
    try:
        for module, untraced in plain_forwards:
            if "forward" not in module.__dict__:
                module.__dict__["forward"] = untraced
                installed.append(module)
        return forward(*args, **kwargs)
    finally:
        for module in installed:
            module.__dict__.pop("forward", None)


torch._dynamo.eval_frame.skip_code(call_with_forwards_not_traced.__code__)  # eager bookkeeping around untraced frames


def copy_dynamo_skips(function: types.FunctionType) -> types.FunctionType:
    """``function`` with a code object of its own, whose frames Dynamo runs without tracing them (the
    frames they call it still traces): ``function`` itself, called elsewhere, is traced as before. A
    decorator's wrapper (``functools.wraps``: Hugging Face's ``can_return_tuple`` on its forwards) is
    copied with the function it wraps, where it holds it in its closure, so neither frame is traced."""
    closure = function.__closure__
    wrapped = getattr(function, "__wrapped__", None)
    if closure and isinstance(wrapped, types.FunctionType):
        closure = tuple(types.CellType(copy_dynamo_skips(wrapped)) if _holds(cell, wrapped) else cell for cell in closure)
    copy = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__ = function.__qualname__
    copy.__dict__.update(function.__dict__)
    torch._dynamo.eval_frame.skip_code(copy.__code__)
    return copy


def names_a_checkpoint(function: types.FunctionType) -> bool:
    """Whether ``function``'s code (its nested functions' and, under ``functools.wraps``, the wrapped
    functions' included, down the chain copy_dynamo_skips copies) names anything with "checkpoint" in its
    name: ``checkpoint(...)``, ``torch.utils.checkpoint.checkpoint``, Hugging Face's
    ``self._gradient_checkpointing_func``."""
    codes = []
    while isinstance(function, types.FunctionType):
        codes.append(function.__code__)
        function = getattr(function, "__wrapped__", None)
    while codes:
        code = codes.pop()
        if any("checkpoint" in name for name in (*code.co_names, *code.co_freevars)):
            return True
        codes.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return False


def _holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def inside_a_forward_breaking_at_block_frames() -> bool:
    """Whether this call runs inside such a forward: whether a frame of
    ``call_forward_breaking_at_block_frames`` is on the call stack. Read off the stack, not a flag, so a
    forward that an exception ended leaves nothing behind, on any rank."""
    code = call_forward_breaking_at_block_frames.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
