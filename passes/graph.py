"""The graph vocabulary every pass shares: what an FSDP collective is, how its annotation reads,
which graph a pass is looking at, which ops are views, copies or casts (by meaning, as torch 2.13
and 2.14 spell them), how many bytes a collective keeps allocated, and how a pass says it gave up.

recompute, bucket, reorder, dump and ``benchmarks/cost_model.py`` import these from here, so a
collective's bytes in the dump timeline are the bytes the in-flight budget counts and the bytes
the cost model sends over the wire::

    for node, flying in inflight_collectives(gm.graph):   # flying: {collective: collective_bytes}
        ...
    max_inflight_bytes(gm.graph)                          # what PassConfig.max_inflight_bytes bounds
"""
from __future__ import annotations

import logging
import operator
from collections import Counter
from typing import Any, Iterator

import torch
import torch.fx as fx

import fsdp_compile.kernels  # noqa: F401 - registers torch.ops.fsdp_compile's copy ops (COPY_IN, COPY_OUT)
import fsdp_compile.compile.ops  # noqa: F401 - registers torch.ops.fsdp_compile's traced and frame ops (FRAME_GATHER, DELIVER_GRADIENT)
from fsdp_compile.annotations import (
    BLOCK_FRAME_TOKEN, BUCKET_KEY, FSDP_ANNOTATION_KEY, GROUP_KEY, GROUPS_KEY, KEEPS_GATHERED_KEY, PARAM_KEY, PARAMS_KEY,
    RESHARD_AFTER_FORWARD_KEY, STATE_KEY, fsdp_annotation,
)

__all__ = [
    "ALL_TO_ALL",
    "FSDP_ANNOTATION_KEY", "GROUP_KEY", "PARAM_KEY", "RESHARD_AFTER_FORWARD_KEY", "STATE_KEY", "BUCKET_KEY", "GROUPS_KEY", "PARAMS_KEY",
    "BLOCK_FRAME_TOKEN", "KEEPS_GATHERED_KEY",
    "ALL_GATHER", "REDUCE_SCATTER", "ALL_REDUCE", "WAIT", "COLLECTIVES", "GRADIENT_REDUCTIONS", "COLLECTIVE_NAMES", "FORCE_STRIDE", "COPY_IN", "COPY_OUT",
    "collective_nodes", "single_wait", "one_wait_per_collective", "is_cast", "host_source", "new_node", "node_value", "erase_unused_chain", "FRAME_GATHER", "DELIVER_GRADIENT", "DELIVER_REDUCE_SCATTER_LATE", "fsdp_annotation", "is_tangent", "graph_kind", "is_view", "is_copy",
    "tensor_bytes", "collective_bytes", "inflight_collectives", "inflight_bytes", "max_inflight_bytes",
    "pass_counters", "give_up",
]

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
ALL_GATHER = _c10d.all_gather_into_tensor.default
REDUCE_SCATTER = _c10d.reduce_scatter_tensor.default
ALL_REDUCE = _c10d.all_reduce.default  # HSDP: the reduced shard across replicas
ALL_TO_ALL = _c10d.all_to_all_single.default  # CommPolicy's gradient wire (the reduce-scatter's stand-in)
WAIT = _c10d.wait_tensor.default
# A block frame's all-gather that takes (and issues) prefetches across frames, in forward or backward (compile/ops.py).
FRAME_GATHER = torch.ops.fsdp_compile.frame_all_gather.default
# A block frame's reduced gradient handed to the runtime, as the graph traces it, and as the post-grad
# pass leaves a bucket's reduce-scatter, in flight (compile/ops.py).
DELIVER_GRADIENT = torch.ops.fsdp_compile.deliver_reduced_gradient.default
DELIVER_REDUCE_SCATTER_LATE = torch.ops.fsdp_compile.deliver_reduce_scatter_late.default
# What issues work that a WAIT completes; a block frame's all-gather is one only after the passes
# have bucketed and placed it, so they never meet it.
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL, FRAME_GATHER)
# The reductions of gradients: a reduce-scatter, or CommPolicy's low-precision wire (an all-to-all
# whose received chunks each rank sums); both issue after their bucket's last gradient.
GRADIENT_REDUCTIONS = (REDUCE_SCATTER, ALL_TO_ALL)
COLLECTIVE_NAMES = {
    ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE: "all_reduce", ALL_TO_ALL: "all_to_all", FRAME_GATHER: "all_gather",
}


def _force_stride_op() -> Any:
    import torch._inductor.inductor_prims as inductor_prims

    return inductor_prims.force_stride_order


FORCE_STRIDE = _force_stride_op()  # bucket.py pins a copy-out's layout with it
# A bucket's whole copy-in and copy-out as one node each ([Note: one copy-in and one copy-out per
# bucket in compiled graphs] in fsdp_compile/kernels/ops.py); a parameter reads its unsharded
# tensor from the copy-out through a getitem.
COPY_IN = torch.ops.fsdp_compile.all_gather_copy_in_functional.default
COPY_OUT = torch.ops.fsdp_compile.all_gather_copy_out_functional.default


