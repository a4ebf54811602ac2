"""``python -m benchmarks.gpu``: check and measure the CUDA path on one GPU in one command.

    python -m benchmarks.gpu --out-dir gpu_out     # a CUDA machine: under 8 minutes (--budget-s)
    python -m benchmarks.gpu --dry-run             # anywhere: the same stages on CPU at tiny sizes

Everything runs at world size 1 (NCCL; rank 0 of 1, MASTER_ADDR / MASTER_PORT set here), in this
order, each stage a subprocess of its own with a time box, so a hung or crashed stage costs its
box and nothing more:

  a  pytest          the CUDA tests (tests/test_cuda.py: parity with the unsharded model in fp32 and
                     bf16 for eager, compiled with block frames, regions and per-block compile; the
                     stream protocol on real streams and under the CUDA sanitizer; the Triton kernels
                     against their references; CPU offload), tests/test_stream_protocol.py and the
                     Triton registration tests
  b  kernels         python -m benchmarks.kernels: the four copy ops with and without casts, 1 MB to
                     1 GB groups; Triton vs the plain-torch reference vs Inductor's code for the
                     reference vs FSDP2's ops, as GB/s and a fraction of a measured device copy
  c  bench-default   python -m benchmarks, every mode, the default model
     bench-compute   the same at --dim 2048 --layers 8 --heads 16 --seq 1024 --bf16 (compute-bound)
     bench-overhead  the same on 16 tiny layers (host overhead per step dominates)
  d  offload         python -m benchmarks.offload: CPUOffloadPolicy (pinned, unpinned) vs none

[Note: the time boxes] The budget (--budget-s) is shared in proportion to each stage's box
(``Stage.box_s``); time a stage leaves unused flows to the later ones in the same proportion.
At its box a stage is interrupted (pytest with SIGINT, so it still writes its report) and then
killed; what it wrote so far is kept and its status says "timed out".

Outputs in --out-dir, few files (each rewritten as a stage finishes, so a run cut short keeps
every finished stage): RESULTS.md (a section per stage between ``<!-- gpu stage: NAME -->``
markers; stages not run yet say so), results.json (status, time, command and figures of every
stage), summary.txt (the one-screen summary printed at the end), pytest.txt (pytest's output),
kernels.md (the kernel table, row by row as measured) and log.txt (each stage's command, exit
status and the tail of its output).

--dry-run runs the same stages on CPU at tiny sizes in well under a minute (gloo instead of
NCCL): pytest runs the same selection (the CUDA tests skip; the stream-protocol tests, which need
a pool of ranks, are deselected), the kernels time the reference and FSDP2's ops with the
reference compiled by aot_eager, the first benchmark run trains its eager modes for one step,
the other two are skipped (their commands are the GPU's; tests/test_gpu_check.py parses them),
and the offload stage trains a tiny model.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

__all__ = ["Stage", "build_stages", "main", "parse_args", "PYTEST_SELECTION", "ALL_MODES"]

REPO_DIR = Path(__file__).resolve().parent.parent
# Every mode of python -m benchmarks that trains the same model differently (not the ablations).
ALL_MODES = (
    "ours-eager", "ours-compiled", "ours-compiled-regions", "ours-blockcompile", "ours-fallback", "torch-eager",
    "torch-blockcompile",
)
PYTEST_SELECTION = (
    "tests/test_cuda.py",
    "tests/test_stream_protocol.py",
    "tests/test_kernels.py::test_importing_kernels_registers_triton_as_the_cuda_implementation",
    "tests/test_kernels.py::test_compiled_triton_rejects_cpu_tensors",
    "tests/test_quant_kernels.py::test_importing_kernels_registers_the_quantized_triton_kernels_for_cuda",
)
# The kernel table: no cast at all; torchtitan's bf16 compute with fp32 reduction; bf16 reduction
# (the only setting whose reduce-scatter copy-out casts).
KERNEL_DTYPES = ("fp32/fp32/fp32", "fp32/bf16/fp32", "fp32/bf16/bf16")
# The benchmark runs: label -> (what it shows, its flags on the GPU). Steps are few: on the H200 run
# the three runs at the benchmark's default steps each overran their box (every mode's cold compile
# comes first); five modes of 30 steps of the overhead model took 43 s, of 6 steps of the compute model 45 s.
# The compute run also profiles one step of every mode (--profile-step): there the H200 gave block
# frames 79 ms a step against regions' 37 ms, and the device figures say whether the device's work
# or the host made the difference.
BENCH_RUNS = {
    "default": ("the benchmark's default model", ["--steps", "6", "--warmup", "2"]),
    "compute": (
        "a compute-dominated model",
        ["--dim", "2048", "--layers", "8", "--heads", "16", "--seq", "1024", "--bf16", "--steps", "6", "--warmup", "2",
         "--profile-step"],
    ),
    "overhead": ("host overhead: python -m benchmarks --overhead", ["--overhead", "--steps", "20", "--warmup", "2"]),
}
# Each stage's time box in seconds (see [Note: the time boxes]), summing to DEFAULT_BUDGET_S: the tests
# first (parity compiles six models; the Triton kernels compile per dtype pair), then what measures.
# On the H200: the tests reached 85 of 102 in 127 s, the kernels 335 rows in 71 s, the offload stage took 9 s.
# The second H200 run: tests 121 s, kernels out of their box at 70 s, benchmarks 35, 65 and 65 s (the
# overhead preset now also runs every mode at its shallow depth, for host time per block).
# The third (10-parameter kernel table, the compute run profiled): tests 129 s, kernels 95 rows in their 72 s box,
# the default and compute runs out of their 39 and 78 s boxes (on the same machine afterwards, alone, 68 s for
# every mode and 88 s for five modes with the profile), overhead 81 s, offload 12 s.
STAGE_BOXES_S = {"pytest": 135, "kernels": 75, "bench-default": 75, "bench-compute": 95, "bench-overhead": 85, "offload": 15}
TINY_MODEL = ["--dim", "32", "--layers", "2", "--heads", "4", "--vocab", "64", "--seq", "16", "--batch", "2"]
DEFAULT_BUDGET_S = 475.0  # under 8 minutes: the GPU run must end within 8
DRY_RUN_BUDGET_S = 180.0
GRACE_S = 8.0  # after the interrupt at a stage's box, before SIGKILL (pytest writes its report in it)
MIN_TIMEOUT_S = 5.0
MIN_STAGE_S = 20.0  # a stage offered less than this is not started
TAIL_LINES = 150
OUT_FILES = ("RESULTS.md", "results.json", "summary.txt", "pytest.txt", "kernels.md", "log.txt")


@dataclass
class Stage:
    """One process of the run: ``python <argv>`` from the repository root (``argv`` is ``-m MODULE
    ARGS...``), or, forked from this process, ``entry(ARGS)`` (see [Note: stages forked from a
    preloaded process])."""

    name: str  # results.json's key and the RESULTS.md marker
    letter: str  # a, b, c, d: the order the stages run in (docs/gpu.md)
    kind: str  # "pytest", "kernels", "bench" or "offload": how its output is read
    title: str
    box_s: float  # its share of the budget (see [Note: the time boxes])
    argv: list[str]
    data_path: Path | None = None  # what it writes for us: junit XML, JSON lines or JSON
    stdout_name: str | None = None  # an --out-dir file for its stdout (else a scratch file)
    rank_env: bool = False  # rank 0 of world size 1 from the environment: no spawned rank process
    interrupt: int = signal.SIGTERM
    skip: str | None = None  # why it does not run
    flags: list[str] = field(default_factory=list)  # the benchmark's model flags, shown in its section

    @property
    def entry(self) -> str:
        """``module:function`` that ``python -m MODULE`` runs, called with ARGS in a forked process."""
        module = self.argv[1]
        return {"pytest": "pytest:main", "benchmarks": "benchmarks.__main__:main"}.get(module, f"{module}:main")


@dataclass
class Run:
    """How a stage's process ended."""

    returncode: int | None
    seconds: float
    timeout_s: float
    timed_out: bool
    stdout: Path
    stderr: Path


