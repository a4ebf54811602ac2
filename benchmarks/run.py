"""One benchmark run on every rank: build the modes, step them interleaved, probe, time a warm compile, report.

[Note: interleaving] Step k of every mode runs before step k+1 of any, each after a barrier, so
a burst of machine noise lands on all modes alike rather than on whichever ran at that moment.
Each rank keeps all modes' models resident for the whole run; per-mode memory is therefore
measured as the peak of one probe step and its rise over the value just before that step.
"""
from __future__ import annotations

import functools
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch._inductor.utils
import torch.distributed as dist

from benchmarks import report
from benchmarks.config import BenchConfig
from benchmarks.measure import probe_step, timed_step
from benchmarks.modes import COMPILED, Mode, build_mode
from benchmarks.overhead import profile_step, shallow_name
from benchmarks.progress import Progress

__all__ = ["worker"]


def _global_batches(cfg: BenchConfig, world: int, count: int) -> list[torch.Tensor]:
    """Learnable sequences (random start, small random stride, modulo vocab), so the loss falls."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    rows = cfg.batch * world
    batches = []
    for _ in range(count):
        start = torch.randint(0, cfg.vocab, (rows, 1), generator=generator)
        stride = torch.randint(1, 8, (rows, 1), generator=generator)
        batches.append((start + stride * torch.arange(cfg.seq)) % cfg.vocab)
    return batches


def _short(error: BaseException) -> str:
    first = next((line for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first}"[:160]


class _Agreement:
    """All ranks learn whether any rank failed, so a failed mode is dropped everywhere at once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.world = dist.get_world_size()

    def gather(self, values: list[float]) -> torch.Tensor:
        """[world, len(values)] of every rank's values (one small all-gather)."""
        local = torch.tensor(values, dtype=torch.float64, device=self.device)
        rows = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(rows, local)
        return torch.stack(rows).cpu()

    def reason(self, local_reason: str | None) -> str | None:
        """None if no rank failed, else the first failing rank's reason."""
        failed = self.gather([0.0 if local_reason is None else 1.0])[:, 0]
        return self.first_reason(local_reason) if failed.any() else None

    def first_reason(self, local_reason: str | None) -> str:
        """Called on every rank once some rank is known to have failed."""
        reasons: list = [None] * self.world
        dist.all_gather_object(reasons, local_reason)
        return next(r for r in reasons if r)


def _build(name: str, cfg: BenchConfig, device: torch.device, agree: _Agreement, errors: dict,
           layers: int | None = None) -> tuple[Mode | None, str | None]:
    """Mode ``name`` at --layers, or as its shallow twin at ``layers`` (named so in ``errors``)."""
    mode, local_reason = None, None
    key = name if layers is None else shallow_name(name, layers)
    try:
        mode = build_mode(name, cfg.model_config(layers), device, cfg.seed, cfg.lr, cfg.bf16, cfg.tp, cfg.foreach_adamw)
        mode.name = key
    except Exception as error:  # noqa: BLE001 - reported as "unavailable" in the table
        local_reason, errors[key] = _short(error), traceback.format_exc()
    reason = agree.reason(local_reason)
    return (mode, None) if reason is None else (None, reason)


def _step_all_ranks(mode: Mode, tokens: torch.Tensor, device: torch.device, agree: _Agreement, errors: dict):
    """(per-rank seconds, per-rank optimizer seconds, global mean loss, failure reason or None) of one timed step."""
    dist.barrier()
    try:
        seconds, loss = timed_step(mode, tokens, device)
        values, local_reason = [seconds, loss.item(), 0.0, mode.optimizer_s], None
    except Exception as error:  # noqa: BLE001
        values, local_reason = [0.0, 0.0, 1.0, 0.0], _short(error)
        errors[mode.name] = traceback.format_exc()
    rows = agree.gather(values)
    if rows[:, 2].any():
        return None, None, None, agree.first_reason(local_reason)
    return rows[:, 0].tolist(), rows[:, 3].tolist(), rows[:, 1].mean().item(), None


def _fresh_inductor_cache(rank: int) -> str:
    # A cold compile is cold only with an empty cache; each rank gets its own, removed at the end.
    path = tempfile.mkdtemp(prefix=f"fsdp_bench_inductor_rank{rank}_")
    _use_inductor_cache(path)
    return path


