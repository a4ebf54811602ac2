"""Post-grad pass: one all-gather and one reduce-scatter per ``fully_shard`` group.

Expects a partitioned forward or backward graph (AOTAutograd's, before or after Inductor's
decompositions) whose per-parameter collectives carry ``node.meta["custom"]["fsdp_group"]``
(``fsdp_compile.compile.param_reads``), each read through one wait ([Note: one wait per collective]
in graph.py). Leaves, per group (and per process group and dtype), one
collective on a flat bucket. The all-gather's copy-in pads and casts each shard to ``param_dtype``
as it writes the bucket (one op, or a ``cat`` of per-parameter casts Inductor fuses into the one
kernel that writes it); the reduce-scatter's ``cat`` takes the ``reduce_dtype`` casts alike; no
full-precision copy of a bucket exists::

    before:  cast(pad(p0)) -> ag -> wait -> use0 ...  cast(pad(p1)) -> ag -> wait -> use1
    after:   copy_in(p0, p1) -> ag -> wait -> [world, total] -> copy_out -> use0, use1
    (backward) grads g0, g1 -> cat per rank row -> reduce_scatter -> wait [-> + deferred -> all_reduce -> wait] -> split

The copy-in and the copy-out are one extern op each per bucket of several parameters (``COPY_IN``,
``COPY_OUT``; otherwise the ``cat`` and each member's columns reshaped): see [Note: one copy-in and
one copy-out per bucket in compiled graphs] in fsdp_compile/kernels/ops.py.
The bucketed all-gather sits where the group's first all-gather was (its shard inputs are
hoisted above it); the bucketed reduce-scatter right after the group's last gradient (readers of
the reduced shards that came earlier are moved after it). With ``merge_small_groups_bytes``
adjacent buckets merge while their unsharded size stays under the cap. A group it cannot bucket
stays per parameter, counted and logged (see [Note: a pass that gives up] in graph.py).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fsdp_compile.config import PassConfig
from fsdp_compile.passes.graph import (
    ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BUCKET_KEY, COLLECTIVE_NAMES, COLLECTIVES, COPY_IN, COPY_OUT, FORCE_STRIDE, FSDP_ANNOTATION_KEY, GROUP_KEY,
    GRADIENT_REDUCTIONS, GROUPS_KEY, KEEPS_GATHERED_KEY, PARAM_KEY, PARAMS_KEY, REDUCE_SCATTER, RESHARD_AFTER_FORWARD_KEY, STATE_KEY, WAIT, collective_nodes,
    erase_unused_chain, fsdp_annotation, give_up, is_cast, new_node, node_value, single_wait,
)

__all__ = ["bucket_collectives", "unpadded_shard"]

_aten = torch.ops.aten


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return list(reversed(strides))


@dataclass
class _Member:
    collective: fx.Node
    wait: fx.Node
    result: fx.Node  # what readers use: the wait, or for HSDP the all-reduce's wait
    numel: int  # per-rank elements of this member in the flat bucket
    # HSDP after steps that deferred the all-reduce: ``added = wait + addend`` feeds the all-reduce
    # (see [Note: deferred all-reduce] in fsdp_compile/param.py).
    added: fx.Node | None = None


@dataclass
class _Bucket:
    key: tuple
    groups: list[str]
    members: list[_Member] = field(default_factory=list)

    def numel(self) -> int:
        return sum(m.numel for m in self.members)


def _bucket_annotation(bucket: _Bucket, kind: str) -> dict:
    annotations = [fsdp_annotation(m.collective) or {} for m in bucket.members]
    states = {annotation.get(STATE_KEY) for annotation in annotations}
    one_group = len(states) == 1
    bucket_annotation = {
        FSDP_ANNOTATION_KEY: True,
        GROUP_KEY: "+".join(bucket.groups),
        GROUPS_KEY: tuple(bucket.groups),
        BUCKET_KEY: kind,
        PARAMS_KEY: tuple(str(annotation.get(PARAM_KEY)) for annotation in annotations),
        RESHARD_AFTER_FORWARD_KEY: annotations[0].get(RESHARD_AFTER_FORWARD_KEY),
        # The group's trace token where every member has the one (merged groups have none).
        STATE_KEY: states.pop() if one_group else None,
    }
    if one_group and all(annotation.get(KEEPS_GATHERED_KEY) for annotation in annotations):
        bucket_annotation[KEEPS_GATHERED_KEY] = True  # one group's, which the runtime keeps gathered (frames.py)
    return bucket_annotation


def _shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["val"].shape)


def _member_and_key(node: fx.Node, group: str) -> tuple[_Member, tuple] | None:
    """The member an annotated collective makes and the key of its bucket; None if it is not read
    through one wait of a traced tensor (the shape compile/param_reads.py emits)."""
    wait = single_wait(node)
    source = node.args[0]
    if wait is None or not isinstance(source, fx.Node) or "val" not in source.meta or "val" not in wait.meta:
        return None
    dtype = source.meta["val"].dtype
    if node.target is ALL_GATHER:
        world, group_name = node.args[1], node.args[2]
        return _Member(node, wait, wait, math.prod(_shape(source))), (ALL_GATHER, group, world, group_name, dtype)
    if node.target is ALL_TO_ALL:
        splits, group_name = node.args[1], node.args[3]
        world = len(splits)
        if list(node.args[2]) != list(splits) or len(set(splits)) != 1:
            return None
        return _Member(node, wait, wait, math.prod(_shape(source)) // world), (ALL_TO_ALL, group, world, group_name, dtype)
    reduce_op, world, group_name = node.args[1], node.args[2], node.args[3]
    result, replicate, added = wait, None, None
    users = list(wait.users)
    if len(users) == 1 and users[0].target is _aten.add.Tensor and users[0].args[0] is wait:
        after_add = list(users[0].users)
        if isinstance(users[0].args[1], fx.Node) and len(after_add) == 1 and after_add[0].target is ALL_REDUCE:
            added, users = users[0], after_add
    # HSDP: the reduced shard is all-reduced across replicas; bucket that too.
    if len(users) == 1 and users[0].target is ALL_REDUCE and single_wait(users[0]) is not None:
        result = single_wait(users[0])
        replicate = (users[0].args[1], users[0].args[2])
    key = (REDUCE_SCATTER, group, reduce_op, world, group_name, replicate, dtype)
    return _Member(node, wait, result, math.prod(_shape(wait)), added), key


def _collect(graph: fx.Graph, target: Any, config: PassConfig) -> list[_Bucket]:
    """Per-group buckets of annotated collectives, in order of each group's first collective."""
    buckets: dict[tuple, _Bucket] = {}
    for node in collective_nodes(graph, target):
        annotation = fsdp_annotation(node)
        if annotation is None or BUCKET_KEY in annotation:
            continue  # not FSDP's, or bucketed already
        group = annotation[GROUP_KEY]
        found = _member_and_key(node, group)
        if found is None:
            give_up(
                "bucket", "%s %s of %s is not read through one wait; left per parameter",
                COLLECTIVE_NAMES[target], node.name, group,
            )
            continue
        member, key = found
        buckets.setdefault(key, _Bucket(key, [group])).members.append(member)
    ordered = list(buckets.values())
    if target in GRADIENT_REDUCTIONS:  # a reduction bucket goes out after its last gradient
        position = {n: i for i, n in enumerate(graph.nodes)}
        ordered.sort(key=lambda b: max(position[m.collective] for m in b.members))
    return _merge_small(ordered, config)


