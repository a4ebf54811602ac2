"""FSDP1's optimizer state dicts: optim_state_dict / optim_state_dict_to_load under state_dict_type."""
from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_compile
from fsdp_compile import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    StateDictType,
    optim_state_dict,
    optim_state_dict_to_load,
    state_dict_type,
)
from fsdp_compile.models import next_token_loss
from fsdp_testing import UNEVEN, build_reference, global_batches, local_part, mean_across_ranks, shard_model

# 12 rows split evenly over 1, 2 and 3 ranks: the same global batches at every world size.
GLOBAL_ROWS = 12
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _batches() -> list[torch.Tensor]:
    return global_batches(steps=STEPS_BEFORE + STEPS_AFTER, batch_per_rank=GLOBAL_ROWS // 2, world_size=2, config=UNEVEN)


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _build(seed: int = 0):
    model = shard_model(build_reference(UNEVEN, seed=seed), fsdp_compile.fully_shard)
    return model, _adamw(model)


def _train(model, optimizer, batches, sharded: bool = True) -> list[float]:
    """One optimizer step per global batch; sharded, each rank takes its slice. Global mean losses."""
    losses = []
    for batch in batches:
        rows = local_part(batch) if sharded else batch
        loss = next_token_loss(model(rows), rows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_across_ranks(loss.item()) if sharded else loss.item())
    return losses


def _trained_reference():
    """Single-process AdamW on the global batches, the first steps: its model and optimizer."""
    reference = build_reference(UNEVEN)
    optimizer = _adamw(reference)
    _train(reference, optimizer, _batches()[:STEPS_BEFORE], sharded=False)
    return reference, optimizer


def _by_name(reference: nn.Module, state_dict: dict) -> dict:
    names = [name for name, _ in reference.named_parameters()]
    return {names[index]: per_param for index, per_param in state_dict["state"].items()}


def _full(model, optimizer, rank0_only: bool = False, offload_to_cpu: bool = True) -> dict:
    config = FullOptimStateDictConfig(rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=rank0_only), config):
        return optim_state_dict(model, optimizer)


# --- full -----------------------------------------------------------------------------------------


def _full_state_matches_single_process_adamw():
    reference, reference_optimizer = _trained_reference()
    reference_state = reference_optimizer.state_dict()
    model, optimizer = _build()
    _train(model, optimizer, _batches()[:STEPS_BEFORE])
    full = _full(model, optimizer)
    expected = _by_name(reference, reference_state)
    keys_match = set(full["state"]) == set(expected) and all(set(full["state"][k]) == set(v) for k, v in expected.items())
    if not keys_match:
        return {"keys_match": False}
    worst, plain_cpu, moved = 0.0, True, True
    for fqn, per_param in expected.items():
        for name, value in per_param.items():
            mine = full["state"][fqn][name]
            plain_cpu &= type(mine) is torch.Tensor and mine.device.type == "cpu" and mine.shape == value.shape
            scale = value.abs().max().item()
            moved &= scale > 0
            # Relative to the tensor's own size: exp_avg_sq is ~1e-7, an absolute bound would not see it.
            worst = max(worst, (mine - value).abs().max().item() / max(scale, 1e-30))
    groups_match = [
        ({k: v for k, v in group.items() if k != "params"}, group["params"]) for group in full["param_groups"]
    ] == [({k: v for k, v in group.items() if k != "params"}, list(expected)) for group in reference_state["param_groups"]]
    return {"keys_match": True, "plain_cpu": plain_cpu, "worst": worst, "moved": moved, "groups_match": groups_match}


def test_full_optim_state_dict_on_every_rank_equals_single_process_adamw_state(dist):
    for rank, result in enumerate(dist.run(2, _full_state_matches_single_process_adamw)):
        assert result["keys_match"], f"rank {rank}: the full state must be keyed by parameter FQN, as AdamW's own"
        assert result["moved"], "the reference's AdamW state must have left zero for the comparison to mean something"
        # Two ranks sum gradients in another order than one process: equal up to float rounding.
        assert result["worst"] < 1e-5, f"rank {rank}: AdamW state differs from the single-process run by {result['worst']} (relative)"
        assert result["plain_cpu"], f"rank {rank}: full state must be plain full-size CPU tensors (offload_to_cpu default)"
        assert result["groups_match"], f"rank {rank}: param_groups must carry AdamW's hyperparameters and the FQNs"


