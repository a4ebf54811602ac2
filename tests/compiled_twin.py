"""The compiled twin of an eager training test: the same test, each model's root compiled.

[Note: compiled twins of eager training tests]
A test marked ``@pytest.mark.compiled_twin`` runs twice: as written ("eager") and "compiled", where
every ``fully_shard`` call in the ranks compiles the module it shards in place with
``TWIN_BACKEND`` (``module.compile(backend=...)``, the in-place form of ``torch.compile(model)``),
and lets go of the compile of the FSDP modules under it: the module sharded last, the root, is the
one compiled, as a user compiles the whole model. Whatever the test asserts of eager training (a
reference model's numerics, gradients, state) then holds of the compiled path too, so a training
pattern tested eagerly is a pattern tested compiled. ``fsdp_aot_eager`` is fsdp_inductor's trace,
checks and passes without code generation: fp32 numerics equal eager's.

The switch is installed in each rank before any test module is imported (``conftest._worker``), so
``from fsdp_compile import fully_shard`` in a test module binds it; it only acts while a compiled
twin runs (``compiling_roots``).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

TWIN_BACKEND = "fsdp_aot_eager"
# ``@pytest.mark.compiled_twin(costly="N s")``: the twin runs only with this variable set (the suite's
# time budget); ``FSDP_COMPILE_ALL_TWINS=1 make test`` runs every twin.
ALL_TWINS_ENV = "FSDP_COMPILE_ALL_TWINS"


class _Switch:
    backend: str | None = None


def _compiling_root(fully_shard: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fully_shard)
    def shard(module: Any, *args: Any, **kwargs: Any) -> Any:
        if _Switch.backend is None:
            return fully_shard(module, *args, **kwargs)
        from fsdp_compile import FSDPModule

        # Before fully_shard sees them: it takes a block compiled in place for one compiled per
        # block ([Note: every way of compiling a block, one form] in module.py).
        for outer in module if isinstance(module, (list, tuple)) else [module]:
            for inner in outer.modules():
                if inner is not outer and isinstance(inner, FSDPModule):
                    inner._compiled_call_impl = None
        result = fully_shard(module, *args, **kwargs)
        if isinstance(module, (list, tuple)):
            return result
        module._compiled_call_impl = None
        module.compile(backend=_Switch.backend)
        return result

    shard._compiled_twin = True  # type: ignore[attr-defined]
    return shard


def install() -> None:
    """Route ``fsdp_compile.fully_shard`` through the switch (once per process)."""
    import fsdp_compile
    import fsdp_compile.module

    if getattr(fsdp_compile.fully_shard, "_compiled_twin", False):
        return
    fsdp_compile.fully_shard = fsdp_compile.module.fully_shard = _compiling_root(fsdp_compile.module.fully_shard)


@contextlib.contextmanager
def compiling_roots(backend: str | None) -> Iterator[None]:
    """While a test function runs in a rank: roots compile with ``backend`` (None: they stay eager)."""
    if backend is None:
        yield
        return
    import torch

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _Switch.backend = backend
    try:
        yield
        # A twin that compiled nothing (no fully_shard call, a refused setting that fell back) tests nothing.
        if not torch._dynamo.utils.counters["stats"]["unique_graphs"]:
            raise AssertionError(f"the compiled twin compiled no graph with {backend}: this test has no compiled twin")
    finally:
        _Switch.backend = None
        torch._dynamo.reset()
