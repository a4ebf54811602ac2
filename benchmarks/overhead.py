"""Host overhead (``--overhead``): each mode's host time per block, and a profile of one step of each of ours.

[Note: host time per block] On the overhead preset a step's time is host work: hooks, dispatch,
frame entries, guards. Step time / layers would charge each block its share of the per-step fixed
work (embedding, loss, root hooks, the optimizer's per-step part), so each mode also runs at a
second, shallower depth (``--shallow-layers``), interleaved with the deep one in the same process
([Note: interleaving] in run.py), and the host time per block is the slope between the two:
``(median(deep) - median(shallow)) / (deep - shallow)``; the intercept is the fixed work per step.
Its spread is a bootstrap over the measured steps of both depths (p10-p90 of the resampled slope).
The optimizer's step and zero_grad are timed apart (``Mode.optimizer_s``): the same torch.optim code
in every mode, on the DTensor shards of both FSDPs. The preset runs AdamW's foreach implementation
(``--foreach-adamw``), the default on CUDA, whose host time is the GPU run's; CPU's default, a loop
over the parameters with a DTensor dispatch per op each, was most of each block's slope on the tiny
model in every mode alike. The slope of the steps without it is FSDP's own host time per block.

[Note: profiling a step] ``--profile-step`` runs two more untimed steps of each of ours after the
timed ones: one under cProfile (Python functions by own time; cProfile slows Python, so read
shares, not milliseconds), one under torch.profiler, which sees every op the dispatcher runs
(``aten::`` events, nested calls included: each is a dispatch) and Dynamo's own events: one
"TorchDynamo Cache Lookup" per frame whose code Dynamo has seen, one "Torch-Compiled Region: F/C"
per compiled entry that ran. torch 2.13 counts no guard evaluations at run time (the C++ guard
managers are called from the frame evaluator), so the guard figure is the number of leaf guards
in the guard trees of the entries that ran, once per entry: what a lookup that hits at once checks.
Entries tried and failed before the hit (another mode's entry of a shared code object, first in
Dynamo's most-recently-used order) are not counted, and a guard manager may skip a subtree it
knows unchanged. On CUDA the torch.profiler step also records the device: its wall time against
the union of the intervals the device ran kernels and copies (a step far longer than that is
host-bound or waits), the host's waits for the device, and the heaviest kernels; there FSDP2's
modes are profiled too, so each mode's device time sits beside its counterpart's.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import random
import statistics
import sys
import types
import torch

from benchmarks.measure import quiet_profiler, timed_step, train_step
from benchmarks.modes import Mode

__all__ = [
    "shallow_name", "per_block_figures", "per_block_table", "profile_step", "profile_markdown", "PROFILE_TOP",
]

PROFILE_TOP = 15
_BOOTSTRAP_DRAWS = 400


def shallow_name(name: str, layers: int) -> str:
    """The key of a mode's shallow twin in run.py's dicts (never a table row)."""
    return f"{name}@{layers}"


# ---- host time per block ------------------------------------------------------------------

def _slope(deep: list[float], shallow: list[float], layers: int) -> float:
    return (statistics.median(deep) - statistics.median(shallow)) / layers


def per_block_figures(deep_s: list[float], shallow_s: list[float], deep_layers: int, shallow_layers: int,
                      seed: int = 0) -> dict:
    """Host ms per block (the slope between two depths), its bootstrap p10-p90, and the fixed ms per step.

    Example: ``per_block_figures([0.12] * 5, [0.06] * 5, 16, 4)["block_ms"] == 5.0``.
    """
    span = deep_layers - shallow_layers
    block = _slope(deep_s, shallow_s, span)
    generator = random.Random(seed)
    draws = sorted(
        _slope(generator.choices(deep_s, k=len(deep_s)), generator.choices(shallow_s, k=len(shallow_s)), span)
        for _ in range(_BOOTSTRAP_DRAWS)
    )
    return {
        "block_ms": block * 1e3,
        "block_ms_p10": draws[len(draws) // 10] * 1e3,
        "block_ms_p90": draws[len(draws) * 9 // 10] * 1e3,
        "fixed_ms": (statistics.median(shallow_s) - shallow_layers * block) * 1e3,
        "shallow_step_ms": statistics.median(shallow_s) * 1e3,
        "deep_layers": deep_layers,
        "shallow_layers": shallow_layers,
    }


def per_block_table(summary: dict[str, dict], baseline: str = "torch-eager") -> str:
    """The per-block table of the modes whose two depths both ran."""
    rows = {name: f["per_block"] for name, f in summary.items() if f.get("per_block")}
    if not rows:
        return ""
    first = next(iter(rows.values()))
    deep, shallow = first["deep_layers"], first["shallow_layers"]
    base = rows.get(baseline, {}).get("block_ms")
    base_forward_backward = summary.get(baseline, {}).get("per_block_forward_backward", {}).get("block_ms")
    lines = [
        f"| mode | step ms, {deep} layers | step ms, {shallow} layers | host ms per block (p10–p90) "
        f"| fixed ms per step | per block vs {baseline} | of the {deep}-layer step, optimizer ms "
        f"| forward + backward ms per block (p10–p90) | forward + backward per block vs {baseline} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in rows.items():
        ratio = f"{p['block_ms'] / base:.2f}×" if base and base > 0 else "—"
        optimizer = summary[name].get("optimizer_ms_median")
        fb = summary[name].get("per_block_forward_backward")
        if not fb:
            fb_cells = "— | —"
        elif not base_forward_backward:
            fb_cells = f"{fb['block_ms']:.2f} | —"
        else:
            fb_cells = f"{fb['block_ms']:.2f} ({fb['block_ms_p10']:.2f}–{fb['block_ms_p90']:.2f}) | {fb['block_ms'] / base_forward_backward:.2f}×"
        lines.append(
            f"| {name} | {summary[name]['step_ms_median']:.1f} | {p['shallow_step_ms']:.1f} "
            f"| {p['block_ms']:.2f} ({p['block_ms_p10']:.2f}–{p['block_ms_p90']:.2f}) | {p['fixed_ms']:.1f} | {ratio} "
            f"| {'—' if optimizer is None else f'{optimizer:.1f}'} | {fb_cells} |"
        )
    return "\n".join(lines)


# ---- the profile of one step ----------------------------------------------------------------

def _where(filename: str, line: int, function: str) -> str:
    """``torch/nn/modules/module.py:1750(_call_impl)``: paths from the package root, not the machine's."""
    if filename == "~":  # a builtin: pstats names it "<built-in method ...>"
        return function
    for root in sorted(sys.path, key=len, reverse=True):
        if root and filename.startswith(root.rstrip(os.sep) + os.sep):
            filename = filename[len(root.rstrip(os.sep)) + 1:]
            break
    return f"{filename}:{line}({function})"


