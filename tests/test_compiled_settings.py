"""FSDP2's settings under fsdp_inductor: each changes the compiled step's collectives as it changes the
eager step's (counted with the profiler), or is refused with an error naming it; none is ignored."""
from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.measure import count_collectives
import fsdp_compile
from fsdp_compile import BackwardPrefetch, CommPolicy, CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from fsdp_compile.models import next_token_loss
from fsdp_testing import UNEVEN, BlocksNet, CountingAllGather, CountingReduceScatter, TinyLM, block_compile_mode, global_batches, local_part, shard_model, sharded_copy
from test_compiled_all_gather_extension import bind_all_gather_extension

MICRO_BATCHES = 4


def _accumulate_compiled_and_eager(backend: str, hybrid: bool = False, micro_batches: int = MICRO_BATCHES) -> dict:
    """Two optimizer steps of ``micro_batches`` micro-batches each, no sync (HSDP: no all-reduce) but in
    the last; per model: reduce-scatters (HSDP: all-reduces) per micro-batch, the full gradients
    before each optimizer step, Dynamo's graphs."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # Uneven: 37 embedding rows over 2 ranks, so the accumulated gradient meets padding.
    torch.manual_seed(0)
    reference = TinyLM()
    batches = global_batches(2, micro_batches, dist.get_world_size(), UNEVEN)
    kwargs, counted = {}, "reduce_scatter"
    if hybrid:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["mesh"] = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
        counted = "all_reduce"
    results = {}
    for name in ("eager", "compiled"):
        model = shard_model(sharded_copy(reference), fully_shard, **kwargs)
        runner = torch.compile(model, backend=backend) if name == "compiled" else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        reduce_scatters, grads, graphs = [], [], []
        for batch in batches:
            per_micro = []
            for index, micro in enumerate(local_part(batch).chunk(micro_batches)):
                if hybrid:
                    model.set_requires_all_reduce(index == micro_batches - 1)
                else:
                    model.set_requires_gradient_sync(index == micro_batches - 1)
                with count_collectives() as counts:
                    (next_token_loss(runner(micro), micro) / micro_batches).backward()
                per_micro.append(counts.get(counted, 0))
                graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            reduce_scatters.append(per_micro)
            grads.append([p.grad.full_tensor() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
        results[name] = {"reduce_scatters": reduce_scatters, "grads": grads, "graphs": graphs}
    results["grad_difference"] = max(
        (a - b).abs().max().item()
        for step_a, step_b in zip(results["eager"]["grads"], results["compiled"]["grads"])
        for a, b in zip(step_a, step_b)
    )
    results["grad_size"] = max(g.abs().max().item() for g in results["eager"]["grads"][0])
    return results


# Graphs compiled again when a micro-batch syncs after ones that did not: the graphs that hold a
# group's reduce-scatter. Blocks as frames (the default): the blocks' one frame and the root's first
# graph (its group's reads; the later graphs take what it gathered). As one graph: that graph.
_GRAPHS_RECOMPILED_FOR_SYNC = 2 if fsdp_compile.config.block_compile_is("frames") else 1


def test_compiled_accumulation_without_sync_reduce_scatters_only_in_the_last_micro_batch(dist):
    result = dist.run(2, _accumulate_compiled_and_eager, "fsdp_aot_eager")[0]
    groups = 3  # two blocks and the root
    assert result["eager"]["reduce_scatters"] == [[0, 0, 0, groups]] * 2
    assert result["compiled"]["reduce_scatters"] == result["eager"]["reduce_scatters"]
    assert result["grad_difference"] <= 1e-6 * max(1.0, result["grad_size"]), result["grad_difference"]
    assert result["grad_size"] > 1e-3
    # Dynamo's graphs after each micro-batch: the accumulating graphs, more for the synced micro-batch,
    # then none: reused by every later micro-batch.
    graphs = result["compiled"]["graphs"]
    synced = graphs[0] + _GRAPHS_RECOMPILED_FOR_SYNC
    assert graphs == [graphs[0]] * (MICRO_BATCHES - 1) + [synced] * (MICRO_BATCHES + 1), graphs


def test_compiled_hsdp_deferred_all_reduce_all_reduces_only_in_the_last_micro_batch(dist):
    # HSDP 2x2, set_requires_all_reduce(False) but in the last micro-batch; graphs without Inductor's codegen.
    micro = 3
    result = dist.run(4, _accumulate_compiled_and_eager, "fsdp_aot_eager", True, micro)[0]
    groups = 3
    assert result["eager"]["reduce_scatters"] == [[0, 0, groups]] * 2  # here: the all-reduces
    assert result["compiled"]["reduce_scatters"] == result["eager"]["reduce_scatters"]
    assert result["grad_difference"] <= 1e-6 * max(1.0, result["grad_size"]), result["grad_difference"]
    assert result["grad_size"] > 1e-3
    graphs = result["compiled"]["graphs"]  # deferring, then all-reducing, then reused
    assert graphs == [graphs[0]] * (micro - 1) + [graphs[0] + _GRAPHS_RECOMPILED_FOR_SYNC] * (micro + 1), graphs


class _TwoBlocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x).relu()
        return x


def _refused(setting: str) -> str:
    torch._dynamo.reset()
    kwargs = {}
    if setting == "int_reshard_after_forward":
        kwargs["reshard_after_forward"] = 2  # of 4 ranks (1 means False, the world size True)
    elif setting == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    torch.manual_seed(0)
    model = _TwoBlocks()
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    if setting == "all_reduce_hook":
        for block in model.blocks:  # the root holds no parameters of its own
            block.set_all_reduce_hook(lambda reduced: None)
    if setting == "comm_settings":
        for block in model.blocks:
            block.set_custom_reduce_scatter(CountingReduceScatter())
        model.set_reduce_scatter_unused_params(True)
        model.set_reduce_scatter_max_input_buffers(2)
        model.set_separate_reduce_scatter_group()
    compiled = torch.compile(model, backend="fsdp_aot_eager")
    inputs = torch.randn(4, 8)
    # Blocks as one graph (regions) for set_reshard_after_backward(False) and CPUOffloadPolicy: blocks as frames honour them.
    with block_compile_mode("regions" if setting in ("reshard_after_backward", "offload") else fsdp_compile.config.block_compile):
        try:
            if setting in _SET_AFTER_A_STEP:
                # Set after a first compiled step: the change recompiles, and the new graph is refused.
                compiled(inputs).sum().backward()
                _SET_AFTER_A_STEP[setting](model)
            compiled(inputs).sum().backward()
        except Exception as error:  # noqa: BLE001 - the message is the result
            return str(error)
    return ""


_SET_AFTER_A_STEP: dict[str, Callable] = {
    "reshard_after_backward": lambda model: model.set_reshard_after_backward(False),
    "all_reduce_hook_after_a_step": lambda model: [block.set_all_reduce_hook(lambda reduced: None) for block in model.blocks],
}


@pytest.mark.parametrize(
    "setting, named",
    [
        ("reshard_after_backward", "set_reshard_after_backward(False)"),
        ("int_reshard_after_forward", "an int reshard_after_forward"),
        ("offload", "CPUOffloadPolicy"),
        ("all_reduce_hook", "set_all_reduce_hook"),
        # One compile refuses all four (the message lists every refused setting of the group).
        ("comm_settings", "set_custom_all_gather / set_custom_reduce_scatter|set_reduce_scatter_unused_params(True)"
         "|set_reduce_scatter_max_input_buffers|set_separate_reduce_scatter_group"),
    ],
)
def test_settings_the_graph_cannot_honour_are_refused_naming_the_setting_and_the_way_out(dist, setting, named):
    world = 4 if setting == "int_reshard_after_forward" else 2
    for message in dist.run(world, _refused, setting):
        for name in named.split("|"):
            assert "fsdp_inductor" in message and name in message, message
        assert "block.compile(backend=" in message, message


def _settings_table_rows() -> set[str]:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("<!-- settings-table -->")[1]
    return set(re.findall(r"^\| `([a-z_]+)", table, flags=re.MULTILINE))


def test_readme_settings_table_has_a_row_for_every_public_setting():
    public_methods = {
        name for name, value in vars(FSDPModule).items() if callable(value) and not name.startswith("_") and name != "forward"
    }
    arguments = set(inspect.signature(fully_shard).parameters) - {"module"}
    rows = _settings_table_rows()
    missing = (public_methods | arguments) - rows
    assert not missing, f"README settings table lacks rows for {sorted(missing)}"


# --- every setting: collectives per step, eager and compiled ---------------------------------------
# [Note: the settings table is a test]
# One case per row of the README's settings table (a row without a case, or a case without a row,
# fails): the same two training steps run eagerly and compiled (fsdp_aot_eager: fsdp_inductor's
# tracing, checks and passes without code generation; per-block compile for the `compile` row),
# collectives counted per step with the profiler. "honoured": the compiled steps issue the same
# collectives as the eager ones, with the same losses; "refused": the compiled step raises an
# error naming the setting (the NCCL-only settings refuse eagerly too); "eager only": explicit
# unshard/reshard around a step, whose compiled forward gathers its own copy (same losses).


class _Net(BlocksNet):
    """Two blocks between the root's input layer and head: three groups on any world size."""

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)