def _use_the_cache_of_mode(rank_cache: str, name: str) -> None:
    """Before a step of mode ``name``: its own on-disk Inductor cache under this rank's, and none of
    the kernels another mode's compiles left in memory; see [Note: a cold compile per mode]."""
    _use_inductor_cache(os.path.join(rank_cache, name))
    torch._inductor.utils.clear_inductor_caches()


def _use_inductor_cache(path: str) -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")


def worker(cfg: BenchConfig) -> None:
    """Runs on every rank with the process group initialized (see launch.py); rank 0 reports."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    if cfg.threads is not None and device.type == "cpu":
        torch.set_num_threads(cfg.threads)  # after launch.py's default of the cores / ranks
    cache = _fresh_inductor_cache(rank) if cfg.fresh_inductor_cache and cfg.inductor_cache_dir is None else None
    if cfg.inductor_cache_dir is not None:
        _use_inductor_cache(os.path.join(cfg.inductor_cache_dir, f"rank{rank}"))
    try:
        results = _run(cfg, rank, world, device, cache)
    finally:
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
    if rank == 0:
        report.publish(cfg, results, world, device)


def _run(cfg: BenchConfig, rank: int, world: int, device: torch.device, cache: str | None = None) -> dict:
    agree = _Agreement(device)
    load_at_start = _load_average()
    # [Note: a cold compile per mode]
    # With a fresh cache (``cache``, this rank's), each mode compiles with one of its own, and with
    # Inductor's in-memory caches emptied before each of its warm-up steps. One cache for every mode
    # made the later modes' compiles warm: a block's kernels are the same C++ or Triton source in
    # every mode, so torch-blockcompile, last, took them from ours-compiled's and ours-fallback's
    # compiles (2.1 s "cold" on the demo model, 10.5 s in a process of its own).
    use_cache_of = functools.partial(_use_the_cache_of_mode, cache) if cache is not None else lambda name: None
    # With tensor parallelism the ranks of one dp group (consecutive ranks: a (dp, tp) mesh) share a batch.
    data_world, data_rank = world // cfg.tp, rank // cfg.tp
    batches = [b.chunk(data_world)[data_rank].to(device) for b in _global_batches(cfg, data_world, cfg.total_steps + 1)]
    errors: dict[str, str] = {}
    status: dict[str, str | None] = {}
    modes: dict[str, Mode] = {}
    # Every mode, then with --shallow-layers its twin at that depth ([Note: host time per block] in overhead.py).
    twins = {shallow_name(name, cfg.shallow_layers): name for name in cfg.modes} if cfg.shallow_layers else {}
    keys = [*cfg.modes, *twins]
    # On CUDA FSDP2's modes too: the device figures compare ([Note: profiling a step] in overhead.py).
    profiled = [name for name in cfg.modes if name.startswith("ours-") or device.type == "cuda"] if cfg.profile_step else []
    progress = Progress(len(keys) * (cfg.total_steps + 1) + len(cfg.modes) + len(profiled), enabled=rank == 0)
    startup = _inductor_startup(device, agree) if COMPILED.intersection(cfg.modes) else None
    for key in keys:
        name = twins.get(key, key)
        modes[key], status[key] = _build(name, cfg, device, agree, errors, cfg.shallow_layers if key in twins else None)
        progress.advance(f"built {key}")

    times: dict[str, list[list[float]]] = {key: [] for key in keys}  # [step][rank]
    optimizer_times: dict[str, list[list[float]]] = {key: [] for key in keys}  # of it, the optimizer's
    losses: dict[str, list[float]] = {key: [] for key in keys}
    probes: dict[str, list] = {}
    for step in range(cfg.total_steps):
        for name in keys:
            if status[name] is not None:
                progress.advance(f"{name} unavailable")
                continue
            phase = "warm-up" if step < cfg.warmup else "step"
            if step < cfg.warmup:  # where modes compile; a measured step runs what is compiled
                use_cache_of(twins.get(name, name))  # a twin's compile reuses its mode's kernels
            seconds, optimizer_seconds, loss, reason = _step_all_ranks(modes[name], batches[step], device, agree, errors)
            if reason is not None:
                status[name] = reason if step == 0 else f"failed at step {step}: {reason}"
                modes[name] = None
            else:
                times[name].append(seconds)
                optimizer_times[name].append(optimizer_seconds)
                losses[name].append(loss)
            progress.advance(f"{name} {phase} {step + 1}/{cfg.total_steps}")
    compile_stages = _compile_stages()  # the warm-up steps' compiles (probes and profiles compile nothing)
    for name in cfg.modes:
        if status[name] is None:
            probes[name] = _probe_all_ranks(modes[name], batches[cfg.total_steps], device, agree, errors)
        progress.advance(f"probed {name}")
    profiles = {}
    for name in profiled:
        if status[name] is None:
            profiles[name] = _profile(modes[name], batches[cfg.total_steps], errors)
        progress.advance(f"profiled {name}")
    modes.clear()
    gc.collect()

    warm: dict[str, float | None] = {}
    compiled = [name for name in cfg.modes if name in COMPILED and status[name] is None]
    if cfg.warm_compile and compiled:
        progress.grow(len(compiled) * cfg.warmup)
        for name in compiled:
            use_cache_of(name)  # the cache its cold compile filled, nothing in memory: as after a restart
            warm[name] = _warm_compile(name, cfg, batches, device, agree, errors, times[name], progress)
    progress.close()
    return {
        "inductor_startup_s": startup, "status": {name: status[name] for name in cfg.modes}, "times": times, "optimizer_times": optimizer_times,
        "losses": losses, "probes": probes, "warm": warm, "errors": errors if rank == 0 else {},
        "shallow": {name: {"status": status[key], "times": times[key], "optimizer_times": optimizer_times[key]} for key, name in twins.items()},
        "profiles": profiles, "load_average": (load_at_start, _load_average()), "compile_stages": compile_stages,
    }


def _compile_stages() -> dict[str, list[float]]:
    """``torch._dynamo.utils.compile_times()`` of this process as {stage: [calls, seconds]}: every
    ``dynamo_timed`` stage of the compiles since the reset in ``_inductor_startup`` (Dynamo's tracing,
    AOTAutograd, Inductor's code generation, ...; nested: a stage's seconds include the stages it
    calls). All modes' compiles together: per mode where one mode runs (``--compile-scaling``)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {stage: [len(seconds), sum(seconds)] for stage, seconds in compilation_time_metrics.items()}