# --- Nodes ---------------------------------------------------------------------------------------


def collective_nodes(graph: fx.Graph, target: Any) -> list[fx.Node]:
    """The ``call_function`` nodes of ``target`` (e.g. ``ALL_GATHER``), in graph order."""
    return graph.find_nodes(op="call_function", target=target)


def single_wait(collective: fx.Node) -> fx.Node | None:
    """The one ``wait_tensor`` that reads ``collective``, or None if its result is read any other way:
    compile/param_reads.py emits each collective so, and the passes move a collective only with its wait."""
    users = list(collective.users)
    if len(users) == 1 and users[0].target is WAIT:
        return users[0]
    return None


# [Note: one wait per collective]
# A collective read twice (a tied parameter: the embedding and the output projection read one
# all-gather) is waited on once in torch 2.13's graphs, whose CSE merged the two reads' waits; torch
# 2.14 marks ``wait_tensor`` side-effecting, so its CSE keeps both and the collective has two waits
# (each with its own copy of the slice after it). Waiting twice on one collective yields the same
# tensor, so ``apply_post_grad_passes`` (passes/__init__.py) first reads every later wait as the
# first one, once per graph; the graph then holds the shape every pass rewrites (one collective,
# one wait) on either torch. A pass run alone on a graph with two waits leaves that collective
# alone and counts it (``single_wait`` is None), as any collective read other than through one wait.
def one_wait_per_collective(graph: fx.Graph) -> int:
    """Make every collective whose readers are all ``wait_tensor`` read through its first wait (the
    later waits' readers read it; the later waits go); returns how many waits went."""
    merged = 0
    position: dict[fx.Node, int] | None = None
    for target in COLLECTIVES:
        for collective in collective_nodes(graph, target):
            waits = list(collective.users)
            if len(waits) < 2 or any(wait.target is not WAIT for wait in waits):
                continue
            position = position or {node: i for i, node in enumerate(graph.nodes)}
            first, *later = sorted(waits, key=position.__getitem__)
            for wait in later:
                wait.replace_all_uses_with(first)
                graph.erase_node(wait)
                merged += 1
    return merged


def node_value(node: Any) -> Any:
    """A node's fake value (``meta["val"]``), or a constant argument as it is."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def new_node(graph: fx.Graph, target: Any, args: tuple, annotation: dict | None, kwargs: dict | None = None,
              fake_like: fx.Node | None = None) -> fx.Node:
    """A call_function node with ``meta["val"]`` computed on the inputs' fake tensors (Inductor needs
    it); ``fake_like``: a node whose fake mode to use where the node has no tensor inputs."""
    node = graph.call_function(target, args, kwargs)
    inputs = node.all_input_nodes or ([fake_like] if fake_like is not None else [])
    if inputs and all("val" in i.meta for i in inputs):
        values = fx.node.map_arg(args, node_value)
        fake_mode = torch._guards.detect_fake_mode([i.meta["val"] for i in inputs])
        if fake_mode is not None:
            with fake_mode:
                node.meta["val"] = target(*values, **(kwargs or {}))
    if annotation is not None:
        node.meta["custom"] = annotation
    return node


def erase_unused_chain(graph: fx.Graph, node: Any) -> None:
    """Erase ``node`` and then its first input, while each is a computation nothing reads."""
    while isinstance(node, fx.Node) and node.op == "call_function" and not node.users and not node.is_impure():
        source = node.args[0] if node.args else None
        graph.erase_node(node)
        node = source


def is_tangent(node: fx.Node) -> bool:
    """An incoming gradient of an AOTAutograd graph; AOTAutograd itself tells them by the placeholder's
    target (``torch._functorch._aot_autograd.utils._is_tangent``), so this is its contract, not a guess."""
    return node.op == "placeholder" and "tangents" in str(node.target)


def graph_kind(gm: fx.GraphModule) -> str:
    """"backward" if the graph consumes a tangent or reduce-scatters, else "forward"."""
    graph = gm.graph
    if any(is_tangent(node) for node in graph.find_nodes(op="placeholder")):
        return "backward"
    return "backward" if collective_nodes(graph, REDUCE_SCATTER) else "forward"


# What an ``aten._to_copy`` that only casts may name (is_cast checks they keep the input's).
_CAST_KWARGS = {"dtype", "device", "layout", "memory_format"}
# Reshapes that allocate nothing, though the op schema does not mark them as aliasing.
_ALSO_VIEWS = {_aten._unsafe_view.default}
# Ops that only move, pad or re-type data (a bucket's copy-in and copy-out), computing nothing.
_COPIES = {
    _aten.cat.default, _aten.clone.default, _aten._to_copy.default, _aten.constant_pad_nd.default,
    _aten.slice_backward.default, torch.ops.prims.convert_element_type.default, FORCE_STRIDE, COPY_IN, COPY_OUT,
}


def is_cast(node: fx.Node) -> bool:
    """A change of dtype alone: ``prims.convert_element_type`` (what ``tensor.to(dtype)`` traces to
    under torch 2.13) or an ``aten._to_copy`` that keeps its input's device, layout and memory format
    (torch 2.14's spelling of the same cast)."""
    if node.op != "call_function":
        return False
    if node.target is torch.ops.prims.convert_element_type.default:
        return True
    if node.target is not _aten._to_copy.default or len(node.args) != 1 or not set(node.kwargs) <= _CAST_KWARGS:
        return False
    source = node_value(node.args[0])
    kwargs = node.kwargs
    return (
        isinstance(source, torch.Tensor)
        and kwargs.get("device", source.device) == source.device
        and kwargs.get("layout", source.layout) == source.layout
        and kwargs.get("memory_format") in (None, torch.preserve_format)
    )


def host_source(node: fx.Node) -> fx.Node | None:
    """What ``node`` copies from another device, the copy alone (``prims.device_put``, or an
    ``aten._to_copy`` that keeps the dtype; either under a cast to the same dtype), or None: a
    CPU-offloaded shard read on the device ([Note: offloaded shards under whole-model compile] in
    fsdp_compile/compile/param_reads.py)."""
    value, source = node_value(node), node_value(node.args[0]) if node.args else None
    if is_cast(node) and isinstance(value, torch.Tensor) and isinstance(source, torch.Tensor) and source.dtype == value.dtype:
        node = node.args[0]
    if node.op != "call_function" or node.target not in (torch.ops.prims.device_put.default, _aten._to_copy.default):
        return None
    source, copied = node_value(node.args[0]), node_value(node)
    if node.target is _aten._to_copy.default and (len(node.args) != 1 or not set(node.kwargs) <= _CAST_KWARGS):
        return None
    moved = isinstance(source, torch.Tensor) and isinstance(copied, torch.Tensor) and source.device != copied.device
    return node.args[0] if moved and source.dtype == copied.dtype else None


def is_view(node: fx.Node) -> bool:
    """An op whose output shares its input's storage: it costs no bytes and saves none."""
    target = node.target
    if target is operator.getitem:
        return True
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target in _ALSO_VIEWS)


