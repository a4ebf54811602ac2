"""``python -m benchmarks --compile-scaling``: compile seconds and step time against depth.

Each mode at each layer count runs twice, each time in fresh processes of its own: *cold*, with
an empty Inductor cache per rank, then *warm*, with the cache its cold run filled (Dynamo and
AOTAutograd start from nothing again, as after a restart). A mode never inherits another mode's
compiled kernels: run in one process, a later mode would find the earlier modes' identical
kernels in the shared cache and look cheaper than it is. Compile seconds are the warm-up
steps' excess over the median step (``compile_cold_s`` of the run's results.json); step ms is
the cold run's median.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

from benchmarks.config import BenchConfig
from benchmarks.launch import launch
from benchmarks.report import _fmt, write_results_md
from benchmarks.run import worker

__all__ = ["run_compile_scaling", "scaling_table"]

PHASES = ("cold", "warm")


def _one_run(cfg: BenchConfig, layers: int, mode: str, phase: str, cache_dir: str, device_type: str) -> dict[str, Any]:
    out_dir = os.path.join(cfg.out_dir, f"scaling-{layers}-layers-{mode}-{phase}")
    run = dataclasses.replace(
        cfg, modes=(mode,), layers=layers, warm_compile=False, inductor_cache_dir=cache_dir, out_dir=out_dir,
        results_md=None, compile_scaling=None, command=f"{cfg.command} [{layers} layers, {mode}, {phase}]",
    )
    launch(worker, cfg.world_size, device_type, run)
    with open(os.path.join(out_dir, "results.json")) as results:
        return json.load(results)


def _runs_of_one_depth(cfg: BenchConfig, layers: int, device_type: str) -> dict[str, dict]:
    """{phase: results.json} at ``layers``, each phase's ``modes`` gathered from the modes' own runs."""
    by_phase: dict[str, dict] = {}
    for mode in cfg.modes:
        cache_dir = tempfile.mkdtemp(prefix=f"fsdp_bench_scaling_{layers}_{mode}_")
        try:
            for phase in PHASES:
                result = _one_run(cfg, layers, mode, phase, cache_dir, device_type)
                merged = by_phase.setdefault(phase, {**result, "modes": {}})
                merged["modes"].update(result["modes"])
                by_phase.setdefault("stages", {}).setdefault(mode, {})[phase] = result.get("compile_stages", {})
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
    return by_phase


def _figure(run: dict, mode: str, key: str) -> float | None:
    figures = run["modes"].get(mode, {})
    return figures.get(key) if figures.get("status") == "ok" else None


def scaling_table(modes: tuple[str, ...], runs: dict[int, dict[str, dict]]) -> str:
    """Markdown: one row per (layers, mode) with cold / warm compile seconds and step ms."""
    lines = ["| layers | mode | compile cold s | compile warm s (2nd process) | step ms (median) |", "|---|---|---|---|---|"]
    for layers, by_phase in runs.items():
        for mode in modes:
            cold, warm = by_phase["cold"], by_phase["warm"]
            status = cold["modes"].get(mode, {}).get("status", "not run")
            if status != "ok":
                lines.append(f"| {layers} | {mode} | {status} | | |")
                continue
            lines.append(
                f"| {layers} | {mode} | {_fmt(_figure(cold, mode, 'compile_cold_s'), '.1f')} "
                f"| {_fmt(_figure(warm, mode, 'compile_cold_s'), '.1f')} | {_fmt(_figure(cold, mode, 'step_ms_median'), '.0f')} |"
            )
    return "\n".join(lines)


STAGES_TOP = 15


def stages_table(modes: tuple[str, ...], by_phase: dict[str, dict], per_mode: dict[str, dict[str, dict]]) -> str:
    """Markdown: torch._dynamo.utils.compile_times() of each mode's cold and warm process at one depth,
    the STAGES_TOP stages that took longest in any of them, as seconds (calls)."""
    columns = [(mode, phase) for mode in modes for phase in PHASES if per_mode.get(mode, {}).get(phase)]
    if not columns:
        return ""
    stages: dict[str, float] = {}
    for mode, phase in columns:
        for stage, (_, seconds) in per_mode[mode][phase].items():
            stages[stage] = max(stages.get(stage, 0.0), seconds)
    top = sorted(stages, key=stages.get, reverse=True)[:STAGES_TOP]
    lines = ["| stage | " + " | ".join(f"{mode} {phase}" for mode, phase in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for stage in top:
        cells = []
        for mode, phase in columns:
            calls, seconds = per_mode[mode][phase].get(stage, (0, 0.0))
            cells.append(f"{seconds:.2f} ({calls})" if calls else "—")
        lines.append(f"| `{stage}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _stages_text(cfg: BenchConfig, runs: dict[int, dict[str, dict]]) -> str:
    parts = []
    for layers, by_phase in runs.items():
        table = stages_table(cfg.modes, by_phase, by_phase.get("stages", {}))
        if table:
            parts.append(f"Compile stages at {layers} layers, rank 0, seconds (calls) from "
                         f"`torch._dynamo.utils.compile_times()` in each mode's own process, cold and warm "
                         f"(nested: a stage includes the stages it calls; the top {STAGES_TOP} by their "
                         f"largest figure):\n\n{table}\n")
    return "\n".join(parts)


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return "—" if numerator is None or not denominator else f"{numerator / denominator:.2f}x"


# Ours, each way users compile it, against issue 17's targets.
_TARGET_MODES = ("ours-compiled", "ours-compiled-regions", "ours-blockcompile", "ours-fallback")


def _target_lines(runs: dict[int, dict[str, dict]]) -> list[str]:
    """Issue 17's targets, each with the figures it compares, for the modes this run has; and
    ours whole-model against PyTorch's whole-model compile."""
    lines = []
    cold = {layers: by_phase["cold"] for layers, by_phase in runs.items()}
    ran = [mode for mode in _TARGET_MODES if any(mode in run["modes"] for run in cold.values())]
    if 16 in cold:
        for mode in ran:
            for key, what, target in (("compile_cold_s", "cold compile", "1.5x"), ("step_ms_median", "step time", "1.0x")):
                lines.append(f"- {what} at 16 layers, {mode} / torch-blockcompile: "
                             f"{_ratio(_figure(cold[16], mode, key), _figure(cold[16], 'torch-blockcompile', key))} (target <= {target})")
        if "torch-compiled" in cold[16]["modes"]:
            for mode in ("ours-compiled", "ours-compiled-regions"):
                if mode in ran:
                    lines.append(f"- cold compile at 16 layers, {mode} / torch-compiled (both whole model): "
                                 f"{_ratio(_figure(cold[16], mode, 'compile_cold_s'), _figure(cold[16], 'torch-compiled', 'compile_cold_s'))}")
    if 32 in cold and 2 in cold:
        for mode in ran:
            lines.append(f"- cold compile of {mode}, 32 layers / 2 layers: "
                         f"{_ratio(_figure(cold[32], mode, 'compile_cold_s'), _figure(cold[2], mode, 'compile_cold_s'))} (target <= 1.3x)")
    return lines