def _cprofile_top(profiler: cProfile.Profile, top: int) -> dict:
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)
    return {
        "python_calls": sum(row[1] for _, row in rows),
        "profiled_ms": stats.total_tt * 1e3,
        "top": [
            {"where": _where(*key), "calls": row[1], "own_ms": row[2] * 1e3, "cumulative_ms": row[3] * 1e3}
            for key, row in rows[:top]
        ],
    }


def _aten_counts(events: list) -> tuple[int, int]:
    """(every aten:: op the dispatcher ran, those not inside another aten:: op on the same thread)."""
    aten = sorted(((e.start_thread_id(), e.start_ns(), -e.end_ns()) for e in events if e.name().startswith("aten::")))
    top_level, open_until = 0, {}
    for thread, start, negative_end in aten:
        if start >= open_until.get(thread, -1):
            top_level += 1
            open_until[thread] = -negative_end
    return len(aten), top_level


def _guard_count(manager) -> int:
    """Leaf guards in a guard tree (dict managers' keys and values included)."""
    count = len(manager.get_leaf_guards())
    children = list(manager.get_child_managers())
    if hasattr(manager, "get_key_value_managers"):
        for key_manager, value_manager in manager.get_key_value_managers().values():
            children += [m for m in (key_manager, value_manager) if m is not None]
    return count + sum(_guard_count(child) for child in children)


def _guards_by_compile_id() -> dict[str, int]:
    """Every live Dynamo cache entry's compile id -> leaf guards in its tree."""
    from torch._dynamo import convert_frame
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    guards = {}
    for reference in list(convert_frame.input_codes.seen):
        code = reference()
        if isinstance(code, types.CodeType):
            for entry in _debug_get_cache_entry_list(code):
                root = entry.guard_manager.root
                guards[str(entry.compile_id)] = _guard_count(root) + len(root.get_epilogue_lambda_guards())
    return guards


# CUDA runtime calls after which the host waits for the device.
_HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _device_figures(events: list, step_ms: float, top: int = 5) -> dict:
    """On CUDA ([Note: profiling a step]): the step's wall time against the time the device was busy
    (the union of its kernels' and copies' intervals), how often the host waited for the device,
    and the kernels that took most of the busy time."""
    # Without the user annotations' device spans (the optimizer step's, FSDP2's hooks'): they cover
    # kernels and idle time alike, and the third H200 run counted them as busy.
    on_device = [
        e for e in events
        if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0 and not e.is_user_annotation()
    ]
    busy_ns, open_until = 0, -1
    for start, end in sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in on_device):
        busy_ns += max(0, end - max(start, open_until))
        open_until = max(open_until, end)
    by_name: dict[str, list[float]] = {}
    for event in on_device:
        figures = by_name.setdefault(event.name(), [0, 0.0])
        figures[0] += 1
        figures[1] += event.duration_ns() / 1e6
    heaviest = sorted(by_name.items(), key=lambda item: item[1][1], reverse=True)[:top]
    return {
        "step_ms": step_ms,
        "busy_ms": busy_ns / 1e6,
        "launches": len(on_device),
        "host_waits": sum(e.name() in _HOST_WAITS for e in events),
        "top": [{"name": name[:90], "calls": calls, "ms": ms} for name, (calls, ms) in heaviest],
    }


