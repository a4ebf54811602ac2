"""PyTorch FSDP2's own training loops (its test_fully_shard_training.py patterns), each run eagerly
and with the root compiled (fsdp_aot_eager: fsdp_inductor's trace, checks and passes, numerics
equal to eager in fp32), compared with each other and with an unsharded reference."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compile
from fsdp_compile import fully_shard
from torch.distributed.device_mesh import init_device_mesh

from fsdp_testing import shard_model


def _gap(a: nn.Module, b: nn.Module) -> dict[str, float]:
    return {
        name: (x.full_tensor() - y.full_tensor()).abs().max().item()
        for (name, x), y in zip(a.named_parameters(), b.parameters())
    }


def _reference_gap(sharded: nn.Module, reference: nn.Module) -> float:
    return max(
        (x.full_tensor() - y).abs().max().item()
        for x, y in zip(sharded.parameters(), reference.parameters())
    )


def _gaps(eager: nn.Module, compiled: nn.Module, reference: nn.Module) -> dict[str, object]:
    """What each loop below returns: compiled against eager per parameter, and each against the reference."""
    return {"compiled_vs_eager": _gap(eager, compiled), "eager_vs_reference": _reference_gap(eager, reference),
            "compiled_vs_reference": _reference_gap(compiled, reference)}


# --- an output left out of the loss ----------------------------------------------------------------


class _TwoOutputs(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin1(x).relu(), self.lin2(x).relu()


def _output_left_out_of_the_loss(reshard_after_forward, backend, frames):
    torch._dynamo.reset()
    fsdp_compile.config.block_compile = "frames" if frames else "regions"
    torch.manual_seed(0)
    reference = _TwoOutputs()
    models = []
    for compiled in (False, True):
        model = copy.deepcopy(reference)
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        runner = torch.compile(model, backend=backend) if compiled else model
        models.append((model, runner, torch.optim.Adam(model.parameters(), lr=1e-2)))
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    rank, world = dist.get_rank(), dist.get_world_size()
    grads_none = []
    for step in range(10):
        generator = torch.Generator().manual_seed(step)
        batch = torch.randn(2 * world, 8, generator=generator)
        use_both = step < 3
        for model, runner, optimizer in models:
            out1, out2 = runner(batch[2 * rank: 2 * rank + 2])
            loss = out1.sum() + (out2.sum() if use_both else 0)
            loss.backward()
            if model is models[1][0]:
                grads_none.append(model.lin2.weight.grad is None)
            optimizer.step()
            optimizer.zero_grad()
        out1, out2 = reference(batch)
        ((out1.sum() + (out2.sum() if use_both else 0)) / world).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    fsdp_compile.config.block_compile = "frames"
    (eager, _, _), (compiled, _, _) = models
    return {
        "compiled_vs_eager": _gap(eager, compiled),
        "eager_vs_reference": _reference_gap(eager, reference),
        "compiled_lin2_grad_none": grads_none,
    }


@pytest.mark.parametrize(
    "reshard_after_forward, backend, frames",
    # fsdp_inductor wraps its compiled forward the same way (unreached.forget_unreached_gradients);
    # it and reshard_after_forward=False pass too, left out for the suite's time.
    [(True, "fsdp_aot_eager", True), (True, "fsdp_aot_eager", False)],
    ids=["frames", "regions"],
)
def test_an_output_left_out_of_the_loss_leaves_its_parameters_untouched_compiled_as_eagerly(dist, reshard_after_forward, backend, frames):
    result = dist.run(2, _output_left_out_of_the_loss, reshard_after_forward, backend, frames)[0]
    assert result["eager_vs_reference"] < 1e-5, result
    # Steps 3-9 leave lin2 out of the loss: no gradient, so Adam leaves it where it was.
    assert result["compiled_lin2_grad_none"] == [False] * 3 + [True] * 7, result
    assert max(result["compiled_vs_eager"].values()) == 0.0, result


# --- gradient accumulation: every sync pattern ------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 2 * dim)
        self.out_proj = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out_proj(self.in_proj(x).relu())


def _set_sync(model: nn.Module, mode: str, is_last: bool, all_reduce_only: bool) -> None:
    def sync(module: nn.Module, recurse: bool = True) -> None:
        if all_reduce_only:  # HSDP: reduce-scatter every micro-batch, all-reduce on the last
            module.set_requires_all_reduce(is_last, recurse=recurse)
        else:
            module.set_requires_gradient_sync(is_last, recurse=recurse)

    if mode == "all":
        sync(model)
    elif mode == "root_only":
        sync(model, recurse=False)
    elif mode == "some_mlps":
        for mlp in model[1:3]:
            sync(mlp)


def _gradient_accumulation(mode, reshard_after_forward, backend, hsdp=False, all_reduce_only=False):
    from benchmarks.measure import count_collectives

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), *(_MLP() for _ in range(3)))  # the root holds the first linear
    rank, world = dist.get_rank(), dist.get_world_size()
    results, collectives = [], []
    for compiled in (False, True):
        model = copy.deepcopy(reference)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
        for mlp in model[1:]:
            fully_shard(mlp, reshard_after_forward=reshard_after_forward, mesh=mesh)
        fully_shard(model, reshard_after_forward=reshard_after_forward, mesh=mesh)
        runner = torch.compile(model, backend=backend) if compiled else model
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        per_micro_batch = []  # collectives by kind, in each micro-batch's forward and backward, steps 1-3
        for step in range(4):
            for micro in range(3):
                _set_sync(model, mode, micro == 2, all_reduce_only)
                batch = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(10 * step + micro))
                # Counted from the second step: the profiler around the first one's compiles costs seconds.
                with count_collectives() if step else contextlib.nullcontext() as counts:
                    runner(batch[2 * rank: 2 * rank + 2]).sum().backward()
                if step:
                    per_micro_batch.append({kind: n for kind, n in sorted(counts.items()) if n})
            optimizer.step()
            # Kept zero gradients on every other step: accumulation with and without a .grad to add to.
            optimizer.zero_grad(set_to_none=step % 2 == 1)
        results.append(model)
        collectives.append(per_micro_batch)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(4):
        for micro in range(3):
            batch = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(10 * step + micro))
            (reference(batch).sum() / world).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=step % 2 == 1)
    return {**_gaps(*results, reference), "eager_collectives": collectives[0], "compiled_collectives": collectives[1]}


# Every mode x reshard_after_forward passes bitwise (all, root_only, some_mlps; True, False), and on
# a 2x2 HSDP mesh with set_requires_gradient_sync (all) and set_requires_all_reduce (all, root_only,
# some_mlps): _gradient_accumulation's hsdp, all_reduce_only; 15-20 s each on the shared 2-core
# machine. The suite keeps the one that mixes synced and unsynced groups in one micro-batch, for its time.
@pytest.fixture(scope="module")
def some_blocks_unsynced(dist):
    return dist.run(2, _gradient_accumulation, "some_mlps", True, "fsdp_aot_eager")[0]


def test_gradient_accumulation_with_every_sync_pattern_trains_compiled_as_eagerly(some_blocks_unsynced):
    result = some_blocks_unsynced
    assert result["eager_vs_reference"] < 1e-5, result
    assert result["compiled_vs_reference"] < 1e-5, result
    assert max(result["compiled_vs_eager"].values()) == 0.0, result
    # The same reductions in every micro-batch: no reduce-scatter where eager training skips one. The
    # all-gathers may be fewer: eagerly the root (its first linear, reading the data) re-gathers for
    # backward, which the compiled backward skips where it does not read the weight (set_unshard_in_backward's row).
    for eager, compiled in zip(result["eager_collectives"], result["compiled_collectives"], strict=True):
        assert {k: n for k, n in compiled.items() if k != "all_gather"} == {k: n for k, n in eager.items() if k != "all_gather"}, result
        assert eager["all_gather"] - 1 <= compiled["all_gather"] <= eager["all_gather"], result


def test_gradient_accumulation_with_some_blocks_unsynced_issues_no_all_gather_it_does_not_read(some_blocks_unsynced):
    """Before: block frames read without gradient sync copied in their shards' padded copies (a pad of
    no rows, detached), by which gather_in_frame (state.py) did not find them: they took no prefetch
    across frames, and the backward prefetch the next block issued for them (learned from the last
    synced micro-batch's graph) was dropped unread, one all-gather more per such micro-batch from the
    second step on: [8, 8, 7] a step where eager training issues [8, 8, 8]."""
    gathers = [counts["all_gather"] for counts in some_blocks_unsynced["compiled_collectives"]]
    # Synced or not, a micro-batch gathers every group once forward, the resharded ones again backward.
    assert len(set(gathers)) == 1 and len(gathers) == 9, gathers


# --- partial forwards: a grouped head called on its own ---------------------------------------------


class _HeadLM(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8, n_layers: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_MLP(dim) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return x if skip_head else self.output(x)


def _chunked_loss(model: nn.Module, runner, tokens: torch.Tensor, chunks: int) -> torch.Tensor:
    hidden = runner(tokens, skip_head=True)
    loss = 0.0
    for hidden_chunk, target_chunk in zip(hidden.chunk(chunks, dim=1), tokens.chunk(chunks, dim=1)):
        logits = model.output(hidden_chunk)
        loss = loss + nn.functional.cross_entropy(logits.flatten(0, 1), target_chunk.flatten(), reduction="sum")
    return loss / tokens.numel()


def _partial_forwards(tied, pattern, backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = _HeadLM(tied=tied)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for compiled in (False, True):
        model = copy.deepcopy(reference)
        for layer in model.layers:
            fully_shard(layer)
        # The head is called on its own, so it needs a group of its own: with the embedding it shares
        # its weight with, where tied.
        fully_shard([model.tok_embeddings, model.norm, model.output] if tied else [model.norm, model.output])
        fully_shard(model)
        runner = torch.compile(model, backend=backend) if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            tokens = torch.randint(0, 16, (2 * world, 8), generator=torch.Generator().manual_seed(step))[2 * rank: 2 * rank + 2]
            if pattern == "chunked":
                loss = _chunked_loss(model, runner, tokens, chunks=2)
            else:  # two partial forwards, one backward
                loss = _chunked_loss(model, runner, tokens[:1], chunks=1) + _chunked_loss(model, runner, tokens[1:], chunks=1)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        tokens = torch.randint(0, 16, (2 * world, 8), generator=torch.Generator().manual_seed(step))
        losses = []
        for r in range(world):
            local = tokens[2 * r: 2 * r + 2]
            if pattern == "chunked":
                losses.append(_chunked_loss(reference, reference, local, chunks=2))
            else:
                losses.append(_chunked_loss(reference, reference, local[:1], chunks=1) + _chunked_loss(reference, reference, local[1:], chunks=1))
        (sum(losses) / world).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    return _gaps(*results, reference)


# Each pattern passes tied and untied; the suite keeps one of the four for its time.
@pytest.mark.parametrize("tied, pattern", [(False, "chunked")])
def test_partial_forwards_with_a_grouped_head_train_compiled_as_eagerly(dist, tied, pattern):
    result = dist.run(2, _partial_forwards, tied, pattern, "fsdp_aot_eager")[0]
    assert result["eager_vs_reference"] < 1e-5, result
    assert result["compiled_vs_reference"] < 1e-5, result
    assert max(result["compiled_vs_eager"].values()) < 1e-6, result


# --- dataclass and NamedTuple activations between FSDP modules ------------------------------------


class _Carried(NamedTuple):
    hidden: torch.Tensor
    scale: torch.Tensor


@dataclasses.dataclass
class _CarriedData:
    hidden: torch.Tensor
    scale: torch.Tensor


class _CarryingBlock(nn.Module):
    def __init__(self, dim: int, as_dataclass: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)
        self.as_dataclass = as_dataclass

    def forward(self, carried):
        hidden = carried.hidden + self.proj(carried.hidden).relu() * carried.scale
        scale = torch.sigmoid(self.gate(hidden))
        return _CarriedData(hidden, scale) if self.as_dataclass else _Carried(hidden, scale)


class _CarryingModel(nn.Module):
    def __init__(self, dim: int = 8, n_layers: int = 2, as_dataclass: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(_CarryingBlock(dim, as_dataclass) for _ in range(n_layers))
        self.as_dataclass = as_dataclass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(x)
        carried = (_CarriedData if self.as_dataclass else _Carried)(hidden, torch.ones_like(hidden))
        for layer in self.layers:
            carried = layer(carried)
        return carried.hidden * carried.scale


def _structured_activations(as_dataclass, bf16):
    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = _CarryingModel(as_dataclass=as_dataclass)
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else fsdp_compile.MixedPrecisionPolicy()
    results = []
    for compiled in (False, True):
        model = shard_model(copy.deepcopy(reference), fully_shard, mp_policy=policy)
        runner = torch.compile(model, backend="fsdp_aot_eager") if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            batch = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(step))
            runner(batch[2 * rank: 2 * rank + 2]).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(model)
    moved = _reference_gap(results[0], reference)
    return {"compiled_vs_eager": _gap(*results), "moved": moved}


@pytest.mark.parametrize("as_dataclass", [True], ids=["dataclass"])
def test_structured_activations_between_fsdp_modules_train_compiled_as_eagerly_in_bf16(dist, as_dataclass):
    result = dist.run(2, _structured_activations, as_dataclass, True)[0]
    assert result["moved"] > 1e-3, result
    assert max(result["compiled_vs_eager"].values()) <= 1e-2 * result["moved"], result


# --- PyTorch's composable activation checkpointing (project issue 48) ---------------------------------


class _CheckpointedBlock(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = _MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x)).relu()


class _CheckpointedLM(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8, n_layers: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_CheckpointedBlock(dim) for _ in range(n_layers))
        self.output = nn.Linear(dim, vocab)
        if tied:  # a parameter shared by two modules
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def _composable_checkpoint(nested, hsdp=False, tied=False, frames=True, checkpoint_after=False):
    from torch.distributed._composable import checkpoint

    torch._dynamo.reset()
    fsdp_compile.config.block_compile = "frames" if frames else "regions"
    torch.manual_seed(0)
    reference = _CheckpointedLM(tied=tied)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for compiled in (False, True):
        model = copy.deepcopy(reference)
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
        for layer in model.layers:
            # test_fully_shard_training.py's test_train_parity_with_activation_checkpointing: the
            # composable checkpoint on each block, then fully_shard (on its submodules too, nested).
            if not checkpoint_after:
                checkpoint(layer)
            if nested:
                fully_shard(layer.mlp, mesh=mesh)
            fully_shard(layer, mesh=mesh)
            if checkpoint_after:  # on the sharded block, before the model's fully_shard
                checkpoint(layer)
        fully_shard(model, mesh=mesh)
        runner = torch.compile(model, backend="fsdp_aot_eager") if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            tokens = torch.randint(0, 16, (2 * world, 8), generator=torch.Generator().manual_seed(step))[2 * rank: 2 * rank + 2]
            runner(tokens).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        tokens = torch.randint(0, 16, (2 * world, 8), generator=torch.Generator().manual_seed(step))
        losses = [reference(tokens[2 * r: 2 * r + 2]).pow(2).mean() for r in range(world)]
        (sum(losses) / world).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    fsdp_compile.config.block_compile = "frames"
    return _gaps(*results, reference)


@pytest.mark.parametrize(
    "nested, tied, frames",
    # nested, shared-parameter, regions and nested regions pass too; left out for the suite's time,
    # as is checkpoint() applied after fully_shard(block) (_composable_checkpoint's checkpoint_after).
    [(False, False, True)],
    ids=["blocks"],
)
def test_composable_activation_checkpointing_trains_compiled_as_eagerly(dist, nested, tied, frames):
    result = dist.run(2, _composable_checkpoint, nested, False, tied, frames)[0]
    assert result["eager_vs_reference"] < 1e-5, result
    assert result["compiled_vs_reference"] < 1e-5, result
    assert max(result["compiled_vs_eager"].values()) < 1e-6, result


def test_composable_activation_checkpointing_with_hsdp_trains_compiled_as_eagerly(dist):
    result = dist.run(4, _composable_checkpoint, False, True)[0]
    assert result["eager_vs_reference"] < 1e-5, result
    assert result["compiled_vs_reference"] < 1e-5, result
    assert max(result["compiled_vs_eager"].values()) < 1e-6, result



# --- no collective over a shard group of one rank -------------------------------------------------


def _collectives_over_one_shard_rank(hsdp):
    """Eager and compiled training where the shard group is one rank (world size 1, or HSDP with
    (world, 1)); the c10d ops the profiler sees in the compiled steps, by kind, and the calls of the
    compiled graphs that hand a gradient to the runtime instead of returning it."""
    from torch.profiler import profile

    from fsdp_compile.compile.backend import observe_graphs
    from fsdp_compile.passes.graph import DELIVER_GRADIENT, DELIVER_REDUCE_SCATTER_LATE
    from fsdp_testing import TinyLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    world = dist.get_world_size()
    reference = TinyLM(dim=8, n_layers=2)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")) if hsdp else None
    models = []
    for compiled in (False, True):
        model = shard_model(copy.deepcopy(reference), fully_shard, mesh=mesh)
        models.append((model, torch.compile(model, backend="fsdp_aot_eager") if compiled else model))
    seen: dict[str, int] = {}
    with observe_graphs() as graphs:
        _train_over_one_shard_rank(models, seen, profile)
    deliveries = sum(
        node.target in (DELIVER_GRADIENT, DELIVER_REDUCE_SCATTER_LATE) for kind, graph in graphs if kind != "joint"
        for node in graph.graph.nodes
    )
    return {"collectives": seen, "compiled_vs_eager": _gap(models[0][0], models[1][0]), "gradient_deliveries": deliveries}


def _train_over_one_shard_rank(models, seen: dict[str, int], profile) -> None:
    for step in range(3):
        tokens = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        for index, (model, runner) in enumerate(models):
            with profile() as prof:
                runner(tokens).float().pow(2).mean().backward()
            if index == 1 and step > 0:
                for event in prof.events():
                    if event.name.startswith(("c10d::", "_c10d_functional::")) and "wait" not in event.name:
                        seen[event.name] = seen.get(event.name, 0) + 1
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None


def test_a_shard_group_of_one_rank_issues_no_collective_compiled_as_eagerly(dist):
    result = dist.run(1, _collectives_over_one_shard_rank, False)[0]
    assert result["collectives"] == {}, result  # 60 c10d ops a step before [Note: no collective over one rank]
    # Nothing in flight to hand over: the block frames' gradients are returned to autograd, not
    # delivered one parameter at a time ([Note: the cost of entering a block frame]).
    assert result["gradient_deliveries"] == 0, result
    assert max(result["compiled_vs_eager"].values()) == 0.0, result


def test_hsdp_with_shard_groups_of_one_rank_all_reduces_only_compiled_as_eagerly(dist):
    result = dist.run(2, _collectives_over_one_shard_rank, True)[0]
    assert result["collectives"] and all("all_reduce" in name or "allreduce" in name for name in result["collectives"]), result
    assert max(result["compiled_vs_eager"].values()) < 1e-6, result


# --- a compiled model that quietly was not compiled ------------------------------------------------


def _outside_the_compiled_root(case):
    """FSDP2's loops that step outside the root's forward, eagerly and with the root compiled: a block
    trained on its own after the root's steps ("non_root"), or a forward that raised midway and
    ``reset_iter_state()`` ("reset"). What each model warned of, and the gaps."""
    import warnings

    from fsdp_testing import TinyLM

    torch._dynamo.reset()
    torch.manual_seed(0)
    rank = dist.get_rank()
    reference = TinyLM(dim=8, n_layers=2)
    fail = [False]

    def raise_when_told(module, args):
        if fail[0]:
            raise RuntimeError("a step that fails midway")

    results = {"warned": [], "raised": 0}
    models = []
    for compiled in (False, True):
        model = copy.deepcopy(reference)
        model.layers[1].register_forward_pre_hook(raise_when_told)
        shard_model(model, fully_shard)
        models.append((model, torch.compile(model, backend="fsdp_aot_eager") if compiled else model))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            tokens = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(10 * step + rank))
            for model, runner in models:
                if step == 2 and case == "non_root":
                    hidden = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(rank))
                    model.layers[0](hidden).pow(2).mean().backward()
                if step == 2 and case == "reset":
                    fail[0] = True
                    try:
                        runner(tokens)
                    except RuntimeError:
                        results["raised"] += 1
                        model.reset_iter_state()
                    fail[0] = False
                runner(tokens).float().pow(2).mean().backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
    results["warned"] = [str(w.message)[:160] for w in caught if "fsdp_compile" in str(w.message)]
    results["compiled_vs_eager"] = _gap(models[0][0], models[1][0])
    return results


@pytest.mark.parametrize("case", ["non_root", "reset"])
def test_steps_outside_the_compiled_root_leave_it_compiled_and_warn_of_nothing(dist, case):
    result = dist.run(2, _outside_the_compiled_root, case)[0]
    # Before: the block trained on its own was reported as run eagerly inside the compiled model.
    assert result["warned"] == [], result
    assert result["raised"] == (2 if case == "reset" else 0), result
    assert max(result["compiled_vs_eager"].values()) == 0.0, result


# --- two compiled models in one process ------------------------------------------------------------


def _tiny_lm_sgd_step(model: nn.Module, runner, seed: int) -> float:
    """One step of a TinyLM through ``runner`` (the model or its compiled wrapper): a loss on this rank's
    tokens drawn from ``seed``, its backward, and a plain SGD update of ``model``'s parameters."""
    tokens = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    loss = runner(tokens).float().pow(2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    return loss.item()


def _two_models_interleaved():
    """Two independent models (different widths), each compiled with fsdp_aot_eager, trained step by
    step interleaved in one process, and each trained alone: the state the compiled path keeps
    (block frames, prefetch slots, recompile bookkeeping, graph checks) must not mix them up."""
    from fsdp_testing import TinyLM

    def build(dim: int):
        torch.manual_seed(dim)
        model = shard_model(TinyLM(dim=dim, n_layers=2), fully_shard)
        return model, torch.compile(model, backend="fsdp_aot_eager")

    losses = {}
    torch._dynamo.reset()
    alone = {}
    for dim in (8, 12):
        model, runner = build(dim)
        alone[dim] = [_tiny_lm_sgd_step(model, runner, 10 * s) for s in range(3)]
    torch._dynamo.reset()
    pair = {dim: build(dim) for dim in (8, 12)}
    together = {8: [], 12: []}
    for s in range(3):
        for dim, (model, runner) in pair.items():
            together[dim].append(_tiny_lm_sgd_step(model, runner, 10 * s))
    losses["alone"], losses["together"] = alone, together
    return losses


def test_two_compiled_models_trained_interleaved_each_train_as_alone(dist):
    result = dist.run(2, _two_models_interleaved)[0]
    assert result["together"] == result["alone"], result
    assert result["alone"][8] != result["alone"][12], result  # two models, not one twice


def _models_past_the_recompile_limit():
    """A model compiled whole with blocks as frames, then two with regions, in one process with
    Dynamo's recompile_limit at 2, each trained two steps as its eager twin: FSDPModule.forward is
    every root's code (and the first model's blocks'), and what earlier models compiled of it must
    not use up a later model's limit ([Note: a recompile limit per block structure] in
    compile/torch_patches.py; the regions root ran eagerly with its parameters still sharded:
    "mixed torch.Tensor and DTensor")."""
    import warnings

    from fsdp_testing import TinyLM, block_compile_mode

    def losses(dim: int, compiled: bool) -> list[float]:
        torch.manual_seed(dim)
        model = shard_model(TinyLM(dim=dim, n_layers=2), fully_shard)
        runner = torch.compile(model, backend="fsdp_aot_eager") if compiled else model
        return [_tiny_lm_sgd_step(model, runner, step) for step in range(2)]

    torch._dynamo.reset()
    result: dict = {"eager": {}, "compiled": {}, "raised": {}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dim, mode in ((8, "frames"), (12, "regions"), (16, "regions")):
            with block_compile_mode(mode, recompile_limit=2):
                result["eager"][dim] = losses(dim, compiled=False)
                try:
                    result["compiled"][dim] = losses(dim, compiled=True)
                except RuntimeError as error:
                    result["raised"][dim] = str(error)[:200]
    result["ran_eagerly"] = [str(w.message)[:200] for w in caught if "ran eagerly" in str(w.message)]
    torch._dynamo.reset()
    return result


def test_each_model_compiled_in_a_process_has_its_own_recompile_limit(dist):
    result = dist.run(2, _models_past_the_recompile_limit)[0]
    assert result["raised"] == {} and result["ran_eagerly"] == [], result
    assert result["compiled"] == result["eager"], result


# --- compiled twins of more training patterns (project issue 48) -----------------------------------
# Each loop below trains one model eagerly and one with the root compiled by fsdp_aot_eager, through
# the same steps: the compiled parameters equal eager's bitwise (fp32), the compiled steps issue the
# same collectives as the eager ones (counted with the profiler, per step), no block runs eagerly
# inside the compiled model, and both match an unsharded reference. Under fsdp_inductor (the
# functions' backend argument) the 2-D, checkpoint_wrapper and shared-and-tied loops pass too, within
# 2.4e-7 of eager with the same collectives (2026-11-27); left out of the suite for Inductor's compile time.


def _eager_and_compiled(build, loss_of, steps: int, lr: float = 0.1, backend: str = "fsdp_aot_eager") -> dict:
    """``build()``: a sharded model (a fresh copy of the same reference each call); ``loss_of(model,
    runner, step)``: the step's loss (its backward and the optimizer step are run here). The two
    trained models, each one's collectives per step from the second, and the fsdp_compile warnings of
    the compiled run."""
    import warnings

    from benchmarks.measure import count_collectives

    torch._dynamo.reset()
    result: dict = {"models": [], "collectives": [], "warned": []}
    for compiled in (False, True):
        model = build()
        runner = torch.compile(model, backend=backend) if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        per_step = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(steps):
                # Counted from the second step: the profiler around the first one's compile costs seconds.
                with count_collectives() if step else contextlib.nullcontext() as counts:
                    loss_of(model, runner, step).backward()
                if step:
                    per_step.append({kind: n for kind, n in sorted(counts.items()) if n})
                optimizer.step()
                optimizer.zero_grad()
        result["models"].append(model)
        result["collectives"].append(per_step)
        if compiled:
            result["warned"] = [str(w.message)[:200] for w in caught if "fsdp_compile" in str(w.message)]
    torch._dynamo.reset()
    return result


def _train_reference(reference: nn.Module, loss_of, steps: int, lr: float = 0.1) -> None:
    """``loss_of(step)``: the global batch's loss, the mean of the ranks' losses."""
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for step in range(steps):
        loss_of(step).backward()
        optimizer.step()
        optimizer.zero_grad()


def _twin_summary(run: dict, reference: nn.Module) -> dict:
    eager, compiled = run["models"]
    return {
        **_gaps(eager, compiled, reference),
        "eager_collectives": run["collectives"][0], "compiled_collectives": run["collectives"][1], "warned": run["warned"],
    }


def _assert_twin(result: dict, bitwise: bool = True) -> None:
    assert result["eager_vs_reference"] < 1e-5, result
    assert result["compiled_vs_reference"] < 1e-5, result
    gap = max(result["compiled_vs_eager"].values())
    assert (gap == 0.0) if bitwise else (gap < 1e-6), result
    assert result["compiled_collectives"] == result["eager_collectives"] and result["eager_collectives"][0], result
    assert result["warned"] == [], result


# --- 2-D: FSDP over tensor parallelism -------------------------------------------------------------


class _TpResidual(nn.Module):
    def __init__(self) -> None:
        from test_tensor_parallel import FeedForward

        super().__init__()
        self.feed_forward = FeedForward()  # w1, w3 colwise, w2 rowwise: HIDDEN=22 rows split unevenly

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.feed_forward(x)


class _TpModel(nn.Module):
    def __init__(self) -> None:
        from test_tensor_parallel import DIM

        super().__init__()
        self.inp = nn.Linear(DIM, DIM)  # the root's, replicated over tp
        self.layers = nn.ModuleList(_TpResidual() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _fsdp_over_tp(backend="fsdp_aot_eager"):
    """A 2x2 (dp, tp) mesh: test_tensor_parallel.py's feed-forward TP plan on each block, then
    fully_shard over mesh["dp"] (parameters on the sibling tp mesh), the root compiled."""
    from test_tensor_parallel import DIM
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    torch.manual_seed(0)
    reference = _TpModel()
    batches = [torch.randn(4, DIM, generator=torch.Generator().manual_seed(step)) for step in range(2)]
    plan = {"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}

    def build():
        model = copy.deepcopy(reference)
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], plan)
            fully_shard(layer, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])

    def loss_of(model, runner, step):  # the tp ranks of one dp index see the same rows
        return runner(batches[step].chunk(2)[dp_rank]).pow(2).mean()

    run = _eager_and_compiled(build, loss_of, steps=2, backend=backend)
    _train_reference(reference, lambda step: reference(batches[step]).pow(2).mean(), steps=2)
    return _twin_summary(run, reference)


def test_fsdp_over_tensor_parallel_on_a_2d_mesh_trains_compiled_as_eagerly(dist):
    _assert_twin(dist.run(4, _fsdp_over_tp)[0])


# --- activation checkpointing in its other two forms: checkpoint_wrapper, and checkpoint() calls -----


class _CheckpointCallingLM(_CheckpointedLM):
    """Each block called through torch.utils.checkpoint in the model's forward (Hugging Face's form)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.output(x)


def _checkpointed_twin(form: str, backend: str = "fsdp_aot_eager"):
    """``wrapper``: checkpoint_wrapper on each block, then fully_shard on the wrapper (torchtitan's
    order); ``calls``: checkpoint(block, x, use_reentrant=False) in the model's forward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    reference = (_CheckpointCallingLM if form == "calls" else _CheckpointedLM)()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [torch.randint(0, 16, (2 * world, 8), generator=torch.Generator().manual_seed(step)) for step in range(3)]

    def build():
        model = copy.deepcopy(reference)
        if form == "wrapper":
            for index, layer in enumerate(list(model.layers)):
                model.layers[index] = checkpoint_wrapper(layer)
        return shard_model(model, fully_shard)

    run = _eager_and_compiled(build, lambda model, runner, step: runner(batches[step][2 * rank: 2 * rank + 2]).pow(2).mean(), steps=3, backend=backend)
    _train_reference(reference, lambda step: sum(reference(batches[step][2 * r: 2 * r + 2]).pow(2).mean() for r in range(world)) / world, steps=3)
    return _twin_summary(run, reference)


@pytest.mark.parametrize("form", ["wrapper", "calls"])
def test_activation_checkpointing_by_wrapper_and_by_calls_trains_compiled_as_eagerly(dist, form):
    _assert_twin(dist.run(2, _checkpointed_twin, form)[0])


# --- shared and tied parameters ---------------------------------------------------------------------


class _SharingBlock(nn.Module):
    """Two linears sharing one weight (their own biases): a parameter shared inside one FSDP group."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.first = nn.Linear(dim, dim)
        self.second = nn.Linear(dim, dim)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.second(self.first(x).relu())


class _TiedLM(nn.Module):
    """The output head tied to the embedding, both in the root's group; blocks sharing a weight inside."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_SharingBlock(dim) for _ in range(2))
        self.output = nn.Linear(dim, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def _shared_and_tied_twin(backend="fsdp_aot_eager"):
    torch.manual_seed(0)
    reference = _TiedLM()
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [torch.randint(0, 16, (2 * world, 8), generator=torch.Generator().manual_seed(step)) for step in range(3)]

    def loss(model, tokens):
        return nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())

    run = _eager_and_compiled(lambda: shard_model(copy.deepcopy(reference), fully_shard), lambda model, runner, step: loss(runner, batches[step][2 * rank: 2 * rank + 2]), steps=3, backend=backend)
    _train_reference(reference, lambda step: sum(loss(reference, batches[step][2 * r: 2 * r + 2]) for r in range(world)) / world, steps=3)
    result = _twin_summary(run, reference)
    eager, compiled = run["models"]
    result["still_tied"] = [m.output.weight is m.tok_embeddings.weight and m.layers[0].second.weight is m.layers[0].first.weight for m in (eager, compiled)]
    return result


def test_shared_and_tied_parameters_train_compiled_as_eagerly(dist):
    result = dist.run(2, _shared_and_tied_twin)[0]
    assert result["still_tied"] == [True, True], result
    _assert_twin(result)
