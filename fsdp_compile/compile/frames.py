"""Blocks compiled as frames: what happens when a block frame is entered, how its all-gathers cross
frame boundaries (forward and backward prefetch) and how its reduce-scatters are handed over late
(docs/design.md section 5.4).

Per block state (``BlockFrameFSDPState``, mixed into it): what runs eagerly as its frame is entered,
what the groups outside blocks gathered this forward. Per model (its root's ``RootFrames``): each
block's ``BlockFrame`` (its two prefetch slots, ``FramePrefetch``, and its neighbours in the learned
order), the learned order's ends, the blocks registered for the frame ops by their shards' addresses,
their late gradient sinks, the reductions handed over in flight, and the blocks this forward entered
(compared across ranks). The frame ops themselves (``ops.py``) find their model by the shards or
sinks a graph gives them, in O(1), through the one registry of the roots with frames
(``_FrameRoots``, held weakly).
"""
from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING

import torch

from fsdp_compile import config
from fsdp_compile.compile import torch_patches
from fsdp_compile.compile.extension_gathers import gather_through_extensions
from fsdp_compile.compile.graph_check import END_OF_FORWARD, block_frames_fingerprint, check_block_frames_match_across_ranks
from fsdp_compile.compile.kept_gathers import KeptGather, addresses_and_versions, columns_for_graph
from fsdp_compile.compile.ops import FrameOpsRuntime, serve_frame_ops
from fsdp_compile.compile.trace_context import note_block_frame_entered, traced_without_graph_breaks
from fsdp_compile.runtime.collectives import pending_functional_reduce_scatter
from fsdp_compile.runtime.param_group import TrainingState
from fsdp_compile.runtime.state import FSDPState, state_of

if TYPE_CHECKING:
    from fsdp_compile.runtime.param import FSDPParam
    from fsdp_compile.runtime.param_group import FSDPParamGroup

__all__ = ["FramePrefetch", "BlockFrame", "RootFrames", "BlockFrameFSDPState", "blocks_as_frames_in_this_trace", "land_late_reductions", "gradient_holder"]

_functional = torch.ops._c10d_functional