def _dispatch_and_dynamo_counts(mode: Mode, tokens: torch.Tensor) -> dict:
    on_cuda = tokens.is_cuda
    with quiet_profiler(cuda=on_cuda) as profiler:
        seconds, _ = timed_step(mode, tokens, tokens.device)
    step_ms = seconds * 1e3
    events = list(profiler.profiler.kineto_results.events())
    aten, aten_top = _aten_counts(events)
    prefix = "Torch-Compiled Region: "
    regions: dict[str, int] = {}
    for event in events:
        if event.name().startswith(prefix):
            regions[event.name()[len(prefix):]] = regions.get(event.name()[len(prefix):], 0) + 1
    guards = _guards_by_compile_id()
    return {
        "aten_ops": aten,
        "aten_top_level": aten_top,
        "cache_lookups": sum(e.name() == "TorchDynamo Cache Lookup" for e in events),
        "compiled_regions": sum(regions.values()),
        "regions_by_compile_id": regions,
        "guards_checked": sum(count * guards.get(cid, 0) for cid, count in regions.items()),
        "guards_unknown_ids": sorted(cid for cid in regions if cid not in guards),
        **({"device": _device_figures(events, step_ms)} if on_cuda else {}),
    }


def profile_step(mode: Mode, tokens: torch.Tensor, top: int = PROFILE_TOP) -> dict:
    """Two untimed steps of ``mode``: one under cProfile, one under torch.profiler ([Note: profiling a step])."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        train_step(mode, tokens)
    finally:
        profiler.disable()
    return {**_cprofile_top(profiler, top), **_dispatch_and_dynamo_counts(mode, tokens)}


def _profile_block(name: str, p: dict) -> str:
    if "error" in p:
        return f"#### {name}\n\nunavailable: {p['error']}\n"
    unknown = f" ({len(p['guards_unknown_ids'])} entries' trees not found)" if p["guards_unknown_ids"] else ""
    lines = [
        f"#### {name}", "",
        f"ATen ops dispatched: {p['aten_ops']} ({p['aten_top_level']} top-level); "
        f"Dynamo cache lookups: {p['cache_lookups']}; compiled regions entered: {p['compiled_regions']} "
        f"({len(p['regions_by_compile_id'])} distinct entries); guards in the entered entries' trees: "
        f"{p['guards_checked']}{unknown}; Python calls under cProfile: {p['python_calls']:,} "
        f"({p['profiled_ms']:.0f} ms profiled).", "",
    ]
    if "device" in p:
        d = p["device"]
        kernels = "; ".join(f"`{k['name']}` {k['ms']:.1f} ms ({k['calls']}x)" for k in d["top"])
        lines += [
            f"Device (under the profiler): step {d['step_ms']:.1f} ms wall, device busy {d['busy_ms']:.1f} ms "
            f"({d['launches']} kernels and copies), host waited for the device {d['host_waits']} times; "
            f"heaviest: {kernels}.", "",
        ]
    lines += ["| own ms | cumulative ms | calls | function |", "|---|---|---|---|"]
    for row in p["top"]:
        where = row["where"].replace("|", "/")
        lines.append(f"| {row['own_ms']:.2f} | {row['cumulative_ms']:.2f} | {row['calls']} | `{where}` |")
    return "\n".join(lines) + "\n"


def profile_markdown(profiles: dict[str, dict], command: str) -> str:
    """The ``### Profile of one step`` sub-section: per mode, its counts and cProfile's top functions."""
    if not profiles:
        return ""
    head = (
        "### Profile of one step of each of ours (on CUDA, of every mode)\n\n"
        f"Command: `{command}`. Top {PROFILE_TOP} functions by own time in one untimed step under cProfile "
        "(which slows Python: compare shares, not milliseconds); counts from one more step under torch.profiler "
        "([Note: profiling a step] in benchmarks/overhead.py): ATen ops are the profiler's `aten::` events "
        "(every dispatcher call, nested ones included; top-level: not inside another), cache lookups and "
        "compiled regions are Dynamo's own profiler events, and guards are the leaf guards of the guard trees "
        "of the entries that ran (torch 2.13 has no run-time counter of guard evaluations).\n"
    )
    return head + "".join("\n" + _profile_block(name, p) for name, p in profiles.items())