def _merge_small(buckets: list[_Bucket], config: PassConfig) -> list[_Bucket]:
    cap = config.merge_small_groups_bytes
    if cap <= 0:
        return buckets
    merged: list[_Bucket] = []
    for bucket in buckets:
        previous = merged[-1] if merged else None
        if previous is not None and previous.key[:1] + previous.key[2:] == bucket.key[:1] + bucket.key[2:]:
            world = bucket.key[3] if bucket.key[0] is REDUCE_SCATTER else bucket.key[2]  # ALL_TO_ALL: key[2] too
            itemsize = bucket.key[-1].itemsize
            if (previous.numel() + bucket.numel()) * world * itemsize <= cap:
                previous.groups.extend(bucket.groups)
                previous.members.extend(bucket.members)
                continue
        merged.append(_Bucket(bucket.key, list(bucket.groups), list(bucket.members)))
    return merged


def _hoist_above(node: fx.Node, anchor: fx.Node, position: dict[fx.Node, float]) -> bool:
    """Move ``node`` and the inputs it needs above ``anchor``; False if one of them cannot move."""
    if position[node] < position[anchor]:
        return True
    if node.op != "call_function" or node.is_impure() or node.target in (*COLLECTIVES, WAIT):
        return False
    if not all(_hoist_above(i, anchor, position) for i in node.all_input_nodes):
        return False
    anchor.prepend(node)
    position[node] = position[anchor] - 0.5
    return True


