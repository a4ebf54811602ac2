"""FSDP1 names (ShardingStrategy, BackwardPrefetch, MixedPrecision, CPUOffload) and CPU offload."""
from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import fsdp_compile
from fsdp_compile import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, fsdp1_kwargs
from fsdp_compile.models import next_token_loss
from fsdp_compile.runtime.state import state_of
from fsdp_testing import (
    SMALL, build_reference, global_batches, local_part, max_param_difference, train_reference, train_sharded,
)

LOSS_RTOL = 1e-6
PARAM_ATOL = 1e-5


def _shard_fsdp1_style(model, **fsdp1_config):
    kwargs = fsdp1_kwargs(**fsdp1_config)
    for layer in model.layers:
        fsdp_compile.fully_shard(layer, **kwargs)
    fsdp_compile.fully_shard(model, **kwargs)
    return model


class StrategyParity(NamedTuple):
    losses: list[float]  # global loss per step, sharded
    reference_losses: list[float]  # the unsharded model's
    max_param_gap: float  # between the sharded and the reference parameters after training
    layers_unsharded_after_forward: list[bool]
    shard_sizes: set[int]  # ranks each block's parameters are sharded over


def _strategy_parity(strategy_name: str):
    from torch.distributed.device_mesh import init_device_mesh

    strategy = ShardingStrategy[strategy_name]
    mesh = None
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
    batches = global_batches(steps=3, batch_per_rank=2, world_size=dist.get_world_size())
    reference = build_reference()
    model = _shard_fsdp1_style(copy.deepcopy(reference), sharding_strategy=strategy, device_mesh=mesh)
    tokens = local_part(batches[0])
    model(tokens)
    layers_unsharded_after_forward = [state_of(layer).group.is_unsharded for layer in model.layers]
    model.reshard()
    for layer in model.layers:
        layer.reshard()
    shard_sizes = {state_of(layer).group.mesh_info.shard_size for layer in model.layers}
    reference_losses = train_reference(reference, batches, "adamw")
    losses = train_sharded(model, batches, "adamw")
    return StrategyParity(losses, reference_losses, max_param_difference(model, reference), layers_unsharded_after_forward, shard_sizes)


@pytest.mark.parametrize(
    "strategy, keeps_params_after_forward, shard_size",
    [
        ("FULL_SHARD", False, 4),
        ("SHARD_GRAD_OP", True, 4),
        ("NO_SHARD", True, 1),
        ("HYBRID_SHARD", False, 2),
        ("_HYBRID_SHARD_ZERO2", True, 2),
    ],
)
def test_sharding_strategy_trains_like_reference_with_its_documented_layout(dist, strategy, keeps_params_after_forward, shard_size):
    results = dist.run(4, _strategy_parity, strategy)
    first = results[0]
    for rank_result in results:
        assert rank_result.losses == first.losses, "ranks disagree on the global loss"
    for step, (ours, ref) in enumerate(zip(first.losses, first.reference_losses)):
        assert abs(ours - ref) <= LOSS_RTOL * abs(ref), f"step {step}: loss {ours} vs reference {ref}"
    assert first.max_param_gap <= PARAM_ATOL
    assert first.layers_unsharded_after_forward == [keeps_params_after_forward] * SMALL.n_layers
    assert first.shard_sizes == {shard_size}


def _backward_log(mode_name: str | None):
    mode = None if mode_name is None else BackwardPrefetch[mode_name]
    model = _shard_fsdp1_style(build_reference(), sharding_strategy=ShardingStrategy.FULL_SHARD)
    model.set_backward_prefetch(mode)
    tokens = local_part(global_batches(1, 2, dist.get_world_size())[0])
    with fsdp_compile.record_collectives() as log:
        loss = next_token_loss(model(tokens), tokens)
        # Compute markers in the same log, so prefetch order is visible against the hooks.
        for layer in model.layers:
            state = state_of(layer)
            for hook in ("_pre_backward", "_post_backward"):
                original = getattr(state, hook)

                def marked(original=original, hook=hook, label=state.label):
                    log.append(("hook", hook, label))
                    return original()

                setattr(state, hook, marked)
        start = len(log)
        loss.backward()
    entries = []
    for entry in log[start:]:
        if isinstance(entry, tuple):
            entries.append(entry)
        else:
            entries.append((entry.kind, entry.reason, entry.group))
    return entries


