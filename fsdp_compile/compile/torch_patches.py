"""Every patch of torch internals, in one place: each names the torch versions it was written for
and checked against (its gate), the internal it wraps, and what needs it. ``install()`` (called once,
by ``fsdp_compile.module`` as the package is imported) applies those whose gate admits the installed
torch and whose internal is there; a feature whose patch does not apply is refused with a message
(``require``) instead of failing deep inside torch. ``tests/test_torch_patches.py`` checks that every
gate matches the installed torch.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from fsdp_compile.compile.compile_wrapper import name_keys_as_the_model_does
from fsdp_compile.compile.ops import TRACED_OP_DECOMPOSITIONS
from fsdp_compile.compile.trace_context import MODULE_FILE, block_frame_in_trace, is_block_frame_code
from fsdp_compile.runtime.state import state_of

__all__ = ["TORCH_PATCHES", "install", "apply", "require", "region_schemas_kept", "fsdp_frames_recompile_limit_reached"]


@dataclass(frozen=True)
class TorchPatch:
    """One patch of a torch internal."""

    name: str
    # The torch releases (major, minor) it was written for and checked against, first and last.
    first: tuple[int, int]
    last: tuple[int, int]
    # Whether the installed torch has the internal it wraps.
    target_present: Callable[[], bool]
    apply: Callable[[], None]
    # What needs it, and what to do where it does not apply (``require``'s message).
    needed_by: str
    # Applied by install() as the package is imported; else by the first require() of it.
    at_import: bool = True

    def gate_admits(self, version: str | None = None) -> bool:
        major, minor = (int(part) for part in (version or torch.__version__).split("+")[0].split(".")[:2])
        return self.first <= (major, minor) <= self.last

    def applies(self) -> bool:
        return self.gate_admits() and self.target_present()


def _has(module_name: str, *path: str) -> Callable[[], bool]:
    def present() -> bool:
        try:
            owner: Any = __import__(module_name, fromlist=["_"])
        except ImportError:
            return False
        for name in path:
            owner = getattr(owner, name, None)
            if owner is None:
                return False
        return True

    return present


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
# per-block recipe), whose frames are all FSDPModule.forward's code, and for the roots of models
# compiled whole, whose forward is that code too: each root is a structure of its own, so every
# model compiled in the process has the limit for its root. Counted together, the roots of the
# models before it (and their blocks' entries) used up the limit, and a later model's root ran
# eagerly; under regions, whose hooks had stood aside for a trace that never came, with its
# parameters still sharded (the H200 benchmark's fourteenth model: "mixed torch.Tensor and DTensor").
class _RecompileBudgets:
    """Dynamo's compiled code objects of module.py and the block structures seen per code object, for
    the life of the process (Dynamo's own cache of those code objects lives as long;
    ``torch._dynamo.reset()`` empties both, seen as a first compile again)."""

    def __init__(self) -> None:
        self.structures_by_frame_code: dict[Any, int] = {}
        # Every code object of module.py Dynamo compiled (FSDPModule.forward, shared by the root and
        # each block, and the block frames' resume functions), in order.
        self.fsdp_frame_codes: dict[Any, None] = {}
        self.blocks_seen_by_frame_code: "dict[Any, weakref.WeakSet[Any]]" = {}


_budgets = _RecompileBudgets()


def _recompile_limit_per_block_structure() -> None:
    """Installs the per-structure limit of [Note: a recompile limit per block structure] around Dynamo's
    frame compile (``convert_frame._compile``); once per process."""
    from torch._dynamo import config as dynamo_config, convert_frame

    compile_frame = convert_frame._compile
    if getattr(compile_frame, "_fsdp_compile_limit_per_structure", False):
        return

    @functools.wraps(compile_frame)
    def compile_with_a_limit_per_block_structure(code: Any, *args: Any, **kwargs: Any) -> Any:
        if code.co_filename != MODULE_FILE:
            return compile_frame(code, *args, **kwargs)
        _budgets.fsdp_frame_codes[code] = None  # for fsdp_frames_recompile_limit_reached
        block = _module_whose_frame_is_compiled(code, args[1] if len(args) > 1 and isinstance(args[1], dict) else {})
        if block is None:
            return compile_frame(code, *args, **kwargs)
        if not _cache_entries_of(code):  # the first compile, or the first since torch._dynamo.reset()
            _budgets.blocks_seen_by_frame_code.pop(code, None)
            _budgets.structures_by_frame_code.pop(code, None)
        seen = _budgets.blocks_seen_by_frame_code.setdefault(code, weakref.WeakSet())
        if block not in seen:
            seen.add(block)
            _budgets.structures_by_frame_code[code] = _budgets.structures_by_frame_code.get(code, 0) + 1
        structures = max(1, _budgets.structures_by_frame_code.get(code, 0))
        with dynamo_config.patch(recompile_limit=dynamo_config.recompile_limit * structures):
            return compile_frame(code, *args, **kwargs)

    compile_with_a_limit_per_block_structure._fsdp_compile_limit_per_structure = True  # type: ignore[attr-defined]
    convert_frame._compile = compile_with_a_limit_per_block_structure


def _module_whose_frame_is_compiled(code: Any, frame_locals: dict[str, Any]) -> Any:
    """The FSDP state of the module whose frame Dynamo is about to compile, where it counts as a
    structure ([Note: a recompile limit per block structure]), or None: a block frame (the resume
    function of its forward's graph break, entered by that block), the forward of a block compiled
    alone (block.compile(), torchtitan's per-block recipe), or a root's forward."""
    if is_block_frame_code(code):
        return block_frame_in_trace()
    module = frame_locals.get("self")
    state = state_of(module) if code.co_name == "forward" and isinstance(module, torch.nn.Module) else None
    return state if state is not None and (state.per_block_compiled or state.outer is None) else None


def fsdp_frames_recompile_limit_reached() -> str | None:
    """Why an FSDP module ran eagerly inside a compiled model, where it is Dynamo's recompile limit,
    reached on FSDPModule.forward's code (the root's and every block's) or on the block frames'
    ([Note: a recompile limit per block structure]): a sentence naming the limit and the way out,
    else None."""
    from torch._dynamo import config as dynamo_config

    for code in list(_budgets.fsdp_frame_codes):
        structures = _budgets.structures_by_frame_code.get(code)
        graphs = len(_cache_entries_of(code))
        if graphs and graphs >= dynamo_config.recompile_limit * (structures or 1):
            per = f" per block structure, {structures} structure(s)" if structures else ""
            compiled = "the block frames" if is_block_frame_code(code) else f"FSDPModule.{code.co_name}"
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
    from torch._inductor import codecache
    from torch.distributed.device_mesh import DeviceMesh

    pickler = codecache.FxGraphCachePickler
    reduce_opaque = pickler._reduce_fake_script_object
    ident = codecache._ident
    if getattr(reduce_opaque, "_keys_meshes", False):
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
# The answers kept while one of our backends compiles (region_schemas_kept); None outside.
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
def region_schemas_kept() -> Iterator[None]:
    global _kept_region_schemas
    outer = _kept_region_schemas
    _kept_region_schemas = {} if outer is None else outer
    try:
        yield
    finally:
        _kept_region_schemas = outer


def _keep_region_schemas() -> None:
    """Wrap invoke_subgraph's ``gen_schema`` (once per process)."""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    generate = InvokeSubgraphHOP.gen_schema
    if getattr(generate, "_fsdp_compile_kept", False):
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


def _add_traced_op_to_inductors_decompositions() -> None:
    """TRACED_OP_DECOMPOSITIONS in Inductor's own table. Not ``compile_fx(decompositions=...)``: that
    table object goes into Inductor's FX-graph cache key, which cannot pickle it and then refuses
    every graph (seen with torch 2.13: each process compiled everything again)."""
    from torch._inductor import decomposition

    if all(op in decomposition.decompositions for op in TRACED_OP_DECOMPOSITIONS):
        return
    decomposition.decompositions.update(TRACED_OP_DECOMPOSITIONS)
    # Inductor memoizes the table it selects: forget a copy taken before this addition.
    memoized = getattr(decomposition, "fast_random_decomps", None)
    if hasattr(memoized, "cache_clear"):
        memoized.cache_clear()


def _invoke_subgraph_variable() -> Any:
    """Dynamo's variable for an invoke_subgraph call, where its fallback switch is there: in
    ``torch._dynamo.variables.invoke_subgraph`` from torch 2.13, in ``higher_order_ops`` in 2.11
    (same class, same ``_ALLOW_FALLBACK_TO_EAGER`` read when its body breaks the graph)."""
    for module_name in ("torch._dynamo.variables.invoke_subgraph", "torch._dynamo.variables.higher_order_ops"):
        if _has(module_name, "InvokeSubgraphHigherOrderVariable", "_ALLOW_FALLBACK_TO_EAGER")():
            return getattr(__import__(module_name, fromlist=["_"]), "InvokeSubgraphHigherOrderVariable")
    return None


def _let_a_block_body_graph_break(region_codes: tuple[Any, ...]) -> None:
    """See [Note: a block whose body graph-breaks] (regions.py); once per process. ``region_codes``:
    the code objects of the block regions' bodies."""
    from torch._dynamo.variables import UnspecializedNNModuleVariable, UserFunctionVariable

    InvokeSubgraphHigherOrderVariable = _invoke_subgraph_variable()
    traced = InvokeSubgraphHigherOrderVariable.call_function
    if getattr(traced, "_fsdp_compile_block_fallback", False):
        return

    def body_code(fn_var: Any) -> Any:
        # What torch 2.13's get_fn_code returns (2.11 has no such function): the code a region calls.
        if isinstance(fn_var, UserFunctionVariable):
            return fn_var.get_function().__code__
        if isinstance(fn_var, UnspecializedNNModuleVariable):
            return fn_var.value.forward.__func__.__code__
        return None

    # torch 2.13's own reading where it has one (it knows more kinds of callables than body_code).
    code_of = getattr(sys.modules.get("torch._dynamo.variables.invoke_subgraph"), "get_fn_code", None) or body_code

    def call_function(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        if args and code_of(args[0]) in region_codes:
            self._ALLOW_FALLBACK_TO_EAGER = True  # this call only: other regions keep torch's hard error
        return traced(self, tx, args, kwargs)

    call_function._fsdp_compile_block_fallback = True  # type: ignore[attr-defined]
    InvokeSubgraphHigherOrderVariable.call_function = call_function


# [Note: a block whose body graph-breaks]
# Dynamo refuses a graph break inside a nested compile region outright (UncapturedHigherOrderOpError:
# torch 2.11 to 2.14 give invoke_subgraph no fallback), so a block whose forward breaks (a print, a
# data-dependent .item() branch, an unsupported call) would crash a whole-model compile that traces
# the same block inline without trouble. For our block region alone, Dynamo is let to do what it does
# for a break anywhere else: break the graph at the region's call, run that call eagerly and compile
# the frames inside it on their own. The block then runs as an inlined block with a graph break does
# (its parameters gathered in the graph before the break, read as plain tensors after it), which
# trains like eager (tests/test_compile_blocks.py); it is not compiled once for all blocks.


def _state_dict_names_of_compiled_models() -> None:
    """``OptimizedModule.__init__`` followed by ``name_keys_as_the_model_does`` (compile_wrapper.py): the
    one place a user's ``torch.compile(model)`` is seen before its first call."""
    from torch._dynamo.eval_frame import OptimizedModule

    init = OptimizedModule.__init__
    if getattr(init, "_fsdp_compile_names_keys", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        name_keys_as_the_model_does(self)

    __init__._fsdp_compile_names_keys = True  # type: ignore[attr-defined]
    OptimizedModule.__init__ = __init__


# The block regions' body code objects, given by install() (regions.py owns them).
_region_codes: tuple[Any, ...] = ()

TORCH_PATCHES: tuple[TorchPatch, ...] = (
    TorchPatch(
        "recompile limit per block structure", (2, 11), (2, 14), _has("torch._dynamo.convert_frame", "_compile"),
        _recompile_limit_per_block_structure,
        "blocks compiled as frames (every block frame shares one code object, so Dynamo's recompile limit would count "
        "every block structure together); set fsdp_compile.config.block_compile = \"regions\"",
    ),
    TorchPatch(
        "graph break inside a block region", (2, 11), (2, 14),
        lambda: _invoke_subgraph_variable() is not None,
        lambda: _let_a_block_body_graph_break(tuple(_region_codes)),
        "a block compiled once as a region whose body breaks the graph; set fsdp_compile.config.block_compile = \"inline\"",
    ),
    TorchPatch(
        "device meshes keyed by identity in Inductor's cache", (2, 11), (2, 14),
        lambda: _has("torch._inductor.codecache", "FxGraphCachePickler", "_reduce_fake_script_object")()
        and _has("torch._inductor.codecache", "_ident")(),
        _key_device_meshes_by_identity,
        "warm starts across processes (without it every process compiles again; nothing is refused)",
    ),
    TorchPatch(
        "region body schema once per compile", (2, 11), (2, 14),
        _has("torch._higher_order_ops.invoke_subgraph", "InvokeSubgraphHOP", "gen_schema"), _keep_region_schemas,
        "a fast cold compile of block regions (without it each region call traces its body again; nothing is refused)",
    ),
    TorchPatch(
        "traced all-gather in Inductor's decompositions", (2, 11), (2, 14), _has("torch._inductor.decomposition", "decompositions"),
        _add_traced_op_to_inductors_decompositions,
        "fsdp_inductor (its passes read the traced all-gather as a functional collective); use backend='fsdp_aot_eager' "
        "or the eager runtime",
        at_import=False,  # at fsdp_inductor's first compile: until then torch's own inductor keeps the op whole
    ),
    TorchPatch(
        "state-dict names of torch.compile(model)", (2, 11), (2, 14), _has("torch._dynamo.eval_frame", "OptimizedModule", "__init__"),
        _state_dict_names_of_compiled_models,
        "the original state-dict names of torch.compile(model) (without it its keys carry torch's '_orig_mod.' prefix); "
        "call model.compile() in place instead, which keeps the names",
        at_import=False,  # by the first fully_shard: a process that shards nothing keeps torch's own wrapper
    ),
)
_BY_NAME = {patch.name: patch for patch in TORCH_PATCHES}
# The patches this process applied, by name: a patch applies once per process.
_applied: set[str] = set()


def install(region_codes: tuple[Any, ...]) -> None:
    """Apply every patch whose gate admits this torch and whose internal is present (once per process)."""
    global _region_codes
    _region_codes = region_codes
    for patch in TORCH_PATCHES:
        if patch.at_import and patch.name not in _applied and patch.applies():
            patch.apply()
            _applied.add(patch.name)


def apply(name: str) -> bool:
    """Apply the patch ``name`` unless it is applied (one applied at first use is applied again each time:
    its apply is a no-op once done, and torch may have rebuilt what it patched); False where it does not
    apply to this torch."""
    patch = _BY_NAME[name]
    if patch.at_import and name in _applied:
        return True
    if not patch.applies():
        return False
    patch.apply()
    _applied.add(name)
    return True


def require(name: str) -> None:
    """``apply(name)``, or refuse the feature that needs the patch where it does not apply to this torch."""
    if apply(name):
        return
    patch = _BY_NAME[name]
    raise NotImplementedError(
        f"fsdp_compile: torch {torch.__version__} is outside the versions fsdp_compile's patch '{name}' was written for and "
        f"checked against ({'.'.join(map(str, patch.first))} to {'.'.join(map(str, patch.last))}), or lacks what it "
        f"patches; it is needed by {patch.needed_by}."
    )