def _bucket_all_gather(graph: fx.Graph, bucket: _Bucket, config: PassConfig) -> bool:
    position: dict[fx.Node, float] = {n: float(i) for i, n in enumerate(graph.nodes)}
    anchor = min((m.collective for m in bucket.members), key=position.__getitem__)
    if not all(_hoist_above(m.collective.args[0], anchor, position) for m in bucket.members):
        give_up("bucket", "cannot bucket all-gathers of %s (inputs computed late); left per parameter", bucket.groups)
        return False
    _, _, world, group_name, dtype = bucket.key  # dtype: every member's all-gather input's
    annotation = _bucket_annotation(bucket, "all_gather")
    total = bucket.numel()
    sent = node_value(bucket.members[0].collective.args[0])
    copy_ops = isinstance(sent, torch.Tensor) and config.bucket_copy_for(sent.device) == "ops"
    with graph.inserting_before(anchor):
        shards = [_unpadded_shard(m) for m in bucket.members]
        if copy_ops and len(bucket.members) > 1 and all(shard is not None for shard in shards):
            copy_in = new_node(graph, COPY_IN, (shards, [m.numel for m in bucket.members], dtype), annotation)
        else:
            flats = [new_node(graph, _aten.reshape.default, (m.collective.args[0], [-1]), annotation) for m in bucket.members]
            copy_in = new_node(graph, _aten.cat.default, (flats,), annotation) if len(flats) > 1 else flats[0]
        gathered = new_node(graph, ALL_GATHER, (copy_in, world, group_name), annotation)
        waited = new_node(graph, WAIT, (gathered,), annotation)
        rows = new_node(graph, _aten.view.default, (waited, [world, total]), annotation)
        if copy_ops and len(bucket.members) > 1 and dtype.is_floating_point:
            unsharded = _copy_out_in_one_node(graph, rows, bucket, annotation)
        else:
            unsharded = _copy_out_per_parameter(graph, rows, bucket, annotation)
        for member, tensor in zip(bucket.members, unsharded):
            member.wait.replace_all_uses_with(tensor)
    for member in bucket.members:
        padded = member.collective.args[0]
        graph.erase_node(member.wait)
        graph.erase_node(member.collective)
        erase_unused_chain(graph, padded)  # the pad and cast the copy-in op took over
    return True


def _unpadded_shard(member: _Member) -> fx.Node | None:
    return unpadded_shard(member.collective.args[0], member.numel)


def unpadded_shard(sent: fx.Node, padded_numel: int) -> fx.Node | None:
    """The local shard an all-gather input ``sent`` pads (and casts), as the copy-in op takes it: the
    input with at most a cast and a ``constant_pad_nd`` of rows on dim 0's end taken off (Inductor
    has already dropped a pad of no rows and a cast to the same dtype), a contiguous floating-point
    tensor. None for any other input (a quantized payload, a dim-1 shard's strided view)."""
    node = sent
    if is_cast(node):
        node = node.args[0]
    if node.target is _aten.detach.default:  # a read without gradient sync gathers its padded shard detached
        node = node.args[0]
    if node.target is _aten.constant_pad_nd.default and (len(node.args) < 3 or node.args[2] in (0, 0.0)):
        pads, padded = list(node.args[1]), node_value(node.args[0])
        # Only rows appended on dim 0: every pad before the last is zero (F.pad's pairs run from the last dim).
        if not isinstance(padded, torch.Tensor) or len(pads) != 2 * padded.dim() or any(pads[:-1]):
            return None
        node = node.args[0]
    value = node_value(node)
    if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.is_contiguous()):
        return None
    return node if value.numel() <= padded_numel else None