# ---- the stages ----------------------------------------------------------------------------------


def build_stages(dry_run: bool, scratch: Path, out_dir: Path) -> list[Stage]:
    """The run's stages in order; ``dry_run``: the CPU versions (tiny sizes, gloo)."""
    junit = scratch / "junit.xml"
    pytest_argv = [
        "-m", "pytest", "-v", "-rfEs", "--tb=short", "-p", "no:cacheprovider", f"--junitxml={junit}", *PYTEST_SELECTION,
    ]
    if dry_run:  # the CUDA tests skip on CPU; the stream-protocol tests would start a pool of gloo ranks
        pytest_argv += ["-k", "not test_stream_protocol"]
    no_pytest = None if importlib.util.find_spec("pytest") else f"pytest is not installed for {sys.executable}"
    stages = [
        Stage("pytest", "a", "pytest", "CUDA tests (pytest)", STAGE_BOXES_S["pytest"], pytest_argv, junit, "pytest.txt",
              interrupt=signal.SIGINT, skip=no_pytest),
    ]
    kernels_jsonl = scratch / "kernels.jsonl"
    kernels_argv = ["-m", "benchmarks.kernels", "--dtypes", *KERNEL_DTYPES, "--impls", "triton", "reference", "inductor", "fsdp2",
                    "--host-profile"]
    if dry_run:
        kernels_argv += ["--cpu", "--sizes-mb", "0.0625", "--params", "3", "--world", "2", "--iters", "1", "--warmup", "1",
                         "--compile-backend", "aot_eager"]
    else:
        # 10-parameter groups (a transformer block's count) of 1 MB (launch-bound) to 1 GB
        # (bandwidth-bound): with 100-parameter groups too the table ran out of its box before
        # Inductor's rows (it compiles once per group shape, seconds each).
        kernels_argv += ["--sizes-mb", "1", "64", "1024", "--params", "10",
                         "--inductor-params", "10", "--inductor-sizes-mb", "1", "64", "1024"]
    kernels_argv += ["--jsonl", str(kernels_jsonl)]
    stages.append(Stage("kernels", "b", "kernels", "Copy-in / copy-out kernels", STAGE_BOXES_S["kernels"], kernels_argv,
                        kernels_jsonl, "kernels.md"))
    for index, (label, (what, flags)) in enumerate(BENCH_RUNS.items()):
        argv = ["-m", "benchmarks", "--world-size", "1", "--no-warm-compile", "--reuse-inductor-cache",
                "--out-dir", str(scratch / f"bench-{label}")]
        skip = None
        if dry_run and index == 0:
            flags = [*TINY_MODEL, "--steps", "1", "--warmup", "1"]
            argv += ["--device", "cpu", "--modes", "ours-eager,torch-eager", *flags]
        else:  # the GPU's command, also shown (not run) for the dry run's other benchmark runs
            argv += ["--device", "cuda", *flags, "--modes", ",".join(ALL_MODES)]  # after --overhead, which names its own
            if dry_run:
                skip = "dry run: the first benchmark run exercises the code path; this is the GPU's command"
        stages.append(Stage(f"bench-{label}", "c", "bench", f"Benchmark, {what}", STAGE_BOXES_S[f"bench-{label}"], argv,
                            scratch / f"bench-{label}" / "results.json", rank_env=True, skip=skip, flags=flags))
    offload_json = scratch / "offload.json"
    offload_argv = ["-m", "benchmarks.offload", "--json", str(offload_json)]
    if dry_run:
        offload_argv += ["--device", "cpu", "--dim", "32", "--layers", "2", "--heads", "4", "--vocab", "64", "--seq", "16",
                         "--batch", "2", "--steps", "1", "--warmup", "1"]
    else:
        # 50M parameters: 800 MB of shards, gradients and AdamW state to keep off the device, and
        # an AdamW step on the CPU short enough for the box.
        offload_argv += ["--device", "cuda", "--dim", "1024", "--layers", "4", "--heads", "16", "--seq", "1024", "--batch", "4",
                         "--bf16", "--steps", "5", "--warmup", "2"]
    stages.append(Stage("offload", "d", "offload", "CPU offload (pinned host memory) vs none", STAGE_BOXES_S["offload"],
                        offload_argv, offload_json, rank_env=True))
    return stages


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment(stage: Stage, scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONUNBUFFERED="1",  # a stage cut short has written what it printed
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        # One Inductor / Triton cache for the whole run, empty at its start: nothing left on the
        # machine by another run changes compile times, and the benchmark runs
        # (--reuse-inductor-cache) reuse kernels their modes share.
        TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor-cache"), TRITON_CACHE_DIR=str(scratch / "triton-cache"),
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    if stage.rank_env:
        # benchmarks.launch then initializes rank 0 of 1 in the stage's own process (as under
        # torchrun) instead of spawning a rank: one import of torch and fsdp_compile fewer.
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    return env


# [Note: stages forked from a preloaded process]
# Each stage as ``python -m ...`` imports torch and fsdp_compile afresh: seconds of CPU each (about
# 6.5 s on the 2-core machine, most of a dry run's time). So this process imports them once
# (PRELOAD) and forks each stage from itself, as tests/conftest.py forks its ranks from a preloaded
# server; the stage then calls what ``python -m`` would (``Stage.entry``) with the same arguments,
# in its own session, environment and output files. A fork is as clean as a fresh process for what
# the stages use provided this process has started no thread and not initialized CUDA (a child
# could not use it): it never runs a CUDA call (the NVML-based availability check), and on a GPU a
# forked probe must create a CUDA tensor first, or every stage runs as ``python -m`` instead
# (``--exec`` forces that).
PRELOAD = (
    "torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "fsdp_compile", "pytest",
    "benchmarks.__main__", "benchmarks.kernels", "benchmarks.offload",
)


def _preload_and_check_fork(dry_run: bool) -> str | None:
    """Import PRELOAD; None if stages can be forked from this process, else why not."""
    import importlib
    import threading

    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:  # pytest may be missing: its stage then fails alone, saying so
            pass
    import torch

    if threading.active_count() > 1:
        return f"{threading.active_count()} threads after the imports"
    if torch.cuda.is_initialized():
        return "CUDA is initialized in this process"
    if dry_run:
        return None
    pid = _fork(lambda: torch.ones(1, device="cuda").add_(1).item())
    code, timed_out = _wait(pid, 120.0)
    if timed_out:
        _signal_group(pid, signal.SIGKILL)
        _wait(pid, 30.0)
        return "a forked probe hung creating a CUDA tensor"
    return None if code == 0 else f"a forked probe could not use CUDA (exit status {code})"


def _fork(
    work: Callable[[], object], stdout: Path | None = None, stderr: Path | None = None, env: dict[str, str] | None = None,
) -> int:
    """Fork; the child runs ``work()`` in a session of its own and exits with its status
    (an int it returns or raises as SystemExit; 1 for an exception, whose traceback it prints)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        os.chdir(REPO_DIR)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        if stdout is not None:
            out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            err = out if stderr in (None, stdout) else os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(err, 2)
            # New line-buffered streams on the two descriptors (a stage cut short has written what it
            # printed), whatever sys.stdout was in this process (pytest's capture, say).
            sys.stdout = open(1, "w", buffering=1, closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
        result = work()
        code = result if isinstance(result, int) else 0
    except SystemExit as exit:
        if isinstance(exit.code, str):
            print(exit.code, file=sys.stderr)
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child reports and exits; it must never return into the parent's code
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _call_entry(stage: Stage) -> object:
    import importlib

    module, function = stage.entry.split(":")
    arguments = stage.argv[2:]
    sys.argv = [module, *arguments]
    return getattr(importlib.import_module(module), function)(arguments)


def _wait(pid: int, timeout_s: float) -> tuple[int | None, bool]:
    """(exit status, or None if still running at the timeout; whether it timed out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() >= deadline:
            return None, True
        time.sleep(0.1)


def _execute(stage: Stage, scratch: Path, out_dir: Path, budget_s: float, fork: bool = False) -> Run:
    """Run the stage in a process and session of its own (its workers and ranks die with it):
    forked from this one (``fork``) or as ``python -m``; stop it at its box."""
    stdout = out_dir / stage.stdout_name if stage.stdout_name else scratch / f"{stage.name}.out"
    # pytest's report belongs in one file with its stderr; the others keep stderr apart (progress bars).
    stderr = stdout if stage.kind == "pytest" else scratch / f"{stage.name}.err"
    timeout_s = max(MIN_TIMEOUT_S, budget_s - GRACE_S)
    env = _environment(stage, scratch)
    start = time.monotonic()
    process = None  # exec: kept until reaped here, or subprocess would reap it behind our back
    if fork:
        pid = _fork(lambda: _call_entry(stage), stdout, stderr, env)
    else:
        with contextlib.ExitStack() as files:
            out = files.enter_context(open(stdout, "w"))
            err = subprocess.STDOUT if stderr == stdout else files.enter_context(open(stderr, "w"))
            process = subprocess.Popen([sys.executable, *stage.argv], cwd=REPO_DIR, env=env, stdout=out, stderr=err,
                                       start_new_session=True)
            pid = process.pid
    code, timed_out = None, False
    try:
        code, timed_out = _wait(pid, timeout_s)
        if timed_out:
            _signal_group(pid, stage.interrupt)
            code, killed = _wait(pid, GRACE_S)
            if killed:
                _signal_group(pid, signal.SIGKILL)
                code, _ = _wait(pid, 60.0)
    except BaseException:  # Ctrl-C here: nothing of the stage may outlive us
        _signal_group(pid, signal.SIGKILL)
        _wait(pid, 60.0)
        raise
    finally:
        _signal_group(pid, signal.SIGKILL)  # stray workers of a process that exited
        if process is not None:
            process.returncode = code  # reaped by _wait
    return Run(code, time.monotonic() - start, timeout_s, timed_out, stdout, stderr)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ---- reading a stage's output ----------------------------------------------------------------------


def _base_status(run: Run) -> str:
    if run.timed_out:
        return f"timed out after {run.timeout_s:.0f} s"
    return "ok" if run.returncode == 0 else f"failed (exit status {run.returncode})"


def _first_line(text: str | None, limit: int = 160) -> str:
    return next((line.strip() for line in (text or "").splitlines() if line.strip()), "")[:limit]


def _read_pytest(stage: Stage, run: Run) -> tuple[str, str, dict]:
    tests = _junit_tests(stage.data_path) if stage.data_path and stage.data_path.exists() else _verbose_tests(run.stdout)
    counts = collections.Counter(test["outcome"] for test in tests)
    detail = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "error", "skipped"))
    status = _base_status(run)
    if run.returncode == 1 and not run.timed_out:
        status = "tests failed"
    elif run.returncode == 5:
        status = "failed: no tests collected"
    return status, detail, {"counts": dict(counts), "tests": tests}


