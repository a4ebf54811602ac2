"""CPU offload's training step against none: ``python -m benchmarks.offload`` (``--help`` for flags).

Trains the benchmark's model (``benchmarks.config``: the same Transformer, data and seed) eagerly
with our ``fully_shard`` per block + root, once per variant, one variant after the other in the
same process, each from the same initial weights:

* ``none``: no offloading (``OffloadPolicy()``): shards, gradients and AdamW state on the device.
* ``pinned``: ``CPUOffloadPolicy()``: shards and gradients in pinned host memory, copied to the
  device around the collectives; AdamW steps on the CPU.
* ``unpinned``: ``CPUOffloadPolicy(pin_memory=False)``, to show what pinning buys.

Per variant: the median step time (forward, backward, AdamW; slowest of the measured steps'
spread as p10-p90), the peak device memory over the measured steps
(``torch.cuda.max_memory_allocated``; on CPU the process's peak RSS, which says nothing about
offloading), the device memory resident before the first step (``torch.cuda.memory_allocated``),
where the sharded parameters live and whether they are pinned, and the largest relative gap of
the losses from ``none``'s (AdamW runs on the CPU when offloaded, so not bit for bit). The compiled
path refuses ``CPUOffloadPolicy`` (``fsdp_compile/state.py``), hence eager only.

    python -m benchmarks.offload --device cuda --world-size 1 --dim 1024 --layers 4 --heads 16 --bf16
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

import fsdp_compile
from benchmarks.config import BenchConfig
from benchmarks.launch import launch, pick_device_type
from benchmarks.measure import _peak_memory, timed_step
from benchmarks.modes import Mode
from benchmarks.report import _percentile, git_commit
from benchmarks.run import _global_batches
from fsdp_compile.models import Transformer

__all__ = ["VARIANTS", "OffloadConfig", "parse_args", "main"]

VARIANTS = ("none", "pinned", "unpinned")
MIB = 2**20


@dataclass(frozen=True)
class OffloadConfig:
    """What to train and how; picklable, so a spawned rank gets it unchanged."""

    bench: BenchConfig  # the model, data, seed, lr, steps and warm-up steps
    variants: tuple[str, ...] = VARIANTS
    json_path: str | None = None
    command: str = ""


def _policy(variant: str) -> fsdp_compile.OffloadPolicy:
    if variant == "none":
        return fsdp_compile.OffloadPolicy()
    return fsdp_compile.CPUOffloadPolicy(pin_memory=variant == "pinned")


def _build(variant: str, cfg: BenchConfig, device: torch.device) -> Mode:
    """The benchmark's model (seeded: every variant starts from the same weights), sharded per block + root."""
    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model_config()).to(device)
    mp_policy = (
        fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.bf16 else fsdp_compile.MixedPrecisionPolicy()
    )
    for module in [*model.layers, model]:
        fsdp_compile.fully_shard(module, mp_policy=mp_policy, offload_policy=_policy(variant))
    return Mode(variant, model, torch.optim.AdamW(model.parameters(), lr=cfg.lr))


def _placement(model: torch.nn.Module) -> dict:
    """Where the sharded parameters live: their devices and whether every one is pinned."""
    locals_ = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    return {
        "shard_devices": sorted({str(t.device) for t in locals_}),
        "all_pinned": all(t.is_pinned() for t in locals_ if t.device.type == "cpu") and any(t.device.type == "cpu" for t in locals_),
    }