def _copy_out_in_one_node(graph: fx.Graph, rows: fx.Node, bucket: _Bucket, annotation: dict) -> list[fx.Node]:
    """The bucket's unsharded parameters from one extern copy-out (see [Note: one copy-in and one
    copy-out per bucket in compiled graphs] in fsdp_compile/kernels/ops.py): each a fresh, contiguous tensor."""
    shapes = [_shape(member.wait) for member in bucket.members]
    sizes, ndims = [size for shape in shapes for size in shape], [len(shape) for shape in shapes]
    outs = new_node(graph, COPY_OUT, (rows, [m.numel for m in bucket.members], sizes, ndims), annotation)
    return [new_node(graph, operator.getitem, (outs, index), annotation) for index in range(len(shapes))]


def _copy_out_per_parameter(graph: fx.Graph, rows: fx.Node, bucket: _Bucket, annotation: dict) -> list[fx.Node]:
    """Each parameter's columns of ``rows``, reshaped (a lone member's are a view of the buffer)."""
    unsharded, offset = [], 0
    for member in bucket.members:
        columns = new_node(graph, _aten.slice.Tensor, (rows, 1, offset, offset + member.numel), annotation)
        tensor = new_node(graph, _aten.reshape.default, (columns, list(_shape(member.wait))), annotation)
        # Pin the copy-out to the contiguous layout the per-parameter gather had: left free, Inductor
        # may lay it out for its consumer (a transposed mm operand) and change the GEMM's rounding.
        unsharded.append(new_node(graph, FORCE_STRIDE, (tensor, _contiguous_strides(_shape(member.wait))), annotation))
        offset += member.numel
    return unsharded