def test_backward_prefetch_pre_issues_next_all_gather_before_current_gradient_computation(dist):
    log = dist.run(2, _backward_log, "BACKWARD_PRE")[0]
    prefetch = log.index(("all_gather", "backward-prefetch", "layers.1"))
    assert log.index(("hook", "_pre_backward", "layers.2")) < prefetch < log.index(("hook", "_post_backward", "layers.2"))


def test_backward_prefetch_post_issues_next_all_gather_right_before_current_reduce_scatter(dist):
    log = dist.run(2, _backward_log, "BACKWARD_POST")[0]
    prefetch = log.index(("all_gather", "backward-prefetch", "layers.1"))
    post_backward = log.index(("hook", "_post_backward", "layers.2"))
    assert post_backward < prefetch
    assert log[prefetch + 1] == ("reduce_scatter", "backward", "layers.2")


def test_backward_prefetch_none_never_prefetches_in_backward(dist):
    log = dist.run(2, _backward_log, None)[0]
    assert not any(entry[1] == "backward-prefetch" for entry in log)
    assert ("all_gather", "backward", "layers.1") in log


def _mixed_precision_mapping():
    batches = global_batches(steps=2, batch_per_rank=2, world_size=dist.get_world_size())
    reference = build_reference()
    fsdp1 = _shard_fsdp1_style(
        copy.deepcopy(reference), mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    )
    policy = fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp2 = copy.deepcopy(reference)
    for layer in fsdp2.layers:
        fsdp_compile.fully_shard(layer, mp_policy=policy)
    fsdp_compile.fully_shard(fsdp2, mp_policy=policy)
    return train_sharded(fsdp1, batches, "adamw") == train_sharded(fsdp2, batches, "adamw")


def test_fsdp1_mixed_precision_equals_the_matching_policy(dist):
    assert all(dist.run(2, _mixed_precision_mapping))


def test_fsdp1_mixed_precision_without_fsdp2_counterpart_is_refused():
    with pytest.raises(ValueError, match="buffer_dtype"):
        MixedPrecision(buffer_dtype=torch.bfloat16).to_policy()
    with pytest.raises(ValueError, match="keep_low_precision_grads"):
        MixedPrecision(keep_low_precision_grads=True).to_policy()


def test_fsdp1_cpu_offload_maps_to_offload_policies():
    assert isinstance(CPUOffload(offload_params=True).to_policy(), fsdp_compile.CPUOffloadPolicy)
    assert type(CPUOffload().to_policy()) is fsdp_compile.OffloadPolicy


# --- CPU offload ----------------------------------------------------------------------------------


def _cpu_offload_contract():
    batches = global_batches(steps=3, batch_per_rank=2, world_size=dist.get_world_size())
    reference = build_reference()
    plain = _shard_fsdp1_style(copy.deepcopy(reference))
    offloaded = _shard_fsdp1_style(copy.deepcopy(reference), cpu_offload=CPUOffload(offload_params=True))
    fsdp_params = [p for layer in [*offloaded.layers, offloaded] for p in state_of(layer).group.fsdp_params]
    plain_losses = train_sharded(plain, batches, "adamw")
    losses = train_sharded(offloaded, batches, "adamw")
    # On a CPU mesh the device is the CPU, so where tensors live says nothing here (a GPU run
    # checks that); what holds everywhere is the policy reaching every parameter, pinning only
    # with CUDA, and training exactly like the plain model.
    return {
        "policy_on_every_parameter": all(p.offload_to_cpu and p.pin_memory for p in fsdp_params),
        "pinned_only_with_cuda": all(p.local_shard().is_pinned() == torch.cuda.is_available() for p in fsdp_params),
        "same_losses": losses == plain_losses,
        "same_parameters": all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(offloaded.parameters(), plain.parameters())),
    }


def test_cpu_offload_policy_reaches_every_parameter_and_trains_identically(dist):
    for result in dist.run(2, _cpu_offload_contract):
        assert all(result.values()), result
