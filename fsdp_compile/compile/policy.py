"""The compile policy: which settings a compiled graph honours, which it refuses and why, checked
before a graph's first collective (docs/design.md section 5.7).

Every public setting either changes the compiled graph exactly as it changes eager behaviour (the
graph guards on it) or is refused here with an error naming it and the way out.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.fx as fx

from fsdp_compile import config
from fsdp_compile.annotations import BLOCK_FRAME_TOKEN, GROUP_KEY, KEEPS_GATHERED_KEY, PARAM_KEY, STATE_KEY, fsdp_annotation
from fsdp_compile.compile.graph_check import qualified_op_name
from fsdp_compile.compile.trace_context import block_frame_in_trace, inside_a_forward_breaking_at_block_frames
from fsdp_compile.runtime.state import live_states

if TYPE_CHECKING:
    from fsdp_compile.config import PassConfig
    from fsdp_compile.runtime.param_group import FSDPParamGroup

__all__ = [
    "settings_refused_when_compiled", "check_parameters_read", "all_gather_extension_refused", "refuse_tensor_parallel_graphs",
    "refuse_block_frame_gathers_left_with_extensions", "KEPT_GATHER_LOSES_THE_EXTENSION", "runs_as_traced_outside_blocks",
]

# The way out every refusal names; each refused setting's is tested to train as eagerly
# (test_compiled_settings.py, and the all-gather extension's in test_fsdp2_semantics.py).
_PER_BLOCK_WAY_OUT = (
    "per-block compile honours it: block.compile(backend=\"fsdp_inductor\") on each block, the root left "
    "uncompiled (FSDP2's and torchtitan's recipe), whose eager hooks around each compiled block"
)


def settings_refused_when_compiled(group: "FSDPParamGroup | None", gathers_through_frames: bool = False) -> list[str]:
    """This group's settings a traced graph cannot honour, each with the way out.

    Read while a parameter read is traced, so Dynamo guards on every one: setting one after the
    first compile recompiles, and the backend (``check_parameters_read``) refuses it then.
    ``gathers_through_frames``: the group's all-gather is the runtime's (a block compiled as a frame,
    or a group outside blocks under frames), which honours set_reshard_after_backward(False) without
    the graph reading it ([Note: keeping parameters gathered across a backward] in kept_gathers.py), and
    copies CPU-offloaded shards to the device ([Note: offloaded shards under whole-model compile] in
    param_reads.py).
    """
    if group is None:
        return []
    refused = []
    alternative = f"{_PER_BLOCK_WAY_OUT} do what the setting asks; or the eager runtime"
    runtime_gathers = (
        gathers_through_frames and not group.comm_policy.quantizes_all_gather
        and not any(p.tensor_parallel is not None for p in group.fsdp_params)
    )
    if not runtime_gathers and not group.reshard_after_backward:
        refused.append(
            "set_reshard_after_backward(False) where the group's all-gather is a node of the compiled graph (blocks "
            "compiled as regions or inline: config.block_compile \"regions\" or \"inline\", torch.compile(fullgraph=True), "
            "a block called inside its caller's checkpoint; or a group with CommPolicy's quantized all-gather or "
            "tensor-parallel parameters, which gather in their own graph): that node runs on every call and the graph "
            "frees what it gathered once read, so nothing is left gathered for the next forward, which would send the "
            "bytes this setting saves. Blocks compiled as frames (block_compile \"frames\", the default, without "
            f"fullgraph=True) honour it: their all-gathers are the runtime's, which keeps them; or {alternative}"
        )
    if group.post_forward_mesh_info is not None:
        refused.append(f"an int reshard_after_forward: the compiled graph re-gathers from the full shard group; pass True or False, or {alternative}")
    if group.all_reduce_hook is not None:
        refused.append(f"set_all_reduce_hook: the compiled graph's reductions cannot call a Python hook; {alternative}")
    if not runtime_gathers and group.fsdp_params[0].offload_to_cpu:
        refused.append(
            "CPUOffloadPolicy where the group's all-gather is a node of the compiled graph (blocks compiled as regions or "
            "inline: config.block_compile \"regions\" or \"inline\", torch.compile(fullgraph=True), a block called inside "
            "its caller's checkpoint; or a group with CommPolicy's quantized all-gather or tensor-parallel parameters): "
            "the copy of each host shard to the device would be a graph node too, made where the graph gathers, with no "
            "prefetch ahead of it, where the runtime copies it on the all-gather's stream ahead of use. Blocks compiled "
            f"as frames (block_compile \"frames\", the default, without fullgraph=True) honour it; or {alternative}"
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


def check_parameters_read(gm: fx.GraphModule, passes: "PassConfig | None" = None) -> None:
    """Before compiling a graph: every live fully_shard state whose parameters it reads learns that
    its model runs compiled (so an eager call into the model later initializes from the root
    instead of failing), and a parameter the graph cannot serve is refused.

    Refused: a group's settings that the graph cannot honour (``settings_refused_when_compiled``),
    and a local shard with FSDP2's all-gather extension (``fsdp_pre_all_gather``) where the runtime
    cannot run it ([Note: all-gather extensions under a whole-model compile]): the traced unshard
    would gather the shard itself and silently lose the extension. ``passes``: the backend's pass
    configuration (``fsdp_compile.config.passes`` when None).
    """
    annotations = [a for node in gm.graph.nodes if (a := fsdp_annotation(node)) is not None]
    traced = {(a[STATE_KEY], a[PARAM_KEY]) for a in annotations}
    kept_gathered = {a[STATE_KEY] for a in annotations if a.get(KEEPS_GATHERED_KEY)}
    # A block compiled as a frame is named in its graph by a token every such block shares: the block
    # is the one whose frame Dynamo is tracing ([Note: blocks compiled as frames] in frames.py).
    block_frame = block_frame_in_trace()
    for state in live_states():
        tokens = {state.trace_token}
        if state is block_frame:
            tokens.add(BLOCK_FRAME_TOKEN)
        read = [p for p in state.group.fsdp_params if any((t, p.fqn) in traced for t in tokens)] if state.group is not None else []
        if not read:
            continue
        state.outermost().runs_compiled = True
        # A block frame's gathers, and those of a group whose reads say so, are the runtime's.
        refused = settings_refused_when_compiled(state.group, state is block_frame or state.trace_token in kept_gathered)
        if refused:
            raise NotImplementedError(
                f"fsdp_inductor: the fully_shard group '{state.group.label}' has settings the compiled graph "
                "cannot honour: " + "; ".join(refused) + "."
            )
        if state.group.uses_all_gather_extension:
            refused_extension = _why_extension_is_not_run(state, read, state is block_frame, passes or config.passes)
            if refused_extension is not None:
                raise NotImplementedError(all_gather_extension_refused(*refused_extension, state.group.label))


# [Note: all-gather extensions under a whole-model compile]
# FSDP2's all-gather extension (fsdp_pre_all_gather / fsdp_post_all_gather on a local shard, [Note:
# all-gather extensions] in runtime/param.py) decides what crosses the wire (torchao's float8 training
# sends fp8, half bf16's bytes) and builds the unsharded parameter from it: Python on the shard, run
# where the all-gather is issued. A block compiled as a frame (the default) has its all-gather issued
# by the runtime already (fsdp_compile::frame_all_gather, [Note: prefetch across block frames] in
# frames.py), so there the runtime runs the extension: for a block whose group has one, the frame op
# has the group gather as its eager unshard does (FSDPParamGroup.read_gathered: pre_all_gather, the
# packed all-gather of what it returned, post_all_gather; every parameter of the group, as eagerly)
# and lays the unsharded parameters out as the plain all-gather's output that the graph's copy-out
# reads (the reduce-scatter copy-in's layout, undivided), in the parameter dtype, then frees them
# (frames.py: _gather_in_frame, extension_gathers.gather_through_extensions). The graph is the one
# it is without the extension (a block with one and a block without share it), so the fake
# implementation and the backward are unchanged: the gradient of the unsharded parameter is
# reduce-scattered as without the extension, as in FSDP2. Same collectives as eager; not prefetched
# by the block before it (its pre_all_gather runs as its own frame gathers). What cannot be run is
# refused before the graph's first collective (_why_extension_is_not_run): an all-gather that is a
# graph node (regions, inline, fullgraph=True, a block inside its caller's checkpoint, a group
# outside blocks, CommPolicy's quantized all-gather); a local shard that is a tensor subclass (the
# graph would take it apart as an input); one rank (no all-gather in the graph: [Note: no collective
# over one rank] in ops.py); a rank without rows of a parameter (the frame op could not find the
# block); set_reshard_after_backward(False) (the runtime keeps plain gathers only); a PassConfig
# under which the post-grad pass leaves the block's all-gather a graph node (bucket=False, ...). A
# fsdp_post_all_gather returning a tensor subclass (torchao's Float8Tensor) is refused at the first
# call, on every rank alike, after the all-gather and before the graph computes on it: a graph
# input of that op is a plain tensor.


# Why set_reshard_after_backward(False) is refused with an extension: checked before the graph is
# admitted, and again by the frame op when it is set after (extension_gathers.py).
KEPT_GATHER_LOSES_THE_EXTENSION = (
    "set_reshard_after_backward(False): what the runtime keeps gathered across a backward for a block frame is "
    "a plain all-gather, not what the extension builds; leave it True"
)


def all_gather_extension_refused(fqn: str, why: str, label: str) -> str:
    """The error for a parameter whose all-gather extension a compiled graph cannot run, ``why`` said."""
    return (
        f"fsdp_inductor: '{fqn}' (group '{label}') has an all-gather extension (fsdp_pre_all_gather / "
        f"fsdp_post_all_gather), which this compiled graph cannot run: {why}. {_PER_BLOCK_WAY_OUT} run the extension "
        "and each block's graph receives what fsdp_post_all_gather returns; or fsdp_compile.config.skip_fsdp_hooks = True, "
        "or the eager runtime."
    )


def _why_extension_is_not_run(state: Any, read: list[Any], as_block_frame: bool, passes: "PassConfig") -> tuple[str, str] | None:
    """``(parameter, why)`` where this graph cannot run the all-gather extension of ``state``'s group
    (whose parameters ``read`` it reads), or None where the runtime runs it ([Note: all-gather
    extensions under a whole-model compile])."""
    group = state.group
    if not as_block_frame or group.comm_policy.quantizes_all_gather:
        extended = [p for p in read if p.uses_all_gather_extension]
        return None if not extended else (extended[0].fqn, (
            "its all-gather is a node of the graph (blocks compiled as regions or inline: config.block_compile "
            "\"regions\" or \"inline\", torch.compile(fullgraph=True), a block called inside its caller's checkpoint; a "
            "group outside blocks, such as the root's; or CommPolicy's quantized all-gather), one functional op on the "
            "plain shard that the passes bucket with the group's other parameters, while the extension is Python on the "
            "local shard, and gathering the shard instead would silently send other bytes than the extension asks. "
            "Blocks compiled as frames (block_compile \"frames\", the default, without fullgraph=True) run it in the "
            "runtime's all-gather"
        ))
    # The frame op runs the whole group's extensions, whichever parameters this graph reads.
    extended = [p for p in group.fsdp_params if p.uses_all_gather_extension]
    subclassed = [p for p in extended if type(p.sharded_param._local_tensor) is not torch.Tensor]
    if subclassed:
        local = subclassed[0].sharded_param._local_tensor
        return subclassed[0].fqn, (
            f"its local shard is a tensor subclass ({type(local).__name__}; torchao's float8 training weights are one), "
            "which the block frame's graph would take apart as its input, while the runtime's all-gather that runs the "
            "extension is handed the plain shards"
        )
    fqn = extended[0].fqn
    if group.mesh_info.shard_size == 1:
        return fqn, (
            "its group is sharded over one rank, where the graph issues no all-gather ([Note: no collective over one "
            "rank] in compile/ops.py), so no runtime all-gather is there to run the extension"
        )
    if not state._gathers_identifiably_in_frames(state.outermost().root_frames.block(state)):
        return fqn, (
            "a parameter of its group has no rows on some rank, so the runtime cannot tell the block by its shards' "
            "addresses when the graph asks for its all-gather; shard it so every rank holds rows"
        )
    if not passes.bucket or passes.bucket_copy == "inductor" or passes.merge_small_groups_bytes:
        # passes/recompute.gather_frames_through_prefetch hands the runtime a group's one bucket copied in by the
        # copy-in op; otherwise the all-gather stays a node of the graph and the extension would be lost.
        return fqn, (
            "the graph passes are configured (PassConfig bucket=False, bucket_copy=\"inductor\" or "
            "merge_small_groups_bytes) so that the block's all-gather stays a node of the graph instead of the "
            "runtime's; keep PassConfig's defaults for these"
        )
    if not group.reshard_after_backward:
        return fqn, KEPT_GATHER_LOSES_THE_EXTENSION
    return None


def refuse_block_frame_gathers_left_with_extensions(gm: fx.GraphModule) -> None:
    """After the post-grad passes: a block frame's all-gather they left a node of the graph (a pass that
    gave up, which logs it) gathers the plain shards, where the runtime would have run an all-gather
    extension. One graph serves every block of its structure (its frame label), so while a live block of
    that structure has an extension such a graph is refused, before it runs ([Note: all-gather
    extensions under a whole-model compile])."""
    from fsdp_compile.passes.graph import ALL_GATHER  # the passes' vocabulary, imported where used, as the backend does

    left = {
        annotation.get(GROUP_KEY): node.name
        for node in gm.graph.find_nodes(op="call_function", target=ALL_GATHER)
        if (annotation := fsdp_annotation(node)) is not None and annotation.get(STATE_KEY) == BLOCK_FRAME_TOKEN
    }
    for state in live_states():
        if state.group is None or getattr(state, "frame_label", None) not in left:
            continue
        extended = [p for p in state.group.fsdp_params if p.uses_all_gather_extension]
        if extended:
            raise NotImplementedError(all_gather_extension_refused(extended[0].fqn, (
                f"a graph pass left a block frame's all-gather ({left[state.frame_label]}) a node of the graph (it gave "
                "up: see the fsdp_compile.passes warning), which gathers the plain shards of every block of its structure "
                "instead of the runtime running the extension"
            ), state.group.label))


def refuse_tensor_parallel_graphs(example_inputs: Sequence[Any]) -> None:
    """A graph that takes a tensor-parallel parameter's *unsharded* DTensor (the eager fallback's and
    per-block compile's graphs read it; the whole-model graph gathers from the sharded one) is
    refused: those paths do not compose with tensor parallelism yet."""
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


# [Note: graphs outside blocks run as traced]
# Block frames break the root's forward at every block. Where the blocks are called in a loop (every
# transformer), Dynamo cannot resume inside it and runs the loop's whole frame eagerly ("graph break
# in loop"), compiling instead each frame it calls: a Hugging Face-shaped Llama's causal mask, rotary
# embeddings, the first read of the root's parameters (the root's all-gather), each block's frame, the
# final norm, the head. All but the read and the blocks hold no FSDP work: they read no parameter that
# gathers (the root's were handed over by its first read: unsharded_across_frames) and issue no
# collective. Compiling each cost AOTAutograd and an Inductor code generation forward and backward:
# at 16 layers of that Llama on 2 CPU ranks, 6 of 10 Inductor compiles and most of the cold compile
# beyond FSDP2's per-block compile, which runs that code eagerly. With
# config.graphs_outside_blocks = "eager" (the default) the backend returns such a graph as Dynamo
# traced it (its Python code: the same ops as eagerly, autograd as eagerly), as Dynamo's "eager"
# backend does; "inductor" compiles it. Only inside the forward of a module with blocks compiled as
# frames inside it (trace_context.inside_a_forward_breaking_at_block_frames, read off the call stack:
# a flag that an exception left set would differ between ranks as their dead models are collected):
# a block compiled alone (per-block compile) holds no FSDP op either and is compiled as asked, as is
# any graph outside such a forward (a loss, a compiled training step). A graph with a higher-order op
# (a checkpointed or nested region) is compiled as before.
def runs_as_traced_outside_blocks(gm: "torch.fx.GraphModule") -> bool:
    """Whether the backend runs ``gm`` as traced: [Note: graphs outside blocks run as traced]."""
    if not config.graphs_outside_blocks_is("eager") or config.skip_fsdp_hooks or not config.block_compile_is("frames"):
        return False
    if not inside_a_forward_breaking_at_block_frames():
        return False
    return not any(_keeps_graph_compiled(node) for node in gm.graph.nodes)


# The ops of FSDP's traced collectives and copies; a graph holding none of them issues no collective.
_FSDP_OP_NAMESPACES = frozenset({"fsdp_compile", "_c10d_functional", "c10d_functional", "_dtensor"})


def _keeps_graph_compiled(node: "torch.fx.Node") -> bool:
    """FSDP work (an annotated parameter read, a collective or copy op) or a higher-order op (a
    checkpointed or nested region)."""
    if fsdp_annotation(node) is not None:
        return True
    if node.op != "call_function":
        return False
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return True
    return qualified_op_name(node.target).split("::")[0] in _FSDP_OP_NAMESPACES