def _dependents(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    frontier = list(nodes)
    while frontier:
        for user in frontier.pop().users:
            if user not in seen:
                seen.add(user)
                frontier.append(user)
    return seen


def _bucket_reduction(graph: fx.Graph, bucket: _Bucket) -> bool:
    """One reduction per bucket, right after its last gradient: a reduce-scatter (then, for HSDP, the
    added deferred sums and the all-reduce), or CommPolicy's all-to-all, whose received
    ``[world, total]`` rows each member reads its columns of (its float32 sum stays per parameter,
    for Inductor to fuse)."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    grads = [m.collective.args[0] for m in bucket.members]
    anchor = max(grads, key=position.__getitem__)
    old = [n for m in bucket.members for n in _chain(m)]
    dependents = _dependents(old) - set(old)
    if any(g in dependents for g in grads):
        give_up("bucket", "gradients of %s depend on each other's reduction; left per parameter", bucket.groups)
        return False
    kind = bucket.key[0]
    annotation = _bucket_annotation(bucket, COLLECTIVE_NAMES[kind])
    cursor = anchor  # each new node goes right after the previous one

    def emit(target: Any, args: tuple, kwargs: dict | None = None, fake_like: fx.Node | None = None) -> fx.Node:
        nonlocal cursor
        with graph.inserting_after(cursor):
            cursor = new_node(graph, target, args, annotation, kwargs, fake_like)
        return cursor

    def zeros(shape: list[int], like: fx.Node) -> fx.Node:
        # aten.full, the constructor Inductor lowers in a post-grad graph (it decomposes new_zeros
        # earlier and refuses it here).
        value = node_value(like)
        return emit(_aten.full.default, (list(shape), 0), {"dtype": value.dtype, "device": value.device}, fake_like=like)

    world = bucket.key[3] if kind is REDUCE_SCATTER else bucket.key[2]
    # [Note: a tied parameter's one reduction]
    # A parameter tied under two names is read (and traced) once per name, so its two gradients come
    # as two members. Each reduced on its own, its gradient would cross the wire twice; eagerly,
    # autograd sums both uses on the one unsharded parameter before its one reduce-scatter. Here too:
    # the earlier member carries the sum, the later one reads zeros (its piece of the sum is in the
    # carrier's, and the two pieces add up in the shard's gradient as before).
    tied = _tied_reads(bucket) if kind is REDUCE_SCATTER else {}
    summed = list(grads)
    for later, carrier in tied.items():
        summed[carrier] = emit(_aten.add.Tensor, (summed[carrier], grads[later]))
    carried = [(index, member) for index, member in enumerate(bucket.members) if index not in tied]
    total = sum(member.numel for _, member in carried)
    per_rank = [emit(_aten.reshape.default, (summed[index], [world, m.numel])) for index, m in carried]
    copy_in = emit(_aten.cat.default, (per_rank, 1)) if len(per_rank) > 1 else per_rank[0]
    flat = emit(_aten.reshape.default, (copy_in, [world * total]))
    if kind is ALL_TO_ALL:
        splits = [total] * world
        received = emit(_aten.reshape.default, (emit(WAIT, (emit(ALL_TO_ALL, (flat, splits, splits, bucket.key[3])),)), [world, total]))
        pieces = [(member.wait, received, 1) for _, member in carried]
    else:
        _, _, reduce_op, world, group_name, replicate, _ = bucket.key
        reduced = emit(WAIT, (emit(REDUCE_SCATTER, (flat, reduce_op, world, group_name)),))
        if any(m.added is not None for _, m in carried):
            # A tied parameter's second read adds nothing: its sum was added through the first.
            addends = [
                emit(_aten.reshape.default, (m.added.args[1], [m.numel])) if m.added is not None
                else zeros([m.numel], reduced)
                for _, m in carried
            ]
            reduced = emit(_aten.add.Tensor, (reduced, emit(_aten.cat.default, (addends, 0)) if len(addends) > 1 else addends[0]))
        if replicate is not None:
            reduced = emit(WAIT, (emit(ALL_REDUCE, (reduced, replicate[0], replicate[1])),))
        pieces = [(member.result, reduced, 0) for _, member in carried]
    offset = 0
    for (_, member), (result, source, dim) in zip(carried, pieces):
        piece = emit(_aten.slice.Tensor, (source, dim, offset, offset + member.numel))
        if dim:  # the received rows' columns: copied out of the row-major buffer
            piece = emit(_aten.clone.default, (piece,))
        offset += member.numel
        result.replace_all_uses_with(emit(_aten.view.default, (piece, list(_shape(result)))))
    for later in tied:
        result = bucket.members[later].result
        result.replace_all_uses_with(zeros(list(_shape(result)), result))
    # Readers of a reduced shard that sat between its old collective and the last gradient move after the bucket.
    for node in [n for n in graph.nodes if n in dependents and position.get(n, -1) < position[anchor]]:
        cursor.append(node)
        cursor = node
    for member in bucket.members:
        for node in reversed(_chain(member)):
            graph.erase_node(node)
    return True


def _tied_reads(bucket: _Bucket) -> dict[int, int]:
    """{index of a member: index of the earlier member reducing the same parameter's gradient}; see
    [Note: a tied parameter's one reduction]. A member that adds HSDP's deferred sum is left alone."""
    first: dict[tuple, int] = {}
    tied: dict[int, int] = {}
    for index, member in enumerate(bucket.members):
        annotation = fsdp_annotation(member.collective) or {}
        key = (annotation.get(STATE_KEY), annotation.get(PARAM_KEY), member.numel, node_value(member.collective.args[0]).dtype)
        if key[0] is None or key[1] is None or member.added is not None:
            continue
        if key in first:
            tied[index] = first[key]
        else:
            first[key] = index
    return tied


def _chain(member: _Member) -> list[fx.Node]:
    chain = [member.collective, member.wait]
    if member.added is not None:
        chain.append(member.added)
    if member.result is not member.wait:
        chain += [member.result.args[0], member.result]
    return chain


def bucket_collectives(gm: fx.GraphModule, config: PassConfig) -> fx.GraphModule:
    """Bucket the annotated all-gathers and reduce-scatters of ``gm`` per group (see module docstring).

    Example::

        gm = bucket_collectives(forward_graph_module, PassConfig())
        # len(collective_nodes(gm.graph, ALL_GATHER)) == number of fully_shard groups read
    """
    if not config.bucket:
        return gm
    graph = gm.graph
    changed = False
    for bucket in _collect(graph, ALL_GATHER, config):
        changed |= _bucket_all_gather(graph, bucket, config)
    for target in GRADIENT_REDUCTIONS:
        for bucket in _collect(graph, target, config):
            changed |= _bucket_reduction(graph, bucket)
    if changed:
        graph.lint()
        gm.recompile()
    return gm
