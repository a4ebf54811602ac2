"""Raw per-step numbers -> figures per mode -> a Markdown table (stdout), JSON and a PNG in --out-dir.

Every figure is computed here from what run.py measured; nothing is typed in by hand.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys

import torch

from benchmarks.config import BASELINE_LOSS, BASELINE_SPEED, BenchConfig
from benchmarks.modes import COMM_POLICY_MODES, COMPILED
from benchmarks.overhead import per_block_figures, per_block_table, profile_markdown

__all__ = ["summarize", "markdown_table", "publish", "git_commit", "write_results_md"]

MIB = 2**20


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _mib_max_over_ranks(probes: list[dict], key: str) -> float | None:
    values = [p[key] for p in probes if p.get(key) is not None]
    return max(values) / MIB if values else None


def summarize(cfg: BenchConfig, results: dict, world: int) -> dict[str, dict]:
    """Figures per mode, in table order; raw series included so the JSON can be re-analysed."""
    tokens_per_step = cfg.batch * cfg.seq * world
    summary: dict[str, dict] = {}
    for name in cfg.modes:
        reason = results["status"][name]
        per_step = [max(ranks) for ranks in results["times"][name]]  # the slowest rank sets the pace
        figures: dict = {
            "status": "ok" if reason is None else f"unavailable: {reason}",
            "losses": results["losses"][name],
            "warmup_times_s": per_step[: cfg.warmup],
            "step_times_s": per_step[cfg.warmup :],
            "step_times_per_rank_s": results["times"][name][cfg.warmup :],
        }
        summary[name] = figures
        if reason is not None:
            continue
        measured = figures["step_times_s"]
        median = _percentile(measured, 0.5)
        figures.update(
            step_ms_median=median * 1e3, step_ms_p10=_percentile(measured, 0.1) * 1e3,
            step_ms_p90=_percentile(measured, 0.9) * 1e3, step_ms_min=min(measured) * 1e3,
            step_ms_max=max(measured) * 1e3, tokens_per_s=tokens_per_step / median,
        )
        forward_backward = _forward_backward_steps(results["times"][name], results.get("optimizer_times", {}).get(name), cfg.warmup)
        if forward_backward:
            figures["forward_backward_ms_median"] = _percentile(forward_backward, 0.5) * 1e3
            figures["optimizer_ms_median"] = median * 1e3 - figures["forward_backward_ms_median"]
        shallow = results.get("shallow", {}).get(name)
        if shallow and shallow["status"] is None:
            shallow_steps = [max(ranks) for ranks in shallow["times"][cfg.warmup:]]
            figures["per_block"] = per_block_figures(measured, shallow_steps, cfg.layers, cfg.shallow_layers, cfg.seed)
            shallow_forward_backward = _forward_backward_steps(shallow["times"], shallow.get("optimizer_times"), cfg.warmup)
            if forward_backward and shallow_forward_backward:
                figures["per_block_forward_backward"] = per_block_figures(
                    forward_backward, shallow_forward_backward, cfg.layers, cfg.shallow_layers, cfg.seed)
        elif shallow:
            figures["per_block_status"] = f"unavailable at {cfg.shallow_layers} layers: {shallow['status']}"
        if name in COMPILED:
            figures["compile_cold_s"] = sum(figures["warmup_times_s"]) - cfg.warmup * median
            figures["compile_warm_s"] = results["warm"].get(name)
        probes = results["probes"].get(name, [])
        figures["probe_per_rank"] = probes
        errors = [p["error"] for p in probes if "error" in p]
        if errors:
            figures["probe_error"] = errors[0]
        else:
            figures.update(
                peak_mib=_mib_max_over_ranks(probes, "peak_bytes"),
                step_mib=_mib_max_over_ranks(probes, "step_bytes"),
                saved_mib=_mib_max_over_ranks(probes, "saved_bytes"),
                collectives=probes[0]["collectives"],
                collectives_total=sum(probes[0]["collectives"].values()),
                collectives_same_on_all_ranks=all(p["collectives"] == probes[0]["collectives"] for p in probes),
                wire_kib=max(p.get("wire_bytes", 0) for p in probes) / 1024,
            )
    _add_ratios(summary)
    return summary


def _forward_backward_steps(times: list[list[float]], optimizer: list[list[float]] | None, warmup: int) -> list[float]:
    """Each measured step's seconds (``times``, [step][rank]) without its optimizer step and zero_grad
    (the slowest rank's), or [] where the run did not time the optimizer apart."""
    if not optimizer:
        return []
    steps = zip(times[warmup:], optimizer[warmup:])
    return [max(step - opt for step, opt in zip(ranks, ranks_optimizer)) for ranks, ranks_optimizer in steps]


def _add_ratios(summary: dict[str, dict]) -> None:
    speed_base = summary.get(BASELINE_SPEED, {}).get("step_ms_median")
    loss_base = summary.get(BASELINE_LOSS, {})
    for name, figures in summary.items():
        if figures["status"] != "ok":
            continue
        if speed_base:
            figures["speed_vs_torch_eager"] = speed_base / figures["step_ms_median"]
        if loss_base.get("status") == "ok":
            pairs = list(zip(figures["losses"], loss_base["losses"]))
            figures["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in pairs) if pairs else None


def _fmt(value, spec: str, missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def _collectives_cell(figures: dict) -> str:
    counts = figures.get("collectives")
    if counts is None:
        return "n/a"
    known = ("all_gather", "reduce_scatter", "all_reduce")
    cell = f"{figures['collectives_total']} ({'/'.join(str(counts.get(k, 0)) for k in known)})"
    others = {k: v for k, v in counts.items() if k not in known}
    return cell + "".join(f" +{v} {k}" for k, v in others.items())


_HEADER = (
    "| mode | step ms median (p10–p90) | tokens/s | vs torch-eager | peak MiB | step +MiB | saved MiB "
    "| coll/step (AG/RS/AR) | wire KiB/step | compile cold s | compile warm s | loss rel diff |"
)


def markdown_table(summary: dict[str, dict]) -> str:
    lines = [_HEADER, "|" + "---|" * _HEADER.count(" | ") + "---|"]
    for name, f in summary.items():
        if f["status"] != "ok":
            status = f["status"].replace("|", "/")
            lines.append(f"| {name} | {status} |" + " — |" * (_HEADER.count(" | ") - 1))
            continue
        cells = [
            name,
            f"{f['step_ms_median']:.0f} ({f['step_ms_p10']:.0f}–{f['step_ms_p90']:.0f})",
            f"{f['tokens_per_s']:,.0f}",
            _fmt(f.get("speed_vs_torch_eager"), ".2f") + ("×" if f.get("speed_vs_torch_eager") else ""),
            _fmt(f.get("peak_mib"), ".0f", "n/a"),
            _fmt(f.get("step_mib"), ".0f", "n/a"),
            _fmt(f.get("saved_mib"), ".1f", "n/a"),
            _collectives_cell(f),
            _fmt(f.get("wire_kib"), ".0f", "n/a"),
            _fmt(f.get("compile_cold_s"), ".1f"),
            _fmt(f.get("compile_warm_s"), ".1f"),
            _fmt(f.get("loss_max_rel_diff"), ".1e"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _slowest_line(summary: dict[str, dict]) -> str:
    rated = {n: f["speed_vs_torch_eager"] for n, f in summary.items() if f.get("speed_vs_torch_eager") and n != BASELINE_SPEED}
    if not rated:
        return ""
    name = min(rated, key=rated.get)
    return f"Slowest mode relative to {BASELINE_SPEED}: {name} (speed {rated[name]:.2f}× {BASELINE_SPEED}'s)."


def git_commit() -> str:
    """The checkout's commit (with "with uncommitted changes" when dirty), for provenance lines."""
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{commit}{' with uncommitted changes' if dirty else ''}" if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _meta(cfg: BenchConfig, results: dict, world: int, device: torch.device) -> dict:
    with torch.device("meta"):
        from benchmarks.modes import build_model

        parameters = sum(p.numel() for p in build_model(cfg.model_config()).parameters())
    if device.type == "cuda":
        machine = f"{torch.cuda.get_device_name(device)}, NCCL"
    else:
        machine = f"{os.cpu_count()}-core CPU ({platform.machine()}), gloo, {torch.get_num_threads()} thread(s) per rank"
    return {
        "command": cfg.command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "device": device.type,
        "machine": machine,
        "world_size": world,
        "parameters": parameters,
        "tokens_per_step": cfg.batch * cfg.seq * (world // cfg.tp),  # tp ranks share their dp rank's batch
        "inductor_startup_s": results["inductor_startup_s"],
        "load_average": results.get("load_average"),
        "config": {k: v for k, v in cfg.__dict__.items() if k != "command"},
        "section_key": f"{device.type}-{'nccl' if device.type == 'cuda' else 'gloo'}-world{world}"
        + ("-hf-llama" if cfg.model == "hf-llama" else "")
        + (f"-tp{cfg.tp}" if cfg.tp > 1 else "")
        + ("-comm-policy" if set(cfg.modes) & set(COMM_POLICY_MODES) else "")
        + ("-overhead" if cfg.overhead else ""),
    }


_METHOD = """\
How the figures are measured: modes run interleaved step by step after a barrier; step time is
forward + backward + AdamW step of the slowest rank, warm-up steps excluded. Memory, saved
tensors and collectives come from one extra, untimed probe step per mode: on CPU the peak is
the rank's RSS sampled every 1 ms from /proc/self/statm after returning free heap memory to
the OS (malloc_trim), and "step +MiB" is that peak minus the RSS just before the step (all
modes' models stay resident, so the absolute peak includes theirs); on CUDA it is
torch.cuda.max_memory_allocated. Saved MiB sums the distinct tensors autograd saves for
backward in one forward (saved_tensors_hooks). Collectives are the c10d ops the torch profiler
sees in one step (AG all-gather / RS reduce-scatter / AR all-reduce). Compile cold is the
warm-up steps' excess over the median step in a fresh Inductor cache of the mode's own (no
kernel another mode compiled is reused); warm, the same for a second model built after
torch._dynamo.reset() with its cache populated; Inductor's one-time
start-up is paid by a trivial compile before any mode (STARTUP). Loss rel diff is
the max over all steps of |loss - loss(ours-eager)| / |loss(ours-eager)|."""


def _method(meta: dict) -> str:
    startup = meta["inductor_startup_s"]
    return _METHOD.replace(" (STARTUP)", "" if startup is None else f" ({startup:.1f} s in this run)")


def _section(meta: dict, table: str, summary: dict, extra: str = "") -> str:
    """``extra``: the host-overhead tables (per block, profiles) after the method paragraph."""
    key = meta["section_key"]
    slowest = _slowest_line(summary)
    return (
        f"<!-- benchmark section: {key} -->\n"
        f"## {meta['machine']}, world size {meta['world_size']}{_section_topic(key)}\n\n"
        f"Command: `{meta['command']}`  \n"
        f"torch {meta['torch']}, Python {meta['python']}, {meta['date'][:10]}, commit {meta['commit']}"
        f"{_load_text(meta.get('load_average'))}.  \n"
        f"Model: {meta['parameters'] / 1e6:.2f}M parameters ({_model_text(meta['config'])}), "
        f"{meta['tokens_per_step']} tokens per step over all ranks.\n\n"
        f"{table}\n\n{slowest + chr(10) + chr(10) if slowest else ''}{_method(meta)}\n"
        f"{extra}"
        f"<!-- end benchmark section: {key} -->\n"
    )


def _load_text(load: list | tuple | None) -> str:
    if not load or None in load:
        return ""
    return f"; machine load average (1 min) {load[0]:.1f} at the start, {load[1]:.1f} at the end, on {os.cpu_count()} cores"


def _section_topic(key: str) -> str:
    """What sets a section apart from the plain run of the same machine and world size (its key's suffix)."""
    topics = []
    if "-tp" in key:
        topics.append(f"FSDP + TP ({key.split('-tp')[1].split('-')[0]}-way)")
    if "-comm-policy" in key:
        topics.append("CommPolicy modes")
    if "-hf-llama" in key:
        topics.append("Hugging Face-shaped Llama")
    if key.endswith("-overhead"):
        topics.append("host overhead (tiny model, compute ~0)")
    return "".join(f", {topic}" for topic in topics)


def _model_text(config: dict) -> str:
    head = "untied head" if config["untied"] else "tied head"
    precision = "bf16 params / fp32 reduce" if config["bf16"] else "fp32"
    model = ""
    if config.get("model") == "hf-llama":
        kv_heads = config["kv_heads"] if config.get("kv_heads") is not None else max(1, config["heads"] // 2)
        model = f"Hugging Face-shaped Llama (benchmarks/hf_llama.py, {kv_heads} key-value heads), "
    return (model + f"dim {config['dim']}, {config['layers']} layers, {config['heads']} heads, vocab {config['vocab']}, "
            f"seq {config['seq']}, batch {config['batch']} per rank, {head}, {precision}, "
            + (f"tensor parallel {config['tp']} ways (torchtitan's plan; batch per dp rank), " if config.get("tp", 1) > 1 else "")
            + f"{config['warmup']} warm-up + {config['steps']} measured steps"
            + (", AdamW foreach" if config.get("foreach_adamw") else ""))


def _overhead_text(cfg: BenchConfig, summary: dict[str, dict], profiles: dict[str, dict]) -> str:
    """With --shallow-layers and --profile-step: the per-block table and the profiles, as Markdown."""
    parts = []
    table = per_block_table(summary, BASELINE_SPEED)
    if table:
        missing = [f"{name}: {f['per_block_status']}" for name, f in summary.items() if f.get("per_block_status")]
        parts.append(
            f"### Host time per block\n\nEach mode also ran at {cfg.shallow_layers} layers, interleaved with the "
            f"{cfg.layers}-layer run in the same process; host ms per block is the slope of the median step time "
            f"between the two depths, (p10–p90) a bootstrap over the measured steps, and fixed ms per step the "
            f"intercept (embedding, loss, root module, the optimizer's per-step part): [Note: host time per block] "
            f"in benchmarks/overhead.py. Step time / layers would charge each block a share of the fixed part. "
            f"The optimizer's step and zero_grad are timed apart (host time, the same torch.optim code in every "
            f"mode, {'foreach over all parameters as on CUDA' if cfg.foreach_adamw else 'per parameter'}, so part of "
            f"each block's slope); forward + backward per block is the slope "
            f"without them: what the FSDP runtime and compiled code cost.\n\n"
            + table + "".join(f"\n\n{line}" for line in missing) + "\n"
        )
    if profiles:
        parts.append(profile_markdown(profiles, cfg.command))
    return "".join("\n" + part for part in parts)


def write_results_md(path: str, section: str, key: str) -> None:
    """Replace this machine kind's section in ``path`` (or append it); other sections stay."""
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    pattern = re.compile(rf"<!-- benchmark section: {re.escape(key)} -->.*?<!-- end benchmark section: {re.escape(key)} -->\n", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as out:
        out.write(text)


def _plot(path: str, cfg: BenchConfig, summary: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("benchmarks: matplotlib is not installed (pip install matplotlib); no PNG written", file=sys.stderr)
        return False
    ok = [name for name, f in summary.items() if f["status"] == "ok"]
    figure, (times_ax, loss_ax) = plt.subplots(1, 2, figsize=(13, 4.8))
    if ok:
        times_ax.boxplot([[t * 1e3 for t in summary[n]["step_times_s"]] for n in ok], whis=(10, 90), showfliers=True)
        times_ax.set_xticks(range(1, len(ok) + 1), ok, rotation=20)
    times_ax.set_ylabel("step time (ms)")
    all_times = [t for n in ok for t in summary[n]["step_times_s"]]
    if all_times and max(all_times) > 20 * min(all_times):
        times_ax.set_yscale("log")  # one mode far slower (e.g. recompiling) would flatten the others
    times_ax.set_title(f"step time per mode (box: quartiles, whiskers: p10–p90; {cfg.steps} steps)")
    for name in ok:
        loss_ax.plot(range(len(summary[name]["losses"])), summary[name]["losses"], label=name, marker=".")
    loss_ax.axvspan(-0.5, cfg.warmup - 0.5, color="0.9", label="warm-up")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("global loss")
    loss_ax.set_title("loss per step (same data and seed)")
    loss_ax.legend(fontsize="small")
    missing = [n for n in summary if n not in ok]
    if missing:
        figure.text(0.01, 0.01, "unavailable: " + ", ".join(missing), fontsize="small", color="0.4")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def publish(cfg: BenchConfig, results: dict, world: int, device: torch.device) -> None:
    """Print the table and write results.{md,json,png} into cfg.out_dir (rank 0)."""
    summary = summarize(cfg, results, world)
    meta = _meta(cfg, results, world, device)
    table = markdown_table(summary)
    overhead = _overhead_text(cfg, summary, results.get("profiles", {}))
    section = _section(meta, table, summary, overhead)
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(os.path.join(cfg.out_dir, "results.json"), "w") as out:
        json.dump({"meta": meta, "modes": summary, "profiles": results.get("profiles", {}),
                   "compile_stages": results.get("compile_stages", {}), "errors": results["errors"]}, out, indent=1)
    with open(os.path.join(cfg.out_dir, "results.md"), "w") as out:
        out.write(section)
    wrote_png = _plot(os.path.join(cfg.out_dir, "results.png"), cfg, summary)
    if cfg.results_md:
        write_results_md(cfg.results_md, section, meta["section_key"])
    print(f"\n{meta['machine']}, world size {world}, {meta['parameters'] / 1e6:.2f}M parameters, torch {meta['torch']}\n")
    print(table)
    slowest = _slowest_line(summary)
    if slowest:
        print("\n" + slowest)
    if overhead:
        print("\n" + overhead)
    written = ["results.md", "results.json"] + (["results.png"] if wrote_png else [])
    print(f"\nwrote {', '.join(os.path.join(cfg.out_dir, name) for name in written)}"
          + (f" and the section in {cfg.results_md}" if cfg.results_md else ""))
    for name in results["errors"]:
        print(f"note: {name} raised; its full traceback is under \"errors\" in results.json", file=sys.stderr)
