"""Ranks compiled graphs whose collectives match, checked without a collective.

[Note: cross-rank graph check]
A compiled graph's collectives must match up across ranks, or the job hangs (NCCL) or aborts
(gloo). What must match is the sequence of collectives (kind, process group, FSDP group), not the
rest of the graph: ranks may legitimately trace different shapes (a smaller last batch, per-rank
sequence lengths) or recompile alone when their shapes change. So each compile publishes the
fingerprint of its collective sequence in the process group's store, under the Dynamo frame it
belongs to, and compares it with what the other ranks published for that frame:

- the graph holds no collective (a block frame's forward, whose all-gather was issued between
  frames; a model's code around the blocks): nothing can hang on it, and nothing is published or
  awaited. Dynamo may compile such a frame on one rank and run it eagerly on another (a frame it
  gave up on, whose bytecode each process treats by its own history): waiting there for the
  others would itself hang the job (seen in CI). The price: where rank-dependent control flow
  leaves one rank's graph of a frame with no collective and another's with some, the other rank
  is not told at once but by the timeout below;
- another rank already compiled a graph with the same collectives (the usual case, and every
  rank-local recompile): nothing to wait for;
- otherwise this is a new collective structure: wait (in the store, not in a collective) for every
  rank to publish it, which they do when they reach the same compile. If another rank is itself
  waiting on a different structure for this frame that this rank never compiled, the ranks
  diverged: both raise an error naming the ranks at once, long before any collective could hang.
  A rank that never arrives fails the wait after ``config.graph_check_timeout_s``.

Blocks compiled as frames share one graph on every rank, so there the ranks also compare the
sequence of blocks each forward enters ([Note: ranks entering different block frames] below).
"""
from __future__ import annotations

import hashlib
import re
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from fsdp_compile.annotations import GROUP_KEY

__all__ = [
    "collective_fingerprint", "check_collectives_match_across_ranks", "check_block_frames_match_across_ranks",
    "block_frames_fingerprint", "END_OF_FORWARD", "qualified_op_name",
]

_PREFIX = "fsdp_compile/collectives"
_POLL_S = 0.02


class _StoreChecks:
    """What one store (the default process group's) has seen checked: the generation of its keys,
    bumped by every rank that raises a divergence (the ranks that diverged, all of them raising, start
    afresh, so a caller that catches the error and goes on is not judged by the keys left behind),
    and the block sequences every rank agreed on. A new default store (a re-initialized process
    group) starts a new one."""

    def __init__(self, store: object) -> None:
        self.store = store  # held: the same object names the same store on each lookup
        self.generation = 0
        self.frame_sequences_agreed: set[tuple[int, str, str]] = set()


_checks: _StoreChecks | None = None


def _checks_of(store: object) -> _StoreChecks:
    global _checks
    if _checks is None or _checks.store is not store:
        _checks = _StoreChecks(store)
    return _checks


def _collective_calls(gm: fx.GraphModule) -> list[str]:
    """Every functional collective in ``gm`` and its subgraphs (autograd functions' forward and
    backward bodies, nested regions), in graph order, with its non-tensor arguments."""
    calls = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            sub = getattr(gm, node.target, None)
            if isinstance(sub, fx.GraphModule):
                calls.extend(_collective_calls(sub))
        elif node.op == "call_function" and _is_functional_collective(node.target):
            name = getattr(node.target, "__name__", str(node.target))
            if not name.startswith("wait_tensor"):
                # The process group's name comes last; ranks in different shard or replica groups
                # (HSDP) legitimately name different groups of the same size.
                args = node.args[:-1] if node.args and isinstance(node.args[-1], str) else node.args
                if qualified_op_name(node.target).startswith("fsdp_compile::"):  # names its groups in the middle
                    args = [a for a in node.args if not isinstance(a, str)]
                constants = [repr(a) for a in args if not isinstance(a, (fx.Node, list, tuple))]
                label = (node.meta.get("custom") or {}).get(GROUP_KEY, "")
                calls.append(f"{name}({', '.join(constants)}) group={label}")
    return calls


def qualified_op_name(target: object) -> str:
    """"namespace::name" of an op node's target ("" for anything else): Dynamo's graphs hold op packets
    (torch.ops._c10d_functional.x), AOT's the overloads (x.default)."""
    return getattr(target, "_qualified_op_name", None) or getattr(getattr(target, "overloadpacket", None), "_qualified_op_name", "")


