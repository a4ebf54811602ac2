"""The ``fsdp_inductor`` torch.compile backend: AOTAutograd + Inductor with our graph passes.

Registered on ``import fsdp_compile`` and through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="fsdp_inductor")`` works right after ``pip install``.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import warnings
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

try:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn as _CustomPartitionerFn
except ImportError:  # a torch without Inductor's partitioner hook
    _CustomPartitionerFn = None

from fsdp_compile.compile.graph_check import check_collectives_match_across_ranks
from fsdp_compile.compile.unreached import GradientDelivery, forget_unreached_gradients, output_reach

__all__ = ["fsdp_inductor", "fsdp_inductor_with", "fsdp_aot_eager", "observe_graphs", "traced_for_an_fsdp_backend"]

_PASS_VERSION = "fsdp_compile-recompute-v1"
_POST_GRAD_VERSION = "fsdp_compile-bucket-reorder-v3"
_PARTITION_VERSION = "fsdp_compile-saved-values-in-runtime-order-v1"


_graph_observers: list[Callable[[str, fx.GraphModule], None]] = []


@contextlib.contextmanager
def observe_graphs() -> Iterator[list[tuple[str, fx.GraphModule]]]:
    """Collect ("joint" | "forward" | "backward", graph) as the fsdp backends produce them (compile
    caches are off while it is open, so every graph is produced).

    Example::

        with observe_graphs() as graphs:
            torch.compile(model, backend="fsdp_aot_eager")(x).sum().backward()
        forward = next(g for kind, g in graphs if kind == "forward")
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    seen: list[tuple[str, fx.GraphModule]] = []
    observer = lambda kind, gm: seen.append((kind, gm))  # noqa: E731
    _graph_observers.append(observer)
    try:
        # A graph served from Inductor's or AOTAutograd's cache skips the passes that report it.
        with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), functorch_config.patch(enable_autograd_cache=False):
            yield seen
    finally:
        _graph_observers.remove(observer)


def _notify(kind: str, gm: fx.GraphModule) -> None:
    for observer in _graph_observers:
        observer(kind, gm)


# [Note: a backend failure Dynamo turns into eager code]
# Dynamo (torch 2.13) does not raise every error of a backend: a fake-tensor error (a data-dependent
# ``.item()``, an unsupported operator; torch's ``exceptions_allowed_to_be_fallback``) becomes a
# graph break that runs the frame eagerly, logged only under TORCH_LOGS=graph_breaks. For a whole
# FSDP model that means the whole step runs eagerly (with the eager hooks, so it still trains
# right) while the user believes it compiled; the eager hooks' own warning names only the modules.
# So the fsdp backends say it, once per graph, naming the error, and let Dynamo go on as it does.
# The tests turn that warning into an error (pyproject.toml, tests/conftest.py): in the whole suite
# no compiled test quietly ran eagerly, besides the one that makes its backend fail on purpose.
_FALLBACK_ERRORS = getattr(
    torch._dynamo.exc, "exceptions_allowed_to_be_fallback",
    (torch._subclasses.fake_tensor.DataDependentOutputException, torch._subclasses.fake_tensor.DynamicOutputShapeException,
     torch._subclasses.fake_tensor.UnsupportedOperatorException),
)


# What torch 2.13's invoke_subgraph says of a region body that writes a buffer or input in place.
_REGION_WRITES_IN_PLACE = "does not currently support training with in-place input or buffer mutations"


@contextlib.contextmanager
def _said_when_dynamo_falls_back(backend: str) -> Iterator[None]:
    """See [Note: a backend failure Dynamo turns into eager code]; a block region whose body writes
    in place (a buffer the forward updates) gets the way out."""
    try:
        yield
    except _FALLBACK_ERRORS as error:  # RuntimeErrors too: this clause goes first
        graph = torch._guards.CompileContext.current_compile_id()
        warnings.warn(
            f"fsdp_compile: {backend} could not compile graph {graph} ({type(error).__name__}: {error}). Dynamo runs "
            "that code eagerly instead; fsdp_compile's eager hooks gather and reduce the parameters of each module in "
            "it, so training stays correct, but it is not compiled. TORCH_LOGS=graph_breaks shows where it failed.",
        )
        raise
    except RuntimeError as error:
        if _REGION_WRITES_IN_PLACE not in str(error):
            raise
        raise RuntimeError(
            f"fsdp_compile: {backend}: a fully_shard block's forward writes one of its buffers or inputs in place while "
            "training, which a block compiled once for all identical blocks (a nested compile region) cannot do under "
            "this torch's autograd (BatchNorm's running statistics are recognised and traced inline). Set "
            "fsdp_compile.config.compile_blocks_once = False to trace every block inline, or compile each block on its "
            "own (block.compile())."
        ) from error


def _tag_recompute(graph: fx.Graph) -> None:
    from fsdp_compile.passes.recompute import tag_reshard_after_forward_for_recompute

    tag_reshard_after_forward_for_recompute(graph)
    _notify("joint", graph.owning_module)


