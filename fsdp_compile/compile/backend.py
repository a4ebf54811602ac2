"""The ``fsdp_inductor`` torch.compile backend: AOTAutograd + Inductor with our graph passes.

Registered on ``import fsdp_compile`` and through the ``torch_dynamo_backends`` entry point, so
``torch.compile(model, backend="fsdp_inductor")`` works right after ``pip install``.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

try:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn as _CustomPartitionerFn
except ImportError:  # a torch without Inductor's partitioner hook
    _CustomPartitionerFn = None

from fsdp_compile.compile import ops, param_reads, torch_patches
from fsdp_compile.compile.frames import gradient_holder, land_late_reductions
from fsdp_compile.compile.graph_check import check_collectives_match_across_ranks
from fsdp_compile.compile.ops import TRACED_OP_DECOMPOSITIONS
from fsdp_compile.compile.policy import (
    check_parameters_read, refuse_block_frame_gathers_left_with_extensions, refuse_tensor_parallel_graphs, runs_as_traced_outside_blocks,
)
from fsdp_compile.compile.trace_context import mark_fsdp_backend
from fsdp_compile.compile.torch_patches import region_schemas_kept
from fsdp_compile.compile.unreached import GradientDelivery, forget_unreached_gradients, output_reach
from fsdp_compile.runtime.state import live_states

__all__ = ["fsdp_inductor", "fsdp_inductor_with", "fsdp_aot_eager", "observe_graphs"]

_PASS_VERSION = "fsdp_compile-recompute-v1"
_POST_GRAD_VERSION = "fsdp_compile-bucket-reorder-v3"
_PARTITION_VERSION = "fsdp_compile-saved-values-in-runtime-order-v1"


# The open observe_graphs() blocks: process-wide, as the backends registered with Dynamo are.
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
            "fsdp_compile.config.block_compile = \"inline\" to trace every block inline, or compile each block on its "
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
    """A hash of ops.py and param_reads.py. AOTAutograd's cache keys a graph by Dynamo's, where each
    traced all-gather is one op whose decomposition and backward formula live in ops.py, built from
    the arguments param_reads.py gives it (see [Note: the traced all-gather is one op] in ops.py): a changed
    formula must miss the cache."""
    digest = hashlib.sha256()
    # The files the modules were loaded from: their sources, or their compiled files where none shipped.
    for module in (ops, param_reads):
        with open(module.__file__, "rb") as loaded:
            digest.update(loaded.read())
    return digest.hexdigest()[:16]


class _PostGradPasses(CustomGraphPass):
    """Inductor post-grad hook running ``passes.bucket`` / ``passes.reorder`` on the forward and the
    (possibly lazily compiled) backward; the config is captured when the backend is called, and the
    uuid carries it so a cached graph compiled under other knobs is never reused. It carries whether a
    live group has an all-gather extension too: a cache hit runs no pass, so no refusal after them
    (``refuse_block_frame_gathers_left_with_extensions``), and a graph is the same with or without one."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.extensions_live = any(
            state.group is not None and state.group.uses_all_gather_extension for state in live_states()
        )

    def __call__(self, graph: fx.Graph) -> None:
        from fsdp_compile.passes import apply_post_grad_passes

        gm = graph.owning_module
        apply_post_grad_passes(gm, self.config)
        refuse_block_frame_gathers_left_with_extensions(gm)
        _notify(_kind(gm), gm)

    def uuid(self) -> Any:
        return f"{_POST_GRAD_VERSION}:{self.config!r}:extensions={self.extensions_live}"


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


@mark_fsdp_backend
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
    return mark_fsdp_backend(backend)


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
            False, "see [Note: Inductor's buffer reuse across nested regions] (fsdp_compile.config.block_compile = "
            "\"inline\" frees it)",
        )
    config_patches = {**_settings_from_torch_compile(mode, options, pinned), **{k: v for k, (v, _) in pinned.items()}}
    refuse_tensor_parallel_graphs(example_inputs)
    check_collectives_match_across_ranks(gm)
    check_parameters_read(gm, pass_config)
    if runs_as_traced_outside_blocks(gm):
        return gm.forward
    torch_patches.require("traced all-gather in Inductor's decompositions")
    reach = output_reach(gm)
    with _said_when_dynamo_falls_back("fsdp_inductor"), region_schemas_kept():
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
# memory. Only graphs holding nested regions (block_compile "regions", or "frames" where a trace may not break) get the patch. Other backends,
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


@mark_fsdp_backend
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

    refuse_tensor_parallel_graphs(example_inputs)
    check_collectives_match_across_ranks(gm)
    pass_config = config.passes.resolved()
    check_parameters_read(gm, pass_config)
    if runs_as_traced_outside_blocks(gm):
        return gm.forward

    def partition(joint: fx.GraphModule, joint_inputs: Any, **partition_kwargs: Any) -> Any:
        _tag_recompute(joint.graph)
        return _partition(joint, joint_inputs, **partition_kwargs)

    def run_eagerly(kind: str) -> Callable[[fx.GraphModule, Any], Any]:
        def compiler(graph: fx.GraphModule, inputs: Any) -> Any:
            graph = apply_post_grad_passes(graph, pass_config)
            refuse_block_frame_gathers_left_with_extensions(graph)
            _notify(kind, graph)
            return make_boxed_func(graph.forward)

        return compiler

    reach = output_reach(gm)
    with _said_when_dynamo_falls_back("fsdp_aot_eager"), region_schemas_kept():
        compiled = aot_module_simplified(
            gm, example_inputs, fw_compiler=run_eagerly("forward"), bw_compiler=run_eagerly("backward"), partition_fn=partition,
            decompositions=TRACED_OP_DECOMPOSITIONS,
        )
    return forget_unreached_gradients(compiled, reach, _runtime_gradient_delivery())


def _runtime_gradient_delivery() -> GradientDelivery:
    """The runtime's side of [Note: a graph output left out of the loss] (unreached.py)."""
    return GradientDelivery(gradient_holder, land_late_reductions)


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    for name, backend in (("fsdp_inductor", fsdp_inductor), ("fsdp_aot_eager", fsdp_aot_eager)):
        if name not in _BACKENDS:
            register_backend(name=name)(backend)


_register()