def _junit_tests(path: Path) -> list[dict]:
    tests = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            child = case.find(kind)
            if child is not None:
                outcome, message = name, child.get("message") or _first_line(child.text)
                break
        tests.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0.0), "message": (message or "")[:500]})
    return tests


_VERBOSE_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
_VERBOSE_OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "skipped", "XPASS": "passed"}


def _verbose_tests(path: Path) -> list[dict]:
    """pytest -v's lines, where no junit XML was written (a kill): the tests that finished."""
    tests = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        match = _VERBOSE_LINE.match(line)
        if match:
            tests.append({"id": match.group(1), "outcome": _VERBOSE_OUTCOMES[match.group(2)], "seconds": None, "message": ""})
    return tests


def _read_kernels(stage: Stage, run: Run) -> tuple[str, str, dict]:
    device, rows = {}, []
    if stage.data_path and stage.data_path.exists():
        for line in stage.data_path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # the last line of a killed run
                continue
            if entry.get("kind") == "device":
                device = entry
            elif entry.get("kind") == "row":
                rows.append(entry)
    errors = sum("error" in row for row in rows)
    detail = f"{len(rows)} rows" + (f" ({errors} errors)" if errors else "")
    if device:
        detail += f"; {device['device']} copy {device['copy_gb_s']:.0f} GB/s"
    status = _base_status(run)
    if status == "ok" and not rows:
        status = "failed: no rows"
    return status, detail, {"device": device, "rows": rows}


