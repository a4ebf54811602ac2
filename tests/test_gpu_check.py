"""``python -m benchmarks.gpu --dry-run``: the one-GPU check's stages, run on CPU at tiny sizes.

The dry run is a subprocess, as a user runs it, started once per session as these tests are
collected (tests/conftest.py; see [Note: the benchmark smoke run overlaps the suite] in
test_benchmark_smoke.py, which this follows). Its tests check that every stage ran or says why not,
and that what comes back from a GPU machine stays within what its transfer takes: a handful of
files, no folders. The GPU's own commands are checked without running them: each parses with the
tool it calls, and the pytest selection names tests that exist.
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from benchmarks.gpu import ALL_MODES, OUT_FILES, PYTEST_SELECTION, Stage, _execute, build_stages
from conftest import REPO_DIR
from fsdp_testing import wait_for_background_run

STAGES = ("pytest", "kernels", "bench-default", "bench-compute", "bench-overhead", "offload")


def start_dry_run() -> tuple[subprocess.Popen, pathlib.Path, pathlib.Path]:
    """``python -m benchmarks.gpu --dry-run`` started in the background: (process, out dir, scratch
    folder holding its stdout and stderr)."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="fsdp_compile_gpu_dry_run_"))
    out_dir = scratch / "gpu_out"
    with open(scratch / "stdout", "w") as stdout, open(scratch / "stderr", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--out-dir", str(out_dir)],
            cwd=REPO_DIR, stdout=stdout, stderr=stderr, text=True,
        )
    return process, out_dir, scratch


@pytest.fixture(scope="module")
def dry_run(request):
    started = getattr(request.config, "gpu_dry_run", None) or start_dry_run()
    yield wait_for_background_run(started, "dry run")
    shutil.rmtree(started[2], ignore_errors=True)


def test_dry_run_writes_a_few_files_and_no_folders(dry_run):
    _, out_dir = dry_run
    entries = sorted(path.name for path in out_dir.iterdir())
    assert entries == sorted(OUT_FILES), entries
    assert len(entries) <= 8 and all((out_dir / name).is_file() for name in entries)


def test_every_stage_ran_or_says_why_not(dry_run):
    _, out_dir = dry_run
    stages = json.loads((out_dir / "results.json").read_text())["stages"]
    assert list(stages) == list(STAGES)
    for name in ("pytest", "kernels", "bench-default", "offload"):
        assert stages[name]["status"] == "ok", (name, stages[name]["status"], stages[name]["detail"])
        assert stages[name]["seconds"] > 0
    for name in ("bench-compute", "bench-overhead"):
        assert stages[name]["status"] == "skipped" and stages[name]["detail"].startswith("dry run"), stages[name]
        assert "--device cuda" in stages[name]["command"], "a skipped run shows the GPU's command"


def test_results_md_has_a_section_per_stage_with_its_figures(dry_run):
    _, out_dir = dry_run
    text = (out_dir / "RESULTS.md").read_text()
    for name in STAGES:
        assert f"<!-- gpu stage: {name} -->" in text and f"<!-- end gpu stage: {name} -->" in text, name
    section = {name: text.split(f"<!-- gpu stage: {name} -->")[1].split(f"<!-- end gpu stage: {name} -->")[0] for name in STAGES}
    assert "| params | op | cast | group MB |" in section["kernels"]
    assert "| ours-eager |" in section["bench-default"] and "| torch-eager |" in section["bench-default"]
    assert "| pinned |" in section["offload"] and "| none |" in section["offload"]
    assert "Skipped:" in section["pytest"], "the CUDA tests skip on CPU, with their reason"


def test_pytest_stage_ran_the_selection_and_skipped_the_cuda_tests(dry_run):
    _, out_dir = dry_run
    tests = json.loads((out_dir / "results.json").read_text())["stages"]["pytest"]["data"]["tests"]
    cuda = [t for t in tests if "test_cuda" in t["id"]]
    assert cuda and all(t["outcome"] == "skipped" and "needs a CUDA GPU" in t["message"] for t in cuda)
    assert any("registers" in t["id"] and t["outcome"] == "passed" for t in tests)
    assert "test_cuda.py" in (out_dir / "pytest.txt").read_text()