class _RecomputeReshardedParams(CustomGraphPass):
    """Inductor joint-graph hook around ``passes.recompute``; the uuid keeps FX-graph caching valid."""

    def __call__(self, graph: fx.Graph) -> None:
        _tag_recompute(graph)

    def uuid(self) -> Any:
        return f"{_PASS_VERSION}:{_traced_code_version()}"


# [Note: saved RNG states before opaque objects]
# AOTAutograd's runtime reads the values a forward saves for backward in this order: tensors,
# opaque objects, symints. torch 2.13's partitioner appends a checkpointed region's RNG states
# (``functionalize_rng_ops``, saved even with ``preserve_rng_state=False``) after the opaque
# objects instead. A graph saving both failed at its first step with "expected all
# tensors_saved_with_vc_check to be Tensors": a block traced inline under activation checkpointing
# saves RNG states, and the root parameter's DeviceMesh (an opaque graph input the backward needs
# to rebuild its DTensor gradient). After partitioning, the saved values of both graphs are put in
# the order the runtime reads them. The backward takes the symints first, then the other saved
# values in the forward's order; where a graph is laid out otherwise, it is left as torch made it.
def _saved_values_in_runtime_order(forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int) -> None:
    from torch.fx.experimental.proxy_tensor import is_sym_node

    try:  # what the runtime counts as an opaque object
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    except ImportError:
        return

    def runtime_rank(node: fx.Node) -> int:
        if is_sym_node(node):
            return 3
        if is_opaque_node(node):
            return 2
        return 1 if node.meta.get("saved_tensor_with_no_vc_check", False) else 0

    output = next(iter(forward.graph.find_nodes(op="output")))
    outputs = list(output.args[0])
    saved = outputs[num_fwd_outputs:]
    ranks = [runtime_rank(node) for node in saved]
    order = sorted(range(len(saved)), key=ranks.__getitem__)
    if order == list(range(len(saved))):
        return
    not_symints = [node for node, rank in zip(saved, ranks) if rank != 3]
    placeholders = list(backward.graph.find_nodes(op="placeholder"))
    num_symints = len(saved) - len(not_symints)
    taken = placeholders[num_symints : num_symints + len(not_symints)]
    if len(taken) != len(not_symints) or any(
        placeholder.name != node.name and not placeholder.name.startswith("rng_state_output")
        for placeholder, node in zip(taken, not_symints)
    ):
        return
    reordered = [saved[i] for i in order]
    output.args = (type(output.args[0])(outputs[:num_fwd_outputs] + reordered),)
    descriptions = output.meta.get("desc")
    if isinstance(descriptions, list) and len(descriptions) == len(outputs):
        output.meta["desc"] = descriptions[:num_fwd_outputs] + [descriptions[num_fwd_outputs + i] for i in order]
    placeholder_of = dict(zip(not_symints, taken))
    after_taken = taken[-1].next
    for node in reordered:
        if node in placeholder_of:
            after_taken.prepend(placeholder_of[node])
    forward.recompile()
    backward.recompile()


def _partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut partition, its saved values in the order the runtime reads them."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    _saved_values_in_runtime_order(forward, backward, kwargs["num_fwd_outputs"])
    return forward, backward


if _CustomPartitionerFn is not None:

    class _RuntimeOrderedPartitioner(_CustomPartitionerFn):
        """Inductor's partitioner hook around ``_partition``. A module-level class: Inductor's cache
        key pickles the config holding it."""

        def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> Any:
            return _partition(gm, joint_inputs, **kwargs)

        def uuid(self) -> Any:
            return _PARTITION_VERSION


def _runtime_ordered_partitioner() -> Any:
    """The partitioner hook's object; None where this torch has no such hook."""
    return None if _CustomPartitionerFn is None else _RuntimeOrderedPartitioner()


@functools.cache
def _traced_code_version() -> str:
    """A hash of traceable.py. AOTAutograd's cache keys a graph by Dynamo's, where each traced
    all-gather is one op whose decomposition and backward formula live in traceable.py (see
    [Note: the traced all-gather is one op]): a changed formula must miss the cache."""
    from fsdp_compile.compile import param_reads

    # The file the module was loaded from: its source, or its compiled file where none shipped.
    with open(param_reads.__file__, "rb") as loaded:
        return hashlib.sha256(loaded.read()).hexdigest()[:16]


