"""Process-group fixtures: persistent gloo worker pools, one per world size.

Spawning ranks costs seconds (each re-imports torch), so a pool of ``world_size`` processes
is started once per session and every distributed test ships a function to it by name.
A test function is any module-level function in a test module (importable by its module
name in the workers); it runs on every rank and its return values come back as a list.
A failing or hanging task tears its pool down so the next test starts clean.
"""
from __future__ import annotations

import faulthandler
import importlib
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable

# [Note: the tests compile scalar C++]
# Inductor's CPU vectorization is the largest part of compiling the tests' tiny graphs (its tiling
# analysis: 21.9 s -> 14.2 s for test_compile's fsdp_inductor training test, 198 s -> 154 s for
# test_compile.py with test_compile_blocks.py) and is not what they test: the graphs and
# collectives are the same, Inductor then writes scalar loops. Set before torch is imported here
# and in the ranks (which inherit the environment). The benchmark smoke test runs without it, so the
# user's default, vectorized code still trains in the suite (tests/test_benchmark_smoke.py).
SCALAR_INDUCTOR_ENV = {"TORCHINDUCTOR_VEC_ISA_OK": "0"}
for _name, _value in SCALAR_INDUCTOR_ENV.items():
    os.environ.setdefault(_name, _value)

import pytest
import torch.multiprocessing as mp

import compiled_twin

# The fsdp backends' warning that Dynamo runs a graph they failed on eagerly.
COMPILE_FELL_BACK_TO_EAGER = r"fsdp_compile. fsdp_\w+ could not compile graph"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(TESTS_DIR)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_crash_log: Any = None  # kept open for the process's lifetime: faulthandler writes to its descriptor


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any, timeout_s: float, crash_log_path: str) -> None:
    # A rank killed by a signal writes every thread's Python stack here; RankDied quotes it.
    global _crash_log
    _crash_log = open(crash_log_path, "w")
    faulthandler.enable(file=_crash_log, all_threads=True)
    # A rank that does not finish in time is asked for its stacks (DistributedPool.run's timeout).
    faulthandler.register(signal.SIGUSR1, file=_crash_log, all_threads=True)
    sys.path[:0] = [TESTS_DIR, REPO_DIR]
    import torch
    import torch.distributed as dist

    # Before any test module is imported: `from fsdp_compile import fully_shard` there binds the switch.
    import compiled_twin

    compiled_twin.install()
    # Ranks share 2 cores: one thread each keeps them from fighting and keeps numerics stable.
    torch.set_num_threads(1)
    # A compile torch quietly replaces by eager code fails the test instead (pyproject.toml does the
    # same in the test process): see [Note: a backend failure Dynamo turns into eager code].
    warnings.filterwarnings("error", message=COMPILE_FELL_BACK_TO_EAGER)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, function_name, args, kwargs, root_backend = task
        try:
            function = getattr(importlib.import_module(module_name), function_name)
            with compiled_twin.compiling_roots(root_backend):
                results.put((rank, True, function(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the test process
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


_POLL_S = 1.0  # how often a waiting test checks that its ranks are still alive


class RankDied(RuntimeError):
    """A rank process ended while running a test function (killed by a signal, as a rule)."""

    def __init__(self, function_name: str, exit_codes: dict[int, int | None], failures: str) -> None:
        self.exit_codes = exit_codes
        self.by_signal = all(code is not None and code < 0 for code in exit_codes.values())
        described = ", ".join(f"rank {r} ({_describe_exit(code)})" for r, code in sorted(exit_codes.items()))
        super().__init__(f"{described} died running {function_name}{failures}")


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


# [Note: ranks forked from a preloaded server]
# A spawned rank imports torch, Dynamo, Inductor and fsdp_compile on its own: about 3.7 s of CPU per
# rank, paid by some 30 ranks a session on 2 cores. The ranks are forked instead from one forkserver
# that imported those modules once; a fork is as clean as a spawn for what the tests use (the server
# runs no torch op, holds no process group and no compile worker: each rank makes its own).
_RANK_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "fsdp_compile", "fsdp_testing"]
_rank_context = mp.get_context("forkserver")
_rank_context.set_forkserver_preload(_RANK_PRELOAD)


class DistributedPool:
    """``world_size`` gloo ranks that run test functions on demand."""

    def __init__(self, world_size: int, collective_timeout_s: float = 120.0) -> None:
        context = _rank_context
        self.world_size = world_size
        self.tasks = [context.Queue() for _ in range(world_size)]
        self.results = context.Queue()
        port = free_port()
        self.crash_log_dir = tempfile.mkdtemp(prefix=f"fsdp_compile_ranks{world_size}_")
        self.processes = [
            context.Process(
                target=_worker, daemon=True,
                args=(rank, world_size, port, self.tasks[rank], self.results, collective_timeout_s, self.crash_log(rank)),
            )
            for rank in range(world_size)
        ]
        for process in self.processes:
            process.start()

    def run(self, function: Callable[..., Any], *args: Any, timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
        for task_queue in self.tasks:
            task_queue.put((function.__module__, function.__name__, args, kwargs, _compiled_twin_backend[0]))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=_POLL_S)
            except queue.Empty:
                failures = "".join(f"\n--- rank {r} ---\n{v}" for r, (ok, v) in outcomes.items() if not ok)
                dead = {r: p.exitcode for r, p in enumerate(self.processes) if r not in outcomes and not p.is_alive()}
                if dead:
                    raise RankDied(function.__name__, dead, failures + self.crash_stacks(dead))
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(self.world_size)) - set(outcomes))
                    raise TimeoutError(
                        f"ranks {missing} did not finish {function.__name__}{failures}{self.stacks_of_live_ranks(missing)}"
                    ) from None
                continue
            outcomes[rank] = (ok, value)
            if not ok:  # the others may be stuck in a collective with the failed rank
                deadline = min(deadline, time.monotonic() + 30.0)
        failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
        if failures:
            raise AssertionError(f"{function.__name__} failed:\n" + "\n".join(failures))
        return [outcomes[r][1] for r in range(self.world_size)]

    def crash_log(self, rank: int) -> str:
        return os.path.join(self.crash_log_dir, f"rank{rank}.txt")

    def stacks_of_live_ranks(self, ranks: list[int]) -> str:
        """Where the hung ``ranks`` are: each dumps its threads' Python stacks into its crash log."""
        for rank in ranks:
            if self.processes[rank].is_alive():
                os.kill(self.processes[rank].pid, signal.SIGUSR1)
        time.sleep(2.0)  # faulthandler writes from its own thread
        return self.crash_stacks(dict.fromkeys(ranks))

    def crash_stacks(self, ranks: dict[int, Any]) -> str:
        """What faulthandler wrote for the dead ``ranks`` (the stacks of their threads), if anything."""
        stacks = ""
        for rank in sorted(ranks):
            try:
                with open(self.crash_log(rank)) as log:
                    text = log.read().strip()
            except OSError:
                continue
            if text:
                stacks += f"\n--- rank {rank}, faulthandler ---\n{text}"
        return stacks

    def close(self) -> None:
        self.request_stop()
        self.stop_by(time.monotonic() + 2.0)

    def request_stop(self) -> None:
        for task_queue, process in zip(self.tasks, self.processes):
            if process.is_alive():
                task_queue.put(None)

    def stop_by(self, deadline: float) -> None:
        """Wait for the ranks to leave until ``deadline``; one left then (stuck in
        destroy_process_group with a failed peer) is killed, as it has nothing left to report."""
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=1.0)  # a killed rank has let go of its crash log
        shutil.rmtree(self.crash_log_dir, ignore_errors=True)


