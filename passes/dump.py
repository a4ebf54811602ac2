"""``FSDP_COMPILE_DUMP=dir``: write each graph before and after each pass, and a collectives timeline.

Not a rewrite: ``dump_graph(gm, kind, stage, config)`` writes ``<dir>/<n>-<kind>-<stage>.py`` (the
readable graph) and ``<dir>/<n>-<kind>-<stage>.timeline.txt``, one line per collective or compute
op in graph order, with the collectives in flight at that point::

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
from fsdp_compile.passes.recompute import fsdp_annotation

__all__ = ["dump_graph", "collective_timeline", "graph_kind"]

_counter = itertools.count()
_lock = threading.Lock()
_COLLECTIVES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}
_VIEWS_AND_COPIES = ("view", "reshape", "slice", "getitem", "cat", "convert_element_type", "_to_copy", "t.default", "permute", "clone")


def graph_kind(gm: fx.GraphModule) -> str:
    """"backward" if the graph consumes a tangent or reduce-scatters, else "forward"."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "tangents" in node.name:
            return "backward"
        if node.op == "call_function" and "reduce_scatter" in str(node.target):
            return "backward"
    return "forward"


def _collective_name(node: fx.Node) -> str | None:
    if node.op != "call_function" or not str(node.target).startswith("_c10d_functional."):
        return None
    return _COLLECTIVES.get(str(node.target).split(".")[1])


def collective_timeline(gm: fx.GraphModule) -> str:
    """Collectives (issue / wait) and compute ops in graph order, with the collectives in flight."""
    lines = []
    in_flight: dict[fx.Node, str] = {}
    for index, node in enumerate(gm.graph.nodes):
        if node.op != "call_function":
            continue
        name = _collective_name(node)
        group = str((fsdp_annotation(node) or {}).get("fsdp_group", "-"))
        if name is not None:
            value = node.meta.get("val")
            size = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
            in_flight[node] = group
            event = f"issue  {name:<15} {group:<24} {size:>10} B"
        elif "wait_tensor" in str(node.target):
            issued = node.args[0]
            in_flight.pop(issued, None)
            event = f"wait   {_collective_name(issued) or '?':<15} {group:<24} {'':>12}"
        elif any(part in str(node.target) for part in _VIEWS_AND_COPIES):
            continue
        else:
            event = f"comp   {str(node.target).split('.')[-2] if '.' in str(node.target) else node.target!s:<15} {'':<24} {'':>12}"
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
