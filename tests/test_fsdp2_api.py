"""FSDP2 methods beyond the basics, each tested by what it changes: gradient scale, backward
all-gathers, the reduce op, a non-forward method's gathers, refusals before any collective."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compile
import fsdp_compile.runtime.collectives as collectives
from fsdp_compile import fully_shard, register_fsdp_forward_method
from fsdp_compile.models import Transformer, TransformerConfig, next_token_loss
from fsdp_testing import CountingAllGather, CountingReduceScatter, count_process_group_calls, max_difference, shard_model

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


def _step_grads(model: Transformer, tokens: torch.Tensor, log: list | None = None) -> list[torch.Tensor]:
    """One backward; ``log`` gets the length of the reductions-in-flight queue at each reduce-scatter."""
    if log is None:
        return _grads_after_backward(model, tokens)
    original = collectives.issue_reduce_scatter

    def watching(grads, padded, spec, group, comm, *rest):
        log.append(len(comm.reducing_groups))
        return original(grads, padded, spec, group, comm, *rest)

    collectives.issue_reduce_scatter = watching
    try:
        return _grads_after_backward(model, tokens)
    finally:
        collectives.issue_reduce_scatter = original


def _comm_settings_effects() -> dict:
    tokens = _tokens(seed=dist.get_rank())
    default = _grads_after_backward(_sharded_model(), tokens)
    out: dict = {}

    # set_custom_all_gather / set_custom_reduce_scatter: every collective of the module goes through them.
    custom = _sharded_model()
    gather, scatter = CountingAllGather(), CountingReduceScatter()
    for module in (*custom.layers, custom):
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
    with fsdp_compile.record_collectives() as log:
        out["custom_gap"] = max_difference(_grads_after_backward(custom, tokens), default)
    out["custom_calls"] = (gather.calls, scatter.calls)
    out["recorded"] = (sum(r.kind == "all_gather" for r in log), sum(r.kind == "reduce_scatter" for r in log))
    out["custom_allocations"] = len(gather.allocated), len(scatter.allocated)
    try:
        custom.set_custom_all_gather(lambda *args: None)
        out["not_a_comm"] = ""
    except TypeError as error:
        out["not_a_comm"] = str(error)

    # set_reduce_scatter_max_input_buffers: reductions in flight when the next one is issued.
    in_flight = {}
    for buffers in (1, 3):
        model = _sharded_model()
        model.set_reduce_scatter_max_input_buffers(buffers)
        queue: list[int] = []
        out[f"buffers_{buffers}_gap"] = max_difference(_step_grads(model, tokens, queue), default)
        in_flight[buffers] = queue
    out["in_flight"] = in_flight
    bad = []
    for value in (0, True, 1.5):
        try:
            _sharded_model().set_reduce_scatter_max_input_buffers(value)
        except ValueError as error:
            bad.append(str(error))
    out["bad_buffers"] = bad

    # set_separate_reduce_scatter_group: reduce-scatters leave on another communicator, same ranks.
    separate = _sharded_model()
    separate.set_separate_reduce_scatter_group()
    groups = {"all_gather": set(), "reduce_scatter": set()}
    originals = (collectives.all_gather_single, collectives._reduce_scatter_single)

    def spy(kind, function):
        def call(*args, **kwargs):
            groups[kind].add(kwargs["group"])
            return function(*args, **kwargs)
        return call

    collectives.all_gather_single = spy("all_gather", originals[0])
    collectives._reduce_scatter_single = spy("reduce_scatter", originals[1])
    try:
        out["separate_gap"] = max_difference(_grads_after_backward(separate, tokens), default)
    finally:
        collectives.all_gather_single, collectives._reduce_scatter_single = originals
    out["separate_groups"] = {kind: len(found) for kind, found in groups.items()}
    out["separate_distinct"] = groups["all_gather"].isdisjoint(groups["reduce_scatter"])
    out["separate_same_ranks"] = {
        tuple(dist.get_process_group_ranks(g)) for found in groups.values() for g in found
    } == {tuple(range(dist.get_world_size()))}
    return out


def test_custom_comms_buffers_in_flight_and_a_separate_reduce_scatter_group_do_what_they_say(dist):
    result = dist.run(2, _comm_settings_effects)[0]
    # 3 groups (2 blocks + root): forward gathers 3, backward re-gathers the 2 blocks; 3 reductions.
    assert result["custom_calls"] == result["recorded"] == (5, 3), result
    assert result["custom_allocations"] == (5, 6)  # reduce-scatter: input and output buffers
    assert result["custom_gap"] == 0.0
    assert "allocate(size" in result["not_a_comm"]
    assert result["in_flight"] == {1: [0, 0, 0], 3: [0, 1, 2]}, result["in_flight"]
    assert result["buffers_1_gap"] == result["buffers_3_gap"] == 0.0
    assert len(result["bad_buffers"]) == 3 and all("int >= 1" in m for m in result["bad_buffers"])
    assert result["separate_groups"] == {"all_gather": 1, "reduce_scatter": 1}
    assert result["separate_distinct"] and result["separate_same_ranks"]
    assert result["separate_gap"] == 0.0


class _Branches(nn.Module):
    """``b`` is used only where ``use_b`` (a mixture-of-experts router's choice on one rank)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        y = self.a(x)
        return y + self.b(x) if use_b else y


def _unused_params() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    inputs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    torch.manual_seed(0)
    reference = _Branches()
    model = copy.deepcopy(reference)
    fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    with fsdp_compile.record_collectives() as log:
        model(inputs[rank], use_b=rank == 0).pow(2).sum().backward()
    # The reference: the mean over ranks of each rank's loss, b used by rank 0 only.
    sum(reference(x, use_b=r == 0).pow(2).sum() for r, x in enumerate(inputs)).div(world).backward()
    numels = [r.numel for r in log if r.kind == "reduce_scatter"]
    return {
        "grad_gap": max_difference([p.grad.full_tensor() for p in model.parameters()], [p.grad for p in reference.parameters()]),
        "reduce_scatter_numels": numels,
    }


def test_reduce_scatter_unused_params_reduces_zeros_so_ranks_that_skip_a_branch_match(dist):
    by_rank = dist.run(2, _unused_params)
    # Rank 1 never used b: without the setting its reduce-scatter would be smaller than rank 0's.
    # a and b: (16 + 4) * 2 elements in the [world, per-rank shard] input, on both ranks.
    assert by_rank[0]["reduce_scatter_numels"] == by_rank[1]["reduce_scatter_numels"] == [40]
    for result in by_rank:
        assert result["grad_gap"] < 1e-6, result


def _failing_step(model: Transformer, tokens: torch.Tensor, where: str) -> None:
    """A step that raises mid-forward (in the second block) or mid-backward (between the blocks)."""
    def fail(*args):
        raise RuntimeError("injected")

    if where == "forward":
        handle = model.layers[1].register_forward_pre_hook(fail)
    else:
        def fail_in_backward(module, args, output):
            output.register_hook(fail)

        handle = model.layers[0].register_forward_hook(fail_in_backward)
    try:
        next_token_loss(model(tokens), tokens).backward()
    except RuntimeError as error:
        assert "injected" in str(error), error
    finally:
        handle.remove()


def _reset_iter_state() -> dict:
    tokens = [_tokens(seed=10 * step + dist.get_rank()) for step in range(3)]
    out: dict = {}
    for where in ("forward", "backward"):
        model, clean = _sharded_model(), _sharded_model()
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, clean)]
        for m, optimizer, batches in ((model, optimizers[0], (tokens[0], None, tokens[2])), (clean, optimizers[1], (tokens[0], tokens[2]))):
            for batch in batches:
                if batch is None:
                    _failing_step(m, tokens[1], where)
                    states = [s for s in m._fsdp_state().states_under(recurse=True)]
                    out[f"{where}_left_busy"] = any(
                        s.group.training_state != fsdp_compile.TrainingState.IDLE or s.group.is_unsharded
                        or s.training_state != fsdp_compile.TrainingState.IDLE
                        for s in states if s.group is not None
                    )
                    try:
                        m.layers[0].reset_iter_state()
                        out["non_root"] = ""
                    except RuntimeError as error:
                        out["non_root"] = str(error)
                    m.reset_iter_state()
                    out[f"{where}_all_sharded"] = all(not s.group.is_unsharded for s in states if s.group is not None)
                    optimizer.zero_grad(set_to_none=True)  # the failed step's gradients are dropped
                    continue
                next_token_loss(m(batch), batch).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        out[f"{where}_param_gap"] = max_difference(
            [p.full_tensor() for p in model.parameters()], [p.full_tensor() for p in clean.parameters()]
        )
    return out