class _PostGradPasses(CustomGraphPass):
    """Inductor post-grad hook running ``passes.bucket`` / ``passes.reorder`` on the forward and the
    (possibly lazily compiled) backward; the config is captured when the backend is called, and the
    uuid carries it so a cached graph compiled under other knobs is never reused."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __call__(self, graph: fx.Graph) -> None:
        from fsdp_compile.passes import apply_post_grad_passes

        gm = graph.owning_module
        apply_post_grad_passes(gm, self.config)
        _notify(_kind(gm), gm)

    def uuid(self) -> Any:
        return f"{_POST_GRAD_VERSION}:{self.config!r}"


def _kind(gm: fx.GraphModule) -> str:
    from fsdp_compile.passes.graph import graph_kind

    return graph_kind(gm)


# Inductor's own collective bucketing / reordering stay off: only our passes place collectives
# (docs/design.md section 5.2). Several of these are off by default today; pinning them keeps a global
# torch._inductor.config change from reordering collectives differently per rank.
INDUCTOR_COMM_PASSES_OFF: dict[str, Any] = {
    "reorder_for_compute_comm_overlap": False,
    "bucket_all_gathers_fx": "none",
    "bucket_reduce_scatters_fx": "none",
    "bucket_all_reduces_fx": "none",
    "dedup_reduce_scatters": False,
    "_fuse_ddp_communication": False,
    "_micro_pipeline_tp": False,
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "aten_distributed_optimizations.collective_bucketing": False,
    "aten_distributed_optimizations.allow_comms_decompositions": False,
    "aten_distributed_optimizations.enable_low_contention_collectives": False,
}


def refuse_tensor_parallel_graphs(example_inputs: Sequence[Any]) -> None:
    """A graph that takes a tensor-parallel parameter's *unsharded* DTensor (the eager fallback's and
    per-block compile's graphs read it; the whole-model graph gathers from the sharded one) is
    refused: those paths do not compose with tensor parallelism yet."""
    from fsdp_compile.runtime.state import live_states

    tensor_parallel = {
        id(fsdp_param._unsharded_param): fsdp_param.fqn
        for state in live_states() if state.group is not None
        for fsdp_param in state.group.fsdp_params
        if fsdp_param.tensor_parallel is not None and fsdp_param._unsharded_param is not None
    }
    read = [tensor_parallel[id(value)] for value in example_inputs if id(value) in tensor_parallel]
    if read:
        raise NotImplementedError(
            f"fsdp_inductor: the graph reads the unsharded tensor-parallel DTensor parameter '{read[0]}' (the eager "
            "fallback, config.skip_fsdp_hooks, or per-block compile), which does not support tensor parallelism yet. "
            "Compile the whole model with torch.compile(model, backend='fsdp_inductor'), or train eagerly."
        )


# Set on each of our backends (see traced_for_an_fsdp_backend).
_FSDP_BACKEND_ATTR = "_fsdp_compile_backend"
_warned_backends: set[str] = set()


def _fsdp_backend(backend: Callable[..., Any]) -> Callable[..., Any]:
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
    under such a trace they are regions instead ([Note: blocks compiled as frames] in module.py)."""
    tx = _dynamo_tracer()
    return tx is not None and bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))


_MODULE_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "module.py")


@torch._dynamo.assume_constant_result
def traced_in_a_callers_higher_order_op() -> bool:
    """Read while Dynamo traces a block's call: whether it is traced inside the body of a higher-order
    op of a frame other than a block frame's own (``checkpoint(block, x)``, as Hugging Face's gradient
    checkpointing calls its layers), where the graph may not break: that block is compiled in its
    caller's graph, as a region, not as a frame of its own ([Note: blocks compiled as frames] in
    module.py). A block frame's own higher-order ops (a checkpointed body) do not count."""
    tx = _dynamo_tracer()
    if tx is None or tx.output.current_tracer.parent is None:
        return False
    return not _is_block_frame_code(tx.output.root_tx.f_code)