def is_copy(node: fx.Node) -> bool:
    """An op that moves data without computing on it (cat, pad, cast, layout pin)."""
    return node.target in _COPIES


# --- Bytes ---------------------------------------------------------------------------------------


def tensor_bytes(value: Any) -> int:
    """Bytes of a fake tensor (``node.meta["val"]``), or of the tensors in a tuple or list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def collective_bytes(collective: fx.Node) -> int:
    """Bytes a collective keeps allocated until its wait: an all-gather's output (the unsharded
    bucket), a reduce-scatter's input (the unsharded gradients), an all-reduce's tensor.

    The in-flight budget, the dump timeline and the cost model all count these.
    """
    if collective.target is REDUCE_SCATTER and isinstance(collective.args[0], fx.Node):
        return tensor_bytes(collective.args[0].meta.get("val"))
    return tensor_bytes(collective.meta.get("val"))


def inflight_collectives(graph: fx.Graph) -> Iterator[tuple[fx.Node, dict[fx.Node, int]]]:
    """(node, {collective: collective_bytes} issued and not yet waited on just after it), in graph order.

    Every collective counts, the HSDP all-reduce included. The dict is a fresh copy per node.
    """
    flying: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target in COLLECTIVES:
            flying[node] = collective_bytes(node)
        elif node.op == "call_function" and node.target is WAIT:
            flying.pop(node.args[0], None)
        yield node, dict(flying)


def inflight_bytes(graph: fx.Graph) -> Iterator[tuple[fx.Node, int]]:
    """(node, bytes of collectives issued and not yet waited on just after it), in graph order."""
    for node, flying in inflight_collectives(graph):
        yield node, sum(flying.values())


def max_inflight_bytes(graph: fx.Graph) -> int:
    """The most bytes in flight at any point of ``graph`` (what ``PassConfig.max_inflight_bytes`` bounds)."""
    return max((total for _, total in inflight_bytes(graph)), default=0)


# --- Giving up -----------------------------------------------------------------------------------

# [Note: a pass that gives up]
# A pass that cannot rewrite (part of) a graph leaves it as it found it: the result is still
# correct, only slower (but for a block frame's all-gather under an all-gather extension, which the
# backend then refuses: compile/policy.py). So that this never goes unnoticed, each such place calls ``give_up``,
# which logs why and counts it in ``pass_counters["<pass>.gave_up"]`` (a process-wide tally, as
# Inductor's ``torch._dynamo.utils.counters``); the pass tests assert it stays zero on the
# models we ship.
pass_counters: Counter[str] = Counter()


def give_up(pass_name: str, reason: str, *args: Any) -> None:
    """Count and log that ``pass_name`` left (part of) a graph alone; see [Note: a pass that gives up].

    Example::

        give_up("bucket", "gradients of %s depend on each other's reduction; left per parameter", groups)
    """
    pass_counters[f"{pass_name}.gave_up"] += 1
    logging.getLogger(f"fsdp_compile.passes.{pass_name}").warning(f"fsdp {pass_name}: {reason}", *args)