# [Note: blocks compiled as frames]
# A region still costs the whole-model trace something per block: Dynamo traces each block's parameter
# reads and checks the reuse of its body, AOTAutograd partitions a joint graph holding every block's
# collectives, Inductor lowers them; the 16-layer benchmark model compiled in 2.6x the time of PyTorch
# FSDP2's per-block compile, growing 0.65 s per layer. With config.block_compile = "frames" (the default), a block's
# forward instead breaks the caller's graph (state.eager_enter_block_frame, a torch.compiler.disable'd
# call) and the rest of it is a Dynamo frame of its own: its graph reads the block's shards,
# all-gathers the group before the body (a graph node that takes the prefetch across frames:
# [Note: prefetch across block frames]), and its backward holds the group's reduce-scatter, with a
# resharding block gathering again in backward (passes/recompute.py, as for any graph). Dynamo keys
# compiled frames by code object, and this code is every block's: a block whose guards hold on the
# first one's graph runs that graph, so compile time stays flat with depth; blocks that differ compile
# a graph per structure, each structure with its own recompile budget
# ([Note: a recompile limit per block structure] in torch_patches.py). Nothing in the trace may then tell
# blocks apart: the annotations name the block's class (frame_label) and a shared token rather than
# the group's label and state, and the backend learns which block it admits from the eager call that
# entered the frame (block_frame_in_trace). The groups outside blocks (the root) are read in several
# graphs, the frames splitting their forward: the first read in a forward gathers the whole group and
# hands the unsharded parameters to later graphs (CompiledFSDPState.unsharded_across_frames), so each group
# still gathers and reduces once per step. The root's own hooks hand their bookkeeping (staging
# no-sync sums, the handoff) to an eager call as well: traced, their walk over every group cost
# compile time and guards per block. A frame Dynamo gives up on (recompile limit, a skipped frame)
# runs with the eager hooks, as any block ([Note: frames Dynamo runs eagerly] in module.py). A read of a group
# outside blocks that runs eagerly under the compiled model (Dynamo skips the read's code once a trace
# of it held no op, as the eager fallback's does) gathers that group in a small graph of its own
# (compiled_state._gather_group_in_a_graph), bucketed as in any graph. Frames are the default: they keep
# compile time flat with depth, where regions (regions.py) grow with it. Not a frame: a block called
# inside a higher-order op of its caller's graph (checkpoint(block, x), as Hugging Face's gradient
# checkpointing calls its layers), whose graph cannot break there (trace_context.
# traced_in_a_callers_higher_order_op): it compiles as a region of that graph, or inline where regions
# are not used (a block whose class checkpoints itself in its own __call__, as Hugging Face's layers
# do now, enters its frame there instead: [Note: a block that checkpoints itself in __call__] in regions.py); and
# every block under fullgraph=True. Ranks whose control flow enters different blocks are caught before
# the block's collectives ([Note: ranks entering different block frames] in graph_check.py), since
# every rank compiles the same frames.
#
# [Note: prefetch across block frames]
# A block frame's graph reads its parameters as any graph does: each read traces its unshard, the bucket
# pass makes the group's all-gather one node, the reorder pass puts it at the graph's start. Left as it
# is, that all-gather could only overlap the block's own first ops; one traced into the previous block's
# graph instead (to prefetch) would make the last block's graph differ from the others' (it has no next
# block), so a chain of identical blocks would compile two frames. The graph cannot name the block (one
# graph serves them all) nor take an input for the block after it. So the post-grad pass
# (passes/recompute.gather_frames_through_prefetch) turns the bucket's copy-in + all-gather into one
# opaque call, fsdp_compile::frame_all_gather, on the same shards, in the same place, its result waited
# on where the reorder pass put the wait; a graph node still, after bucketing and placing. At run time
# (_gather_in_frame below) the call finds its block by the shards' addresses (registered as the block's
# compiled frame was entered, enter_block_frame), takes the all-gather the block before it issued for
# it if one was issued on exactly these shards at these versions (else issues its own), and issues that
# of the block after it (the order the last forward entered them in: BlockFrameFSDPState._learn_frame_order, the
# module tree's at the first), with the shards that block's graph gathered last time. So block i+1's
# all-gather is in flight before block i's first matmul and runs while block i computes, as FSDP2's
# eager forward prefetch; every block's graph is the same, the first, the last and the others; at most
# two blocks are unsharded at once in forward (a frame lets go of its parameters at its end). A
# resharding block's backward graph gathers again, as any graph's (passes/recompute.py), nothing
# unsharded saved. Every rank decides alike: the order, the registration (on every rank, or, where a
# parameter has no rows on some rank and so no address of its own, on none) and the learned gathers
# are the same on all ranks. Not prefetched: a block's first forward (what its graph gathers is learned
# then), a block with CommPolicy's quantized all-gather or tensor-parallel parameters (they gather in
# their own graph), the groups outside blocks. A prefetch is never read stale: one whose shards were
# written since (the optimizer's step) is waited on and let go where the block's graph asks for its
# all-gather; one no frame took (a block skipped on a step) is let go as the next forward's first frame
# is entered (BlockFrame.drop_prefetch, from BlockFrameFSDPState._learn_frame_order); a frame Dynamo runs eagerly hands it to its eager hooks
# ([Note: frames Dynamo runs eagerly] in module.py).
#
# [Note: backward prefetch across block frames]
# A resharding block's backward graph gathers its shards again (a bucketed graph all-gather, which the
# reorder pass hoists to the graph's start), and the same pass makes it the same opaque call as in
# forward ([Note: prefetch across block frames]), run the other way: it takes the all-gather the block
# after it issued for it and issues that of the block before it, the one that ran forward before it and
# so runs backward next, with the shards that block's backward graph gathered last time. So block i-1's
# all-gather runs while block i's backward computes, as FSDP2's eager backward prefetch does; at most
# two blocks are unsharded at once in backward. A block is registered for its backward's gather where
# its compiled frame ran forward with gradients on. Not prefetched: a block whose compiled frame did not
# run forward with gradients on since its backward last ran (a frame Dynamo ran eagerly: its eager hooks
# gather; a no-grad forward), a block's first backward (its gather is learned then), the groups outside
# blocks. One that no backward took (a backward that stops early) is let go as the next forward's first
# frame is entered, as a forward prefetch is.
# The reduce-scatters are issued in the block's graph and waited after it ([Note: late reduce-scatter
# wait across block frames]).
#
# [Note: late reduce-scatter wait across block frames]
# A block frame's backward graph ends where the block's backward ends, so a reduce-scatter waited in
# it overlaps only the rest of that block's backward: the block's bucket, issued after its last
# gradient, hardly anything. FSDP2's eager backward waits on a block's reduce-scatter in the next
# block's post-backward instead, and so do we. The traced reduction of a block frame's parameter
# (all_gather_shard's autograd formula, given the parameter's ``gradient_handover_sink``) returns no
# gradient for the shard: it passes the reduced, divided and cast padded shard with the sink to
# fsdp_compile::deliver_reduced_gradient, which writes it into the sharded ``.grad`` and runs the
# post-accumulate-grad hooks (the eager copy-out, FSDPParamGroup.write_sharded_grads), and returns
# the sink's gradient: zeros, one element, a graph output, so the call is never dead code. The sink
# (a graph input) says whose gradient it is (owner_of_late_gradient_sink below, by address),
# so the graph still names no block. After bucketing and reordering, the post-grad pass
# (passes/recompute.deliver_frame_reductions_late) replaces the wait, copy-out and deliveries of
# each bucket whose reduced shard only its parameters' deliveries read with one
# fsdp_compile::deliver_reduce_scatter_late(in flight, its input, sinks) at the graph's end. At run
# time (_deliver_gradients_late below) that call first lands the reduce-scatters handed over before
# it (the block after this one's: wait, copy-out, .grad, hooks, in FSDPParamGroup.finish_reduction,
# the eager runtime's own), then holds its own as the group's reduction in flight, landed by the
# next hand-over or when the backward ends (a callback queued on autograd's engine). So block i's
# reduce-scatter runs while block i-1's backward computes; two are in flight at most, as in FSDP2.
# The hand-over is the graph's last call because a collective's buffers may not be reused before its
# wait, and Inductor knows only of waits in its graph: after the last call it allocates nothing;
# the runtime keeps both buffers until the wait. Waited in the graph as before: HSDP (an all-reduce
# follows), CommPolicy's gradient wire, tensor-parallel parameters, the groups outside blocks, a
# bucket whose reduced shard something else reads, and any graph another backend compiles (there
# the first call delivers where the graph computed the gradient). Under compiled autograd, which
# traces the whole backward into one graph of its own, no frame takes a sink: its reductions return
# their gradients, as outside frames (trace_context.traced_under_compiled_autograd). Nor over one rank
# (a shard group of size 1), where nothing is in flight to wait on late ([Note: the cost of entering
# a block frame]). ``.grad`` is complete when ``backward()`` returns, as before.
#
# [Note: the cost of entering a block frame]
# Beyond its own ops, a block frame costs the host each step: the eager call that breaks the
# caller's graph (enter_block_frame), Dynamo's cache lookup and guards for the caller's resume and
# the block's frame, the graph's frame ops, and in backward the hand-over of its gradients. FSDP2's
# per-block compile pays the lookup and guards of one frame and its eager hooks. What ours keeps small:
# - A frame op finds its model in O(1): the one registry of the roots with frames (_FrameRoots) by
#   the first shard's or sink's address, then the root's map to the block (BlockFrame), whose
#   parameters' indices come from the addresses registered as its frame was entered. (It walked every
#   live FSDP state per call, and rebuilt the group's address map per gather.)
# - Entering a frame writes the registrations only where they changed since the last entry (a load or
#   a ``.data`` swap moves shards; a group's late sinks never move), and decides once per group
#   whether its shards identify it on every rank (a fact of the shapes).
# - Over one rank a block's reductions are no collective ([Note: no collective over one rank] in
#   ops.py), so nothing is in flight to hand over: its gradients are returned to autograd, as outside
#   frames. Delivered to the runtime, each parameter's cost a custom-op call, an owner lookup and a
#   copy-out of its own (nine per block of the benchmark model), most of a block's backward host time.
# The cross-rank check of the blocks entered costs a set lookup per block once a sequence is agreed
# ([Note: ranks entering different block frames] in graph_check.py).