def _run_variant(variant: str, cfg: BenchConfig, device: torch.device, batches: list[torch.Tensor]) -> dict:
    """Train one variant for warm-up + measured steps; its figures (or its error)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    resident_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    mode = _build(variant, cfg, device)
    resident = torch.cuda.memory_allocated(device) - resident_before if device.type == "cuda" else None
    figures: dict = {"placement": _placement(mode.model), "resident_mib": None if resident is None else resident / MIB}
    times, losses = [], []
    for tokens in batches[: cfg.warmup]:
        seconds, loss = timed_step(mode, tokens, device)
        times.append(seconds)
        losses.append(loss.item())
    # The peak of the measured steps only: by then AdamW's state exists, as in steady training.
    with _peak_memory(device) as memory:
        for tokens in batches[cfg.warmup : cfg.total_steps]:
            seconds, loss = timed_step(mode, tokens, device)
            times.append(seconds)
            losses.append(loss.item())
    measured = times[cfg.warmup :]
    figures.update(
        status="ok",
        losses=losses,
        step_times_s=measured,
        step_ms_median=_percentile(measured, 0.5) * 1e3,
        step_ms_p10=_percentile(measured, 0.1) * 1e3,
        step_ms_p90=_percentile(measured, 0.9) * 1e3,
        peak_mib=None if memory.get("peak") is None else memory["peak"] / MIB,
        peak_is=("torch.cuda.max_memory_allocated" if device.type == "cuda" else "process RSS"),
    )
    del mode
    gc.collect()
    return figures


def worker(config: OffloadConfig) -> None:
    """Every rank trains every variant; rank 0 prints the table and writes the JSON."""
    cfg = config.bench
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    batches = [b.chunk(world)[rank].to(device) for b in _global_batches(cfg, world, cfg.total_steps)]
    results: dict[str, dict] = {}
    for variant in config.variants:
        try:
            results[variant] = _run_variant(variant, cfg, device, batches)
        except Exception as error:  # noqa: BLE001 - reported in the table; the other variants still run
            results[variant] = {"status": f"failed: {type(error).__name__}: {next(iter(str(error).splitlines()), '')}"[:300]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
    _add_loss_gaps(results)
    if rank == 0:
        _publish(config, results, world, device)


def _add_loss_gaps(results: dict[str, dict]) -> None:
    base = results.get("none", {}).get("losses")
    for figures in results.values():
        if base and figures.get("losses"):
            figures["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(figures["losses"], base))


def markdown_table(results: dict[str, dict]) -> str:
    """One row per variant: step time, its ratio to no offload, device memory, placement, loss gap."""
    base = results.get("none", {}).get("step_ms_median")
    lines = [
        "| variant | step ms median (p10–p90) | vs none | peak MiB | resident MiB | shards on | pinned | loss rel diff |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def number(value, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    for variant, f in results.items():
        if f.get("status") != "ok":
            lines.append(f"| {variant} | {f.get('status', '?').replace('|', '/')} | | | | | | |")
            continue
        ratio = f"{f['step_ms_median'] / base:.2f}×" if base else "—"
        lines.append(
            f"| {variant} | {f['step_ms_median']:.1f} ({f['step_ms_p10']:.1f}–{f['step_ms_p90']:.1f}) | {ratio} "
            f"| {number(f['peak_mib'], '.0f')} | {number(f['resident_mib'], '.0f')} | {', '.join(f['placement']['shard_devices'])} "
            f"| {'yes' if f['placement']['all_pinned'] else 'no'} | {number(f.get('loss_max_rel_diff'), '.1e')} |"
        )
    return "\n".join(lines)


def _publish(config: OffloadConfig, results: dict[str, dict], world: int, device: torch.device) -> None:
    cfg = config.bench
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    meta = {
        "command": config.command, "torch": torch.__version__, "commit": git_commit(), "device": device.type,
        "machine": machine, "world_size": world, "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "command"},
    }
    table = markdown_table(results)
    print(f"\n{machine}, world size {world}: CPU offload vs none ({cfg.steps} measured steps after {cfg.warmup} warm-up)\n")
    print(table)
    if config.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(config.json_path)), exist_ok=True)
        with open(config.json_path, "w") as out:
            json.dump({"meta": meta, "variants": results, "table": table}, out, indent=1)


def parse_args(argv: list[str] | None = None) -> OffloadConfig:
    """Flags -> OffloadConfig; the model flags are the benchmark's (``python -m benchmarks --help``)."""
    d = BenchConfig()
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offload", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    add("--world-size", type=int, default=1, help="ranks to spawn when not started by torchrun (default 1)")
    add("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA + NCCL if available, else CPU + gloo")
    for name in ("dim", "layers", "heads", "vocab", "seq", "batch"):
        add(f"--{name}", type=int, default=getattr(d, name), help=f"as python -m benchmarks (default {getattr(d, name)})")
    add("--bf16", action="store_true", help="bf16 parameters for compute, fp32 gradient reduction")
    add("--steps", type=int, default=5, help="measured steps per variant (default 5)")
    add("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    add("--json", dest="json_path", default=None, metavar="PATH", help="write the figures and the table to PATH")
    args = parser.parse_args(argv)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    bench = BenchConfig(
        world_size=args.world_size, device=args.device, dim=args.dim, layers=args.layers, heads=args.heads,
        vocab=args.vocab, seq=args.seq, batch=args.batch, bf16=args.bf16, steps=args.steps, warmup=args.warmup,
    )
    command = "python -m benchmarks.offload" + "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv))
    return OffloadConfig(bench=bench, variants=variants, json_path=args.json_path, command=command)


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    launch(worker, config.bench.world_size, pick_device_type(config.bench.device), config)


if __name__ == "__main__":
    main()