# Kept out of results.json: the per-rank series (world size 1 repeats them) and the probe's raw dicts.
_BENCH_DROPPED = ("step_times_per_rank_s", "probe_per_rank")


def _read_bench(stage: Stage, run: Run) -> tuple[str, str, dict]:
    data: dict = {"flags": stage.flags}
    status = _base_status(run)
    if stage.data_path and stage.data_path.exists():
        results = json.loads(stage.data_path.read_text())
        data["meta"] = results["meta"]
        data["modes"] = {name: {k: v for k, v in figures.items() if k not in _BENCH_DROPPED} for name, figures in results["modes"].items()}
        data["errors"] = {name: text[-4000:] for name, text in results.get("errors", {}).items()}
        markdown = stage.data_path.with_name("results.md")
        data["section_md"] = markdown.read_text() if markdown.exists() else ""
        ran = [name for name, figures in data["modes"].items() if figures["status"] == "ok"]
        detail = f"{len(ran)}/{len(data['modes'])} modes ran"
        missing = [name for name in data["modes"] if name not in ran]
        if missing:
            detail += f" (not: {', '.join(missing)})"
    else:
        detail = "no results.json"
        if status == "ok":
            status = "failed: no results.json"
    return status, detail, data


def _read_offload(stage: Stage, run: Run) -> tuple[str, str, dict]:
    status = _base_status(run)
    if not (stage.data_path and stage.data_path.exists()):
        return (status if status != "ok" else "failed: no JSON"), "no JSON", {}
    data = json.loads(stage.data_path.read_text())
    failed = [name for name, figures in data["variants"].items() if figures.get("status") != "ok"]
    detail = f"{len(data['variants']) - len(failed)}/{len(data['variants'])} variants ran" + (f" (not: {', '.join(failed)})" if failed else "")
    return status, detail, data


