"""``FSDP_COMPILE_DUMP=dir``: write each graph before and after each pass, and a collectives timeline.

Not a rewrite: ``dump_graph(gm, kind, stage, config)`` writes ``<dir>/<n>-<kind>-<stage>.py`` (the
readable graph) and ``<dir>/<n>-<kind>-<stage>.timeline.txt``, one line per collective or compute
op in graph order (views and copies left out), with the collectives in flight at that point::

    12  issue  all_gather      layers.1   65536 B   in flight: layers.1
    13  comp   mm                                   in flight: layers.1
    14  wait   all_gather      layers.1             in flight: -
"""
from __future__ import annotations

import itertools
import os
import threading

import torch
import torch.fx as fx

from fsdp_compile.config import PassConfig
from fsdp_compile.passes.graph import COLLECTIVE_NAMES, GROUP_KEY, WAIT, fsdp_annotation, is_copy, is_view, tensor_bytes

__all__ = ["dump_graph", "collective_timeline"]

_counter = itertools.count()
_lock = threading.Lock()


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def collective_timeline(gm: fx.GraphModule) -> str:
    """Collectives (issue / wait) and compute ops in graph order, with the collectives in flight."""
    lines = []
    in_flight: dict[fx.Node, str] = {}
    for index, node in enumerate(gm.graph.nodes):
        if node.op != "call_function":
            continue
        group = str((fsdp_annotation(node) or {}).get(GROUP_KEY, "-"))
        if node.target in COLLECTIVE_NAMES:
            in_flight[node] = group
            event = f"issue  {COLLECTIVE_NAMES[node.target]:<15} {group:<24} {tensor_bytes(node.meta.get('val')):>10} B"
        elif node.target is WAIT:
            issued = node.args[0]
            in_flight.pop(issued, None)
            event = f"wait   {COLLECTIVE_NAMES.get(getattr(issued, 'target', None), '?'):<15} {group:<24} {'':>12}"
        elif is_view(node) or is_copy(node):
            continue
        else:
            event = f"comp   {_op_name(node):<15} {'':<24} {'':>12}"
        flying = ", ".join(in_flight.values()) or "-"
        lines.append(f"{index:5d}  {event}   in flight: {flying}")
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