def blocks_as_frames_in_this_trace() -> bool:
    """``config.block_compile`` is "frames", unless the trace may not break the graph (fullgraph=True),
    where blocks are regions as before ([Note: blocks compiled as frames])."""
    return config.block_compile_is("frames") and not traced_without_graph_breaks()


class FramePrefetch:
    """One direction's all-gather of a block frame's group (forward's or backward's), as its graph's
    ``fsdp_compile::frame_all_gather`` asks for it: what that graph gathers (learned as it first runs:
    indices of the group's parameters, padded numels, dtype, shard size, process group), whether the
    block's compiled frame was entered for it since it last ran (forward: entered; backward: entered
    with gradients on), and the all-gather issued for it ahead, with what it was issued on. See [Note:
    prefetch across block frames] in frames.py."""

    def __init__(self) -> None:
        self.learned: tuple | None = None
        self.pending = False
        self.in_flight: torch.Tensor | None = None
        self._issued_from: tuple | None = None

    def take(self, shards: list[torch.Tensor], layout: tuple | None = None) -> torch.Tensor | None:
        """The all-gather issued ahead on exactly ``shards`` as they are now, in ``layout`` (what the
        graph gathers, by default), or None (any other is let go)."""
        in_flight, issued_from = self.in_flight, self._issued_from
        self.in_flight, self._issued_from = None, None
        if in_flight is None:
            return None
        if issued_from != (self.learned if layout is None else layout, addresses_and_versions(shards)):
            torch.ops._c10d_functional.wait_tensor(in_flight)
            return None
        return in_flight

    def issue_ahead(self, group: "FSDPParamGroup | None", layout: tuple | None = None) -> None:
        """The all-gather this graph issued last time, on ``group``'s shards as they are now (in ``layout``:
        a group kept gathered gathers whole, see kept_gathers.py)."""
        if self.learned is None or group is None or self.in_flight is not None:
            return
        layout = self.learned if layout is None else layout
        indices, padded_numels, param_dtype, shard_size, shard_group_name = layout
        shards = [group.fsdp_params[index].local_shard() for index in indices]
        self.in_flight = _issue_frame_all_gather(shards, padded_numels, param_dtype, shard_size, shard_group_name, group.device)
        self._issued_from = (layout, addresses_and_versions(shards))

    def is_whole_group_of(self, group: "FSDPParamGroup") -> bool:
        """Whether what it gathers is ``group``'s eager all-gather, in its layout (its eager hooks can take it)."""
        if self.learned is None:
            return False
        indices, padded_numels, param_dtype, shard_size, shard_group_name = self.learned
        spec = group.reduce_spec
        return (
            indices == tuple(range(len(group.fsdp_params))) and param_dtype == group.param_dtype
            and padded_numels == [p.padded_shard_numel for p in group.fsdp_params]
            and (shard_size, shard_group_name) == (spec.shard_size, spec.shard_group_name)
        )

    def drop(self) -> None:
        """Let go of an all-gather issued ahead that no graph will read, once it completed (its buffer is
        in use until then, and a collective's tensor is waited on before it is freed)."""
        if self.in_flight is not None:
            torch.ops._c10d_functional.wait_tensor(self.in_flight)
        self.in_flight, self._issued_from = None, None