def _hsdp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return {"mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))}


def _shard_net(block_kwargs: dict | None = None, root_kwargs: dict | None = None) -> _Net:
    torch.manual_seed(0)
    model = _Net()
    for block in model.blocks:
        fully_shard(block, **(block_kwargs or {}))
    fully_shard(model, **(root_kwargs if root_kwargs is not None else block_kwargs or {}))
    return model


def _tensor_parallel_net() -> torch.nn.Module:
    from test_tensor_parallel import SpmdModel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fsdp_compile import DataParallelMeshDims

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = SpmdModel()
    for layer in model.layers:
        for linear, tp_dim in ((layer.up, 0), (layer.down, 1)):
            linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Replicate(), Shard(tp_dim)]))
        fully_shard(layer, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    model.loss_mesh = mesh
    return model


def _each_block(method: str, *args) -> Callable:
    return lambda model: [getattr(block, method)(*args) for block in model.blocks]


def _shard_dim1(param):
    from torch.distributed.tensor import Shard

    return Shard(1) if param.ndim == 2 else None


_SETTING_CASES: dict[str, dict] = {
    "mesh": dict(world=4, build=lambda: _shard_net(_hsdp_mesh())),
    "reshard_after_forward": dict(build=lambda: _shard_net({"reshard_after_forward": False})),
    "shard_placement_fn": dict(build=lambda: _shard_net({"shard_placement_fn": _shard_dim1})),
    "mp_policy": dict(build=lambda: _shard_net({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}), tolerance=1e-2),
    # Honoured by blocks compiled as frames (the default); refused as regions (the test above; test_compiled_cpu_offload.py).
    "offload_policy": dict(build=lambda: _shard_net({"offload_policy": CPUOffloadPolicy(pin_memory=False)})),
    "ignored_params": dict(build=lambda: _shard_net_ignoring_a_bias()),
    # FSDP2's all-gather extension (fp8 on the wire) on both blocks' weights: the runtime runs it for each block
    # frame. Compiled equals eager bitwise here; the tight tolerance lets changes= see the fp8 round trip (5e-4).
    "fsdp_pre_all_gather": dict(configure=lambda model: bind_all_gather_extension(model, blocks=(0, 1)), changes=True, tolerance=1e-6),
    "comm_policy": dict(build=lambda: _shard_net({"comm_policy": CommPolicy(reduce_wire_dtype=torch.bfloat16)})),
    # Its way out is another mesh layout (its own test in test_tensor_parallel.py), not per-block compile.
    "dp_mesh_dims": dict(world=4, build=_tensor_parallel_net, verdict="refused", named="dp_mesh_dims", way_out=False),
    "set_requires_gradient_sync": dict(each_step=lambda model, step: model.set_requires_gradient_sync(step == 1)),
    "set_requires_all_reduce": dict(world=4, build=lambda: _shard_net(_hsdp_mesh()), each_step=lambda model, step: model.set_requires_all_reduce(step == 1)),
    "set_reshard_after_forward": dict(configure=lambda model: model.set_reshard_after_forward(False)),
    # Two micro-batches, one optimizer step: the first keeps its parameters gathered for the second,
    # whose forward gathers nothing (test_compiled_reshard_after_backward.py counts it).
    "set_reshard_after_backward": dict(each_step=lambda model, step: model.set_reshard_after_backward(step == 1), optimizer_steps=(1,)),
    # changes: the steps also run without the setting, and its parameters must differ (not ignored by both).
    "set_gradient_divide_factor": dict(configure=lambda model: model.set_gradient_divide_factor(3.0), changes=True),
    "set_reduce_scatter_divide_factor": dict(configure=lambda model: model.set_reduce_scatter_divide_factor(3.0), changes=True),
    "set_unshard_in_backward": dict(build=lambda: _shard_net_with_embed_group(), configure=lambda model: model.embed.set_unshard_in_backward(False)),
    "set_force_sum_reduction_for_comms": dict(configure=_each_block("set_force_sum_reduction_for_comms", True)),
    "set_symm_mem_for_comm": dict(configure=lambda model: model.set_symm_mem_for_comm(), verdict="refused everywhere", named="set_symm_mem_for_comm"),
    "set_allocate_memory_from_process_group_for_comm": dict(
        configure=lambda model: model.set_allocate_memory_from_process_group_for_comm(True), verdict="refused everywhere",
        named="set_allocate_memory_from_process_group_for_comm",
    ),
    "set_all_reduce_hook": dict(configure=_each_block("set_all_reduce_hook", lambda reduced: None), verdict="refused", named="set_all_reduce_hook"),
    "set_custom_all_gather": dict(configure=lambda model: _each_block("set_custom_all_gather", CountingAllGather())(model), verdict="refused", named="set_custom_all_gather"),
    "set_custom_reduce_scatter": dict(
        configure=lambda model: _each_block("set_custom_reduce_scatter", CountingReduceScatter())(model), verdict="refused", named="set_custom_reduce_scatter",
    ),
    "set_reduce_scatter_unused_params": dict(configure=lambda model: model.set_reduce_scatter_unused_params(True), verdict="refused", named="set_reduce_scatter_unused_params"),
    "set_reduce_scatter_max_input_buffers": dict(configure=lambda model: model.set_reduce_scatter_max_input_buffers(2), verdict="refused", named="set_reduce_scatter_max_input_buffers"),
    "set_separate_reduce_scatter_group": dict(configure=lambda model: model.set_separate_reduce_scatter_group(), verdict="refused", named="set_separate_reduce_scatter_group"),
    "reset_iter_state": dict(each_step=lambda model, step: model.reset_iter_state()),
    "share_comm_ctx": dict(configure=lambda model: fsdp_compile.share_comm_ctx([model])),
    "register_fsdp_forward_method": dict(configure=lambda model: fsdp_compile.register_fsdp_forward_method(model, "encode"), method="encode"),
    # Two micro-batches, one optimizer step: the first backward's reductions land at the next forward.
    "set_is_last_backward": dict(each_step=lambda model, step: model.set_is_last_backward(step == 1), optimizer_steps=(1,)),
    "set_modules_to_forward_prefetch": dict(configure=lambda model: model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1]])),
    "set_modules_to_backward_prefetch": dict(configure=lambda model: model.blocks[1].set_modules_to_backward_prefetch([model.blocks[0]])),
    "set_backward_prefetch": dict(configure=lambda model: model.set_backward_prefetch(BackwardPrefetch.BACKWARD_POST)),
    "set_post_optim_event": dict(each_step=lambda model, step: model.set_post_optim_event(torch.Event())),
    "unshard": dict(each_step=lambda model, step: model.blocks[0].unshard(), verdict="eager only"),
    "reshard": dict(each_step=lambda model, step: (model.blocks[0].unshard(), model.blocks[0].reshard()), verdict="eager only"),
    "compile": dict(per_block=True),
}