def test_reset_iter_state_recovers_from_an_exception_mid_forward_or_mid_backward(dist):
    result = dist.run(2, _reset_iter_state)[0]
    for where in ("forward", "backward"):
        assert result[f"{where}_left_busy"], f"the injected failure in {where} left nothing to reset"
        assert result[f"{where}_all_sharded"]
        # The recovered model trains on as one that never saw the failed step.
        assert result[f"{where}_param_gap"] == 0.0, result
    assert "not the root" in result["non_root"] and "reset_iter_state" in result["non_root"]


class _Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x).tanh()
        return x


def _pipeline_stages(share: bool) -> dict:
    torch.manual_seed(0)
    stages = [_Stage(), _Stage()]
    for stage in stages:
        for block in stage.blocks:
            fully_shard(block)
        fully_shard(stage)
    if share:
        fsdp_compile.share_comm_ctx(stages)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    stages[1](stages[0](x)).pow(2).sum().backward()
    contexts = {id(s.group.comm) for stage in stages for s in stage._fsdp_state().states_under(True) if s.group is not None}
    return {"contexts": len(contexts), "grads": [p.grad.full_tensor() for stage in stages for p in stage.parameters()]}


def _share_comm_ctx() -> dict:
    own, shared = _pipeline_stages(False), _pipeline_stages(True)
    return {"contexts": (own["contexts"], shared["contexts"]), "grad_gap": max_difference(shared["grads"], own["grads"])}


def test_share_comm_ctx_gives_pipeline_stages_one_communication_context(dist):
    result = dist.run(2, _share_comm_ctx)[0]
    assert result["contexts"] == (2, 1) and result["grad_gap"] == 0.0, result