def _issue_frame_all_gather(
    shards: list[torch.Tensor], padded_numels: list[int], param_dtype: torch.dtype, shard_size: int, shard_group_name: str, device: torch.device,
) -> torch.Tensor:
    """A block frame's group all-gather on ``device`` as ``frame_all_gather`` issues it (one flat buffer, the
    eager runtime's fused copy-in), in flight for the graph that waits on it ([Note: prefetch across block
    frames]; host shards: [Note: offloaded shards under whole-model compile] in param_reads.py)."""
    with torch.no_grad():
        flat = torch.ops.fsdp_compile.all_gather_copy_in_functional([s.to(device, non_blocking=True) for s in shards], padded_numels, param_dtype)
        return _functional.all_gather_into_tensor(flat, shard_size, shard_group_name)


class BlockFrame:
    """What the root keeps for one block compiled as a frame: its forward and backward all-gathers
    (``gathers``, by ``backward``: False, True), each with the one issued for it ahead, and its
    neighbours in the learned order: ``next``, the block whose frame ran after it in the last forward
    (the module tree's order at first), and ``previous``, the block entered just before it in the
    last forward that entered it (its backward runs after this one's), None where it came first. See
    [Note: prefetch across block frames]."""

    def __init__(self, state: "FSDPState") -> None:
        self.state = state
        self.gathers = (FramePrefetch(), FramePrefetch())
        self.next: BlockFrame | None = None
        self.previous: BlockFrame | None = None
        # What RootFrames registered for this block, so that a frame entry whose group and shards are
        # those of the last one writes nothing ([Note: the cost of entering a block frame]): the group
        # whose late sinks are registered, the group found identifiable (_gathers_identifiably_in_frames)
        # and the group's shards' addresses as registered, each with its index in the group.
        self.sinks_registered_for: FSDPParamGroup | None = None
        self.identifiable_group: tuple[FSDPParamGroup, bool] | None = None
        self.index_by_address: dict[int, int] = {}
        # What the group gathered, kept across a backward ([Note: keeping parameters gathered across a backward] in kept_gathers.py).
        self.kept = KeptGather(state)

    def indices_of(self, shards: list[torch.Tensor]) -> "tuple[int, ...] | None":
        """The indices in the block's group of the parameters whose shards ``shards`` are (every one
        of them, by the addresses registered as its frame was entered), or None."""
        index_by_address = self.index_by_address
        indices = tuple(index_by_address.get(shard.data_ptr(), -1) for shard in shards)
        return None if -1 in indices else indices

    def gather_to_keep(self, layout: tuple, whole: tuple) -> torch.Tensor:
        """In this group's backward graph, whose gather is ``layout``: the group's whole all-gather
        (``whole``, the forward's layout; issued ahead by the block after it, or now), kept, and the
        graph's columns of it ([Note: keeping parameters gathered across a backward] in kept_gathers.py)."""
        group = self.state.group
        assert group is not None
        indices, padded_numels, param_dtype, shard_size, shard_group_name = whole
        shards = [group.fsdp_params[index].local_shard() for index in indices]
        in_flight = self.gathers[True].take(shards, whole)
        if in_flight is None:
            in_flight = _issue_frame_all_gather(shards, padded_numels, param_dtype, shard_size, shard_group_name, group.device)
        return columns_for_graph(self.kept.keep(in_flight, whole, shards), whole, layout)

    def gather_next_ahead(self, backward: bool) -> None:
        """In this block's forward (backward) graph: issue the all-gather of the block whose forward
        (backward) runs next, the block after it in the last forward (the one before it), as its graph
        gathered last time. Backward: where its compiled frame ran forward with gradients on since its
        backward last ran; forward: where its frame will take it (compiled as a frame, its hooks idle)."""
        if backward:
            previous = self.previous
            if previous is not None and previous.gathers[True].pending:
                previous.gathers[True].issue_ahead(previous.state.group, previous.kept.whole_layout(previous.gathers[False].learned))
            return
        following = self.next
        if following is not None and not following.kept.holds and following.state.takes_prefetched_frame_gathers():
            following.gathers[False].issue_ahead(following.state.group)

    def drop_prefetch(self) -> None:
        """Eagerly: let go of the all-gathers issued ahead for this block that no frame will read."""
        for gather in self.gathers:
            gather.drop()