READERS: dict[str, Callable[[Stage, Run], tuple[str, str, dict]]] = {
    "pytest": _read_pytest, "kernels": _read_kernels, "bench": _read_bench, "offload": _read_offload,
}


# ---- rendering -------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str, missing: str = "—") -> str:
    return missing if value is None else format(value, spec)


def _section_pytest(result: dict) -> str:
    tests = result["data"].get("tests", [])
    lines = [f"Selection: `{' '.join(PYTEST_SELECTION)}` ({result['detail']}); the full output is in pytest.txt.", ""]
    problems = [t for t in tests if t["outcome"] in ("failed", "error")]
    if problems:
        lines += ["| failed test | message |", "|---|---|"]
        lines += [f"| `{t['id']}` | {_first_line(t['message'], 300).replace('|', '/')} |" for t in problems]
        lines.append("")
    skipped = collections.Counter(_first_line(t["message"], 200) for t in tests if t["outcome"] == "skipped")
    if skipped:
        lines += ["Skipped:", *[f"- {count} × {reason or '(no reason given)'}" for reason, count in skipped.items()], ""]
    slowest = sorted((t for t in tests if (t.get("seconds") or 0) >= 0.5), key=lambda t: -t["seconds"])[:8]
    if slowest:
        lines += ["Slowest: " + ", ".join(f"`{t['id'].split('::')[-1]}` {t['seconds']:.1f} s" for t in slowest), ""]
    return "\n".join(lines)


def _kernel_cell(row: dict | None) -> str:
    if row is None:
        return ""
    if "error" in row:
        return "error"
    rate = f"{row['gb_s']:.0f}" if row["gb_s"] >= 100 else f"{row['gb_s']:.3g}"
    host = f", {row['host_us']:.0f} us" if "host_us" in row else ""
    return f"{rate} ({100 * row['copy_fraction']:.0f}%{host})"


def _section_kernels(result: dict) -> str:
    device, rows = result["data"].get("device", {}), result["data"].get("rows", [])
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    lines = []
    if device:
        lines.append(f"{device['device']}: one same-device copy of {device['copy_bytes'] // 2**20} MB runs at "
                     f"{device['copy_gb_s']:.0f} GB/s (read + write); world {device['world']}, {device['iters']} timed "
                     f"calls per cell after {device['warmup']} untimed ones (which compile Triton and Inductor code).")
    lines += [
        "", "Each cell: GB/s of device time counting each input element read once and each output element written "
        "once, that as a fraction of the copy's, and the host's time per call (launching it; see [Note: device time "
        "apart from host time] in benchmarks/kernels.py). inductor: the reference compiled by torch.compile (static "
        "shapes). The raw table, with times, is kernels.md.", "",
        "| params | op | cast | group MB | " + " | ".join(impls) + " |",
        "|---:|---|---|---:|" + "---:|" * len(impls),
    ]
    cells: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        cells.setdefault((row["params"], row["op"], row["cast"], row["size_mb"]), {})[row["impl"]] = row
    # Group by parameter count in the order measured, then op, cast and size.
    order = list(dict.fromkeys(row["params"] for row in rows))
    for key in sorted(cells, key=lambda k: (order.index(k[0]), k[1], k[2], k[3])):
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]:g} | " + " | ".join(_kernel_cell(cells[key].get(i)) for i in impls) + " |")
    errors = [row for row in rows if "error" in row]
    if errors:
        lines += ["", "Errors:"]
        lines += [f"- {r['impl']} {r['op']} {r['cast']} {r['size_mb']:g} MB {r['params']} params: {r['error']}" for r in errors[:20]]
    return "\n".join(lines) + "\n"


