"""``FSDP_COMPILE_DUMP=dir``: write each graph before and after each pass, and a collectives timeline.

Not a rewrite: ``dump_graph(gm, kind, stage, config)`` writes ``<dir>/<n>-<kind>-<stage>.py`` (the
readable graph) and ``<dir>/<n>-<kind>-<stage>.timeline.txt``, one line per collective or compute
op in graph order (views and copies left out; a block's nested region lists its body's ops under
the call's index), with the collectives in flight just after it and their bytes, as the in-flight
budget counts them (``graph.inflight_collectives``)::

    12  issue  all_gather      layers.1        65536 B   in flight: layers.1 (65536 B)
    13  comp   mm                                         in flight: layers.1 (65536 B)
    14  wait   all_gather      layers.1                   in flight: -
"""
from __future__ import annotations

import itertools
import os
import threading

import torch
import torch.fx as fx

from fsdp_compile.config import PassConfig
from fsdp_compile.passes.graph import (
    COLLECTIVE_NAMES, GROUP_KEY, WAIT, fsdp_annotation, inflight_collectives, is_copy, is_view,
)

__all__ = ["dump_graph", "collective_timeline"]

_counter = itertools.count()
_lock = threading.Lock()


def _group(node: fx.Node) -> str:
    return str((fsdp_annotation(node) or {}).get(GROUP_KEY, "-"))


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def _event(node: fx.Node, flying: dict[fx.Node, int]) -> str | None:
    """The timeline's text for ``node`` (issue / wait / comp), or None for what it leaves out."""
    if node.op != "call_function":
        return None
    if node.target in COLLECTIVE_NAMES:
        return f"issue  {COLLECTIVE_NAMES[node.target]:<15} {_group(node):<24} {flying[node]:>10} B"
    if node.target is WAIT:
        issued = node.args[0]
        return f"wait   {COLLECTIVE_NAMES.get(getattr(issued, 'target', None), '?'):<15} {_group(issued):<24} {'':>12}"
    if is_view(node) or is_copy(node):
        return None
    return f"comp   {_op_name(node):<15} {'':<24} {'':>12}"


def collective_timeline(gm: fx.GraphModule) -> str:
    """Collectives (issue / wait) and compute ops in graph order, with the collectives in flight and
    their bytes: the figures ``max_inflight_bytes`` bounds."""
    lines = []
    for index, (node, flying) in enumerate(inflight_collectives(gm.graph)):
        groups = ", ".join(_group(c) for c in flying)
        in_flight = f"{groups} ({sum(flying.values())} B)" if flying else "-"
        if node.target is torch.ops.higher_order.invoke_subgraph:
            # A block compiled once: its body's ops run here, under the same collectives in flight.
            body = getattr(gm, node.args[0].target).graph
            events = [event for inner in body.nodes if (event := _event(inner, {})) is not None]
        else:
            events = [event] if (event := _event(node, flying)) is not None else []
        lines.extend(f"{index:5d}  {event}   in flight: {in_flight}" for event in events)
    return "\n".join(lines) + "\n"


def dump_graph(gm: fx.GraphModule, kind: str, stage: str, config: PassConfig) -> None:
    """Write ``gm`` and its timeline under ``config.dump_dir`` (no-op when unset)."""
    if not config.dump_dir:
        return
    os.makedirs(config.dump_dir, exist_ok=True)
    with _lock:
        index = next(_counter)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    stem = os.path.join(config.dump_dir, f"rank{rank}-{index:03d}-{kind}-{stage}")
    with open(stem + ".py", "w") as f:
        f.write(gm.print_readable(print_output=False))
    with open(stem + ".timeline.txt", "w") as f:
        f.write(collective_timeline(gm))
