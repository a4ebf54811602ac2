"""FSDP2's all-gather extensions (fsdp_pre_all_gather / fsdp_post_all_gather) under a whole-model
torch.compile with blocks compiled as frames (the default): the runtime runs each block's extension
around the all-gather the block's graph asks for, what pre_all_gather returns crosses the wire, and the
model trains as eagerly ([Note: all-gather extensions under a whole-model compile] in compile/policy.py).
What cannot be run that way is refused with the parameter, the reason and the way out."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import fsdp_compile
from benchmarks.measure import count_collectives
from fsdp_compile import fully_shard
from fsdp_compile.compile.backend import observe_graphs
from fsdp_testing import BlocksNet, block_compile_mode
from test_compile_blocks import _modules_run_eagerly

BLOCKS = 3
STEPS = 3
EXTENDED_BLOCKS = (0, 2)  # block 1 has none: the blocks share one graph all the same
_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def _fp8_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    """Sends the shard in float8 e4m3 scaled to its range, with the scale: a quarter of float32's bytes."""
    scale = (self.abs().amax().clamp(min=1e-12) / _E4M3_MAX).float()
    return (self.div(scale).to(torch.float8_e4m3fn), scale), None


def _fp8_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    data, scales = all_gather_outputs  # every rank's rows, every rank's scale
    assert data.dtype == torch.float8_e4m3fn
    world = scales.shape[0]
    value = (data.to(param_dtype).view(world, data.shape[0] // world, -1) * scales.view(world, 1, 1).to(param_dtype)).view(data.shape)
    if out is not None:
        with torch.autograd.grad_mode._unsafe_preserve_version_counter(out):
            out.data.copy_(value)
        return None
    return value, (value,)


def _subclass_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    """Returns a tensor subclass, as torchao's float8 training does (its Float8Tensor)."""
    from torch.testing._internal.two_tensor import TwoTensor

    value = _fp8_post_all_gather(self, all_gather_outputs, metadata, param_dtype)[0]
    return TwoTensor(value, value.clone()), (value,)


def bind_all_gather_extension(model: BlocksNet, post=_fp8_post_all_gather, blocks=EXTENDED_BLOCKS) -> None:
    """The fp8 extension bound onto the local shards of ``blocks``' weights (8 rows: even over 2 ranks,
    no padding for the extension to handle), as FSDP2's own tests bind theirs: plain tensors."""
    for index in blocks:
        local = model.blocks[index].weight._local_tensor
        local.fsdp_pre_all_gather = _fp8_pre_all_gather.__get__(local)
        local.fsdp_post_all_gather = post.__get__(local)


def _sharded_model(extension: bool) -> BlocksNet:
    torch.manual_seed(0)
    model = BlocksNet(BLOCKS)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if extension:
        bind_all_gather_extension(model)
    return model


def _train(mode: str, extension: bool, unshard_first: bool = False) -> dict:
    """``STEPS`` Adam steps of BlocksNet, eagerly (``mode`` "eager") or compiled with the backend ``mode``:
    per step the collectives and the bytes handed to them; the packed all-gathers by group and reason;
    Dynamo's graphs, the modules that ran eagerly, the parameters after. ``unshard_first``: an explicit
    ``unshard()`` of an extended block before the first step."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _sharded_model(extension)
    runner = model if mode == "eager" else torch.compile(model, backend=mode)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if unshard_first:
        model.blocks[EXTENDED_BLOCKS[0]].unshard()
    generator = torch.Generator().manual_seed(10 + dist.get_rank())
    result: dict = {"collectives": [], "wire_bytes": []}
    with warnings.catch_warnings(record=True) as caught, observe_graphs() as graphs, fsdp_compile.record_collectives() as log:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            with count_collectives() as counts:
                runner(torch.randn(4, 8, generator=generator)).square().mean().backward()
            result["collectives"].append({kind: n for kind, n in sorted(counts.items()) if n})
            result["wire_bytes"].append(counts.nbytes)
            optimizer.step()
            optimizer.zero_grad()
    packed = [r for r in log if r.kind == "all_gather" and r.dtype == torch.uint8]
    result["packed"] = sorted({(r.group, r.reason) for r in packed})
    result["packed_bytes"] = sorted((r.group, r.nbytes) for r in packed)
    # What each block's plain all-gather sends: its float32 shards.
    result["shard_bytes"] = {f"blocks.{i}": sum(p._local_tensor.nbytes for p in block.parameters()) for i, block in enumerate(model.blocks)}
    result["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    result["forward_graphs"] = sum(kind == "forward" for kind, _ in graphs)
    result["run_eagerly"] = _modules_run_eagerly(caught)
    result["params"] = [p.full_tensor().detach() for p in model.parameters()]
    return result


def _runs(backend: str) -> dict:
    return {
        "eager": _train("eager", True),
        "compiled": _train(backend, True),
        "compiled_without_extension": _train(backend, False),
    }


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("backend, tolerance", [("fsdp_aot_eager", 0.0), ("fsdp_inductor", 1e-5)])
def test_blocks_with_an_fp8_all_gather_extension_train_compiled_as_eagerly_sending_fp8(dist, backend, tolerance):
    runs = dist.run(2, _runs, backend)[0]
    eager, compiled, plain = runs["eager"], runs["compiled"], runs["compiled_without_extension"]
    assert compiled["forward_graphs"] >= 1 and compiled["run_eagerly"] == [], compiled["run_eagerly"]
    # The graphs are those of the model without the extension: the runtime runs it, not the graph.
    assert compiled["graphs"] == plain["graphs"], (compiled["graphs"], plain["graphs"])
    assert compiled["collectives"] == eager["collectives"], (compiled["collectives"], eager["collectives"])
    assert eager["collectives"][0]["all_gather"] > 0 and eager["collectives"][0]["reduce_scatter"] > 0
    # What pre_all_gather returns crosses the wire, as eagerly: fp8 and a scale in place of float32,
    # in fewer bytes than the block's plain all-gather and than the model sends without the extension.
    assert compiled["packed_bytes"] == eager["packed_bytes"], (compiled["packed_bytes"], eager["packed_bytes"])
    assert all(nbytes < compiled["shard_bytes"][group] for group, nbytes in compiled["packed_bytes"]), compiled
    assert all(a < b for a, b in zip(compiled["wire_bytes"], plain["wire_bytes"])), (compiled["wire_bytes"], plain["wire_bytes"])
    extended = {f"blocks.{index}" for index in EXTENDED_BLOCKS}
    assert {group for group, _ in compiled["packed"]} == {group for group, _ in eager["packed"]} == extended, compiled["packed"]
    assert {reason for _, reason in compiled["packed"]} == {"block-frame-forward", "block-frame-backward"}, compiled["packed"]
    assert plain["packed"] == []
    assert _gap(compiled["params"], eager["params"]) <= tolerance
    # The fp8 round trip changed the training: equal to eager's not because both ignored it.
    assert _gap(eager["params"], plain["params"]) > 1e-3


def _explicit_unshard_runs() -> dict:
    return {"eager": _train("eager", True, unshard_first=True), "compiled": _train("fsdp_aot_eager", True, unshard_first=True)}


def test_an_explicit_unshard_before_a_compiled_step_is_read_once_then_resharded(dist):
    # The block frame reads what the explicit unshard gathered, then reshards: were the group left
    # unsharded, every later step would read its parameters from before the optimizer's steps.
    runs = dist.run(2, _explicit_unshard_runs)[0]
    assert runs["compiled"]["run_eagerly"] == [], runs["compiled"]["run_eagerly"]
    assert runs["compiled"]["collectives"] == runs["eager"]["collectives"], runs
    assert _gap(runs["compiled"]["params"], runs["eager"]["params"]) == 0.0


def _refused(
    post_subclass: bool, mode: str = "frames", reshard_after_backward: bool = True, bucket: bool = True, frame_gathers: bool = True,
) -> dict:
    torch._dynamo.reset()
    if not frame_gathers:  # as if a pass gave up on the block's all-gather: left a node of the graph
        monkeypatch = pytest.MonkeyPatch()
        monkeypatch.setattr("fsdp_compile.passes.recompute.gather_frames_through_prefetch", lambda graph, backward: 0)
    else:
        monkeypatch = None
    model = _sharded_model(False)
    bind_all_gather_extension(model, _subclass_post_all_gather if post_subclass else _fp8_post_all_gather)
    model.set_reshard_after_backward(reshard_after_backward)
    try:
        with block_compile_mode(mode, passes=fsdp_compile.config.PassConfig(bucket=bucket)):
            torch.compile(model, backend="fsdp_aot_eager")(torch.randn(4, 8)).sum().backward()
    except Exception as error:  # noqa: BLE001 - Dynamo may wrap backend errors
        return {"error": str(error)}
    finally:
        if monkeypatch is not None:
            monkeypatch.undo()
    return {}


def _check_refusal_names_the_parameter_and_the_way_out(message: str) -> None:
    named = [f"fsdp_inductor: 'weight' (group 'blocks.{index}') has an all-gather extension" for index in EXTENDED_BLOCKS]
    assert any(name in message for name in named), message
    assert 'block.compile(backend="fsdp_inductor")' in message and "skip_fsdp_hooks" in message, message


def test_an_fsdp_post_all_gather_returning_a_tensor_subclass_is_refused_on_every_rank(dist):
    results = dist.run(2, _refused, True)
    for result in results:  # both ranks raise: neither is left waiting in a collective
        message = result.get("error", "")
        _check_refusal_names_the_parameter_and_the_way_out(message)
        assert "returned a TwoTensor, a tensor subclass" in message, message


def test_an_all_gather_extension_is_refused_where_the_all_gather_is_a_graph_node(dist):
    for result in dist.run(2, _refused, False, "regions"):
        message = result.get("error", "")
        _check_refusal_names_the_parameter_and_the_way_out(message)
        assert "its all-gather is a node of the graph" in message and "Blocks compiled as frames" in message, message


def test_an_all_gather_extension_is_refused_with_parameters_kept_gathered_across_a_backward(dist):
    for result in dist.run(2, _refused, False, "frames", False):
        message = result.get("error", "")
        _check_refusal_names_the_parameter_and_the_way_out(message)
        assert "set_reshard_after_backward(False): what the runtime keeps gathered" in message, message


def test_an_all_gather_extension_is_refused_where_the_passes_leave_a_block_frames_all_gather_in_the_graph(dist):
    """Unbucketed, a block's all-gathers stay graph nodes on the plain shards (the runtime never sees them)."""
    for result in dist.run(2, _refused, False, "frames", True, False):
        message = result.get("error", "")
        _check_refusal_names_the_parameter_and_the_way_out(message)
        assert "PassConfig bucket=False" in message, message


def test_an_all_gather_extension_is_refused_where_a_pass_gave_up_on_a_block_frames_all_gather(dist):
    """A pass that gives up leaves a graph correct but slower ([Note: a pass that gives up]), except that
    a block's all-gather left in the graph would gather the plain shards past the extension."""
    for result in dist.run(2, _refused, False, "frames", True, True, False):
        message = result.get("error", "")
        _check_refusal_names_the_parameter_and_the_way_out(message)
        assert "a graph pass left a block frame's all-gather" in message, message
