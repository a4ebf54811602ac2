"""FSDP2 methods beyond the basics, each tested by what it changes: gradient scale, backward
all-gathers, the reduce op, a non-forward method's gathers, refusals before any collective."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compile
import fsdp_compile.collectives as collectives
from fsdp_compile import fully_shard, register_fsdp_forward_method
from fsdp_compile.models import Transformer, TransformerConfig, next_token_loss
from fsdp_testing import count_process_group_calls, max_difference, shard_model

# Untied: the embedding is a group of its own (set_unshard_in_backward below).
TINY = TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=16, tie_embeddings=False)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))


def _sharded_model(embedding_group: bool = False) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(TINY)
    if embedding_group:
        fully_shard(model.tok_embeddings)
    return shard_model(model, fully_shard)


def _grads_after_backward(model: Transformer, tokens: torch.Tensor) -> list[torch.Tensor]:
    next_token_loss(model(tokens), tokens).backward()
    return [p.grad.full_tensor() for p in model.parameters()]


def _api_effects() -> dict:
    tokens = _tokens(seed=dist.get_rank())
    default = _grads_after_backward(_sharded_model(), tokens)
    out: dict = {"world": dist.get_world_size()}

    # set_reduce_scatter_divide_factor(1.0): summed, not averaged, gradients.
    summed = _sharded_model()
    summed.set_reduce_scatter_divide_factor(1.0)
    out["summed_vs_world_times_mean"] = max_difference(_grads_after_backward(summed, tokens), [g * dist.get_world_size() for g in default])

    # set_all_reduce_hook: in place on each reduced buffer, before the post-divide (doubling here).
    hooked, calls = _sharded_model(), []
    for module in (*hooked.layers, hooked):
        module.set_all_reduce_hook(lambda reduced: (calls.append(reduced.numel()), reduced.mul_(2)))
    out["hooked_vs_twice"] = max_difference(_grads_after_backward(hooked, tokens), [2 * g for g in default])
    out["hook_calls"] = len(calls)

    # set_unshard_in_backward(False) on the embedding's group: its backward all-gather goes away.
    gathered = {}
    for unshard in (True, False):
        model = _sharded_model(embedding_group=True)
        model.tok_embeddings.set_unshard_in_backward(unshard)
        loss = next_token_loss(model(tokens), tokens)
        with fsdp_compile.record_collectives() as log:
            loss.backward()
        gathered[unshard] = sorted(r.group for r in log if r.kind == "all_gather")
        out[f"grads_unshard_{unshard}"] = [p.grad.full_tensor() for p in model.parameters()]
    out["backward_all_gathers"] = gathered
    out["unshard_in_backward_grad_gap"] = max_difference(out.pop("grads_unshard_True"), out.pop("grads_unshard_False"))

    # set_force_sum_reduction_for_comms(True): every reduce-scatter is a SUM (ours always is).
    ops = []
    original = collectives._reduce_scatter_single

    def recording(*args, **kwargs):
        ops.append(kwargs.get("op", dist.ReduceOp.SUM))
        return original(*args, **kwargs)

    forced = _sharded_model()
    forced.set_force_sum_reduction_for_comms(True)
    collectives._reduce_scatter_single = recording
    try:
        out["forced_sum_grad_gap"] = max_difference(_grads_after_backward(forced, tokens), default)
    finally:
        collectives._reduce_scatter_single = original
    out["reduce_ops"] = sorted({str(op) for op in ops})
    out["reduce_scatters"] = len(ops)

    # symm_mem / process-group buffers: refused on gloo before any collective.
    refused = _sharded_model()
    with count_process_group_calls() as calls:
        messages = []
        for call in (refused.set_symm_mem_for_comm, lambda: refused.set_allocate_memory_from_process_group_for_comm(True)):
            try:
                call()
                messages.append("")
            except NotImplementedError as error:
                messages.append(str(error))
    out["refusals"], out["calls_during_refusals"] = messages, list(calls)
    return out


def test_fsdp2_api_methods_change_what_they_say(dist):
    result = dist.run(2, _api_effects)[0]
    assert result["summed_vs_world_times_mean"] < 1e-6
    assert result["hooked_vs_twice"] < 1e-6 and result["hook_calls"] == 3  # once per group: 2 blocks + root
    # The embedding's group ("tok_embeddings") is gathered in forward only; the blocks in both.
    with_unshard, without = result["backward_all_gathers"][True], result["backward_all_gathers"][False]
    assert "tok_embeddings" in with_unshard and "tok_embeddings" not in without, result["backward_all_gathers"]
    assert sorted(without + ["tok_embeddings"]) == with_unshard
    assert result["unshard_in_backward_grad_gap"] == 0.0
    assert result["reduce_ops"] == [str(torch.distributed.ReduceOp.SUM)] and result["reduce_scatters"] == 3  # 2 blocks + root
    assert result["forced_sum_grad_gap"] == 0.0
    for message in result["refusals"]:
        assert "needs the NCCL backend and this job runs 'gloo'" in message and "Leave it out" in message, message
    assert result["calls_during_refusals"] == []


class _Encoder(nn.Module):
    """A model whose ``encode`` uses the parameters without calling ``forward``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)

    def encode(self, x):
        return torch.tanh(self.proj(x)).sum(dim=-1)


def _forward_method() -> dict:
    torch.manual_seed(0)
    reference = _Encoder()
    model = copy.deepcopy(reference)
    fully_shard(model)
    register_fsdp_forward_method(model, "encode")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    with fsdp_compile.record_collectives() as log:
        loss = model.encode(x).pow(2).mean()
        loss.backward()
    expected = reference.encode(x).pow(2).mean()
    expected.backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    mean_grads = []
    for p in reference.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        mean_grads.append(g / dist.get_world_size())
    not_fsdp = ""
    try:
        register_fsdp_forward_method(nn.Linear(2, 2), "forward")
    except ValueError as error:
        not_fsdp = str(error)
    return {
        "loss_gap": abs(loss.item() - expected.item()),
        "grad_gap": max_difference(grads, mean_grads),
        "kinds": sorted(r.kind for r in log),
        "not_fsdp": not_fsdp,
    }


def test_register_fsdp_forward_method_gathers_around_a_non_forward_method(dist):
    result = dist.run(2, _forward_method)[0]
    assert result["loss_gap"] < 1e-6 and result["grad_gap"] < 1e-6, result
    assert result["kinds"] == ["all_gather", "reduce_scatter"], result["kinds"]
    assert "not managed by fully_shard" in result["not_fsdp"]
