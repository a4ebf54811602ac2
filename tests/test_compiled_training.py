"""Compiled training as real loops run it: per-rank shapes and rank-local recompiles, evaluation
mid-training, checkpointed blocks, gradient clipping and accumulation, skipped blocks, an
optimizer built too early; each under fsdp_inductor against our eager runtime."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp_compile
from fsdp_compile import fully_shard
from fsdp_compile.models import Transformer, TransformerConfig, next_token_loss
from fsdp_testing import shard_model

# Two small blocks: enough for prefetch across groups, cheap to compile on 2 cores.
TINY = TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=16)


def _tokens(rows: int, seq: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, TINY.vocab_size, (rows, 1), generator=generator)
    return (start + torch.arange(seq)) % TINY.vocab_size


def _pair():
    """Our eager model and an identical one to compile, sharded the same way."""
    torch.manual_seed(0)
    reference = Transformer(TINY)
    return shard_model(copy.deepcopy(reference), fully_shard), shard_model(copy.deepcopy(reference), fully_shard)


def _sgd_step(model, runner, tokens, optimizer) -> float:
    loss = next_token_loss(runner(tokens), tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _max_param_gap(a, b) -> float:
    return max((x.full_tensor() - y.full_tensor()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


# --- per-rank shapes: rank-local recompiles --------------------------------------------------------


def _per_rank_shapes(dynamic):
    torch._dynamo.reset()
    rank = dist.get_rank()
    eager, compiled = _pair()
    runner = torch.compile(compiled, backend="fsdp_inductor", dynamic=dynamic)
    # (rows, seq) per step and rank: rank 1's batch grows, then rank 0's sequence shrinks, then a
    # smaller last batch on every rank.
    plan = [((2, 12), (2, 12)), ((2, 12), (3, 12)), ((2, 8), (3, 12)), ((1, 12), (1, 12))]
    eager_opt, compiled_opt = torch.optim.SGD(eager.parameters(), lr=0.1), torch.optim.SGD(compiled.parameters(), lr=0.1)
    graphs, losses = [], []
    for step, shapes in enumerate(plan):
        tokens = _tokens(*shapes[rank], seed=10 * step + rank)
        losses.append((_sgd_step(eager, eager, tokens, eager_opt), _sgd_step(compiled, runner, tokens, compiled_opt)))
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return {"graphs_after_each_step": graphs, "losses": losses, "param_gap": _max_param_gap(eager, compiled)}


@pytest.mark.parametrize("dynamic", [None, False, True])
def test_per_rank_shapes_recompile_on_that_rank_only_and_train_like_eager(dist, dynamic):
    rank0, rank1 = dist.run(2, _per_rank_shapes, dynamic)
    for result in (rank0, rank1):
        for step, (eager, compiled) in enumerate(result["losses"]):
            assert abs(eager - compiled) <= 1e-5 * abs(eager), (step, eager, compiled)
        assert result["param_gap"] < 1e-5
    if dynamic is not True:
        # Step 1 changes rank 1's shape only: only rank 1 compiles again (rank-local recompile).
        assert rank0["graphs_after_each_step"][1] == rank0["graphs_after_each_step"][0]
        assert rank1["graphs_after_each_step"][1] > rank1["graphs_after_each_step"][0]