def _load_average() -> float | None:
    """The machine's 1-minute load average: other work on a shared machine shows in every step time."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _profile(mode: Mode, tokens: torch.Tensor, errors: dict) -> dict:
    """This rank's profile of one step (benchmarks/overhead.py); ranks are not compared."""
    try:
        return profile_step(mode, tokens)
    except Exception as error:  # noqa: BLE001 - shown as unavailable in the profile sub-section
        errors[f"{mode.name} (profile)"] = traceback.format_exc()
        return {"error": _short(error)}


def _inductor_startup(device: torch.device, agree: _Agreement) -> float:
    """Compile a trivial function first, so Inductor's one-time start-up (imports, compiler probe)
    is not charged to whichever compiled mode happens to come first; returns its time."""
    start = time.perf_counter()
    function = torch.compile(lambda x: (x.sin() * 2).sum())
    function(torch.randn(8, device=device, requires_grad=True)).backward()
    torch._dynamo.reset()
    return agree.gather([time.perf_counter() - start])[:, 0].max().item()


def _probe_all_ranks(mode: Mode, tokens: torch.Tensor, device: torch.device, agree: _Agreement, errors: dict) -> list:
    """Every rank's probe (a dict), or every rank's error string."""
    dist.barrier()
    try:
        probe = probe_step(mode, tokens, device).__dict__
    except Exception as error:  # noqa: BLE001 - the figures it would give show as n/a
        probe = {"error": _short(error)}
        errors[f"{mode.name} (probe)"] = traceback.format_exc()
    everyone: list = [None] * agree.world
    dist.all_gather_object(everyone, probe)
    return everyone


def _warm_compile(name, cfg, batches, device, agree, errors, measured_times, progress) -> float | None:
    """Rebuild the mode after torch._dynamo.reset() and time its warm-up steps again: compile with warm caches."""
    torch._dynamo.reset()
    mode, reason = _build(name, cfg, device, agree, errors)
    if mode is None:
        return None
    total = 0.0
    for step in range(cfg.warmup):
        seconds, _, _, reason = _step_all_ranks(mode, batches[step], device, agree, errors)
        progress.advance(f"{name} warm compile {step + 1}/{cfg.warmup}")
        if reason is not None:
            return None
        total += max(seconds)
    median = statistics.median(max(per_rank) for per_rank in measured_times[cfg.warmup:])
    del mode
    gc.collect()
    return total - cfg.warmup * median


if __name__ == "__main__":
    sys.exit("run this through `python -m benchmarks`")