def _is_functional_collective(target: object) -> bool:
    # fsdp_compile::all_gather_shard: a parameter's traced all-gather (see ops.py).
    return qualified_op_name(target).startswith(("_c10d_functional::", "fsdp_compile::"))


def collective_fingerprint(gm: fx.GraphModule) -> str:
    """Hash of the collective sequence: independent of shapes and of every non-collective op."""
    return _fingerprint_of(_collective_calls(gm))


def _fingerprint_of(calls: list[str]) -> str:
    return hashlib.sha256("\n".join(calls).encode()).hexdigest()[:16]


def _frame_key() -> str:
    """The Dynamo frame being compiled, named by its code's location: the same key on every rank
    running the same code, whatever else each process compiled before (Dynamo's frame ids count
    frames in the order one process first met them, so they differ once ranks compiled different
    functions)."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    autograd = "compiled-autograd/" if compile_id is not None and compile_id.compiled_autograd_id is not None else ""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
    except AttributeError:  # not under Dynamo (a graph handed to the backend directly)
        return f"{autograd}unknown"
    # FX names generated code "<eval_with_key>.N" with a per-process counter.
    filename = re.sub(r"^(<eval_with_key>)\.\d+$", r"\1", code.co_filename)
    return f"{autograd}{filename}:{code.co_firstlineno}:{code.co_name}"


def _store_and_ranks() -> tuple[object, int, int] | None:
    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return None
    return dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()


def check_collectives_match_across_ranks(gm: fx.GraphModule) -> None:
    """See [Note: cross-rank graph check]; raises on every diverging rank, naming the ranks."""
    found = _store_and_ranks()
    calls = _collective_calls(gm) if found is not None else []
    if not calls:
        return
    _await_every_rank(found, _frame_key(), _fingerprint_of(calls), "", _raise_divergence)


def check_block_frames_match_across_ranks(model: str, entered: Sequence[str], fingerprint: str) -> None:
    """Eagerly, as a compiled forward of ``model`` enters a block frame (and as it ends): this rank
    entered the blocks ``entered`` (labels, in order, ending in END_OF_FORWARD at the end) so far;
    ``fingerprint`` hashes them (block_frames_fingerprint). Where this sequence is new to this rank,
    waits for every rank to have entered the same before any collective of the frame is issued.
    See [Note: ranks entering different block frames]."""
    found = _store_and_ranks()
    if found is None:
        return
    # Run at every block of every forward: a sequence agreed before costs this lookup only.
    checks = _checks_of(found[0])
    agreed = (checks.generation, model, fingerprint)
    if agreed in checks.frame_sequences_agreed:
        return
    key = f"frames/{model}/{len(entered)}"
    _await_every_rank(found, key, fingerprint, " -> ".join(entered), _raise_frames_divergence)
    checks.frame_sequences_agreed.add(agreed)


END_OF_FORWARD = "end of forward"


# Appended to a block's label in the sequence of entered blocks where Dynamo runs its frame eagerly.
EAGER_FRAME_MARK = " (run eagerly)"


def block_frames_fingerprint(previous: str, label: str) -> str:
    """The fingerprint of a sequence of entered blocks, from its prefix's and its last block's label."""
    return _fingerprint_of([previous, label])


# [Note: ranks entering different block frames]
# With block frames (config.block_compile = "frames") every block frame is one graph shared by every identical block, so the
# graph check above cannot see ranks whose control flow enters different blocks (rank 0 runs a block
# rank 1 skips): each compiles the same graph, or none at all, and their all-gathers, issued ahead for
# the block that runs next, and reduce-scatters would then pair up wrongly or hang. What must match there is the
# sequence of blocks a forward enters, so each rank checks that instead, as blocks are entered and
# before the frame's collectives: a prefix of the sequence new to this rank is published and awaited
# in the store as a new graph's collectives are. A sequence every rank entered before costs a set
# lookup; a forward that ends early on one rank is told apart by END_OF_FORWARD. A block whose frame
# Dynamo runs eagerly enters the sequence again, marked EAGER_FRAME_MARK, before its eager hooks'
# collectives: a rank that runs it eagerly where another runs it compiled (Dynamo's recompile limit
# reached on one rank) would gather and reduce at other points, and hung; the ranks meet where the
# compiled one waits on a new graph or sequence, and both raise. A compiled rank that meets nothing
# new (every graph and sequence agreed before) does not wait: the eager rank raises after
# config.graph_check_timeout_s, and the compiled one stays in its collective.


def _await_every_rank(
    found: tuple[object, int, int], key: str, fingerprint: str, description: str,
    raise_divergence: Callable[[object, str, int, str, dict[int, str]], None],
) -> None:
    """Publishes ``fingerprint`` under ``key`` and waits (in the store) until every rank published it
    too, unless one did already; raises through ``raise_divergence`` when another rank waits on a
    different fingerprint this rank never published, and after ``config.graph_check_timeout_s``."""
    from fsdp_compile import config

    store, rank, world = found
    prefix = f"{_PREFIX}/{_checks_of(store).generation}/{key}"
    if description:
        store.set(f"{prefix}/described/{fingerprint}", description)
    store.set(f"{prefix}/{fingerprint}/{rank}", "1")
    missing = [r for r in range(world) if r != rank and not store.check([f"{prefix}/{fingerprint}/{r}"])]
    if not missing:
        return
    waiting_key = f"{prefix}/waiting/{rank}"
    store.set(waiting_key, fingerprint)
    deadline = time.monotonic() + config.graph_check_timeout_s
    while missing:
        for other in list(missing):
            if store.check([f"{prefix}/{fingerprint}/{other}"]):
                missing.remove(other)
                continue
            theirs = store.get(f"{prefix}/waiting/{other}").decode() if store.check([f"{prefix}/waiting/{other}"]) else ""
            if theirs and theirs != fingerprint and not store.check([f"{prefix}/{theirs}/{rank}"]):
                # This rank's waiting key stays set: the other rank sees the same standoff and raises too.
                raise_divergence(store, prefix, rank, fingerprint, {other: theirs})
        if missing and time.monotonic() > deadline:
            raise RuntimeError(
                f"fsdp_inductor: rank {rank} compiled a graph or entered fully_shard blocks ({description or fingerprint}) "
                f"that ranks {missing} have not after {config.graph_check_timeout_s:.0f} s. Every rank must run the same "
                "code path (no control flow on the rank or on rank-local data that changes which parameters "
                "are gathered), or their collectives would hang."
            )
        if missing:
            time.sleep(_POLL_S)
    store.set(waiting_key, "")


def _raise_divergence(store: object, prefix: str, rank: int, mine: str, others: dict[int, str]) -> None:
    _checks_of(store).generation += 1
    listed = "; ".join([f"rank {rank} traced collectives {mine}"] + [f"rank {r} traced collectives {fp}" for r, fp in others.items()])
    raise RuntimeError(
        f"fsdp_inductor: ranks traced graphs with different collectives ({listed}); ranks {sorted([rank, *others])} "
        "differ. Every rank must run the same code path (no control flow on the rank or on rank-local data that "
        "changes which parameters are gathered), or their collectives would hang. Move rank-dependent logic "
        "outside the compiled model."
    )


def _raise_frames_divergence(store: object, prefix: str, rank: int, mine: str, others: dict[int, str]) -> None:
    _checks_of(store).generation += 1

    def entered(fingerprint: str) -> str:
        key = f"{prefix}/described/{fingerprint}"
        return store.get(key).decode() if store.check([key]) else fingerprint  # type: ignore[attr-defined]

    listed = "; ".join([f"rank {rank} entered {entered(mine)}"] + [f"rank {r} entered {entered(fp)}" for r, fp in others.items()])
    run_eagerly = EAGER_FRAME_MARK in listed
    raise RuntimeError(
        f"fsdp_inductor: ranks entered different fully_shard blocks in one compiled forward ({listed}); ranks "
        f"{sorted([rank, *others])} differ. Every rank must run the same blocks in the same order (no control flow on "
        "the rank or on rank-local data that skips or reorders a fully_shard module), or their collectives would "
        "hang. Move rank-dependent logic outside the compiled model."
        + (
            " A block that Dynamo ran eagerly on some ranks only (its frame at Dynamo's recompile limit there, after "
            "rank-local shapes recompiled it, or torch.compiler.disable on some ranks) gathers and reduces at other "
            "points than a compiled one: raise torch._dynamo.config.recompile_limit, or give every rank the same "
            "shapes (pad the batch), or disable the block on every rank."
            if run_eagerly else ""
        )
    )