def _full_state_rank0_only():
    model, optimizer = _build()
    _train(model, optimizer, _batches()[:STEPS_BEFORE])
    everywhere = _full(model, optimizer)
    rank0 = _full(model, optimizer, rank0_only=True)
    if dist.get_rank() != 0:
        return rank0 == {}
    return all(
        torch.equal(rank0["state"][fqn][name], value) for fqn, per_param in everywhere["state"].items() for name, value in per_param.items()
    ) and rank0["param_groups"] == everywhere["param_groups"]


def test_full_optim_state_dict_rank0_only_gives_other_ranks_an_empty_dict(dist):
    assert dist.run(2, _full_state_rank0_only) == [True, True], "rank 0: the full state; rank 1: {}"


class OffloadedState(NamedTuple):
    full_sharing_live_storage: list[str]  # full offloaded entries whose storage is the optimizer's own
    sharded_not_live_shards: list[str]  # sharded offloaded entries that are not the live state's shards


def _storage(tensor: torch.Tensor) -> int:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage().data_ptr()


def _offloaded_state():
    model, optimizer = _build()
    _train(model, optimizer, _batches()[:1])
    full = _full(model, optimizer, offload_to_cpu=True)
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT, optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=True)):
        sharded = optim_state_dict(model, optimizer)
    live = {fqn: optimizer.state[param] for fqn, param in model.named_parameters()}
    live_storage = {_storage(value) for per_param in live.values() for value in per_param.values()} - {0}
    full_sharing = [
        f"{fqn}.{name}" for fqn, per_param in full["state"].items() for name, value in per_param.items() if _storage(value) in live_storage
    ]
    not_live_shards = [
        f"{fqn}.{name}"
        for fqn, per_param in sharded["state"].items()
        for name, value in per_param.items()
        if type(value) is not type(live[fqn][name])
        or (isinstance(value, DTensor) and value.placements != live[fqn][name].placements)
        or not torch.equal(value, live[fqn][name])
    ]
    return OffloadedState(full_sharing, not_live_shards)


def test_optim_state_dict_offload_to_cpu_copies_the_full_state_and_returns_the_cpu_shards_as_they_are(dist):
    # On CPU (gloo) a device check cannot fail: the full dict must be a copy, the sharded one the unchanged live shards.
    for result in dist.run(2, _offloaded_state):
        assert result.full_sharing_live_storage == []
        assert result.sharded_not_live_shards == []


def _full_round_trip(rank0_only: bool):
    batches = _batches()
    model, optimizer = _build()
    _train(model, optimizer, batches[:STEPS_BEFORE])
    with state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=rank0_only), FullOptimStateDictConfig(rank0_only=rank0_only)):
        saved_model, saved_optim = model.state_dict(), optim_state_dict(model, optimizer)
    expected = _train(model, optimizer, batches[STEPS_BEFORE:])
    fresh, fresh_optimizer = _build(seed=123)  # other initial values: loading must overwrite all
    if rank0_only and dist.get_rank() != 0:
        assert saved_model == {} and saved_optim == {}
    with state_dict_type(fresh, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=rank0_only), FullOptimStateDictConfig(rank0_only=rank0_only)):
        fresh.load_state_dict(saved_model)
        to_load = optim_state_dict_to_load(fresh, fresh_optimizer, saved_optim)
    fresh_optimizer.load_state_dict(to_load)
    return {"position_keys": all(isinstance(k, int) for k in to_load["state"]), "resumed": _train(fresh, fresh_optimizer, batches[STEPS_BEFORE:]), "expected": expected}


@pytest.mark.parametrize("rank0_only", [False, True], ids=["every_rank", "rank0_broadcast"])
def test_full_optim_state_dict_loads_back_and_training_resumes_exactly(dist, rank0_only):
    result = dist.run(2, _full_round_trip, rank0_only)[0]
    assert result["position_keys"], "optim_state_dict_to_load returns position keys, as optimizer.load_state_dict expects"
    assert result["resumed"] == result["expected"]


