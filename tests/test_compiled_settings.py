"""FSDP2's settings under fsdp_inductor: each changes the compiled step's collectives as it changes the
eager step's (counted with the profiler), or is refused with an error naming it; none is ignored."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from benchmarks.measure import count_collectives
from fsdp_compile import CPUOffloadPolicy, FSDPModule, fully_shard
from fsdp_compile.models import next_token_loss
from fsdp_testing import UNEVEN, build_reference, global_batches, local_part, shard_model, sharded_copy

MICRO_BATCHES = 4


def _accumulate_compiled_and_eager(backend: str, hybrid: bool = False, micro_batches: int = MICRO_BATCHES) -> dict:
    """Two optimizer steps of ``micro_batches`` micro-batches each, no sync (HSDP: no all-reduce) but in
    the last; per model: reduce-scatters (HSDP: all-reduces) per micro-batch, the full gradients
    before each optimizer step, Dynamo's graphs."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # Uneven: 37 embedding rows over 2 ranks, so the accumulated gradient meets padding.
    reference = build_reference(UNEVEN)
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


def test_accumulation_without_sync_under_fsdp_inductor_reduce_scatters_only_in_the_last_micro_batch(dist):
    result = dist.run(2, _accumulate_compiled_and_eager, "fsdp_inductor")[0]
    groups = 3  # two blocks and the root
    assert result["eager"]["reduce_scatters"] == [[0, 0, 0, groups]] * 2
    assert result["compiled"]["reduce_scatters"] == result["eager"]["reduce_scatters"]
    assert result["grad_difference"] <= 1e-6 * max(1.0, result["grad_size"]), result["grad_difference"]
    assert result["grad_size"] > 1e-3
    # Dynamo's graphs after each micro-batch: the accumulating graph (with its pre-forward hook's),
    # one more for the synced micro-batch, then none: reused by every later micro-batch.
    graphs = result["compiled"]["graphs"]
    assert graphs == [graphs[0]] * (MICRO_BATCHES - 1) + [graphs[0] + 1] * (MICRO_BATCHES + 1), graphs


def test_hsdp_deferred_all_reduce_under_fsdp_inductor_all_reduces_only_in_the_last_micro_batch(dist):
    # HSDP 2x2, set_requires_all_reduce(False) but in the last micro-batch; graphs without Inductor's codegen.
    micro = 3
    result = dist.run(4, _accumulate_compiled_and_eager, "fsdp_aot_eager", True, micro)[0]
    groups = 3
    assert result["eager"]["reduce_scatters"] == [[0, 0, groups]] * 2  # here: the all-reduces
    assert result["compiled"]["reduce_scatters"] == result["eager"]["reduce_scatters"]
    assert result["grad_difference"] <= 1e-6 * max(1.0, result["grad_size"]), result["grad_difference"]
    assert result["grad_size"] > 1e-3
    graphs = result["compiled"]["graphs"]  # deferring and all-reducing: two graphs, then reused
    assert graphs == [graphs[0]] * (micro - 1) + [graphs[0] + 1] * (micro + 1), graphs


class _PlainReduceScatter:
    """An FSDP2 ``ReduceScatter`` doing what the default does."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output, input, group, op, async_op=False):
        return torch.distributed.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


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
            block.set_custom_reduce_scatter(_PlainReduceScatter())
        model.set_reduce_scatter_unused_params(True)
        model.set_reduce_scatter_max_input_buffers(2)
        model.set_separate_reduce_scatter_group()
    compiled = torch.compile(model, backend="fsdp_aot_eager")
    inputs = torch.randn(4, 8)
    if setting == "reshard_after_backward":
        # Set after a first compiled step: the change recompiles, and the new graph is refused.
        compiled(inputs).sum().backward()
        model.set_reshard_after_backward(False)
    try:
        compiled(inputs).sum().backward()
    except Exception as error:  # noqa: BLE001 - the message is the result
        return str(error)
    return ""


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
        assert "block.compile()" in message, message


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