class RootFrames:
    """What the root of one model keeps for its blocks compiled as frames: each block's ``BlockFrame``,
    the first and last block entered (the learned order's ends), the blocks registered for the frame
    ops by their shards' addresses and the groups' late gradient sinks by theirs (a block frame's
    graph, shared by every block of its structure, names no block: [Note: prefetch across block
    frames]), the reductions a backward graph handed over in flight, oldest first, with the backward
    (autograd graph task) whose end lands them ([Note: late reduce-scatter wait across block frames]),
    and the blocks this forward entered so far with their fingerprint ([Note: ranks entering different
    block frames] in graph_check.py)."""

    def __init__(self) -> None:
        self.blocks: dict[FSDPState, BlockFrame] = {}
        self.first_block: BlockFrame | None = None
        self.last_block: BlockFrame | None = None
        self.blocks_by_shard: dict[int, BlockFrame] = {}
        self.owners_by_late_sink: dict[int, tuple[weakref.ref[FSDPParamGroup], int]] = {}
        self.handed_over: list[FSDPParamGroup] = []
        self.landed_at_end_of_backward: int | None = None
        self.entered: list[str] = []
        self.entered_fingerprint = ""

    def block(self, state: "FSDPState") -> BlockFrame:
        """``state``'s ``BlockFrame``, made at its first use."""
        frame = self.blocks.get(state)
        if frame is None:
            frame = self.blocks[state] = BlockFrame(state)
        return frame

    def register_shards(self, frame: BlockFrame, group: "FSDPParamGroup") -> None:
        """``frame``'s graphs' all-gathers find it by its group's shards (``_frame_block_of``), as they
        are now (a load or a ``.data`` swap may have moved them since the last entry)."""
        addresses = [fsdp_param.local_shard().data_ptr() for fsdp_param in group.fsdp_params]
        if len(addresses) == len(frame.index_by_address) and all(
            frame.index_by_address.get(address) == index for index, address in enumerate(addresses)
        ):
            return
        frame.index_by_address = {address: index for index, address in enumerate(addresses)}
        for address in addresses:
            self.blocks_by_shard[address] = frame
            _FRAME_ROOTS.register(address, self)

    def register_late_sinks(self, frame: BlockFrame, group: "FSDPParamGroup") -> None:
        """The late gradient sinks of ``frame``'s group (made with its parameters, never replaced) find
        their parameters (``owner_of_late_gradient_sink``)."""
        if frame.sinks_registered_for is group:
            return
        for index, fsdp_param in enumerate(group.fsdp_params):
            address = fsdp_param.gradient_handover_sink.data_ptr()
            self.owners_by_late_sink[address] = (weakref.ref(group), index)
            _FRAME_ROOTS.register(address, self)
        frame.sinks_registered_for = group

    def owner_of_late_sink(self, sink: torch.Tensor) -> "tuple[FSDPParamGroup, FSDPParam] | None":
        reference, index = self.owners_by_late_sink.get(sink.data_ptr(), (None, -1))
        group = reference() if reference is not None else None
        return None if group is None else (group, group.fsdp_params[index])

    def land_late_reductions(self) -> None:
        """Wait on every reduce-scatter handed over and write its gradients, oldest first."""
        while self.handed_over:
            group = self.handed_over.pop(0)
            if group._reduction_in_flight is not None:  # else a failed step let it go (reset_iter_state)
                group.finish_reduction()


class _FrameRoots:
    """The ``RootFrames`` of the live models whose blocks compile as frames, each found in O(1) by an
    address its frames registered (a block's shard, a late gradient sink): a frame op's graph names no
    block nor model, only tensors. Held weakly: a model that is dropped leaves it, its addresses with
    it (a later model may reuse an address: the last registration holds it)."""

    def __init__(self) -> None:
        self._by_address: dict[int, weakref.ref[RootFrames]] = {}
        self._roots: dict[weakref.ref[RootFrames], None] = {}  # in registration order
        self._references: weakref.WeakKeyDictionary[RootFrames, weakref.ref[RootFrames]] = weakref.WeakKeyDictionary()

    def register(self, address: int, frames: RootFrames) -> None:
        reference = self._by_address.get(address)
        if reference is not None and reference() is frames:
            return
        reference = self._references.get(frames)
        if reference is None:
            reference = self._references[frames] = weakref.ref(frames, self._forget)
            self._roots[reference] = None
        self._by_address[address] = reference

    def of(self, address: int) -> RootFrames | None:
        reference = self._by_address.get(address)
        return reference() if reference is not None else None

    def all(self) -> list[RootFrames]:
        return [frames for frames in (reference() for reference in self._roots) if frames is not None]

    def _forget(self, reference: weakref.ref[RootFrames]) -> None:
        self._roots.pop(reference, None)
        for address in [address for address, held in self._by_address.items() if held is reference]:
            del self._by_address[address]


_FRAME_ROOTS = _FrameRoots()