class Resumed(NamedTuple):
    resumed_losses: list[float]  # training on after loading
    expected_losses: list[float]  # the single-process run it was saved from, training on


def _single_process_checkpoint_loads():
    reference, reference_optimizer = _trained_reference()
    model, optimizer = _build(seed=123)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(reference.state_dict())
        # Keyed by position (OptimStateKeyType.PARAM_ID), full plain tensors; a copy, as if read
        # from a file: a loaded optimizer shares its step counters with the dict, as in torch.optim.
        checkpoint = copy.deepcopy(reference_optimizer.state_dict())
        optim_state_dict_to_load(model, optimizer, checkpoint, load_directly=True)
    expected = _train(reference, reference_optimizer, _batches()[STEPS_BEFORE:], sharded=False)
    return Resumed(_train(model, optimizer, _batches()[STEPS_BEFORE:]), expected)


def test_single_process_adamw_state_dict_keyed_by_position_loads_under_full_state_dict(dist):
    result = dist.run(2, _single_process_checkpoint_loads)[0]
    assert result.resumed_losses == pytest.approx(result.expected_losses, rel=1e-5)


class Converted(NamedTuple):
    given_lr: float  # in the dict converted from the one given
    own_lr: float  # in the one converted from the optimizer's state
    same_keys: bool


def _given_dict_is_converted():
    model, optimizer = _build()
    _train(model, optimizer, _batches()[:1])
    given = optimizer.state_dict()
    given["param_groups"][0]["lr"] = 0.5
    with state_dict_type(model, StateDictType.FULL_STATE_DICT):
        converted = optim_state_dict(model, optimizer, optim_state_dict=given)
        own = optim_state_dict(model, optimizer)
    return Converted(converted["param_groups"][0]["lr"], own["param_groups"][0]["lr"], list(converted["state"]) == list(own["state"]))


def test_optim_state_dict_converts_the_given_dict_instead_of_the_optimizers(dist):
    result = dist.run(2, _given_dict_is_converted)[0]
    assert (result.given_lr, result.own_lr) == (0.5, 1e-2) and result.same_keys


# --- sharded and local ----------------------------------------------------------------------------


class SavedSharded(NamedTuple):
    all_dtensor: bool  # every non-scalar optimizer-state value saved is a DTensor
    continued_losses: list[float]  # training on after saving


def _save_sharded_and_continue(directory: str):
    batches = _batches()
    model, optimizer = _build()
    _train(model, optimizer, batches[:STEPS_BEFORE])
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": optim_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=directory)
    values = [value for per_param in state["optim"]["state"].values() for value in per_param.values() if value.dim() > 0]
    all_dtensor = bool(values) and all(isinstance(value, DTensor) for value in values)
    return SavedSharded(all_dtensor, _train(model, optimizer, batches[STEPS_BEFORE:]))


def _load_sharded_and_continue(directory: str):
    model, optimizer = _build(seed=123)
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": optim_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=directory)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(optim_state_dict_to_load(model, optimizer, state["optim"]))
    return _train(model, optimizer, _batches()[STEPS_BEFORE:])


def test_sharded_optim_state_dict_saved_at_2_ranks_resumes_at_3_like_an_uninterrupted_run(dist, tmp_path):
    saved = dist.run(2, _save_sharded_and_continue, str(tmp_path))[0]
    assert saved.all_dtensor, "a sharded optimizer state dict holds DTensors"
    expected = saved.continued_losses
    resumed = dist.run(3, _load_sharded_and_continue, str(tmp_path))[0]
    # Three ranks sum gradients in another order: equal up to float rounding, not bitwise.
    assert resumed == pytest.approx(expected, rel=1e-5), (resumed, expected)


class LocalOptimState(NamedTuple):
    same: bool  # LOCAL_STATE_DICT's optimizer half equals the sharded one
    reloaded: bool  # loading it back restored the optimizer's state