@torch._dynamo.assume_constant_result
def traced_under_compiled_autograd() -> bool:
    """Read while Dynamo traces a block frame's parameter reads: whether compiled autograd will trace
    the backward (``torch._dynamo.config.compiled_autograd`` was set as the compiled call began). It
    traces the whole backward into one graph of its own, not the frames' backward graphs that the
    late hand-over pass rewrites, so a late delivery would only add a copy into ``.grad`` per
    parameter there: the frames' reductions return their gradients instead ([Note: late
    reduce-scatter wait across block frames] in module.py). Kept as a constant: a graph traced with
    it off and run under compiled autograd (or the reverse) still delivers correctly."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.compiled_autograd_enabled)


# Dynamo's resume functions of a block frame's graph break: in FSDPModule.forward, or in the FSDP
# class's __call__ ([Note: a block that checkpoints itself in __call__] in module.py).
_BLOCK_FRAME_RESUME_NAMES = ("torch_dynamo_resume_in_forward", "torch_dynamo_resume_in__call_entering_block_frame")


def _is_block_frame_code(code: Any) -> bool:
    """Whether ``code`` is the rest of a block's forward (or __call__) after its frame's graph break:
    Dynamo's resume function of FSDPModule.forward (or of the FSDP class's __call__), named after it,
    in the same file."""
    return code.co_filename == _MODULE_FILE and code.co_name.startswith(_BLOCK_FRAME_RESUME_NAMES)


# [Note: a recompile limit per block structure]
# Every block frame is one code object to Dynamo (the resume function of FSDPModule.forward), so
# torch._dynamo.config.recompile_limit (8 by default) counted the graphs of every block structure
# together: a model whose blocks differ in something their forward reads (a per-layer index or
# scale) compiled its first 8 structures and ran every later block eagerly, with a warning. A model
# traced inline or as regions compiles each. So the limit counts per structure instead: the first
# time a block's frame misses Dynamo's cache (no graph of the blocks before it holds for it), it is a
# structure of its own and the frame code's limit grows by the user's limit; a block that compiled
# before and misses again (a new shape, a train/eval switch) counts as a recompile, as for any code.
# recompile_limit = 1 still runs a block eagerly at its first recompile; accumulated_recompile_limit
# still caps the total. The same holds for blocks compiled alone (block.compile(), torchtitan's
# per-block recipe), whose frames are all FSDPModule.forward's code.
_structures_by_frame_code: dict[Any, int] = {}
# Every code object of module.py Dynamo compiled (FSDPModule.forward, shared by the root and each
# block, and the block frames' resume functions), in order.
_fsdp_frame_codes: dict[Any, None] = {}
_blocks_seen_by_frame_code: "dict[Any, weakref.WeakSet[Any]]" = {}


def _recompile_limit_per_block_structure() -> None:
    """Installs the per-structure limit of [Note: a recompile limit per block structure] around Dynamo's
    frame compile; once per process, a no-op on a torch whose Dynamo lacks the function it wraps."""
    from torch._dynamo import config as dynamo_config, convert_frame

    compile_frame = getattr(convert_frame, "_compile", None)
    if compile_frame is None or getattr(compile_frame, "_fsdp_compile_limit_per_structure", False):
        return

    @functools.wraps(compile_frame)
    def compile_with_a_limit_per_block_structure(code: Any, *args: Any, **kwargs: Any) -> Any:
        if code.co_filename != _MODULE_FILE:
            return compile_frame(code, *args, **kwargs)
        _fsdp_frame_codes[code] = None  # for fsdp_frames_recompile_limit_reached
        block = _block_whose_frame_is_compiled(code, args[1] if len(args) > 1 and isinstance(args[1], dict) else {})
        if block is None:
            return compile_frame(code, *args, **kwargs)
        if not _cache_entries_of(code):  # the first compile, or the first since torch._dynamo.reset()
            _blocks_seen_by_frame_code.pop(code, None)
            _structures_by_frame_code.pop(code, None)
        seen = _blocks_seen_by_frame_code.setdefault(code, weakref.WeakSet())
        if block not in seen:
            seen.add(block)
            _structures_by_frame_code[code] = _structures_by_frame_code.get(code, 0) + 1
        structures = max(1, _structures_by_frame_code.get(code, 0))
        with dynamo_config.patch(recompile_limit=dynamo_config.recompile_limit * structures):
            return compile_frame(code, *args, **kwargs)

    compile_with_a_limit_per_block_structure._fsdp_compile_limit_per_structure = True  # type: ignore[attr-defined]
    convert_frame._compile = compile_with_a_limit_per_block_structure


def _block_whose_frame_is_compiled(code: Any, frame_locals: dict[str, Any]) -> Any:
    """The FSDP state of the block whose frame Dynamo is about to compile, or None: a block frame
    (the resume function of its forward's graph break, entered by that block) or the forward of a
    block compiled alone (block.compile(), torchtitan's per-block recipe)."""
    from fsdp_compile.runtime.state import block_frame_in_trace, state_of

    if _is_block_frame_code(code):
        return block_frame_in_trace()
    module = frame_locals.get("self")
    state = state_of(module) if code.co_name == "forward" and isinstance(module, torch.nn.Module) else None
    return state if state is not None and state.per_block_compiled else None


def fsdp_frames_recompile_limit_reached() -> str | None:
    """Why an FSDP module ran eagerly inside a compiled model, where it is Dynamo's recompile limit,
    reached on FSDPModule.forward's code (the root's and every block's) or on the block frames'
    ([Note: a recompile limit per block structure]): a sentence naming the limit and the way out,
    else None."""
    from torch._dynamo import config as dynamo_config

    for code in list(_fsdp_frame_codes):
        structures = _structures_by_frame_code.get(code)
        graphs = len(_cache_entries_of(code))
        if graphs and graphs >= dynamo_config.recompile_limit * (structures or 1):
            per = f" per block structure, {structures} structure(s)" if structures else ""
            compiled = "the block frames" if _is_block_frame_code(code) else f"FSDPModule.{code.co_name}"
            return (
                f"the recompile limit: the {graphs} graph(s) of {compiled} reached "
                f"torch._dynamo.config.recompile_limit ({dynamo_config.recompile_limit}){per}; each new input shape, "
                "dtype or train/eval switch compiles one more. Raise torch._dynamo.config.recompile_limit, or mark "
                "the varying dimension dynamic, to compile it"
            )
    return None


def _cache_entries_of(code: Any) -> list[Any]:
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return []
    return _debug_get_cache_entry_list(code)


_recompile_limit_per_block_structure()


@torch._dynamo.assume_constant_result
def traced_in_a_block_call_frame() -> bool:
    """Read while Dynamo traces: whether the frame being traced is a block's frame entered in its
    class's ``__call__`` ([Note: a block that checkpoints itself in __call__] in module.py), where the
    block's forward runs its body as it is."""
    tx = _dynamo_tracer()
    if tx is None:
        return False
    root_code = tx.output.root_tx.f_code
    return root_code.co_filename == _MODULE_FILE and root_code.co_name.startswith(_BLOCK_FRAME_RESUME_NAMES[1])


@torch._dynamo.assume_constant_result
def traced_for_an_fsdp_backend() -> bool:
    """Read while Dynamo traces FSDP parameter reads: whether the graph goes to one of our backends.

    Only those check the graph (settings it cannot honour refused, the ranks' collectives compared:
    ``admit_traced_parameters``, ``check_collectives_match_across_ranks``), run the passes, and
    compile nested block regions correctly: ``fsdp_inductor`` turns off Inductor's buffer reuse in
    graphs holding them ([Note: Inductor's buffer reuse across nested regions]); under
    torch.compile's own ``backend="inductor"`` a model of region calls got gradients off by 2 to 25
    times (a 2-block Transformer, silently). Under another backend every block is traced inline, as
    with ``config.compile_blocks_once = False``, and the user is told once what that backend skips.
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


@_fsdp_backend
def fsdp_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None, options: dict[str, Any] | None = None,
) -> Any:
    """Compile a Dynamo graph of an FSDP model: check ranks agree, tag recompute, hand to Inductor
    with our post-grad passes (bucket, reorder; ``fsdp_compile.config.passes`` as it is now) and
    Inductor's own comm passes off.

    ``mode`` and ``options`` are torch.compile's (``torch.compile(model, backend="fsdp_inductor",
    mode="max-autotune")``), applied to Inductor as for ``backend="inductor"``; see
    [Note: torch.compile's mode and options under fsdp_inductor].
    """
    from fsdp_compile import config

    return _compile_with_inductor(gm, example_inputs, config.passes, mode, options)


def fsdp_inductor_with(passes: Any) -> Callable[..., Any]:
    """An ``fsdp_inductor`` backend that always uses ``passes`` (a ``PassConfig``).

    Dynamo guards its compiled code on the backend object, so models compiled with different
    backends from here never share graphs, even if they are instances of the same class (with the
    plain ``"fsdp_inductor"`` string they can: the second model reuses the first one's graph and
    its passes).

    Example::

        torch.compile(model, backend=fsdp_inductor_with(PassConfig(reorder=False)))
    """

    def backend(
        gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None, options: dict[str, Any] | None = None,
    ) -> Any:
        return _compile_with_inductor(gm, example_inputs, passes, mode, options)

    backend.__name__ = backend.__qualname__ = "fsdp_inductor"
    return _fsdp_backend(backend)


def admit_traced_parameters(gm: fx.GraphModule) -> None:
    """Before compiling a graph: every live fully_shard state whose parameters it reads learns that
    its model runs compiled (so an eager call into the model later initializes from the root
    instead of failing), and a parameter the graph cannot serve is refused.

    Refused: a group's settings that the graph cannot honour (``FSDPState.settings_refused_when_compiled``),
    and a local shard with FSDP2's all-gather extension (``fsdp_pre_all_gather``): the traced
    unshard gathers the shard itself and would silently lose the extension.
    """
    from fsdp_compile.runtime import state as state_module
    from fsdp_compile.annotations import BLOCK_FRAME_TOKEN
    from fsdp_compile.passes.graph import PARAM_KEY, STATE_KEY, fsdp_annotation

    traced = {(a[STATE_KEY], a[PARAM_KEY]) for node in gm.graph.nodes if (a := fsdp_annotation(node)) is not None}
    # A block compiled as a frame is named in its graph by a token every such block shares: the block
    # is the one whose frame Dynamo is tracing ([Note: blocks compiled as frames] in module.py).
    block_frame = state_module.block_frame_in_trace()
    for state in state_module.live_states():
        tokens = {state.trace_token}
        if state is block_frame:
            tokens.add(BLOCK_FRAME_TOKEN)
        read = [p for p in state.group.fsdp_params if any((t, p.fqn) in traced for t in tokens)] if state.group is not None else []
        if not read:
            continue
        state.outermost().runs_compiled = True
        refused = state.settings_refused_when_compiled()
        if refused:
            raise NotImplementedError(
                f"fsdp_inductor: the fully_shard group '{state.group.label}' has settings the compiled graph "
                "cannot honour: " + "; ".join(refused) + "."
            )
        for fsdp_param in read:
            if fsdp_param.uses_all_gather_extension:
                raise NotImplementedError(
                    f"fsdp_inductor: '{fsdp_param.fqn}' (group '{state.group.label}') has an all-gather extension "
                    "(fsdp_pre_all_gather / fsdp_post_all_gather), which the compiled graph does not run. Train it "
                    "with the eager runtime, or compile with fsdp_compile.config.skip_fsdp_hooks = True."
                )


def _compile_with_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], passes: Any, mode: str | None = None,
    options: dict[str, Any] | None = None,
) -> Any:
    from torch._inductor.compile_fx import compile_fx

    pass_config = passes.resolved()
    # Why each is pinned: said to a user whose mode= or options= asks otherwise.
    pinned: dict[str, tuple[Any, str]] = {
        "joint_custom_pre_pass": (_RecomputeReshardedParams(), "fsdp_inductor runs its recompute tagging in this hook"),
        "post_grad_custom_post_pass": (
            _PostGradPasses(pass_config), "fsdp_inductor runs its bucketing and reordering passes in this hook",
        ),
        **{
            name: (value, "only fsdp_inductor's passes place collectives (tune them with fsdp_inductor_with(PassConfig(...)))")
            for name, value in _inductor_comm_passes_off().items()
        },
    }
    if pass_config.reorder:
        # Pins our collective placement: Inductor's peak-memory reordering would sink each
        # prefetched all-gather back down to its use (see passes/reorder.py).
        pinned["reorder_for_peak_memory"] = (
            False, "it would undo the prefetch order of fsdp_inductor's reorder pass (PassConfig(reorder=False) frees it)",
        )
    partitioner = _runtime_ordered_partitioner()
    if partitioner is not None:
        pinned["custom_partitioner_fn"] = (
            partitioner, "fsdp_inductor partitions with it ([Note: saved RNG states before opaque objects])",
        )
    if _has_nested_regions(gm):
        pinned["allow_buffer_reuse"] = (
            False, "see [Note: Inductor's buffer reuse across nested regions] (fsdp_compile.config.compile_blocks_once = "
            "False frees it)",
        )
    config_patches = {**_settings_from_torch_compile(mode, options, pinned), **{k: v for k, (v, _) in pinned.items()}}
    refuse_tensor_parallel_graphs(example_inputs)
    check_collectives_match_across_ranks(gm)
    admit_traced_parameters(gm)
    _add_traced_op_to_inductors_decompositions()
    reach = output_reach(gm)
    with _said_when_dynamo_falls_back("fsdp_inductor"), _region_schemas_kept():
        compiled = compile_fx(gm, example_inputs, config_patches=config_patches)
    return forget_unreached_gradients(compiled, reach, _runtime_gradient_delivery())


def _asks_for_settings(mode: str | None, options: dict[str, Any] | None) -> bool:
    """Whether torch.compile's ``mode`` / ``options`` ask for anything beyond Inductor's defaults."""
    return bool((mode and mode != "default") or options)


# [Note: torch.compile's mode and options under fsdp_inductor]
# torch.compile hands a named backend its mode= and options= as keyword arguments; fsdp_inductor
# turns them into Inductor config patches as torch does for backend="inductor" (same modes, same
# check of option names and types), so mode="max-autotune" autotunes. Two exceptions, both said:
# - CUDA graphs (mode="reduce-overhead" / "max-autotune", options={"triton.cudagraphs": True}) stay
#   off, with a warning: CUDA graph capture of graphs holding FSDP collectives has never run in
#   this project (no GPU was lent to check it), so it is not offered.
# - An option that changes a setting fsdp_inductor pins (its pass hooks, Inductor's comm passes,
#   the orders and buffer reuse its passes rely on) is refused, naming why and what frees it,
#   before the graph's first collective.
def _settings_from_torch_compile(
    mode: str | None, options: dict[str, Any] | None, pinned: dict[str, tuple[Any, str]],
) -> dict[str, Any]:
    """torch.compile's ``mode`` / ``options`` as Inductor config patches; see the note above."""
    if not _asks_for_settings(mode, options):
        return {}
    asked = ", ".join(part for part in (f"mode={mode!r}" if mode else "", f"options={options!r}" if options else "") if part)
    try:
        # torch's own translation and checks for backend="inductor": the same modes, option names and types.
        settings = dict(torch._TorchCompileInductorWrapper(mode, options, None).config)
    except RuntimeError as error:
        said = str(error).split(", known options are")[0]  # not the list of several hundred names
        raise ValueError(
            f"fsdp_inductor: torch.compile({asked}): {said}. torch._inductor.list_options() lists Inductor's options, "
            "torch._inductor.list_mode_options() its modes."
        ) from None
    if settings.pop("triton.cudagraphs", False):
        warnings.warn(
            f"fsdp_inductor: torch.compile({asked}) asks for CUDA graphs, which fsdp_inductor leaves off: capturing "
            "graphs that hold FSDP collectives is unverified. The rest of the mode applies; "
            "mode='max-autotune-no-cudagraphs' asks for exactly that.",
            stacklevel=2,
        )
    for name, value in settings.items():
        if name in pinned and pinned[name][0] != value:
            kept, why = pinned[name]
            kept_as = repr(kept) if isinstance(kept, (bool, int, str)) else "its own pass"
            raise ValueError(
                f"fsdp_inductor: torch.compile({asked}) sets Inductor's {name} = {value!r}, which fsdp_inductor keeps at "
                f"{kept_as}: {why}. Leave it out of options."
            )
    return settings


def _add_traced_op_to_inductors_decompositions() -> None:
    """TRACED_OP_DECOMPOSITIONS in Inductor's own table. Not ``compile_fx(decompositions=...)``: that
    table object goes into Inductor's FX-graph cache key, which cannot pickle it and then refuses
    every graph (seen with torch 2.13: each process compiled everything again)."""
    from torch._inductor import decomposition

    from fsdp_compile.compile.param_reads import TRACED_OP_DECOMPOSITIONS

    if all(op in decomposition.decompositions for op in TRACED_OP_DECOMPOSITIONS):
        return
    decomposition.decompositions.update(TRACED_OP_DECOMPOSITIONS)
    # Inductor memoizes the table it selects: forget a copy taken before this addition.
    memoized = getattr(decomposition, "fast_random_decomps", None)
    if hasattr(memoized, "cache_clear"):
        memoized.cache_clear()


# [Note: Inductor's buffer reuse across nested regions]
# torch 2.13's Inductor (CPU seen) computes a wrong gradient when a graph calls one nested compile
# region three or more times with bfloat16 or float16 inputs: the first call's weight gradient
# comes out wrong by up to 0.2 (aot_eager is exact). Reproducer (fp32 exact in this one):
#     region = torch.compiler.nested_compile_region(lambda w, x: x + torch.tanh(F.linear(x, w)))
#     x = x32.bfloat16(); for w in (w1, w2, w3): x = region(w.bfloat16(), x)
#     x.float().pow(2).mean().backward()      # w1.grad is wrong under backend="inductor"
# It is not only low precision: a float32 Transformer whose two blocks are calls of one region
# taking their parameters from an all-gather (2 gloo ranks, 2026-11-24) got weight gradients off
# by a factor of 5 to 40 under backend="inductor", exact under aot_eager or without buffer reuse.
# Turning off Inductor's buffer reuse makes it exact. Dead buffers are still freed as soon as they
# die, so the caching allocator reuses their memory: what is lost is allocation churn, not peak
# memory. Only graphs holding nested regions (compile_blocks_once) get the patch. Other backends,
# torch.compile's own "inductor" among them, get no regions (traced_for_an_fsdp_backend).


def _has_nested_regions(gm: fx.GraphModule) -> bool:
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph
    graphs = [module.graph for module in gm.modules() if isinstance(module, fx.GraphModule)]
    return any(node.op == "call_function" and node.target is invoke_subgraph for graph in graphs for node in graph.nodes)


def _inductor_comm_passes_off() -> dict[str, Any]:
    """The knobs of ``INDUCTOR_COMM_PASSES_OFF`` that this torch version has."""
    import torch._inductor.config as inductor_config

    present = {}
    for name, value in INDUCTOR_COMM_PASSES_OFF.items():
        owner: Any = inductor_config
        *parents, leaf = name.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        if owner is not None and hasattr(owner, leaf):
            present[name] = value
    return present


@_fsdp_backend
def fsdp_aot_eager(
    gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None, options: dict[str, Any] | None = None,
) -> Any:
    """``fsdp_inductor``'s checks and graph passes, with the partitioned graphs run eagerly.

    For debugging and graph tests: no code generation, the same forward/backward split. It has no
    code generator for torch.compile's ``mode`` / ``options`` to configure, so it refuses them.
    """
    if _asks_for_settings(mode, options):
        raise ValueError(
            f"fsdp_aot_eager runs its graphs without code generation, so torch.compile's mode={mode!r} / "
            f"options={options!r} configure nothing: leave them out, or compile with backend='fsdp_inductor'."
        )
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    from fsdp_compile import config
    from fsdp_compile.passes import apply_post_grad_passes
    from fsdp_compile.compile.param_reads import TRACED_OP_DECOMPOSITIONS

    refuse_tensor_parallel_graphs(example_inputs)
    check_collectives_match_across_ranks(gm)
    admit_traced_parameters(gm)
    pass_config = config.passes.resolved()

    def partition(joint: fx.GraphModule, joint_inputs: Any, **partition_kwargs: Any) -> Any:
        _tag_recompute(joint.graph)
        return _partition(joint, joint_inputs, **partition_kwargs)

    def run_eagerly(kind: str) -> Callable[[fx.GraphModule, Any], Any]:
        def compiler(graph: fx.GraphModule, inputs: Any) -> Any:
            graph = apply_post_grad_passes(graph, pass_config)
            _notify(kind, graph)
            return make_boxed_func(graph.forward)

        return compiler

    reach = output_reach(gm)
    with _said_when_dynamo_falls_back("fsdp_aot_eager"), _region_schemas_kept():
        compiled = aot_module_simplified(
            gm, example_inputs, fw_compiler=run_eagerly("forward"), bw_compiler=run_eagerly("backward"), partition_fn=partition,
            decompositions=TRACED_OP_DECOMPOSITIONS,
        )
    return forget_unreached_gradients(compiled, reach, _runtime_gradient_delivery())


def _runtime_gradient_delivery() -> GradientDelivery:
    """The runtime's side of [Note: a graph output left out of the loss] (unreached.py)."""
    from fsdp_compile.runtime.param_group import gradient_holder
    from fsdp_compile.runtime.state import land_late_reductions

    return GradientDelivery(gradient_holder, land_late_reductions)


# [Note: warm start across processes]
# Inductor's FX graph cache keys a graph by pickling its example inputs. Our graphs take the
# DTensor shards' DeviceMesh as opaque inputs, and torch pickles a mesh's whole __dict__ with the
# memo on, whose bytes depend on object identities that differ from process to process: every
# restart missed the cache and compiled again (seen with torch 2.13: 2 misses in a second process,
# 2 hits with the reducer below). A mesh is keyed by what identifies it instead: device type,
# ranks, dim names and process-group names (the graph takes the live mesh as an input at run
# time, so nothing of it is baked into the cached code). Without the hook this torch offers, the
# cache keeps its own behaviour.
def _key_device_meshes_by_identity() -> None:
    try:
        from torch._inductor import codecache
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return
    pickler = getattr(codecache, "FxGraphCachePickler", None)
    reduce_opaque = getattr(pickler, "_reduce_fake_script_object", None)
    ident = getattr(codecache, "_ident", None)
    if reduce_opaque is None or ident is None or getattr(reduce_opaque, "_keys_meshes", False):
        return

    def reduce(self: Any, fake: Any) -> Any:
        mesh = getattr(fake, "real_obj", None)
        if isinstance(mesh, DeviceMesh):
            groups = tuple(getattr(mesh, "_dim_group_names", None) or ())
            return ident, (fake.script_class_name, (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names, groups))
        return reduce_opaque(self, fake)

    reduce._keys_meshes = True  # type: ignore[attr-defined]
    pickler._reduce_fake_script_object = reduce


# [Note: a region body's schema, once per compile]
# While AOTAutograd traces the joint graph, the autograd step of every nested compile region's call
# (torch._ops' ``maybe_run_autograd`` for invoke_subgraph) asks the HOP for its schema, only to
# refuse a body that writes to its inputs, and each ask traces the body again
# (``materialize_as_graph``): 50 asks, 2.9 s of a 16-layer benchmark model's cold compile here,
# growing with depth, for two bodies. While our backends compile, an answer is kept per body object,
# identifier and operands' metadata (shape, strides, dtype, device, requires_grad): within one trace
# every call of a body passes the same object, and its schema (argument kinds, written inputs) follows
# from the body and the operands' types, not their values. The kept answers go with the compile.
# Operands of symbolic sizes are not kept (a region then takes them only after a recompile with a
# new shape, where each block's body is traced on its own anyway).
_kept_region_schemas: dict[tuple, tuple[Any, Any]] | None = None


def _operand_key(operand: Any) -> Any:
    """What an operand's schema depends on, hashable; None where it has symbolic sizes (not kept)."""
    if isinstance(operand, torch.Tensor):
        sizes = (*operand.shape, *operand.stride())
        if any(isinstance(size, torch.SymInt) for size in sizes):
            return None
        return (type(operand), sizes, operand.dtype, operand.device, operand.requires_grad)
    if isinstance(operand, (bool, int, float, str, type(None))):
        return (type(operand), operand)
    return (type(operand), id(operand))  # a SymInt or an opaque object: the same one only


@contextlib.contextmanager
def _region_schemas_kept() -> Iterator[None]:
    global _kept_region_schemas
    outer = _kept_region_schemas
    _kept_region_schemas = {} if outer is None else outer
    try:
        yield
    finally:
        _kept_region_schemas = outer


def _keep_region_schemas() -> None:
    """Wrap invoke_subgraph's ``gen_schema`` (once per process; a no-op on a torch without it)."""
    try:
        from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
    except ImportError:
        return
    generate = getattr(InvokeSubgraphHOP, "gen_schema", None)
    if generate is None or getattr(generate, "_fsdp_compile_kept", False):
        return

    def gen_schema(self: Any, subgraph: Any, identifier: Any, *operands: Any) -> Any:
        kept = _kept_region_schemas
        operand_keys = tuple(_operand_key(operand) for operand in operands) if kept is not None else (None,)
        if kept is None or None in operand_keys:
            return generate(self, subgraph, identifier, *operands)
        key = (id(subgraph), identifier, operand_keys)
        entry = kept.get(key)
        if entry is None or entry[0] is not subgraph:  # the body held in the entry keeps its id unique
            entry = kept[key] = (subgraph, generate(self, subgraph, identifier, *operands))
        return entry[1]

    gen_schema._fsdp_compile_kept = True  # type: ignore[attr-defined]
    InvokeSubgraphHOP.gen_schema = gen_schema


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    for name, backend in (("fsdp_inductor", fsdp_inductor), ("fsdp_aot_eager", fsdp_aot_eager)):
        if name not in _BACKENDS:
            register_backend(name=name)(backend)
    _key_device_meshes_by_identity()
    _keep_region_schemas()


_register()