def _kernel_medians(rows: list[dict]) -> str:
    """Per implementation: the median fraction of copy bandwidth over large and over small groups."""
    parts = []
    for impl in dict.fromkeys(row["impl"] for row in rows):
        mine = [row for row in rows if row["impl"] == impl and "copy_fraction" in row]
        large = [r["copy_fraction"] for r in mine if r["size_mb"] >= 256]
        small = [r["copy_fraction"] for r in mine if r["size_mb"] <= 16]
        if large or small:
            parts.append(f"{impl} {_fmt(100 * statistics.median(large) if large else None, '.0f')}|"
                         f"{_fmt(100 * statistics.median(small) if small else None, '.0f')}")
    return ", ".join(parts)


def _section_bench(result: dict) -> str:
    data = result["data"]
    lines = [
        f"Model flags: `{' '.join(data.get('flags', [])) or '(none: the default model)'}`. "
        "Compile times are not cold: every mode shares one Inductor cache (--reuse-inductor-cache), started empty by "
        "this run, and the warm-compile rebuild is skipped (--no-warm-compile).", "",
    ]
    # The benchmark's own section (its table and how it measures), its headings one level down.
    lines.append(re.sub(r"^## ", "### ", data.get("section_md") or "(the benchmark wrote no results)", flags=re.M))
    for name, text in data.get("errors", {}).items():
        lines += ["", f"{name} raised (the tail of its traceback):", "", "```", text[-1500:].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def _section_offload(result: dict) -> str:
    data = result["data"]
    if not data:
        return "(no results)\n"
    config = data["meta"]["config"]
    peak_is = next((f["peak_is"] for f in data["variants"].values() if "peak_is" in f), "torch.cuda.max_memory_allocated")
    return (
        f"Dim {config['dim']}, {config['layers']} layers, seq {config['seq']}, batch "
        f"{config['batch']}, {'bf16 params / fp32 reduce' if config['bf16'] else 'fp32'}, AdamW; eager (the compiled path "
        f"refuses CPUOffloadPolicy); {config['steps']} measured steps after {config['warmup']} warm-up, each variant alone "
        f"in turn. Peak MiB: {peak_is} over the measured steps; resident MiB: what the sharded model holds on the "
        "device before its first step (CUDA only).\n\n" + data["table"] + "\n"
    )


SECTIONS: dict[str, Callable[[dict], str]] = {
    "pytest": _section_pytest, "kernels": _section_kernels, "bench": _section_bench, "offload": _section_offload,
}


def _summary_lines(result: dict) -> list[str]:
    """A stage's lines under its status line in summary.txt."""
    data, kind, pad = result.get("data") or {}, result["kind"], " " * 4
    if kind == "pytest":
        problems = [t for t in data.get("tests", []) if t["outcome"] in ("failed", "error")]
        lines = [f"{pad}{t['outcome'].upper()} {t['id'].split('::', 1)[-1]}: {_first_line(t['message'], 70)}" for t in problems[:6]]
        return lines + ([f"{pad}... {len(problems) - 6} more in pytest.txt"] if len(problems) > 6 else [])
    if kind == "kernels" and data.get("rows"):
        return [f"{pad}median % of copy, groups >= 256 MB|<= 16 MB: {_kernel_medians(data['rows'])}"]
    if kind == "bench" and data.get("modes"):
        lines = []
        for name, f in data["modes"].items():
            if f["status"] != "ok":
                lines.append(f"{pad}{name:22s} {_first_line(f['status'], 60)}")
                continue
            speed = f.get("speed_vs_torch_eager")
            lines.append(
                f"{pad}{name:22s} {f['step_ms_median']:9.2f} ms  {_fmt(speed, '5.2f', '  —  ')}x torch-eager  peak "
                f"{_fmt(f.get('peak_mib'), '7.0f', '    n/a')} MiB  loss gap {_fmt(f.get('loss_max_rel_diff'), '.0e')}"
            )
        return lines
    if kind == "offload" and data.get("variants"):
        lines = []
        for name, f in data["variants"].items():
            if f.get("status") != "ok":
                lines.append(f"{pad}{name:10s} {_first_line(f.get('status'), 70)}")
                continue
            lines.append(
                f"{pad}{name:10s} {f['step_ms_median']:9.2f} ms  peak {_fmt(f['peak_mib'], '7.0f', '    n/a')} MiB  resident "
                f"{_fmt(f['resident_mib'], '6.0f', '   n/a')} MiB  shards on {','.join(f['placement']['shard_devices'])}"
                f"{' pinned' if f['placement']['all_pinned'] else ''}"
            )
        return lines
    return []


class Report:
    """The out-dir files, rewritten whole after every stage (each via a temporary file, so a kill
    mid-write leaves the previous version)."""

    def __init__(self, out_dir: Path, meta: dict, stages: list[Stage]) -> None:
        self.out_dir, self.meta = out_dir, meta
        self.results: dict[str, dict] = {
            stage.name: {"name": stage.name, "letter": stage.letter, "kind": stage.kind, "title": stage.title,
                         "status": "not run yet", "detail": "", "seconds": None, "command": _command(stage), "data": {}}
            for stage in stages
        }

    def record(self, stage: Stage, status: str, detail: str, data: dict, run: Run | None) -> dict:
        result = self.results[stage.name]
        result.update(status=status, detail=detail, data=data)
        if run is not None:
            result.update(seconds=run.seconds, timeout_s=run.timeout_s, returncode=run.returncode)
        self.write()
        return result

    def write(self) -> None:
        self._write("results.json", json.dumps({"meta": self.meta, "stages": self.results}, indent=1, default=str))
        self._write("RESULTS.md", self.markdown())
        self._write("summary.txt", self.summary())

    def _write(self, name: str, text: str) -> None:
        temporary = self.out_dir / f".{name}.tmp"
        temporary.write_text(text)
        os.replace(temporary, self.out_dir / name)

    def markdown(self) -> str:
        meta = self.meta
        lines = [
            "# GPU check: `python -m benchmarks.gpu`", "",
            f"Command: `{meta['command']}`  ",
            f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}, Python {meta['python']}; commit "
            f"{meta['commit']}; started {meta['started']}; budget {meta['budget_s']:.0f} s"
            + (" (dry run: CPU, tiny sizes)" if meta["dry_run"] else "") + ".", "",
            "Stages run in this order, each in a process of its own with a time box; a section is written as its stage "
            f"ends (docs/gpu.md). Stages ran {meta['stages_run_as']}.", "",
            "| stage | status | s | result |", "|---|---|---:|---|",
        ]
        for r in self.results.values():
            lines.append(f"| {r['letter']} {r['name']} | {r['status']} | {_fmt(r['seconds'], '.0f')} | {r['detail'].replace('|', '/')} |")
        for r in self.results.values():
            body = SECTIONS[r["kind"]](r) if r["seconds"] is not None else f"{r['status']}" + (f": {r['detail']}" if r["detail"] else "") + ".\n"
            lines += [
                "", f"<!-- gpu stage: {r['name']} -->",
                f"## {r['letter']}. {r['title']}: {r['status']}" + (f", {r['seconds']:.0f} s" if r["seconds"] is not None else ""), "",
                f"`python {r['command']}`", "", body.rstrip("\n"), f"<!-- end gpu stage: {r['name']} -->",
            ]
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        meta = self.meta
        done = sum(r["seconds"] or 0.0 for r in self.results.values())
        lines = [
            f"python -m benchmarks.gpu{' --dry-run' if meta['dry_run'] else ''}: {meta['device']} | torch {meta['torch']} | "
            f"triton {meta['triton']} | commit {meta['commit']} | {done:.0f} s of {meta['budget_s']:.0f} s",
        ]
        for r in self.results.values():
            lines.append(f"{r['letter']} {r['name']:15s} {r['status'][:28]:28s} {_fmt(r['seconds'], '4.0f', '   —')} s  {r['detail'][:90]}")
            lines += _summary_lines(r)
        lines.append(f"details: {self.out_dir}/RESULTS.md (sections), results.json, pytest.txt, kernels.md, log.txt")
        return "\n".join(lines) + "\n"