class RankDiedWarning(UserWarning):
    """A rank died by a signal and its test was rerun; see [Note: a rank that dies is rerun once, loudly]."""


class PoolRegistry:
    def __init__(self) -> None:
        self.pools: dict[int, DistributedPool] = {}

    def run(self, world_size: int, function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``function(*args, **kwargs)`` on every rank of a ``world_size`` pool.

        [Note: a rank that dies is rerun once, loudly]
        A rank killed by a signal (a native crash, on record once in CI: glibc's "malloc(): unaligned
        tcache chunk detected" in a test that passed in every run here, with and without glibc's
        malloc checks) takes down the pool, not the test's assertion. The function is run once more
        on a fresh pool and the crash is reported as a warning in the test summary, quoting the
        dead rank's Python stack as faulthandler wrote it (``_worker``); a second death, an
        assertion or a timeout fails the test as before.
        """
        try:
            return self._run_on_pool(world_size, function, *args, **kwargs)
        except RankDied as died:
            if not died.by_signal:  # a rank that exited by itself: our bug, not a crash to retry
                raise
            warnings.warn(f"{died}; rerunning {function.__name__} once on a fresh pool", RankDiedWarning, stacklevel=2)
            return self._run_on_pool(world_size, function, *args, **kwargs)

    def _run_on_pool(self, world_size: int, function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        if world_size not in self.pools:
            self.pools[world_size] = DistributedPool(world_size)
        try:
            return self.pools[world_size].run(function, *args, **kwargs)
        except (AssertionError, TimeoutError, RankDied):
            self.pools.pop(world_size).close()
            raise

    def close(self) -> None:
        # One grace period for every pool's ranks, not one per pool.
        for pool in self.pools.values():
            pool.request_stop()
        deadline = time.monotonic() + 2.0
        for pool in self.pools.values():
            pool.stop_by(deadline)
        self.pools.clear()


@pytest.fixture(scope="session")
def dist() -> PoolRegistry:
    """``dist.run(world_size, fn, *args)`` runs ``fn`` on each rank and returns per-rank results."""
    registry = PoolRegistry()
    yield registry
    registry.close()


# The backend the running test's roots compile with (None: eager); see [Note: compiled twins of
# eager training tests] in compiled_twin.py.
_compiled_twin_backend: list[str | None] = [None]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("compiled_twin")
    if marker is None:
        return
    twin = compiled_twin.TWIN_BACKEND
    if marker.kwargs.get("costly") and not os.environ.get(compiled_twin.ALL_TWINS_ENV):
        # A twin that costs the suite more than its time budget allows runs on demand (docs/testing.md).
        twin = pytest.param(twin, marks=pytest.mark.skip(
            reason=f"a costly compiled twin ({marker.kwargs['costly']}): run it with {compiled_twin.ALL_TWINS_ENV}=1"))
    metafunc.parametrize("compiled_root", [None, twin], ids=["eager", "compiled"], indirect=True)


@pytest.fixture(autouse=True)
def compiled_root(request: pytest.FixtureRequest) -> Any:
    """The running test's root compile backend: None, or the compiled twin's (``compiled_twin`` marker)."""
    _compiled_twin_backend[0] = getattr(request, "param", None)
    yield _compiled_twin_backend[0]
    _compiled_twin_backend[0] = None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "compiled_twin: also run the test with every model's root compiled (compiled_twin.py)")


@pytest.fixture(params=[8, 64])
def fake_world(request):
    """One in-process rank of a fake process group of 8 or 64 ranks, for tracing graphs; the passes'
    give-up counters start at zero (see [Note: a pass that gives up] in passes/graph.py)."""
    import torch
    import torch.distributed as torch_dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compile.passes.graph import pass_counters

    pass_counters.clear()
    torch_dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    torch._dynamo.reset()
    yield request.param
    torch._dynamo.reset()
    torch_dist.destroy_process_group()


# Runs started in the background as their tests are collected; their tests move to the suite's end
# and wait for them there: (test module, the fixture those tests wait on, the config attribute that
# holds the run, the module's function that starts it and returns (process, out dir, scratch folder)).
_BACKGROUND_RUNS = (
    ("test_benchmark_smoke", "run", "benchmark_smoke_run", "start_benchmark_run"),
    ("test_benchmark_smoke", "hf_llama_run", "benchmark_hf_llama_run", "start_hf_llama_run"),  # --model hf-llama
    ("test_gpu_check", "dry_run", "gpu_dry_run", "start_dry_run"),  # python -m benchmarks.gpu --dry-run
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the background runs now and move their tests to the end; see [Note: the benchmark
    smoke run overlaps the suite] in test_benchmark_smoke.py."""
    if config.option.collectonly:
        return
    waiting: list[pytest.Item] = []
    for module_name, fixture, attribute, starter in _BACKGROUND_RUNS:
        tests = [item for item in items if fixture in getattr(item, "fixturenames", ()) and item.module.__name__ == module_name]
        if tests:
            setattr(config, attribute, getattr(importlib.import_module(module_name), starter)())
            waiting += tests
    if not waiting:
        return
    moved = {id(item) for item in waiting}
    rest = [item for item in items if id(item) not in moved]
    # A stable sort: the in-process tests first, each group in collection order.
    items[:] = sorted(rest, key=lambda item: not _runs_in_the_pytest_process_alone(item)) + waiting


def _runs_in_the_pytest_process_alone(item: pytest.Item) -> bool:
    """Whether ``item`` starts no rank or other process: it takes no ``dist`` pool, and its module
    starts none of its own (read from the module's source)."""
    if "dist" in getattr(item, "fixturenames", ()) or getattr(item, "module", None) is None:
        return False
    path = getattr(item.module, "__file__", None)
    if path not in _starts_processes:
        with open(path) as source:
            text = source.read()
        _starts_processes[path] = any(word in text for word in ("DistributedPool", "subprocess", "multiprocessing"))
    return not _starts_processes[path]


_starts_processes: dict[str, bool] = {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for _, _, attribute, _ in _BACKGROUND_RUNS:
        started = getattr(session.config, attribute, None)
        if started is None:
            continue
        if started[0].poll() is None:  # the suite stopped before its tests waited on it
            started[0].kill()
            started[0].wait()
        shutil.rmtree(started[2], ignore_errors=True)