def _gather_in_frame(
    shards: list[torch.Tensor], padded_numels: list[int], param_dtype: torch.dtype, shard_size: int, shard_group_name: str,
    backward: bool, device: torch.device,
) -> torch.Tensor:
    """``fsdp_compile::frame_all_gather`` run in a block frame's graph: the group's all-gather in flight (issued ahead by
    the block that ran before it, or now), after issuing that of the block that runs next ([Note: prefetch across block frames])."""
    block, indices = _frame_block_of(shards, backward)
    if block is None:
        return _issue_frame_all_gather(shards, padded_numels, param_dtype, shard_size, shard_group_name, device)
    if block.state.group.uses_all_gather_extension:
        return gather_through_extensions(block, indices, padded_numels, param_dtype, shard_size, device, backward)
    gather = block.gathers[backward]
    layout = gather.learned = (indices, list(padded_numels), param_dtype, shard_size, shard_group_name)
    gather.pending = False
    # [Note: keeping parameters gathered across a backward] in kept_gathers.py
    kept = block.kept
    whole = kept.whole_layout(block.gathers[False].learned) if backward else None
    if whole is not None:
        in_flight = block.gather_to_keep(layout, whole)
    else:
        in_flight = None if backward else kept.take(layout, shards)
        if in_flight is not None:
            gather.drop()
        else:
            in_flight = gather.take(shards)
            if in_flight is None:
                in_flight = _issue_frame_all_gather(shards, padded_numels, param_dtype, shard_size, shard_group_name, device)
            if not backward and kept.keeps_from_forward():
                in_flight = kept.keep(in_flight, layout, shards).clone()
    block.gather_next_ahead(backward)
    return in_flight


def owner_of_late_gradient_sink(sink: torch.Tensor) -> "tuple[FSDPParamGroup, FSDPParam]":
    """The group and parameter whose ``gradient_handover_sink`` is ``sink`` (registered as the group's block
    frame was entered)."""
    frames = _FRAME_ROOTS.of(sink.data_ptr())
    owner = frames.owner_of_late_sink(sink) if frames is not None else None
    if owner is not None:
        return owner
    raise RuntimeError("fsdp_compile: a compiled backward handed over a gradient for a parameter no live fully_shard group owns")


