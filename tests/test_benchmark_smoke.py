"""``python -m benchmarks`` end to end on a tiny model: 2 gloo ranks, 1 warm-up + 2 measured steps.

Checks what the run produces (table, JSON, PNG) and that the two eager runtimes agree on the
loss; every default mode must run; no timing is asserted. The benchmark runs once per module, in
a subprocess, as a user runs it.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from benchmarks.config import MODES
from conftest import SCALAR_INDUCTOR_ENV
from fsdp_testing import wait_for_background_run

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every default mode must run (none "unavailable"): the compiled ones compile this tiny model in
# about half a minute on 2 CPU cores; the warm-compile rerun is skipped (--no-warm-compile) to
# keep the suite short.
MUST_RUN = MODES
TINY = ["--dim", "32", "--layers", "2", "--heads", "4", "--vocab", "64", "--seq", "16", "--batch", "2"]


# [Note: the benchmark smoke run overlaps the suite]
# The run is a subprocess of its own (two ranks compiling three modes, 40-47 s on 2 CPU cores), and
# much of the suite keeps one core idle (the Triton interpreter's kernel tests run in one process).
# So conftest.py starts it as soon as these tests are collected (start_benchmark_run) and moves them to
# the suite's end, where ``run`` only waits for it: the suite's wall time drops by most of the run's.
# The tests that run in the pytest process alone (no ranks: the kernels under the interpreter, graphs
# traced with a fake process group) move to the suite's start, so the run takes the core they leave
# idle rather than competing with ranks for both (the first test files, 2-rank compiles, ran about
# 45 s longer beside it). Nothing it asserts depends on timing.
def start_benchmark_run() -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    """``python -m benchmarks`` on the tiny model, started in the background: (process, out dir,
    folder of its stdout and stderr)."""
    # --reuse-inductor-cache: both ranks use the one empty cache below rather than one each, so a
    # kernel one rank compiled (the ranks' are identical) is a cache hit for the other (48 s -> 34 s
    # here); nothing asserted depends on compile times.
    # As a user runs it: Inductor's vectorized C++, which the rest of the suite turns off
    # ([Note: the tests compile scalar C++] in conftest.py).
    env = {name: value for name, value in os.environ.items() if SCALAR_INDUCTOR_ENV.get(name) != value}
    return _start_in_background(
        "fsdp_compile_bench_smoke_", env,
        "--modes", ",".join(MODES), *TINY, "--steps", "2", "--warmup", "1", "--no-warm-compile", "--reuse-inductor-cache",
        "--world-size", "2", "--device", "cpu",
    )


def _start_in_background(prefix: str, env: dict[str, str], *args: str) -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    """``python -m benchmarks *args`` in the background, with a fresh Inductor cache and out dir in a
    scratch folder that also takes its stdout and stderr: (process, out dir, scratch folder)."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    out_dir = scratch / "bench_out"
    command = [sys.executable, "-m", "benchmarks", *args, "--out-dir", str(out_dir)]
    env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor_cache")}
    with open(scratch / "stdout", "w") as stdout, open(scratch / "stderr", "w") as stderr:
        process = subprocess.Popen(command, cwd=REPO_DIR, env=env, stdout=stdout, stderr=stderr, text=True)
    return process, out_dir, scratch


@pytest.fixture(scope="module")
def run(request):
    started = getattr(request.config, "benchmark_smoke_run", None) or start_benchmark_run()
    yield wait_for_background_run(started, "benchmark")
    shutil.rmtree(started[2], ignore_errors=True)