def _command(stage: Stage) -> str:
    return " ".join(stage.argv)


def _tail(path: Path, lines: int = TAIL_LINES, limit: int = 32_000) -> str:
    if not path.exists():
        return ""
    text = "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return text[-limit:]


def _log(out_dir: Path, stage: Stage, run: Run | None, status: str) -> None:
    """Append the stage's command, ending and output tail to log.txt."""
    with open(out_dir / "log.txt", "a") as log:
        log.write(f"\n===== {stage.letter} {stage.name}: {status}")
        if run is not None:
            log.write(f" (exit status {run.returncode}, {run.seconds:.1f} s, box {run.timeout_s:.0f} s)")
        log.write(f"\n$ python {_command(stage)}\n")
        if run is not None:
            if run.stdout.parent != out_dir:
                log.write(f"--- stdout (last {TAIL_LINES} lines) ---\n{_tail(run.stdout)}\n")
            if run.stderr != run.stdout:
                log.write(f"--- stderr (last {TAIL_LINES} lines) ---\n{_tail(run.stderr)}\n")


def _git_commit() -> str:
    """The checkout's commit, as benchmarks.report.git_commit gives it; not imported from there, as
    that module imports torch and fsdp_compile (seconds of a dry run) and this process needs neither."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=REPO_DIR, capture_output=True, text=True, timeout=10).stdout.strip()

        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain")
        return f"{commit}{' with uncommitted changes' if dirty else ''}" if commit else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _meta(args: argparse.Namespace, argv: list[str]) -> dict:
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "command": "python -m benchmarks.gpu" + "".join(f" {a}" for a in argv),
        "dry_run": args.dry_run, "budget_s": args.budget_s, "device": _device_name(args.dry_run),
        "torch": version("torch"), "triton": version("triton"), "python": platform.python_version(), "commit": _git_commit(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def _device_name(dry_run: bool) -> str:
    """The GPU's name from nvidia-smi: this process creates no CUDA context (a GPU in exclusive
    mode would refuse the stages theirs)."""
    if dry_run:
        return f"CPU ({os.cpu_count()} cores, dry run)"
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        return f"{names[0]} (1 of {len(names)} GPUs)" if names else "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"


def _cuda_available() -> bool:
    # PyTorch's NVML-based check: it leaves the CUDA driver uninitialized in this process, which
    # only waits for the stages.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()


def _select(stages: list[Stage], names: str | None) -> None:
    """--stages: names (pytest, kernels, bench-default, ...), letters (a-d) or 'bench'; the others are skipped."""
    if not names:
        return
    wanted = {part.strip() for part in names.split(",") if part.strip()}
    known = {s.name for s in stages} | {s.letter for s in stages} | {"bench"}
    unknown = wanted - known
    if unknown:
        raise SystemExit(f"--stages: unknown {sorted(unknown)}; choose from {', '.join(sorted(known))}")
    for stage in stages:
        chosen = stage.name in wanted or stage.letter in wanted or (stage.kind == "bench" and "bench" in wanted)
        if not chosen:
            stage.skip = "not selected (--stages)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="Stages: a pytest, b kernels, c bench-default / bench-compute / bench-overhead, d offload (docs/gpu.md).",
    )
    parser.add_argument("--out-dir", default="gpu_out", help="where the results go (default gpu_out/)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny sizes: checks the stages run and report, in under a minute")
    parser.add_argument("--budget-s", type=float, default=None,
                        help=f"seconds for all stages together (default {DEFAULT_BUDGET_S:.0f}; dry run {DRY_RUN_BUDGET_S:.0f})")
    parser.add_argument("--stages", default=None, help="comma-separated subset: names, letters a-d, or 'bench' (default: all)")
    parser.add_argument("--exec", action="store_true",
                        help="run every stage as python -m ... rather than forked from this process, which imported torch once")
    parser.add_argument("--keep-scratch", action="store_true", help="keep the scratch folder (the benchmark's own outputs, junit XML, caches)")
    args = parser.parse_args(argv)
    if args.budget_s is None:
        args.budget_s = DRY_RUN_BUDGET_S if args.dry_run else DEFAULT_BUDGET_S
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    start = time.monotonic()
    if not args.dry_run and not _cuda_available():
        print("python -m benchmarks.gpu: CUDA is not available here; run it on a GPU machine, or use --dry-run", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in OUT_FILES:  # a previous run's files would read as this run's
        (out_dir / name).unlink(missing_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="fsdp_gpu_check_"))
    stages = build_stages(args.dry_run, scratch, out_dir)
    _select(stages, args.stages)
    no_fork = "--exec given" if args.exec else _preload_and_check_fork(args.dry_run)
    meta = _meta(args, argv)
    meta["stages_run_as"] = "forked from this preloaded process" if no_fork is None else f"python -m ... ({no_fork})"
    print(f"[gpu] stages run {meta['stages_run_as']}", flush=True)
    report = Report(out_dir, meta, stages)
    report.write()
    deadline = start + args.budget_s
    try:
        for index, stage in enumerate(stages):
            if stage.skip:
                report.record(stage, "skipped", stage.skip, {}, None)
                _log(out_dir, stage, None, f"skipped: {stage.skip}")
                continue
            # [Note: the time boxes]
            boxes_left = sum(s.box_s for s in stages[index:] if not s.skip)
            allotted = (deadline - time.monotonic()) * stage.box_s / boxes_left
            if allotted < MIN_STAGE_S:
                report.record(stage, "not run: out of time", f"{allotted:.0f} s left for it", {}, None)
                _log(out_dir, stage, None, "not run: out of time")
                continue
            print(f"[gpu] {stage.letter} {stage.name}: starting, box {allotted:.0f} s", flush=True)
            run = _execute(stage, scratch, out_dir, allotted, fork=no_fork is None)
            try:
                status, detail, data = READERS[stage.kind](stage, run)
            except Exception as error:  # noqa: BLE001 - a stage whose output we cannot read is a failed stage
                status, detail, data = f"failed: unreadable output ({type(error).__name__}: {error})"[:200], "", {}
            result = report.record(stage, status, detail, data, run)
            _log(out_dir, stage, run, status)
            print(f"[gpu] {stage.letter} {stage.name}: {status} in {run.seconds:.0f} s; {detail}", flush=True)
            for line in _summary_lines(result):
                print(line, flush=True)
    finally:
        if args.keep_scratch:
            print(f"[gpu] scratch kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print()
    print(report.summary(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
