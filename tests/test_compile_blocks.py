"""Compile once per block: torchtitan's per-block recipe shares one graph between identical blocks
at any depth, survives frames Dynamo runs eagerly, and does not recompile in steady state; the
whole-model form compiles a block's body once (a nested compile region) and, for a resharding
block, gathers its parameters again in backward instead of saving them."""
from __future__ import annotations

import contextlib
import copy
import importlib
import os
import operator
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
from torch._dynamo.utils import compilation_time_metrics

from fsdp_compile import MixedPrecisionPolicy, fully_shard
from fsdp_compile.compile.backend import observe_graphs
from fsdp_compile.passes.graph import ALL_GATHER, GROUP_KEY, fsdp_annotation, pass_counters
from fsdp_compile.models import Transformer, TransformerConfig, next_token_loss
from fsdp_testing import TinyLM, block_compile_mode
from test_compile_graphs import _saved_all_gather_outputs

DEEP = TransformerConfig(vocab_size=32, dim=16, n_layers=12, n_heads=2, max_seq_len=16)
SHALLOW = TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=16)


def _tokens(rows: int, seq: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 32, (rows, 1), generator=generator)
    return (start + torch.arange(seq)) % 32


def _shard(model: Transformer, policy: MixedPrecisionPolicy, reshard_blocks: bool = True) -> Transformer:
    for block in model.layers:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard_blocks)
    fully_shard(model, mp_policy=policy)
    return model


def _train(model, steps: int, seed: int = 0, seqs: tuple[int, ...] | None = None) -> list[float]:
    """``steps`` SGD steps (``seqs``: one step per sequence length instead)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step, seq in enumerate(seqs or [12] * steps):
        tokens = _tokens(2, seq, seed=100 * step + dist.get_rank() + seed)
        loss = next_token_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _modules_run_eagerly(caught) -> list[str]:
    """The modules the recorded warnings say ran eagerly inside a compiled model ([Note: frames Dynamo
    runs eagerly] in module.py), each once."""
    return sorted({str(w.message).split("'")[1] for w in caught if "ran eagerly inside a compiled model" in str(w.message)})


def _param_gap(a, b) -> float:
    return max((x.full_tensor() - y.full_tensor()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


# --- per block: block.compile(backend="fsdp_inductor") --------------------------------------------


def _compile_each_layer_in_place(model: nn.Module, **compile_kwargs) -> None:
    """torchtitan's ``apply_compile``: each layer replaced by ``torch.compile(layer)`` (before fully_shard)."""
    for index, block in enumerate(model.layers):
        model.layers.register_module(str(index), torch.compile(block, **compile_kwargs))


def _per_block(case: str, param_dtype_name: str | None):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    policy = MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype_name) if param_dtype_name else None)
    torch.manual_seed(0)
    reference = Transformer(DEEP)
    if case == "twelve_structures":
        reference.layers = nn.ModuleList(_IndexedBlock(i) for i in range(len(reference.layers)))
    eager, compiled = _shard(copy.deepcopy(reference), policy), copy.deepcopy(reference)
    if case == "compiled_before_sharding":
        # torchtitan's apply_compile runs before fully_shard: fully_shard takes the compiled blocks.
        _compile_each_layer_in_place(compiled, backend="fsdp_inductor", fullgraph=True)
    compiled = _shard(compiled, policy)
    previous_limit = torch._dynamo.config.recompile_limit
    if case == "recompile_limit_1":
        torch._dynamo.config.recompile_limit = 1
    try:
        for index, block in enumerate(compiled.layers):
            if case != "compiled_before_sharding":
                # What the recompile limit counts is Dynamo's: AOTAutograd alone compiles 12 graphs faster.
                block.compile(backend="fsdp_aot_eager" if case == "twelve_structures" else "fsdp_inductor")
            if case == "one_block_disabled" and index == 5:
                block.forward = torch.compiler.disable(block.forward)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eager_losses, compiled_losses = _train(eager, 3), _train(compiled, 3)
    finally:
        torch._dynamo.config.recompile_limit = previous_limit
    stats = torch._dynamo.utils.counters["stats"]
    return {
        "eager_frames": _modules_run_eagerly(caught),
        "eager_losses": eager_losses,
        "compiled_losses": compiled_losses,
        "param_gap": _param_gap(eager, compiled),
        "unique_graphs": stats["unique_graphs"],
        "recompiles": sum(torch._dynamo.utils.counters["recompiles"].values()),
    }