def _table_rows(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in MODES:
            rows[cells[0]] = cells[1:]
    return rows


def test_table_on_stdout_has_a_row_per_mode_with_numbers_for_the_eager_runtimes(run):
    stdout, _ = run
    rows = _table_rows(stdout)
    assert set(rows) == set(MODES), stdout
    for name in MUST_RUN:
        median = float(rows[name][0].split()[0])  # "48 (42–53)"
        assert math.isfinite(median) and median > 0, rows[name]
        assert float(rows[name][1].replace(",", "")) > 0, rows[name]  # tokens/s


def test_json_lists_every_mode_with_raw_steps_and_run_metadata(run):
    _, out_dir = run
    data = json.loads((out_dir / "results.json").read_text())
    assert list(data["modes"]) == list(MODES)
    assert data["meta"]["world_size"] == 2 and data["meta"]["torch"]
    for name in MUST_RUN:
        figures = data["modes"][name]
        assert figures["status"] == "ok", (name, figures["status"])
        assert len(figures["step_times_s"]) == 2 and len(figures["losses"]) == 3
        assert all(math.isfinite(t) and t > 0 for t in figures["step_times_s"])
        assert figures["collectives_total"] > 0  # counted from the profiler, not assumed
        assert figures["peak_mib"] > 0 and figures["saved_mib"] > 0


def test_png_plot_is_written(run):
    _, out_dir = run
    assert (out_dir / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_torch_eager_loss_matches_ours_eager(run):
    _, out_dir = run
    modes = json.loads((out_dir / "results.json").read_text())["modes"]
    assert modes["torch-eager"]["loss_max_rel_diff"] <= 1e-5
    for name, figures in modes.items():
        # Compiled modes reorder float math; they still train the same model.
        assert figures["loss_max_rel_diff"] <= 1e-3, (name, figures["loss_max_rel_diff"])


def test_scaling_targets_divide_each_of_our_modes_that_ran_by_torchs_figures():
    """--compile-scaling's target lines, from made-up figures (no run): each of ours that ran, over
    torch-blockcompile at 16 layers and over itself at 2 layers; a mode that failed gets a dash;
    ours-compiled over torch-compiled once both whole-model modes ran; no line for a mode not run."""
    from benchmarks.scaling import _target_lines

    def result(figures: tuple[float, float] | None) -> dict:
        if figures is None:
            return {"status": "unavailable: failed to compile"}
        return {"status": "ok", "compile_cold_s": figures[0], "step_ms_median": figures[1]}

    def phase(figures: dict[str, tuple[float, float] | None]) -> dict:
        modes = {mode: result(value) for mode, value in figures.items()}
        return {"cold": {"modes": modes}, "warm": {"modes": modes}}

    runs = {
        2: phase({"ours-compiled": (10.0, 1.0), "ours-fallback": None, "torch-blockcompile": (8.0, 1.0)}),
        16: phase({"ours-compiled": (24.0, 9.0), "ours-fallback": None, "torch-blockcompile": (8.0, 10.0), "torch-compiled": (12.0, 10.0)}),
        32: phase({"ours-compiled": (40.0, 18.0), "ours-fallback": None, "torch-blockcompile": (8.0, 20.0)}),
    }
    lines = _target_lines(runs)
    assert "- cold compile at 16 layers, ours-compiled / torch-blockcompile: 3.00x (target <= 1.5x)" in lines
    assert "- step time at 16 layers, ours-compiled / torch-blockcompile: 0.90x (target <= 1.0x)" in lines
    assert "- cold compile at 16 layers, ours-compiled / torch-compiled (both whole model): 2.00x" in lines
    assert "- cold compile of ours-compiled, 32 layers / 2 layers: 4.00x (target <= 1.3x)" in lines
    assert "- cold compile at 16 layers, ours-fallback / torch-blockcompile: — (target <= 1.5x)" in lines
    assert not any("ours-blockcompile" in line for line in lines)


def test_each_mode_compiles_cold_in_a_cache_of_its_own(tmp_path, monkeypatch):
    """[Note: a cold compile per mode] in benchmarks/run.py: before a mode's warm-up step, Inductor's
    on-disk cache is the mode's own and nothing another mode compiled is left in memory (one shared
    cache gave torch-blockcompile, compiled last, the kernels ours-compiled had compiled)."""
    from torch._inductor.codecache import PyCodeCache

    from benchmarks.run import _use_the_cache_of_mode

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    _use_the_cache_of_mode(str(tmp_path), "ours-compiled")
    ours = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    kernel = PyCodeCache.load("compiled_by = 'ours-compiled'\n")  # as a mode's compile leaves one
    assert kernel.__file__.startswith(ours) and kernel in PyCodeCache.modules
    _use_the_cache_of_mode(str(tmp_path), "torch-blockcompile")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] != ours
    assert os.environ["TRITON_CACHE_DIR"].startswith(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert kernel not in PyCodeCache.modules


# ---- --overhead: host time per block and the profile of a step (benchmarks/overhead.py) -----------

OVERHEAD_TINY = ["--overhead", "--layers", "2", "--shallow-layers", "1", "--steps", "2", "--warmup", "1",
                 "--modes", "ours-eager", "--profile-step", "--device", "cpu"]


@pytest.fixture(scope="module")
def overhead_run(tmp_path_factory):
    """``python -m benchmarks --overhead --profile-step`` on 2 tiny layers (against 1), ours-eager only
    (about 14 s on 2 idle cores, nearly all of it two processes importing torch): (stdout, results.json,
    the RESULTS.md it wrote)."""
    scratch = tmp_path_factory.mktemp("overhead")
    results_md = scratch / "RESULTS.md"
    command = [sys.executable, "-m", "benchmarks", *OVERHEAD_TINY, "--out-dir", str(scratch), "--results-md", str(results_md)]
    done = subprocess.run(command, cwd=REPO_DIR, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads((scratch / "results.json").read_text()), results_md.read_text()


def test_overhead_reports_host_ms_per_block_from_two_depths(overhead_run):
    stdout, data, _ = overhead_run
    per_block = data["modes"]["ours-eager"]["per_block"]
    assert (per_block["deep_layers"], per_block["shallow_layers"]) == (2, 1)
    assert math.isfinite(per_block["block_ms"]) and per_block["shallow_step_ms"] > 0
    assert "| ours-eager |" in stdout.split("host ms per block (p10–p90)")[1]
    # The optimizer's step is timed apart: forward + backward is the step without it.
    figures = data["modes"]["ours-eager"]
    assert 0 < figures["optimizer_ms_median"] < figures["step_ms_median"], figures
    assert math.isfinite(figures["per_block_forward_backward"]["block_ms"])
    # AdamW as a GPU run has it (foreach), not CPU's per-parameter loop, which would dwarf the host time measured.
    assert data["meta"]["config"]["foreach_adamw"] is True


def test_overhead_profile_of_ours_counts_dispatches_and_names_python_functions(overhead_run):
    _, data, results_md = overhead_run
    assert list(data["profiles"]) == ["ours-eager"]
    profile = data["profiles"]["ours-eager"]
    assert profile["aten_ops"] >= profile["aten_top_level"] > 0
    assert profile["compiled_regions"] == 0 and len(profile["top"]) == 15
    assert any(row["where"].endswith(")") and ".py:" in row["where"] for row in profile["top"])  # file:line(function)
    section = results_md.split("<!-- benchmark section: cpu-gloo-world1-overhead -->")[1]
    assert "### Host time per block" in section and "#### ours-eager" in section and "--profile-step" in section
    assert "AdamW foreach" in section and "foreach over all parameters as on CUDA" in section


def test_host_ms_per_block_is_the_slope_between_depths_not_step_time_over_layers():
    from benchmarks.overhead import per_block_figures

    # 10 ms fixed per step + 2 ms per block: 42 ms at 16 layers, 18 ms at 4.
    figures = per_block_figures([0.042, 0.041, 0.043], [0.018, 0.017, 0.019], deep_layers=16, shallow_layers=4)
    assert figures["block_ms"] == pytest.approx(2.0) and figures["fixed_ms"] == pytest.approx(10.0)
    assert figures["block_ms_p10"] <= figures["block_ms"] <= figures["block_ms_p90"]


# ---- --model hf-llama: a Llama shaped like Hugging Face's (benchmarks/hf_llama.py) -------------------

HF_LLAMA_MODES = ("ours-eager", "torch-eager", "ours-compiled")
HF_LLAMA_TINY = ["--model", "hf-llama", "--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--vocab", "64",
                 "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1", "--threads", "1"]


def start_hf_llama_run() -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    """``python -m benchmarks --model hf-llama`` at world size 1, ours-eager, torch-eager and ours-compiled,
    started in the background at collection like ``start_benchmark_run`` (conftest's _BACKGROUND_RUNS)."""
    # The suite's scalar C++ (conftest's SCALAR_INDUCTOR_ENV, inherited): the run above already trains
    # the user's vectorized code, and this one is about the model's calling convention.
    return _start_in_background(
        "fsdp_compile_bench_hf_llama_", dict(os.environ),
        "--modes", ",".join(HF_LLAMA_MODES), *HF_LLAMA_TINY, "--no-warm-compile", "--reuse-inductor-cache",
        "--world-size", "1", "--device", "cpu",
    )


@pytest.fixture(scope="module")
def hf_llama_run(request):
    started = getattr(request.config, "benchmark_hf_llama_run", None) or start_hf_llama_run()
    yield wait_for_background_run(started, "benchmark --model hf-llama")
    shutil.rmtree(started[2], ignore_errors=True)


def test_hf_llama_trains_in_ours_and_fsdp2s_modes_with_the_same_losses(hf_llama_run):
    """Ours eager and compiled (block frames) and FSDP2 eager all train the Hugging Face-shaped Llama
    (keyword arguments, a (cos, sin) tuple and a mask into every layer, a tuple out, grouped-query
    attention) from the same weights and data, to the same losses."""
    stdout, out_dir = hf_llama_run
    data = json.loads((out_dir / "results.json").read_text())
    assert data["meta"]["config"]["model"] == "hf-llama" and data["meta"]["world_size"] == 1
    assert "-hf-llama" in data["meta"]["section_key"] and "Hugging Face-shaped Llama" in (out_dir / "results.md").read_text()
    modes = data["modes"]
    assert list(modes) == list(HF_LLAMA_MODES)
    for name, figures in modes.items():
        assert figures["status"] == "ok", (name, figures["status"], data["errors"].get(name, "")[-2000:])
        assert len(figures["losses"]) == 3 and all(math.isfinite(loss) for loss in figures["losses"])
    assert modes["ours-eager"]["losses"][-1] < modes["ours-eager"]["losses"][0]  # it learns
    assert modes["torch-eager"]["loss_max_rel_diff"] <= 1e-5
    assert modes["ours-compiled"]["loss_max_rel_diff"] <= 1e-3
    assert "| ours-compiled |" in stdout


def test_hf_llama_layers_take_keyword_arguments_and_return_tuples():
    """The model's calling convention is Hugging Face's, as the benchmark option promises: every decoder
    layer is called with keyword arguments only (hidden_states, attention_mask, position_ids,
    position_embeddings=(cos, sin), ...) and returns a tuple; k and v have fewer heads than q."""
    import torch

    from benchmarks.config import parse_args
    from benchmarks.modes import blocks, build_model

    cfg = parse_args([*HF_LLAMA_TINY, "--world-size", "1"])
    model = build_model(cfg.model_config())
    calls = []
    for layer in blocks(model):
        layer.register_forward_hook(lambda module, args, kwargs, out: calls.append((args, kwargs, out)), with_kwargs=True)
    tokens = torch.randint(0, 64, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 64) and len(calls) == 2
    for args, kwargs, out in calls:
        assert args == () and {"hidden_states", "attention_mask", "position_ids", "position_embeddings"} <= set(kwargs)
        cos, sin = kwargs["position_embeddings"]
        assert cos.shape == sin.shape == (1, 16, 8)
        assert kwargs["attention_mask"].dtype == torch.bool and kwargs["attention_mask"].shape == (2, 1, 16, 16)
        assert isinstance(out, tuple) and out[0].shape == (2, 16, 32)
    attention = blocks(model)[0].self_attn
    assert attention.k_proj.out_features == attention.q_proj.out_features // 2  # --kv-heads 2 of --heads 4


def test_compile_stages_table_lists_each_modes_cold_and_warm_stages_longest_first():
    """--compile-scaling's per-stage table (torch._dynamo.utils.compile_times() of each mode's own
    processes), from made-up figures: one column per mode and phase that ran, stages by their largest
    figure, a dash where a process never entered a stage."""
    from benchmarks.scaling import stages_table

    stages = {
        "ours-compiled": {"cold": {"_compile.compile_inner": [4, 12.0], "compile_fx_inner": [8, 6.5]},
                          "warm": {"_compile.compile_inner": [4, 3.0]}},
        "torch-blockcompile": {"cold": {"_compile.compile_inner": [1, 7.0], "compile_fx_inner": [2, 5.0]}, "warm": {}},
    }
    lines = stages_table(("ours-compiled", "torch-blockcompile"), {}, stages).splitlines()
    assert lines[0] == "| stage | ours-compiled cold | ours-compiled warm | torch-blockcompile cold |"
    assert lines[2] == "| `_compile.compile_inner` | 12.00 (4) | 3.00 (4) | 7.00 (1) |"
    assert lines[3] == "| `compile_fx_inner` | 6.50 (8) | — | 5.00 (2) |"