def test_summary_is_one_screen_and_printed_last(dry_run):
    stdout, out_dir = dry_run
    summary = (out_dir / "summary.txt").read_text()
    assert stdout.rstrip().endswith(summary.rstrip())
    lines = summary.splitlines()
    assert len(lines) <= 45 and max(map(len, lines)) <= 200
    for name in STAGES:
        assert any(line.split()[1:2] == [name] for line in lines), name


def test_kernel_table_and_log_are_written_as_the_stages_run(dry_run):
    _, out_dir = dry_run
    kernels = (out_dir / "kernels.md").read_text()
    assert "| op | cast | group MB | params | impl |" in kernels and "compiled (aot_eager)" in kernels
    log = (out_dir / "log.txt").read_text()
    for name in STAGES:
        assert re.search(rf"^===== [a-d] {name}: ", log, re.M), name


def test_gpu_commands_parse_with_the_tools_they_call(tmp_path):
    """What the GPU machine runs, parsed here without running it."""
    import benchmarks.config
    import benchmarks.kernels
    import benchmarks.offload

    stages = build_stages(dry_run=False, scratch=tmp_path, out_dir=tmp_path)
    assert [stage.name for stage in stages] == list(STAGES)
    assert all(stage.skip is None for stage in stages)
    for stage in stages:
        module, argv = stage.argv[1], stage.argv[2:]
        if stage.kind == "bench":
            config = benchmarks.config.parse_args(argv)
            assert config.modes == ALL_MODES and config.world_size == 1 and config.device == "cuda"
            assert not config.warm_compile
        elif stage.kind == "kernels":
            args = benchmarks.kernels.parse_args(argv)
            assert args.sizes_mb == [1, 64, 1024] and not args.cpu and args.jsonl
        elif stage.kind == "offload":
            config = benchmarks.offload.parse_args(argv)
            assert config.bench.device == "cuda" and config.variants == ("none", "pinned", "unpinned")
        else:
            assert module == "pytest"
    compute = benchmarks.config.parse_args(stages[3].argv[2:])
    assert (compute.dim, compute.layers, compute.bf16) == (2048, 8, True)
    overhead = benchmarks.config.parse_args(stages[4].argv[2:])
    # benchmarks' --overhead preset, with fewer steps for the box and every mode of the stage.
    assert (overhead.world_size, overhead.dim, overhead.layers, overhead.steps) == (1, 32, 16, 20)
    assert overhead.modes == ALL_MODES
    # Every mode the benchmark knows that trains the same model another way, none of the ablations.
    assert set(benchmarks.config.MODES) <= set(ALL_MODES) <= set(benchmarks.config.SCALING_MODES) | set(benchmarks.config.MODES)


def test_pytest_selection_names_tests_that_exist():
    root = pathlib.Path(REPO_DIR)
    for node in PYTEST_SELECTION:
        path, _, name = node.partition("::")
        assert (root / path).is_file(), path
        assert not name or f"def {name}(" in (root / path).read_text(), node


def main(argv: list[str]) -> None:
    """What a forked stage of the test below runs (``Stage.entry`` of ``-m test_gpu_check``): it hangs."""
    print("started", *argv, flush=True)
    time.sleep(60)


@pytest.mark.parametrize("fork", [False, True], ids=["python-m", "forked"])
def test_a_stage_past_its_box_is_stopped_and_reported(tmp_path, monkeypatch, fork):
    """The time box: a stage that outlives it is interrupted, then killed, with what it printed kept."""
    import benchmarks.gpu

    monkeypatch.setattr(benchmarks.gpu, "MIN_TIMEOUT_S", 1.0)
    argv = ["-m", "test_gpu_check", "now"] if fork else ["-c", "import time; print('started now', flush=True); time.sleep(60)"]
    stage = Stage("sleeper", "x", "offload", "a stage that hangs", 1.0, argv, interrupt=signal.SIGTERM)
    start = time.monotonic()
    run = _execute(stage, tmp_path, tmp_path, budget_s=0.0, fork=fork)  # the shortest box
    assert run.timed_out and run.returncode == -signal.SIGTERM
    assert time.monotonic() - start < 20
    assert run.stdout.read_text() == "started now\n"