def _shard_net_with_embed_group() -> _Net:
    """The input layer a group of its own: its input carries no gradient, so backward needs none of
    its parameters (an embedding's case for set_unshard_in_backward(False))."""
    torch.manual_seed(0)
    model = _Net()
    for module in (model.embed, *model.blocks):
        fully_shard(module)
    fully_shard(model)
    return model


def _shard_net_ignoring_a_bias() -> _Net:
    torch.manual_seed(0)
    model = _Net()
    ignored = {model.blocks[0].bias}
    for block in model.blocks:
        fully_shard(block, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    return model


def _loss(model, runner, method: str, generator: torch.Generator) -> torch.Tensor:
    mesh = getattr(model, "loss_mesh", None)
    if mesh is not None:  # the tensor-parallel model: DTensor activations (test_tensor_parallel.py)
        from test_tensor_parallel import DIM, _spmd_loss

        x, target = torch.randn(8, DIM, generator=generator), torch.randn(8, DIM, generator=generator)
        return _spmd_loss(runner, x, target, mesh)
    x = torch.randn(4, 8, generator=generator)
    return (runner(x) if method == "forward" else getattr(runner, method)(x)).square().mean()


def _setting_steps(name: str, mode: str) -> dict:
    """Two training steps of the case's model, eager or compiled: collectives and loss per step, or the error."""
    case = _SETTING_CASES[name]
    torch._dynamo.reset()
    model = case.get("build", _shard_net)()
    result: dict = {"collectives": [], "losses": []}
    try:
        if mode != "without":
            case.get("configure", lambda model: None)(model)
        method = case.get("method", "forward")
        runner = model
        if mode == "per_block" or (mode == "compiled" and case.get("per_block")):
            for block in model.blocks:
                block.compile(backend="fsdp_aot_eager")
        elif mode == "compiled" and method != "forward":
            runner = type("Compiled", (), {method: staticmethod(torch.compile(getattr(model, method), backend="fsdp_aot_eager"))})()
        elif mode == "compiled":
            runner = torch.compile(model, backend="fsdp_aot_eager")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(10 + dist.get_rank())
        for step in range(2):
            case.get("each_step", lambda model, step: None)(model, step)
            with count_collectives() as counts:
                loss = _loss(model, runner, method, generator)
                loss.backward()
            if step in case.get("optimizer_steps", (0, 1)):
                optimizer.step()
                optimizer.zero_grad()
            result["collectives"].append({kind: n for kind, n in sorted(counts.items()) if n})
            result["losses"].append(loss.item())
        # Where the steps took the parameters (plain lists: what the pool's queue carries back); a
        # setting may leave some unsharded (reshard_after_backward, unshard): shard them back first.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        result["params"] = [
            (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().flatten().tolist() for p in model.parameters()
        ]
    except Exception as error:  # noqa: BLE001 - the message is the result
        result["error"] = f"{type(error).__name__}: {error}"
    return result


def _setting_case(name: str) -> dict:
    # A setting fsdp_inductor refuses names per-block compile as the way out: that runs too.
    case = _SETTING_CASES[name]
    way_out = ("per_block",) if case.get("verdict") == "refused" and case.get("way_out", True) else ()
    without = ("without",) if case.get("changes") else ()
    return {mode: _setting_steps(name, mode) for mode in ("eager", "compiled", *way_out, *without)}


def _settings_table_cells() -> dict[str, str]:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("<!-- settings-table -->")[1]
    return {name: compiled for name, compiled in re.findall(r"^\| `([a-z_]+)` \|.*\| (.*) \|$", table, flags=re.MULTILINE)}


def test_every_row_of_the_settings_table_has_a_case_and_every_case_a_row():
    assert set(_SETTING_CASES) == set(_settings_table_cells())


@pytest.mark.parametrize("name", list(_SETTING_CASES))
def test_each_setting_changes_compiled_collectives_as_eager_or_is_refused(dist, name):
    case = _SETTING_CASES[name]
    verdict = case.get("verdict", "honoured")
    result = dist.run(case.get("world", 2), _setting_case, name)[0]
    eager, compiled = result["eager"], result["compiled"]
    cell = _settings_table_cells()[name]
    if verdict == "refused everywhere":
        assert case["named"] in eager.get("error", "") and case["named"] in compiled.get("error", ""), result
        assert "refused" in cell, cell
        return
    assert "error" not in eager, eager
    if verdict == "refused":
        assert case["named"] in compiled.get("error", "") and "fsdp_inductor" in compiled["error"], result
        assert "block.compile(" in compiled["error"], compiled["error"]
        assert "refused" in cell, cell
        if "per_block" not in result:
            return
        # The way out the refusal names honours the setting: per-block compile trains as eagerly.
        compiled = result["per_block"]
        assert "error" not in compiled, compiled
        verdict = "honoured"
    assert "error" not in compiled, compiled
    assert "refused" not in cell or name == "reshard_after_forward" or "per_block" in result, cell  # that row refuses only an int
    if verdict == "honoured":  # "eager only" / "same numerics": the losses below
        assert compiled["collectives"] == eager["collectives"], result
        assert eager["collectives"][0], result  # counted, not vacuously equal
    tolerance = case.get("tolerance", 1e-5)
    for a, b in zip(eager["losses"], compiled["losses"]):
        assert abs(a - b) <= tolerance * max(1.0, abs(a)), result
    for a, b in zip(eager["params"], compiled["params"]):
        assert max(abs(x - y) for x, y in zip(a, b)) <= tolerance * max(1.0, *map(abs, a)), name
    if "without" in result:  # the setting did something, eagerly and so compiled
        moved = max(max(abs(x - y) for x, y in zip(a, b)) for a, b in zip(eager["params"], result["without"]["params"]))
        assert moved > 100 * tolerance, (name, moved)


# --- torch.compile's own mode= and options= ----------------------------------------------------------
# [Note: torch.compile's mode and options under fsdp_inductor] in backend.py. The model is TinyLM on
# one in-process rank of a fake world of 8: only the first forward compiles.


def _compile_first_forward(backend: str, **compile_kwargs) -> tuple[torch.Tensor, torch.nn.Module]:
    torch.manual_seed(0)
    model = shard_model(TinyLM(), fully_shard)
    tokens = torch.randint(0, UNEVEN.vocab_size, (2, 8))
    return tokens, torch.compile(model, backend=backend, **compile_kwargs)


@pytest.fixture
def inductor_calls(monkeypatch) -> list[dict]:
    """Each Inductor compile's config patches; the graph then runs as traced (no code generated)."""
    import torch._inductor.compile_fx

    calls: list[dict] = []

    def spy(gm, example_inputs, config_patches=None, **kwargs):
        calls.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", spy)
    return calls


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_torch_compile_options_reach_inductors_generated_code(fake_world):
    """``options={"size_asserts": False}`` (Inductor's default is True): the generated code has no size asserts."""
    from torch._inductor.utils import run_and_get_code

    assert torch._inductor.config.size_asserts
    tokens, compiled = _compile_first_forward("fsdp_inductor", options={"size_asserts": False})
    _, codes = run_and_get_code(lambda: compiled(tokens))
    assert codes and "all_gather_into_tensor" in codes[0]
    assert not any("assert_size_stride(" in code for code in codes)


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_torch_compile_mode_applies_without_cuda_graphs_and_says_so(fake_world, inductor_calls):
    tokens, compiled = _compile_first_forward("fsdp_inductor", mode="max-autotune")
    with pytest.warns(UserWarning, match=r"mode='max-autotune'\) asks for CUDA graphs, which fsdp_inductor leaves off"):
        compiled(tokens)
    patches = inductor_calls[0]
    assert patches["max_autotune"] is True and patches["coordinate_descent_tuning"] is True
    assert "triton.cudagraphs" not in patches
    assert patches["reorder_for_peak_memory"] is False  # fsdp_inductor's own pins stay


@pytest.mark.parametrize(
    "options, named",
    [
        ({"reorder_for_peak_memory": True}, "PassConfig(reorder=False)"),
        ({"bucket_all_gathers_fx": "all"}, "fsdp_inductor_with(PassConfig"),
        ({"post_grad_custom_post_pass": None}, "bucketing and reordering passes"),
        ({"no_such_option": 1}, "Unexpected optimization option no_such_option"),
    ],
)
@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_torch_compile_options_fsdp_inductor_cannot_take_are_refused_before_any_collective(
    fake_world, inductor_calls, monkeypatch, options, named,
):
    import fsdp_compile.compile.backend

    checked: list[object] = []
    monkeypatch.setattr(fsdp_compile.compile.backend, "check_collectives_match_across_ranks", checked.append)
    tokens, compiled = _compile_first_forward("fsdp_inductor", options=options)
    with pytest.raises(Exception, match=re.escape(named)) as raised:
        compiled(tokens)
    assert "fsdp_inductor: torch.compile(options=" in str(raised.value)
    assert not checked and not inductor_calls  # refused before the fingerprint's all-gather


@pytest.mark.parametrize("fake_world", [8], indirect=True)
def test_fsdp_aot_eager_refuses_a_mode_it_cannot_apply(fake_world):
    tokens, compiled = _compile_first_forward("fsdp_aot_eager", mode="max-autotune")
    with pytest.raises(Exception, match="fsdp_aot_eager runs its graphs without code generation"):
        compiled(tokens)