@pytest.mark.parametrize("case", ["plain", "one_block_disabled", "recompile_limit_1", "compiled_before_sharding"])
def test_per_block_compile_of_twelve_blocks_shares_one_graph_and_trains_like_eager(dist, case):
    result = dist.run(2, _per_block, case, None)[0]
    for eager, compiled in zip(result["eager_losses"], result["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-5 * abs(eager), result
    assert result["param_gap"] < 1e-5, result
    # One forward graph for all twelve blocks (no guard on a block's identity), no recompiles.
    assert result["unique_graphs"] == 1, result
    assert result["recompiles"] == 0, result


def test_per_block_compile_of_twelve_block_structures_compiles_each_and_trains_like_eager(dist):
    """[Note: a recompile limit per block structure] in backend.py: twelve blocks that each read their
    own index share FSDPModule.forward's code, whose recompile_limit (8) ran blocks 9-12 eagerly; each
    structure now compiles its graph."""
    result = dist.run(2, _per_block, "twelve_structures", None)[0]
    for eager, compiled in zip(result["eager_losses"], result["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-5 * abs(eager), result
    assert result["param_gap"] < 1e-5, result
    assert result["unique_graphs"] == 12 and result["eager_frames"] == [], result


def test_per_block_compile_with_bf16_matches_eager_bf16(dist):
    result = dist.run(2, _per_block, "plain", "bfloat16")[0]
    for eager, compiled in zip(result["eager_losses"], result["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-2 * abs(eager), result
    assert result["unique_graphs"] == 1


# --- steady state: no recompiles per step or per block ---------------------------------------------


def _steady_state():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = _shard(Transformer(SHALLOW), MixedPrecisionPolicy())
    for block in model.layers:
        # Recompiles are Dynamo's decision (its guards), the same under either fsdp backend:
        # fsdp_aot_eager spares each of the recompiles below Inductor's code generation.
        block.compile(backend="fsdp_aot_eager")
    return steady_state_schedule(model, model)


def steady_state_schedule(model: nn.Module, runner: nn.Module) -> list[int]:
    """Dynamo's graph count after each step of: 3 training steps, an evaluation forward, 3 more
    steps, two new batch sizes, two new sequence lengths (``runner``: the model as it is called)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    graphs = []

    def step(rows: int, seq: int, seed: int) -> None:
        tokens = _tokens(rows, seq, seed)
        next_token_loss(runner(tokens), tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

    for seed in range(3):
        step(2, 12, seed)
    model.eval()
    with torch.no_grad():
        runner(_tokens(2, 12, 9))
    model.train()
    for seed in range(3):
        step(2, 12, seed)
    step(3, 12, 20)  # a new batch size: at most one recompile (then dynamic)
    step(5, 12, 21)
    step(3, 8, 22)  # a new sequence length
    step(4, 6, 23)
    return graphs


def test_steady_state_training_eval_switch_and_new_shapes_recompile_exactly_once_per_shape_class(dist):
    graphs = dist.run(2, _steady_state)[0]
    assert graphs[0] == graphs[2], "steps after the first must not recompile"
    assert graphs[3] == graphs[5], "train -> eval -> train recompiles nothing once seen"
    assert graphs[0] == 1 and graphs[3] == 2, graphs  # exact: one graph, and its no-grad variant for eval
    assert graphs[6] - graphs[5] == 1 and graphs[7] == graphs[6], "one recompile for a new batch size, then dynamic"
    assert graphs[8] - graphs[7] == 1 and graphs[9] == graphs[8], "one recompile for a new sequence length, then dynamic"


# --- whole model: a nested compile region per block ----------------------------------


def _region_inputs_saved(forward, parameters_only: bool = False) -> int:
    """Saved-for-backward values of ``forward`` that are a region's input (or a view of it) passed
    through the region: an unsharded parameter kept alive until backward. ``parameters_only``:
    count only inputs that are unsharded parameters (an annotated unshard's output), not
    activations, which are saved either way."""
    invoke = torch.ops.higher_order.invoke_subgraph
    passed_through = 0
    for value in next(n for n in forward.graph.nodes if n.op == "output").args[0][1:]:
        if not (isinstance(value, torch.fx.Node) and value.target is operator.getitem and value.args[0].target is invoke):
            continue
        call = value.args[0]
        body = getattr(forward, call.args[0].target)
        returned = next(n for n in body.graph.nodes if n.op == "output").args[0][value.args[1]]
        while returned.op == "call_function" and isinstance(returned.target, torch._ops.OpOverload) and returned.target.is_view:
            returned = returned.args[0]
        if returned.op != "placeholder":
            continue
        operand = call.args[2 + list(body.graph.find_nodes(op="placeholder")).index(returned)]
        passed_through += not parameters_only or fsdp_annotation(operand) is not None
    return passed_through


@contextlib.contextmanager
def _calls_counted(module_name: str, name: str):
    """Counts calls of ``<module_name>.<name>`` (torch looks it up by name at each call) while open,
    in a list of one count; [None] on a torch without it."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    original = getattr(module, name, None)
    if original is None:
        yield [None]
        return
    count = [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield count
    finally:
        setattr(module, name, original)


def _whole_model_regions(layers: int, backend: str, reshard_blocks: bool, tiny: bool = False, seqs: tuple[int, ...] = (12, 12)):
    """One training step per sequence length in ``seqs``; the graphs looked at are the last
    compile's (the recompile with symbolic sizes, where ``seqs`` differ)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = TinyLM(n_layers=layers) if tiny else Transformer(TransformerConfig(vocab_size=32, dim=16, n_layers=layers, n_heads=2, max_seq_len=16))
    eager = _shard(copy.deepcopy(reference), MixedPrecisionPolicy(), reshard_blocks=reshard_blocks)
    compiled = _shard(copy.deepcopy(reference), MixedPrecisionPolicy(), reshard_blocks=reshard_blocks)
    body_traces_before = len(compilation_time_metrics.get("invoke_subgraph_trace", []))
    torch._dynamo.utils.counters.clear()
    pass_counters.clear()
    with (
        observe_graphs() as graphs,
        # Region calls whose inputs Dynamo flattened by tracing pytree, its slow path
        # ([Note: a block region's flat arguments] in module.py).
        _calls_counted("torch._dynamo.variables.invoke_subgraph", "build_fingerprint_with_pytree") as pytree_fingerprints,
        # Re-traces of a region body for its schema ([Note: a region body's schema, once per compile] in backend.py).
        _calls_counted("torch._higher_order_ops.utils", "materialize_as_graph") as body_retraces,
        block_compile_mode("regions"),  # a nested compile region per block in the one graph
    ):
        compiled_losses = _train(torch.compile(compiled, backend=backend), len(seqs), seqs=seqs)
    eager_losses = _train(eager, len(seqs), seqs=seqs)
    invoke = torch.ops.higher_order.invoke_subgraph
    # The outer forward graph (Inductor also runs the post-grad passes on each region's body).
    forward = [g for kind, g in graphs if kind == "forward" and any(n.target is invoke for n in g.graph.nodes)][-1]
    calls = [n for n in forward.graph.nodes if n.op == "call_function" and n.target is invoke]
    bodies = {n.args[0].target for n in calls}
    # Prefetch across blocks: the all-gather feeding block i+1's region runs before block i's region.
    order = [n for n in forward.graph.nodes if n.op == "call_function" and (n.target is invoke or "all_gather_into_tensor" in str(n.target))]
    first_region = next(i for i, n in enumerate(order) if n.target is invoke)
    backward = [g for kind, g in graphs if kind == "backward" and any(n.target is invoke for n in g.graph.nodes)][-1]
    return {
        "region_inputs_saved": _region_inputs_saved(forward),
        "region_parameters_saved": _region_inputs_saved(forward, parameters_only=True),
        "saved_gathered_groups": _saved_all_gather_outputs(forward),
        "regathered_groups": sorted(
            fsdp_annotation(n)[GROUP_KEY] for n in backward.graph.nodes if n.target is ALL_GATHER and fsdp_annotation(n)
        ),
        "region_calls": len(calls),
        "passes_gave_up": {name: count for name, count in pass_counters.items() if count},
        # Dynamo's traces of a region body (each later block stamps out the traced one).
        "dynamo_body_traces": len(compilation_time_metrics.get("invoke_subgraph_trace", [])) - body_traces_before,
        "distinct_bodies": len(bodies),
        "pytree_fingerprints": pytree_fingerprints,
        "body_retraces": body_retraces,
        "all_gathers_before_first_region": sum("all_gather" in str(n.target) for n in order[:first_region]),
        "eager_losses": eager_losses,
        "compiled_losses": compiled_losses,
        "param_gap": _param_gap(eager, compiled),
    }


@pytest.mark.parametrize("layers,reshard_blocks", [(2, False), (6, True)])
def test_whole_model_compiles_a_block_body_once(dist, layers, reshard_blocks):
    result = dist.run(2, _whole_model_regions, layers, "fsdp_aot_eager", reshard_blocks)[0]
    assert result["region_calls"] == layers
    assert result["passes_gave_up"] == {}, result
    # One body for all blocks; the first block's input carries no gradient, so its backward may
    # be partitioned apart (a second body), never one per block.
    assert result["distinct_bodies"] <= 2, result
    # Dynamo traces the body once: every later block stamps it out (invoke_subgraph's reuse).
    assert result["dynamo_body_traces"] == 1, result
    # Blocks called with positional tensors enter the flat region: no input flattened through pytree.
    assert result["pytree_fingerprints"] in ([0], [None]), result
    # A body is re-traced for its schema once per compile, not at each of the twelve calls.
    assert result["body_retraces"] == [None] or result["body_retraces"][0] <= 4, result
    # Bucketed per group: the root's, block 0's and block 1's all-gathers go out before block 0 runs.
    assert result["all_gathers_before_first_region"] == 3, result
    if reshard_blocks:
        # Nothing unsharded is kept for backward: every block is all-gathered again there.
        assert result["region_inputs_saved"] == 0, result
        assert result["regathered_groups"] == sorted(f"layers.{i}" for i in range(layers)), result
    else:  # kept after forward: saved (the outer all-gather's output), not gathered again
        assert result["regathered_groups"] == [] and "layers.0" in result["saved_gathered_groups"], result
    for eager, compiled in zip(result["eager_losses"], result["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-5 * abs(eager), result
    assert result["param_gap"] < 1e-5


def test_whole_model_recompiled_with_symbolic_sizes_saves_no_unsharded_parameter(dist):
    """A new sequence length recompiles with symbolic sizes: each block's body is traced on its own
    ([Note: where Dynamo's body reuse stops]) and saves a view of its input activation sized inside
    the body (``x.view(s0 * s1, dim)``, the weight gradient's operand). That activation is saved
    either way: the recompute pass leaves it and still re-gathers every block in backward (it used
    to count it as a pass that gave up)."""
    result = dist.run(2, _whole_model_regions, 2, "fsdp_aot_eager", True, True, (12, 8))[0]
    assert result["passes_gave_up"] == {}, result
    assert result["region_inputs_saved"] > 0 and result["region_parameters_saved"] == 0, result
    assert result["regathered_groups"] == ["layers.0", "layers.1"], result
    for eager, compiled in zip(result["eager_losses"], result["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-5 * abs(eager), result
    assert result["param_gap"] < 1e-5


def test_whole_model_regions_under_inductor_match_eager(dist):
    result = dist.run(2, _whole_model_regions, 2, "fsdp_inductor", True)[0]
    assert result["region_calls"] == 2 and result["distinct_bodies"] <= 2
    assert result["passes_gave_up"] == {}, result
    assert result["region_inputs_saved"] == 0 and result["regathered_groups"] == ["layers.0", "layers.1"], result
    for eager, compiled in zip(result["eager_losses"], result["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-5 * abs(eager), result
    assert result["param_gap"] < 1e-5


def _whole_model_in_block_compile_mode(mode: str):
    """Two fsdp_aot_eager steps of a 3-block model under ``config.block_compile = mode``: the forward
    graphs of block frames, the region calls, against the same model trained eagerly."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = TinyLM(n_layers=3)
    eager, compiled = _shard(copy.deepcopy(reference), MixedPrecisionPolicy()), _shard(copy.deepcopy(reference), MixedPrecisionPolicy())
    torch._dynamo.utils.counters.clear()
    with observe_graphs() as graphs, block_compile_mode(mode):
        compiled_losses = _train(torch.compile(compiled, backend="fsdp_aot_eager"), 2)
    invoke = torch.ops.higher_order.invoke_subgraph
    forwards = [g for kind, g in graphs if kind == "forward"]
    return {
        "frame_graphs": sum(
            any("(block frame)" in str((fsdp_annotation(n) or {}).get(GROUP_KEY, "")) for n in g.graph.nodes) for g in forwards
        ),
        "region_calls": sum(n.target is invoke for g in forwards for n in g.graph.nodes),
        "eager_losses": _train(eager, 2),
        "compiled_losses": compiled_losses,
        "param_gap": _param_gap(eager, compiled),
    }


@pytest.mark.parametrize("mode", ["frames", "regions", "inline"])
def test_block_compile_mode_picks_frames_regions_or_inline_blocks_and_trains_like_eager(dist, mode):
    result = dist.run(2, _whole_model_in_block_compile_mode, mode)[0]
    if mode == "frames":  # one graph for the three identical blocks' frames; no region
        assert result["frame_graphs"] == 1 and result["region_calls"] == 0, result
    elif mode == "regions":  # a region call per block in the model's graph
        assert result["frame_graphs"] == 0 and result["region_calls"] == 3, result
    else:  # every block traced inline
        assert result["frame_graphs"] == 0 and result["region_calls"] == 0, result
    assert result["compiled_losses"] == pytest.approx(result["eager_losses"], rel=1e-5), result
    assert result["param_gap"] < 1e-5, result


def test_an_unknown_block_compile_mode_is_refused_naming_the_modes():
    import fsdp_compile

    with block_compile_mode("region"), pytest.raises(ValueError, match="block_compile = 'region'.*'frames', 'regions', 'inline'"):
        fsdp_compile.config.block_compile_is("frames")


def _whole_model_under_torchs_inductor():
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = TinyLM(n_layers=3)
    eager, compiled = _shard(copy.deepcopy(reference), MixedPrecisionPolicy()), _shard(copy.deepcopy(reference), MixedPrecisionPolicy())
    body_traces_before = len(compilation_time_metrics.get("invoke_subgraph_trace", []))
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled_losses = _train(torch.compile(compiled), 2)  # torch.compile's default backend, "inductor"
    return {
        "backend_warnings": [str(w.message)[:60] for w in caught if "traces this model's FSDP" in str(w.message)],
        "eager_losses": _train(eager, 2),
        "compiled_losses": compiled_losses,
        "param_gap": _param_gap(eager, compiled),
        "dynamo_body_traces": len(compilation_time_metrics.get("invoke_subgraph_trace", [])) - body_traces_before,
        "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


def test_whole_model_under_torchs_own_inductor_traces_blocks_inline_and_trains_like_eager(dist):
    # Inductor without fsdp_inductor's patch computes wrong gradients through region calls
    # ([Note: Inductor's buffer reuse across nested regions]): 2 to 25 times off for a 2-block
    # Transformer, silently; here no block may be a region.
    result = dist.run(2, _whole_model_under_torchs_inductor)[0]
    assert result["dynamo_body_traces"] == 0, result
    # Told once what this backend skips (fsdp_inductor's checks and passes).
    assert result["backend_warnings"] == ["fsdp_compile: torch.compile(backend='inductor') traces this "], result
    for eager, compiled in zip(result["eager_losses"], result["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-5 * abs(eager), result
    assert result["param_gap"] < 1e-5, result


class _NormedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.linear(x).relu())


class _CountingBlock(nn.Linear):
    """Writes a buffer of its own in place in forward: not a norm layer's running statistics."""

    def __init__(self) -> None:
        super().__init__(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x)


def _whole_model_of_blocks_writing_buffers(block: type, frames: bool = True):
    with block_compile_mode("frames" if frames else "regions"):
        return _whole_model_of_blocks_writing_buffers_in_this_mode(block)


def _whole_model_of_blocks_writing_buffers_in_this_mode(block: type):
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 8), *(block() for _ in range(3)), nn.Linear(8, 2))

    def shard(model: nn.Sequential) -> nn.Module:
        for index in range(1, 4):
            fully_shard(model[index])
        return fully_shard(model)

    eager, compiled = shard(copy.deepcopy(reference)), shard(copy.deepcopy(reference))
    body_traces_before = len(compilation_time_metrics.get("invoke_subgraph_trace", []))
    torch._dynamo.utils.counters.clear()
    runner = torch.compile(compiled, backend="fsdp_aot_eager")
    if block is _CountingBlock:
        try:
            runner(torch.randn(6, 4)).sum().backward()
        except Exception as error:
            return {"error": str(error)}
        return {"error": None, "counts": [int(compiled[i].calls) for i in range(1, 4)]}
    for model in (runner, eager):
        generator = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(2):
            model(torch.randn(6, 4, generator=generator)).pow(2).mean().backward()
    return {
        "dynamo_body_traces": len(compilation_time_metrics.get("invoke_subgraph_trace", [])) - body_traces_before,
        "param_gap": max((a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item() for a, b in zip(compiled.parameters(), eager.parameters())),
        "running_mean_gap": max((compiled[i].norm.running_mean - eager[i].norm.running_mean).abs().max().item() for i in range(1, 4)),
    }


def test_whole_model_traces_blocks_keeping_running_stats_inline_and_matches_eager(dist):
    # A region's body may not write its buffers in place under autograd: BatchNorm blocks as
    # regions failed to compile (invoke_subgraph refuses in-place buffer mutation in training).
    result = dist.run(2, _whole_model_of_blocks_writing_buffers, _NormedBlock)[0]
    assert result["dynamo_body_traces"] == 0, result
    assert result["param_gap"] < 1e-6 and result["running_mean_gap"] < 1e-6, result


def test_a_block_region_writing_its_buffer_is_refused_with_the_way_out(dist):
    result = dist.run(2, _whole_model_of_blocks_writing_buffers, _CountingBlock, False)[0]
    assert result["error"] and 'fsdp_compile.config.block_compile = "inline"' in result["error"], result


def test_a_block_frame_writing_its_buffer_compiles_and_writes_it(dist):
    # Blocks as frames (the default): each block's frame is a graph of its own, which may write its
    # buffers in place; the region form (above) cannot.
    result = dist.run(2, _whole_model_of_blocks_writing_buffers, _CountingBlock, True)[0]
    assert result == {"error": None, "counts": [1, 1, 1]}, result


# --- whole model over blocks compiled on their own ------------------------------------------------


def _whole_model_over_compiled_blocks(form: str):
    """torch.compile(model) over blocks already compiled per block (block.compile(), or torchtitan's
    torch.compile(block) before fully_shard): Dynamo traces into each block with its hooks standing
    aside, so the block's parameter reads must trace their all-gathers rather than return shards."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = TinyLM(n_layers=3)
    eager, compiled = _shard(copy.deepcopy(reference), MixedPrecisionPolicy()), copy.deepcopy(reference)
    if form == "compiled_before_sharding":
        _compile_each_layer_in_place(compiled, backend="fsdp_aot_eager")
    compiled = _shard(compiled, MixedPrecisionPolicy())
    if form == "block_compile":
        for block in compiled.layers:
            block.compile(backend="fsdp_aot_eager")
    with observe_graphs() as graphs:
        compiled_losses = _train(torch.compile(compiled, backend="fsdp_aot_eager"), 2)
    gathered_groups = {fsdp_annotation(n)[GROUP_KEY] for kind, g in graphs if kind == "forward" for n in g.graph.nodes if n.target is ALL_GATHER}
    return {
        "eager_losses": _train(eager, 2),
        "compiled_losses": compiled_losses,
        "param_gap": _param_gap(eager, compiled),
        "gathered_groups": sorted(gathered_groups),
    }


@pytest.mark.parametrize("form", ["block_compile", "compiled_before_sharding"])
def test_whole_model_compiled_over_compiled_blocks_gathers_in_its_graph_and_trains_like_eager(dist, form):
    result = dist.run(2, _whole_model_over_compiled_blocks, form)[0]
    for eager, compiled in zip(result["eager_losses"], result["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-5 * abs(eager), result
    assert result["param_gap"] < 1e-5, result
    assert {"layers.0", "layers.1", "layers.2"} <= set(result["gathered_groups"]), result


# --- whole model: frames Dynamo runs eagerly -------------------------------------------------------


def _whole_model_with_eager_frames(case: str):
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = Transformer(TransformerConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, max_seq_len=16))
    eager, compiled = _shard(copy.deepcopy(reference), MixedPrecisionPolicy()), _shard(copy.deepcopy(reference), MixedPrecisionPolicy())
    if case == "one_block_disabled":
        compiled.layers[1].forward = torch.compiler.disable(compiled.layers[1].forward)
    previous_limit = torch._dynamo.config.recompile_limit
    if case == "recompile_limit_1":
        torch._dynamo.config.recompile_limit = 1  # the second sequence length runs the model eagerly
    runner = torch.compile(compiled, backend="fsdp_aot_eager", dynamic=False)
    # New sequence lengths only where the recompile limit is what sends frames to eager code.
    seqs = (12, 12, 8, 6, 12) if case == "recompile_limit_1" else (12, 12)
    import torch._functorch.aot_autograd as aot_autograd

    aot_module_simplified = aot_autograd.aot_module_simplified
    if case == "backend_fails":
        # What Dynamo turns into eager code: a fake-tensor error in the backend (as a data-dependent
        # .item() inside a region raised under dynamic=True).
        def failing(*args, **kwargs):
            raise torch._subclasses.fake_tensor.DataDependentOutputException(torch.ops.aten._local_scalar_dense.default)

        aot_autograd.aot_module_simplified = failing
    from fsdp_compile.runtime.state import FSDPState

    pre_forward = FSDPState._pre_forward
    eager_hooks_ran: set[str] = set()

    def recording_pre_forward(state, *args, **kwargs):
        eager_hooks_ran.add(state.label)
        return pre_forward(state, *args, **kwargs)

    FSDPState._pre_forward = recording_pre_forward
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled_losses = _train(runner, len(seqs), seqs=seqs)
            compiled_collectives = _collectives_of_a_step(runner, seqs[-1])
    finally:
        FSDPState._pre_forward = pre_forward
        torch._dynamo.config.recompile_limit = previous_limit
        aot_autograd.aot_module_simplified = aot_module_simplified
    eager_losses = _train(eager, len(seqs), seqs=seqs)
    return {
        "eager_losses": eager_losses,
        "compiled_losses": compiled_losses,
        "compiled_collectives": compiled_collectives,
        "eager_collectives": _collectives_of_a_step(eager, seqs[-1]),
        "param_gap": _param_gap(eager, compiled),
        "eager_hooks_ran": sorted(eager_hooks_ran),
        "warnings": sorted({str(w.message)[:60] for w in caught if "ran eagerly inside a compiled model" in str(w.message)}),
        "backend_warnings": sorted({str(w.message)[:90] for w in caught if "could not compile graph" in str(w.message)}),
        "told_of_the_recompile_limit": sorted(
            str(w.message).split("'")[1] for w in caught
            if "ran eagerly inside a compiled model" in str(w.message) and "torch._dynamo.config.recompile_limit (1)" in str(w.message)
        ),
    }


def _collectives_of_a_step(runner, seq: int) -> dict[str, int]:
    """Collectives of one forward and backward (no optimizer step: the parameters compared after
    training stay as they were)."""
    from benchmarks.measure import count_collectives

    tokens = _tokens(2, seq, seed=1000 + dist.get_rank())
    with count_collectives() as counts:
        next_token_loss(runner(tokens), tokens).backward()
    return dict(counts)


@pytest.mark.parametrize("case", ["one_block_disabled", "recompile_limit_1", "backend_fails"])
def test_whole_model_frames_run_eagerly_get_the_eager_hooks_and_train_like_eager(dist, case):
    result = dist.run(2, _whole_model_with_eager_frames, case)[0]
    for eager, compiled in zip(result["eager_losses"], result["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-5 * abs(eager), result
    assert result["param_gap"] < 1e-5, result
    if case == "one_block_disabled":  # the block's hooks stood aside in the graph: named, once
        # (Dynamo may run the rest of the loop over blocks eagerly too; each such block is named.)
        assert "fsdp_compile: the forward of 'layers.1' ran eagerly inside a" in result["warnings"], result
        assert "fsdp_compile: the forward of 'layers.0' ran eagerly inside a" not in result["warnings"], result
        # Its eager pre-forward hook ran (the eager hooks gathered and resharded it), not layers.0's.
        assert "layers.1" in result["eager_hooks_ran"] and "layers.0" not in result["eager_hooks_ran"], result
    elif case == "recompile_limit_1":
        # Blocks as frames: the blocks' shared frame, and the root's, meet the limit at a new sequence
        # length and run each block (and the root) eagerly, with its eager hooks, each named once.
        named = ["Transformer"] + [f"layers.{i}" for i in range(3)]
        assert result["warnings"] == [f"fsdp_compile: the forward of '{label}' ran eagerly inside a"[:60] for label in named], result
        # Each warning names the limit and the way out ([Note: a recompile limit per block structure] in backend.py).
        assert result["told_of_the_recompile_limit"] == named, result
        assert set(named) <= set(result["eager_hooks_ran"]), result
    else:  # said by the backend, with the error, not only by the modules that then ran eagerly
        assert result["backend_warnings"] and all(
            "fsdp_aot_eager could not compile graph" in w and "DataDependentOutputException" in w for w in result["backend_warnings"]
        ), result
    if case != "backend_fails":
        assert result["backend_warnings"] == [], result
    # A block whose frame runs eagerly reads the all-gather the block before it issued ahead, if any
    # (its eager hooks gathered again before: 11 all-gathers a step where eager training issues 7). Where the
    # backend fails, the root group's first read, in a small graph of its own that the backend fails
    # on too, gathers and reduces each of the root's 2 parameters alone: one of each more than eager.
    eager, compiled = result["eager_collectives"], result["compiled_collectives"]
    extra = 1 if case == "backend_fails" else 0
    assert compiled == {"all_gather": eager["all_gather"] + extra, "reduce_scatter": eager["reduce_scatter"] + extra}, result


class _IndexedBlock(nn.Module):
    """A block whose forward reads its own layer index: every block is a structure of its own."""

    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.layer_id = layer_id

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x)) / (self.layer_id + 1)


class _BreakingBlock(_IndexedBlock):
    """A block whose forward has a graph break (as a print or a data-dependent branch would)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + torch.tanh(self.proj(x))
        torch._dynamo.graph_break()
        return x * 0.5


class _CheckpointedBlocksTransformer(Transformer):
    """Each fully_shard block called under activation checkpointing, as Hugging Face's
    gradient_checkpointing_enable() calls its decoder layers."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, self.rope_cos, self.rope_sin, use_reentrant=False)
        return self.output(self.norm(x))


def _whole_model_where_dynamos_body_reuse_stops(case: str):
    """[Note: where Dynamo's body reuse stops] in module.py: twelve blocks of twelve structures
    (Dynamo keeps at most 8 reuse entries by default); [Note: a block whose body graph-breaks];
    blocks called under activation checkpointing, as regions, and under ``dynamic=True`` (every dim
    symbolic) inline ([Note: saved RNG states before opaque objects] in backend.py). Blocks as
    regions, but in the ``_under_frames`` form, where blocks compile as frames (the default) and a
    block called inside checkpoint() is a region of its caller's graph all the same (a frame cannot
    break a higher-order op's graph)."""
    with block_compile_mode("frames" if case.endswith("_under_frames") else "regions"):
        return _whole_model_where_dynamos_body_reuse_stops_as_regions(case.removesuffix("_under_frames"))


def _whole_model_where_dynamos_body_reuse_stops_as_regions(case: str):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model_class = _CheckpointedBlocksTransformer if case.endswith("checkpoint_around_blocks") else Transformer
    layers = 12 if case == "twelve_structures" else 2
    reference = model_class(TransformerConfig(vocab_size=32, dim=16, n_layers=layers, n_heads=2, max_seq_len=16))
    if case == "twelve_structures":
        reference.layers = nn.ModuleList(_IndexedBlock(i) for i in range(12))
    elif case == "body_graph_breaks":
        reference.layers = nn.ModuleList(_BreakingBlock(i) for i in range(3))
    eager, compiled = _shard(copy.deepcopy(reference), MixedPrecisionPolicy()), _shard(copy.deepcopy(reference), MixedPrecisionPolicy())
    body_traces_before = len(compilation_time_metrics.get("invoke_subgraph_trace", []))
    torch._dynamo.utils.counters.clear()
    runner = torch.compile(compiled, backend="fsdp_aot_eager", dynamic=True if case.startswith("dynamic") else None)
    # A new sequence length recompiles (with symbolic sizes) and the first one's graphs are taken again;
    # not for the twelve structures, whose every structure would compile twice.
    seqs = (12, 12) if case == "twelve_structures" else (12, 8, 12)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled_losses = _train(runner, len(seqs), seqs=seqs)
    return {
        "eager_frames": _modules_run_eagerly(caught),
        "eager_losses": _train(eager, len(seqs), seqs=seqs),
        "compiled_losses": compiled_losses,
        "param_gap": _param_gap(eager, compiled),
        "dynamo_body_traces": len(compilation_time_metrics.get("invoke_subgraph_trace", [])) - body_traces_before,
        "unique_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
    }


@pytest.mark.parametrize(
    "case",
    [
        "twelve_structures", "twelve_structures_under_frames", "body_graph_breaks", "checkpoint_around_blocks_under_frames",
        "dynamic_checkpoint_around_blocks",
    ],
)
def test_whole_model_where_dynamos_body_reuse_stops_traces_each_block_and_trains_like_eager(dist, case):
    result = dist.run(2, _whole_model_where_dynamos_body_reuse_stops, case)[0]
    for eager, compiled in zip(result["eager_losses"], result["compiled_losses"]):
        assert abs(eager - compiled) <= 1e-5 * abs(eager), result
    assert result["param_gap"] < 1e-5, result
    # Each block's body traced on its own.
    # Not counted where the body is not (only) a region trace: a body that breaks runs from a graph
    # break at its call, and a checkpointed block's region is traced inside the checkpoint's.
    if case == "twelve_structures":
        assert result["dynamo_body_traces"] >= 12, result
    if case == "twelve_structures_under_frames":
        # [Note: a recompile limit per block structure] in backend.py: each of the twelve structures
        # compiles its frame (beyond Dynamo's recompile_limit of 8 for one code object), none runs
        # eagerly; with the root's graphs, more than twelve graphs.
        assert result["eager_frames"] == [] and result["unique_graphs"] > 12, result
    if case == "checkpoint_around_blocks_under_frames":
        # Each block a region of the caller's graph: its body traced once, no block run eagerly (as
        # frames, whose graph break the checkpoint cannot hold, every block ran with its eager hooks).
        assert result["dynamo_body_traces"] >= 1 and result["eager_frames"] == [], result
    if case == "dynamic_checkpoint_around_blocks":
        # Traced inline, in the one graph: as regions, the norms' eps (a float input under
        # dynamic=True) failed AOTAutograd and Dynamo ran the root and every block eagerly; inline
        # under checkpointing, the first step failed in AOTAutograd ([Note: saved RNG states before
        # opaque objects] in backend.py).
        assert result["dynamo_body_traces"] == 0 and result["eager_frames"] == [], result


def _one_compiled_step_of_tiny_lm(cache_dir: str) -> tuple[float, dict[str, int]]:
    """One fsdp_inductor step of TinyLM (two blocks) with Inductor's cache in ``cache_dir``: (loss,
    AOTAutograd's cache counters of this process)."""
    from torch._dynamo.utils import counters

    from fsdp_testing import TinyLM

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    tokens = _tokens(2, 8, seed=dist.get_rank())  # ids below 32, inside TinyLM's 37-row vocabulary
    loss = next_token_loss(torch.compile(model, backend="fsdp_inductor")(tokens), tokens)
    loss.backward()
    return loss.item(), dict(counters["aot_autograd"])


def test_a_second_process_takes_the_compiled_graph_from_aotautograds_cache(tmp_path):
    """[Note: the traced all-gather is one op]: a restarted job finds the whole-model graph in
    AOTAutograd's cache instead of tracing and partitioning it again (an autograd.Function in the
    graph made the cache refuse it: every process missed)."""
    from conftest import DistributedPool

    runs = []
    for _ in range(2):  # two fresh processes (one rank: the cache works alike at any world size), one cache directory
        pool = DistributedPool(1)
        try:
            runs.append(pool.run(_one_compiled_step_of_tiny_lm, str(tmp_path)))
        finally:
            pool.close()
    (first_loss, first), (second_loss, second) = runs[0][0], runs[1][0]
    assert first.get("autograd_cache_hit", 0) == 0 and first.get("autograd_cache_saved", 0) >= 1, first
    assert second.get("autograd_cache_hit", 0) >= first["autograd_cache_saved"], second
    assert "autograd_cache_bypass" not in second, second
    assert second_loss == first_loss