def gradient_holder(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose ``.grad`` a compiled graph input's gradient ends in: the parameter a block
    frame's late gradient sink delivers to, else the input itself (a parameter, or a no-sync sink)."""
    if tensor.numel() == 1 and not isinstance(tensor, torch.nn.Parameter):
        frames = _FRAME_ROOTS.of(tensor.data_ptr())
        owner = frames.owner_of_late_sink(tensor) if frames is not None else None
        if owner is not None and owner[1].gradient_handover_sink is tensor:
            return owner[1].sharded_param
    return tensor


def _deliver_gradient_now(reduced: torch.Tensor, late_sink: torch.Tensor) -> None:
    """``fsdp_compile::deliver_reduced_gradient``: one parameter's reduced, divided and cast padded
    shard, written into its sharded ``.grad`` now."""
    group, fsdp_param = owner_of_late_gradient_sink(late_sink)
    group.write_sharded_grads([fsdp_param], reduced.reshape(-1).contiguous(), 1.0)


def _deliver_gradients_late(in_flight: torch.Tensor, reduce_input: torch.Tensor, late_sinks: list[torch.Tensor]) -> None:
    """``fsdp_compile::deliver_reduce_scatter_late``: land the reduce-scatters handed over before (the
    block after this one's), then hold this one until the next hand-over or the backward's end."""
    owners = [owner_of_late_gradient_sink(sink) for sink in late_sinks]
    group = owners[0][0]
    if any(owner is not group for owner, _ in owners):
        raise RuntimeError(f"fsdp_compile: a compiled backward handed over one reduce-scatter for the parameters of several groups ({group.label}, ...)")
    land_late_reductions()
    group.hold_reduction([fsdp_param for _, fsdp_param in owners], pending_functional_reduce_scatter(in_flight, reduce_input, group.label))
    backward = torch._C._current_graph_task_id()
    if backward == -1:  # not inside autograd's backward: nothing would land it later
        group.finish_reduction()
        return
    state = state_of(group.modules[0])
    assert state is not None
    frames = state.outermost().root_frames
    frames.handed_over.append(group)
    if frames.landed_at_end_of_backward != backward:
        frames.landed_at_end_of_backward = backward
        torch.autograd.Variable._execution_engine.queue_callback(land_late_reductions)


def land_late_reductions() -> None:
    """Wait on every reduce-scatter handed over (every model's) and write its gradients, oldest first."""
    for frames in _FRAME_ROOTS.all():
        frames.land_late_reductions()


def _frame_block_of(shards: list[torch.Tensor], backward: bool) -> "tuple[BlockFrame | None, tuple[int, ...] | None]":
    """The registered block whose shards ``shards`` are (all), entered for this gather or with an all-gather extension (which
    gathers through the runtime: [Note: all-gather extensions under a whole-model compile] in policy.py), with their indices."""
    if not shards:
        return None, None
    address = shards[0].data_ptr()
    frames = _FRAME_ROOTS.of(address)
    block = frames.blocks_by_shard.get(address) if frames is not None else None
    if block is None or not (block.gathers[backward].pending or block.state.group.uses_all_gather_extension):
        return None, None
    indices = block.indices_of(shards)
    return (block, indices) if indices is not None else (None, None)


serve_frame_ops(FrameOpsRuntime(_gather_in_frame, _deliver_gradient_now, _deliver_gradients_late))


class BlockFrameFSDPState:
    """The block-frame side of a ``CompiledFSDPState`` (mixed into it): what runs eagerly as a block's
    frame is entered, the root's hand-over of its bookkeeping around a compiled forward, and the
    prefetches across frames. See [Note: blocks compiled as frames]."""

    def _init_block_frames(self) -> None:
        # Names a block compiled as a frame in its graph: the same for every block of its class, so
        # one graph serves them all ([Note: blocks compiled as frames]).
        self.frame_label = f"{type(self.modules[0]).__name__} (block frame)"
        # The unsharded parameters of this forward's first read, by FQN (unsharded_across_frames).
        self.frame_handoff: dict[str, torch.Tensor] = {}
        # On a root whose blocks compile as frames: between its (eager) pre- and post-forward.
        self.frames_forward_running = False
        # On a root: that its explicit prefetch lists do not place a block frame's all-gathers was said.
        self.told_of_frames_prefetch = False
        # On a root: what its model's block frames share, each block's prefetches and place in the
        # learned order among them (read on the root only).
        self.root_frames = RootFrames()
        # Whether its BlockFrame holds a kept gather: a flag the traces of groups outside blocks read (kept_gathers.py).
        self.serves_kept_gather = False

    def _begin_frame_handoff(self) -> None:
        """Root pre- and post-forward under block frames, traced or run eagerly (a hook
        Dynamo gave up on): each group gathers afresh in the next forward, and nothing holds this one's
        unsharded parameters past it. (A prefetch no frame took is let go eagerly: see _learn_frame_order.)"""
        for state in self.states_in_tree():
            if state._is_outside_blocks():
                state.frame_handoff = {}

    def _learn_frame_order(self, frames: RootFrames, block: BlockFrame) -> None:
        """Eagerly, as this block's frame is entered (``block``, its root's ``frames``): the block
        entered before it in this forward prefetches this one from the next step on. The first forward
        takes the module tree's order of blocks; a block entered when the first block is entered again
        ended the last forward."""
        previous = frames.last_block
        if frames.first_block is None:
            frames.first_block = block
            blocks = [frames.block(state) for state in self.outermost().states_in_tree() if state._is_block()]
            for earlier, following in zip(blocks, blocks[1:]):
                earlier.next = following
            if blocks:
                blocks[-1].next = None
        elif block is frames.first_block:
            if previous is not None and previous.next is not None and previous is not block:
                previous.next = None  # it ended the last forward
            for other in frames.blocks.values():
                if other is not block:
                    other.drop_prefetch()  # a block the last forward prefetched and did not run
        elif previous is not None and previous.next is not block:
            previous.next = block
        block.previous = None if block is frames.first_block else previous
        frames.last_block = block

    def hand_frame_prefetch_to_eager_hooks(self) -> None:
        """Eagerly, where Dynamo runs this block's frame eagerly: the all-gather the block before it
        issued for it ahead is the one its eager hooks read, not one more; see [Note: frames Dynamo runs
        eagerly] in module.py. A stale one, or one the group cannot take, is let go."""
        block = self.outermost().root_frames.blocks.get(self)
        if block is None:  # never entered as a frame nor prefetched: nothing pending, nothing in flight
            return
        forward, backward = block.gathers
        forward.pending = backward.pending = False  # the eager hooks gather, forward and backward
        block.kept.let_go()
        group = self.group
        if forward.in_flight is not None and group is not None and forward.is_whole_group_of(group):
            in_flight = forward.take([p.local_shard() for p in group.fsdp_params])
            if in_flight is not None:
                gathered = torch.ops._c10d_functional.wait_tensor(in_flight).view(group.reduce_spec.shard_size, -1)
                if group.adopt_all_gather(gathered):
                    return
        block.drop_prefetch()

    def _gathers_identifiably_in_frames(self, block: BlockFrame) -> bool:
        """Whether ``gather_in_frame`` can tell this block by its shards' addresses on every rank: each
        parameter holds rows on every rank (a rank's empty shard has no address of its own), a fact of
        the shapes alone, the same on all ranks (so decided once per group)."""
        group = self.group
        if group is None:
            return False
        known = block.identifiable_group
        if known is None or known[0] is not group:
            identifiable = all(p.layout.row_numel > 0 and p.layout.rows(p.layout.world_size - 1) > 0 for p in group.fsdp_params)
            known = block.identifiable_group = (group, identifiable)
        return known[1]

    def _register_for_frame_gathers(self, frames: RootFrames, block: BlockFrame) -> None:
        """Eagerly, as this block's compiled frame is entered: its graphs' all-gathers will find it by
        its shards (``gather_in_frame``), its backward's where the forward runs with gradients on."""
        forward, backward = block.gathers
        group = self.group
        identifiable = self._gathers_identifiably_in_frames(block)
        forward.pending = identifiable
        backward.pending = identifiable and torch.is_grad_enabled()
        if identifiable:
            frames.register_shards(block, group)

    def takes_prefetched_frame_gathers(self) -> bool:
        """Whether this block's frame takes the all-gathers issued for it ahead ([Note: prefetch across
        block frames] in frames.py): a block compiled as a frame, not training its hooks eagerly nor
        recomputing in backward, without CommPolicy's quantized all-gather or tensor-parallel
        parameters (those gather in their own frame's graph, unprefetched)."""
        group = self.group
        return (
            config.block_compile_is("frames") and self._is_block() and self.training_state is TrainingState.IDLE
            and torch._C._current_graph_task_id() == -1 and group is not None
            and not group.comm_policy.quantizes_all_gather and not any(p.tensor_parallel is not None for p in group.fsdp_params)
        )

    def enter_block_frame(self) -> None:
        """Run eagerly where a block compiled as a frame breaks the caller's graph: names the block
        whose frame Dynamo traces next, for the backend's checks (``check_parameters_read`` in policy.py), whose
        graph carries no block's identity. See [Note: blocks compiled as frames] in frames.py."""
        torch_patches.require("recompile limit per block structure")
        note_block_frame_entered(self)
        root = self.outermost()
        # Only a compiled forward enters a block frame: its model runs compiled, also where this is the
        # first of its groups Dynamo meets (no graph admitted the root's yet) and runs the frame eagerly.
        root.runs_compiled = True
        root._check_frames_entered_across_ranks(self.label)
        if self.group is not None:
            self.note_frame_entry()  # [Note: a block frame's guards] in compiled_state.py
        frames = root.root_frames
        block = frames.block(self)
        self._learn_frame_order(frames, block)
        if self.group is not None:
            frames.register_late_sinks(block, self.group)
        if self.takes_prefetched_frame_gathers():
            self._register_for_frame_gathers(frames, block)
        if not root.told_of_frames_prefetch:
            root.told_of_frames_prefetch = True
            explicit = [s.label for s in root.states_in_tree() if s.forward_prefetch or s.backward_prefetch]
            if explicit:
                warnings.warn(
                    f"fsdp_compile: set_modules_to_forward_prefetch / set_modules_to_backward_prefetch on {explicit} have "
                    "no effect while fsdp_compile.config.block_compile is \"frames\": each block's frame prefetches "
                    "the block that ran after it in the last forward, whatever the lists say. Set block_compile = \"regions\" "
                    "to have the whole-model graph place them, or compile per block (block.compile()), where the eager "
                    "hooks honour them.",
                    stacklevel=2,
                )

    @staticmethod
    def _root_hooks_run_eagerly_for_frames(compiling: bool) -> bool:
        """Whether the root's hooks hand their work (staging the no-sync sums, the frames' handoff) to
        an eager call: blocks compiled as frames break the root's forward anyway, and Dynamo's trace of
        those walks over every group would cost compile time per block (and guards on each)."""
        return config.block_compile_is("frames") and (not compiling or blocks_as_frames_in_this_trace())

    def _check_frames_entered_across_ranks(self, label: str) -> None:
        """On the root, eagerly, as its compiled forward enters the block ``label`` (or ends): see
        [Note: ranks entering different block frames] in graph_check.py."""
        frames = self.root_frames
        frames.entered.append(label)
        frames.entered_fingerprint = block_frames_fingerprint(frames.entered_fingerprint, label)
        check_block_frames_match_across_ranks(self.label, frames.entered, frames.entered_fingerprint)

    def _frames_root_pre_forward(self) -> None:
        # Called for a compiled forward (or one whose hooks stand aside for it): the model runs compiled,
        # also where a block runs eagerly before any graph read a parameter (a disabled checkpoint call).
        self.runs_compiled = True
        self.frames_forward_running = True
        self.root_frames.entered, self.root_frames.entered_fingerprint = [], ""
        if torch.is_grad_enabled():
            self._stage_accumulated_grads()
        self._begin_frame_handoff()
        for state in self.states_in_tree():
            if state.keeps_gathered_across_frames():
                state._register_for_frame_gathers(self.root_frames, self.root_frames.block(state))

    def keeps_gathered_across_frames(self) -> bool:
        """Whether this group outside blocks gathers through the runtime, which keeps it gathered across a backward,
        holds a kept gather for it or copies its CPU-offloaded shards: its reads are traced with KEEPS_GATHERED_KEY
        ([Note: keeping parameters gathered across a backward] in kept_gathers.py)."""
        return self._is_outside_blocks() and (not self.group.reshard_after_backward or self.serves_kept_gather or self.group.fsdp_params[0].offload_to_cpu)

    def _frames_root_post_forward(self) -> None:
        self.frames_forward_running = False
        self._check_frames_entered_across_ranks(END_OF_FORWARD)
        self._release_staged_grads()
        self._begin_frame_handoff()