def _local_is_sharded():
    model, optimizer = _build()
    _train(model, optimizer, _batches()[:1])
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT, optim_state_dict_config=ShardedOptimStateDictConfig(offload_to_cpu=False)):
        sharded = optim_state_dict(model, optimizer)
    with state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = optim_state_dict(model, optimizer)
        before = copy.deepcopy(local)
        optimizer.load_state_dict(optim_state_dict_to_load(model, optimizer, local))
    same = all(
        type(local["state"][fqn][name]) is type(value) and torch.equal(local["state"][fqn][name], value)
        for fqn, per_param in sharded["state"].items()
        for name, value in per_param.items()
    )
    reloaded = all(torch.equal(optimizer.state[param]["exp_avg"], before["state"][fqn]["exp_avg"]) for fqn, param in model.named_parameters())
    return LocalOptimState(same, reloaded)


def test_local_optim_state_dict_is_the_sharded_one_as_in_fsdp1(dist):
    for result in dist.run(2, _local_is_sharded):
        assert result.same, "LOCAL_STATE_DICT's optimizer half must equal the sharded one (FSDP1 treats it so)"
        assert result.reloaded


# --- errors ---------------------------------------------------------------------------------------


def _refused(case: str) -> str:
    model, optimizer = _build()
    _train(model, optimizer, _batches()[:1])
    try:
        if case == "wrong_config_class":
            state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(), ShardedOptimStateDictConfig())
        elif case == "plain_tensors_under_sharded":
            full = _full(model, optimizer)
            optim_state_dict_to_load(model, optimizer, full)
        elif case == "dtensors_under_full":
            sharded = optim_state_dict(model, optimizer)
            with state_dict_type(model, StateDictType.FULL_STATE_DICT):
                optim_state_dict_to_load(model, optimizer, sharded)
        elif case == "mixed_keys":
            sharded = optim_state_dict(model, optimizer)
            sharded["state"][0] = sharded["state"].pop(next(iter(sharded["state"])))
            optim_state_dict_to_load(model, optimizer, sharded)
        elif case == "mixed_keys_on_rank0_with_rank0_only":
            configs = (FullStateDictConfig(rank0_only=True), FullOptimStateDictConfig(rank0_only=True))
            with state_dict_type(model, StateDictType.FULL_STATE_DICT, *configs):
                full = optim_state_dict(model, optimizer)
                if dist.get_rank() == 0:
                    full["state"][0] = full["state"].pop(next(iter(full["state"])))
                optim_state_dict_to_load(model, optimizer, full)  # rank 1 passes {}: must raise, not wait
    except (ValueError, TypeError) as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "case, named",
    [
        ("wrong_config_class", "optim_state_dict_config=FullOptimStateDictConfig(...), got ShardedOptimStateDictConfig"),
        ("plain_tensors_under_sharded", "StateDictType.FULL_STATE_DICT"),
        ("dtensors_under_full", "StateDictType.SHARDED_STATE_DICT"),
        ("mixed_keys", "OptimStateKeyType.PARAM_NAME"),
        ("mixed_keys_on_rank0_with_rank0_only", "OptimStateKeyType.PARAM_NAME"),
    ],
)
def test_bad_optim_state_dict_input_raises_error_naming_the_fix(dist, case, named):
    for message in dist.run(2, _refused, case):
        assert named in message, message


def test_model_without_fully_shard_raises_error_naming_the_fix():
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="no fully_shard module in this Linear; apply fully_shard"):
        optim_state_dict(model, torch.optim.AdamW(model.parameters()))


def test_unknown_key_type_raises_error_naming_the_key_types():
    model = nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="OptimStateKeyType.PARAM_NAME"):
        fsdp_compile.rekey_optim_state_dict(optimizer.state_dict(), "names", model, optim=optimizer)


def test_rekey_between_positions_and_original_names_also_through_torch_compile_wrapper():
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    by_position = optimizer.state_dict()
    named = fsdp_compile.rekey_optim_state_dict(by_position, OptimStateKeyType.PARAM_NAME, torch.compile(model), optim=optimizer)
    assert named["param_groups"][0]["params"] == ["0.weight", "0.bias"]  # no "_orig_mod."
    back = fsdp_compile.rekey_optim_state_dict(named, OptimStateKeyType.PARAM_ID, model, optim=optimizer)
    assert back == by_position