def _section(cfg: BenchConfig, runs: dict[int, dict[str, dict]]) -> tuple[str, str]:
    """(RESULTS.md section key, section text) for the layer counts run so far."""
    meta = next(iter(runs.values()))["cold"]["meta"]
    targets = _target_lines(runs)
    key = f"{meta['section_key']}-compile-scaling"
    missing = [layers for layers in cfg.compile_scaling or () if layers not in runs]
    return key, (
        f"<!-- benchmark section: {key} -->\n"
        f"## {meta['machine']}, world size {meta['world_size']}, compile time against depth\n\n"
        f"Command: `{cfg.command}`" + (f" (not yet run: {', '.join(map(str, missing))} layers)" if missing else "") + "  \n"
        f"torch {meta['torch']}, Python {meta['python']}, {meta['date'][:10]}, commit {meta['commit']}.  \n"
        f"Model: {'Hugging Face-shaped Llama (benchmarks/hf_llama.py), ' + str(cfg.key_value_heads) + ' key-value heads, ' if cfg.model == 'hf-llama' else ''}"
        f"dim {cfg.dim}, {cfg.heads} heads, vocab {cfg.vocab}, seq {cfg.seq}, batch {cfg.batch} per rank, "
        f"{'bf16 params / fp32 reduce' if cfg.bf16 else 'fp32'}, {cfg.warmup} warm-up + {cfg.steps} measured steps.\n\n"
        f"{scaling_table(cfg.modes, runs)}\n\n" + ("\n".join(targets) + "\n\n" if targets else "")
        + (_stages_text(cfg, runs) + "\n" if _stages_text(cfg, runs) else "")
        + (__doc__ or "").split("\n\n", 1)[1].strip() + "\n"
        f"<!-- end benchmark section: {key} -->\n"
    )


def run_compile_scaling(cfg: BenchConfig, device_type: str) -> None:
    """Run every layer count of ``cfg.compile_scaling`` cold then warm; print (and write) the table.

    The section is rewritten after each layer count, so a run stopped early keeps what it measured.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        raise SystemExit("--compile-scaling starts its own ranks for every run: run it without torchrun")
    runs: dict[int, dict[str, dict]] = {}
    for layers in cfg.compile_scaling or ():
        runs[layers] = _runs_of_one_depth(cfg, layers, device_type)
        print(f"\n{scaling_table(cfg.modes, {layers: runs[layers]})}\n", flush=True)
        print(_stages_text(cfg, {layers: runs[layers]}), flush=True)
        key, section = _section(cfg, runs)
        with open(os.path.join(cfg.out_dir, "compile_scaling.md"), "w") as out:
            out.write(section)
        if cfg.results_md:
            write_results_md(cfg.results_md, section, key)
    print(scaling_table(cfg.modes, runs))
    print("\n".join(_target_lines(runs)))
    if cfg.results_md:
        print(f"wrote the section in {cfg.results_md}")
