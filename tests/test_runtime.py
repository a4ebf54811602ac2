"""Behaviour of the eager runtime: memory, prefetch order, state machines, FSDPModule methods."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_compile
from fsdp_compile import FSDPModule, fully_shard
from fsdp_compile.models import next_token_loss
from fsdp_testing import SMALL, build_reference, global_batches, local_part, shard_model, sharded_copy


def _groups(model):
    return [m._fsdp_state().group for m in model.modules() if isinstance(m, FSDPModule) and m._fsdp_state().group is not None]


class StorageAfterForward(NamedTuple):
    layer_bytes: list[int]  # unsharded storage each block holds after forward
    layer_states: list[str]  # each block's sharded state after forward
    registered_is_dtensor: bool  # the first block's registered parameters after forward
    after_backward: list[int]  # unsharded storage each block holds after backward


def _storage_after_forward(reshard_after_forward: bool):
    model = shard_model(build_reference(), fully_shard, reshard_after_forward=reshard_after_forward)
    tokens = local_part(global_batches(1, 2, dist.get_world_size())[0])
    logits = model(tokens)
    layer_bytes = [layer._fsdp_state().group.unsharded_storage_bytes() for layer in model.layers]
    layer_states = [layer._fsdp_state().group.sharded_state.name for layer in model.layers]
    registered_is_dtensor = all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.layers[0].parameters())
    next_token_loss(logits, tokens).backward()
    after_backward = [layer._fsdp_state().group.unsharded_storage_bytes() for layer in model.layers]
    return StorageAfterForward(layer_bytes, layer_states, registered_is_dtensor, after_backward)


def test_reshard_after_forward_frees_unsharded_storage(dist):
    result = dist.run(2, _storage_after_forward, True)[0]
    assert result.layer_bytes == [0] * SMALL.n_layers
    assert result.layer_states == ["SHARDED"] * SMALL.n_layers
    assert result.registered_is_dtensor
    assert result.after_backward == [0] * SMALL.n_layers


def test_no_reshard_after_forward_keeps_unsharded_storage(dist):
    result = dist.run(2, _storage_after_forward, False)[0]
    reference_block_bytes = sum(p.numel() * p.element_size() for p in build_reference().layers[0].parameters())
    assert result.layer_bytes == [reference_block_bytes] * SMALL.n_layers
    assert result.layer_states == ["UNSHARDED"] * SMALL.n_layers
    assert not result.registered_is_dtensor
    assert result.after_backward == [0] * SMALL.n_layers  # reshard_after_backward defaults to True


class StepCollectives(NamedTuple):
    first_step: list[tuple[str, str, str]]  # (kind, group, reason) in issue order
    second_step: list[tuple[str, str, str]]


def _collective_order():
    model = shard_model(build_reference(), fully_shard)
    batches = global_batches(2, 2, dist.get_world_size())
    logs = []
    for batch in batches:
        tokens = local_part(batch)
        with fsdp_compile.record_collectives() as log:
            next_token_loss(model(tokens), tokens).backward()
        logs.append([(r.kind, r.group, r.reason) for r in log])
    first_step, second_step = logs
    return StepCollectives(first_step, second_step)


def test_all_gather_and_reduce_scatter_order_follows_the_prefetch_design(dist):
    steps = dist.run(2, _collective_order)[0]
    AG, RS = "all_gather", "reduce_scatter"
    # Step 2 prefetches in forward along the order recorded in step 1 (root, layers.0, .1, .2);
    # backward prefetches in reverse post-forward order; the root keeps its parameters after
    # forward, and its reduce-scatter waits for the end-of-backward callback (its inputs are ids).
    backward = [
        (AG, "layers.2", "backward-prefetch"), (AG, "layers.1", "backward-prefetch"), (RS, "layers.2", "backward"),
        (AG, "layers.0", "backward-prefetch"), (RS, "layers.1", "backward"), (RS, "layers.0", "backward"),
        (RS, "Transformer", "backward"),
    ]
    assert steps.second_step == [
        (AG, "Transformer", "forward"), (AG, "layers.0", "forward-prefetch"), (AG, "layers.1", "forward-prefetch"),
        (AG, "layers.2", "forward-prefetch"),
    ] + backward
    # Step 1 has no recorded order yet: every forward all-gather is issued by its own module.
    assert steps.first_step == [(AG, "Transformer", "forward"), (AG, "layers.0", "forward"), (AG, "layers.1", "forward"), (AG, "layers.2", "forward")] + backward


def _states_during_step():
    model = shard_model(build_reference(), fully_shard)
    tokens = local_part(global_batches(1, 2, dist.get_world_size())[0])
    seen = {}

    def record(name):
        def hook(module, args, output=None):
            group = module._fsdp_state().group
            seen.setdefault(name, []).append((group.training_state.name, group.sharded_state.name))
        return hook

    model.layers[1].register_forward_pre_hook(record("pre_forward"))  # runs after ours (prepended)
    logits = model(tokens)
    seen["after_forward"] = [(g.training_state.name, g.sharded_state.name) for g in _groups(model)]
    next_token_loss(logits, tokens).backward()
    seen["after_backward"] = [(g.training_state.name, g.sharded_state.name) for g in _groups(model)]
    return seen


def test_groups_walk_the_named_state_machines(dist):
    seen = dist.run(2, _states_during_step)[0]
    assert seen["pre_forward"] == [("FORWARD", "UNSHARDED")]
    # The root keeps its parameters (reshard_after_forward=None means False for the root).
    assert seen["after_forward"] == [("IDLE", "UNSHARDED")] + [("IDLE", "SHARDED")] * SMALL.n_layers
    assert seen["after_backward"] == [("IDLE", "SHARDED")] * (SMALL.n_layers + 1)


class ExplicitUnshard(NamedTuple):
    unsharded: list[str]  # the block's parameter types after unshard
    full_shapes: list[tuple[int, ...]]  # and their shapes
    resharded: list[str]  # the parameter types after reshard
    collectives: list[tuple[str, str]]  # (kind, reason)


def _explicit_unshard_and_reshard():
    model = shard_model(build_reference(), fully_shard)
    layer = model.layers[0]
    with fsdp_compile.record_collectives() as log:
        handle = layer.unshard(async_op=True)
        handle.wait()
    unsharded = [type(p).__name__ for p in layer.parameters()]
    full_shapes = [tuple(p.shape) for p in layer.parameters()]
    layer.reshard()
    resharded = [type(p).__name__ for p in layer.parameters()]
    return ExplicitUnshard(unsharded, full_shapes, resharded, [(r.kind, r.reason) for r in log])


def test_explicit_unshard_async_then_reshard(dist):
    result = dist.run(2, _explicit_unshard_and_reshard)[0]
    reference_shapes = [tuple(p.shape) for p in build_reference().layers[0].parameters()]
    assert set(result.unsharded) == {"Parameter"} and result.full_shapes == reference_shapes
    assert set(result.resharded) == {"DTensor"}
    assert result.collectives == [("all_gather", "explicit")]


class TiedFrozenBuffers(NamedTuple):
    tied: bool  # output and embedding weights are one parameter after sharding
    buffer_kept: bool  # the RoPE buffer stayed a plain, unchanged tensor
    frozen_grad_is_none: bool
    tied_grad_error: float  # against the unsharded model's gradient of the tied weight
    tied_after: bool  # still one parameter after a step


def _tied_frozen_and_buffers():
    reference = build_reference()
    model = sharded_copy(reference)
    model.layers[0].attention.wq.weight.requires_grad_(False)
    reference.layers[0].attention.wq.weight.requires_grad_(False)
    buffer_before = model.rope_cos.clone()
    shard_model(model, fully_shard)
    tied = model.output.weight is model.tok_embeddings.weight
    buffer_kept = type(model.rope_cos) is torch.Tensor and torch.equal(model.rope_cos, buffer_before)
    tokens = global_batches(1, 2, dist.get_world_size())[0]
    local = local_part(tokens)
    next_token_loss(model(local), local).backward()
    next_token_loss(reference(tokens), tokens).backward()
    frozen_grad_is_none = model.layers[0].attention.wq.weight.grad is None
    tied_grad = model.tok_embeddings.weight.grad.full_tensor()
    tied_grad_error = (tied_grad - reference.tok_embeddings.weight.grad).abs().max().item()
    tied_after = model.output.weight is model.tok_embeddings.weight
    return TiedFrozenBuffers(tied, buffer_kept, frozen_grad_is_none, tied_grad_error, tied_after)


def test_tied_frozen_parameters_and_buffers(dist):
    for result in dist.run(2, _tied_frozen_and_buffers):
        assert result.tied and result.tied_after, "tied weights must stay one parameter"
        assert result.buffer_kept, "buffers are not sharded"
        assert result.frozen_grad_is_none
        # The tied weight's gradient sums embedding and head contributions, as unsharded.
        assert result.tied_grad_error < 1e-6


class DeferredBackward(NamedTuple):
    kept: list[str]  # each group's sharded state after a backward with reshard_after_backward=False
    forward_gathers: int  # all-gathers in the forward that follows
    pending_after_backward: int  # reductions held back by set_is_last_backward(False)
    pending_after_forward: int  # still held back after the next forward
    grads_present: bool


def _last_backward_and_reshard_after_backward():
    model = shard_model(build_reference(), fully_shard)
    tokens = local_part(global_batches(1, 2, dist.get_world_size())[0])
    model.set_reshard_after_backward(False)
    next_token_loss(model(tokens), tokens).backward()
    kept = [g.sharded_state.name for g in _groups(model)]
    with fsdp_compile.record_collectives() as log:
        model(tokens)  # parameters still unsharded: no all-gather needed
    forward_gathers = len([r for r in log if r.kind == "all_gather"])
    model.set_reshard_after_backward(True)
    for group in _groups(model):
        group.reshard()
    model.zero_grad()
    model.set_is_last_backward(False)
    next_token_loss(model(tokens), tokens).backward()
    pending_after_backward = len(model._fsdp_state().comm.reducing_groups)
    model.set_is_last_backward(True)
    model(tokens)  # the next forward lands the deferred reduction
    pending_after_forward = len(model._fsdp_state().comm.reducing_groups)
    model.reshard()  # the root keeps unsharded parameters registered after forward
    grads_present = all(p.grad is not None for p in model.parameters())
    return DeferredBackward(kept, forward_gathers, pending_after_backward, pending_after_forward, grads_present)


def test_reshard_after_backward_false_and_deferred_last_backward(dist):
    result = dist.run(2, _last_backward_and_reshard_after_backward)[0]
    assert result.kept == ["UNSHARDED"] * (SMALL.n_layers + 1)
    assert result.forward_gathers == 0
    assert result.pending_after_backward == 1 and result.pending_after_forward == 0
    assert result.grads_present


def _divide_factor_and_post_optim_event():
    world = dist.get_world_size()
    reference = build_reference()
    model = shard_model(sharded_copy(reference), fully_shard)
    model.set_gradient_divide_factor(1.0)  # sum instead of average
    model.set_post_optim_event(torch.Event())  # CPU: accepted, nothing to wait for
    tokens = global_batches(1, 2, world)[0]
    local = local_part(tokens)
    next_token_loss(model(local), local).backward()
    # Reference of a sum: each rank's local-mean gradient, summed over ranks.
    grads = []
    for rank in range(world):
        reference.zero_grad()
        part = local_part(tokens, rank, world)
        next_token_loss(reference(part), part).backward()
        grads.append(reference.layers[0].attention.wq.weight.grad.clone())
    expected = sum(grads)
    got = model.layers[0].attention.wq.weight.grad.full_tensor()
    return (got - expected).abs().max().item()


def test_gradient_divide_factor_one_sums_gradients(dist):
    assert max(dist.run(2, _divide_factor_and_post_optim_event)) < 1e-6


class HsdpAllReduce(NamedTuple):
    skipped: list[str]  # collective kinds in a backward with set_requires_all_reduce(False)
    no_grads: bool  # no gradient landed then
    synced: list[str]  # collective kinds in a backward with it True again
    grads: bool  # every parameter has a gradient then


def _hsdp_requires_all_reduce_false():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard_model(build_reference(), fully_shard, mesh=mesh)
    tokens = local_part(global_batches(1, 2, 4)[0])
    model.set_requires_all_reduce(False)
    with fsdp_compile.record_collectives() as skipped:
        next_token_loss(model(tokens), tokens).backward()
    no_grads = all(p.grad is None for p in model.parameters())
    model.set_requires_all_reduce(True)
    with fsdp_compile.record_collectives() as synced:
        next_token_loss(model(tokens), tokens).backward()
    kinds = lambda log: sorted({r.kind for r in log})
    return HsdpAllReduce(kinds(skipped), no_grads, kinds(synced), all(p.grad is not None for p in model.parameters()))


def test_hsdp_defers_all_reduce_when_not_required(dist):
    result = dist.run(4, _hsdp_requires_all_reduce_false)[0]
    assert result.skipped == ["all_gather", "reduce_scatter"] and result.no_grads
    assert result.synced == ["all_gather", "all_reduce", "reduce_scatter"] and result.grads


class ClassSwap(NamedTuple):
    same: bool  # fully_shard returned the module it was given
    is_fsdp: bool
    still_block: bool  # still an instance of its original class
    name: str  # its class's name


def _class_swap_and_api():
    model = build_reference()
    returned = fully_shard(model.layers[0])
    return ClassSwap(
        returned is model.layers[0],
        isinstance(model.layers[0], FSDPModule),
        isinstance(model.layers[0], type(build_reference().layers[0])),
        type(model.layers[0]).__name__,
    )


def test_fully_shard_returns_module_with_fsdp_class(dist):
    result = dist.run(1, _class_swap_and_api)[0]
    assert result.same and result.is_fsdp and result.still_block and result.name == "FSDPTransformerBlock"


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.norm(self.trunk(x)))


class OneGroup(NamedTuple):
    collectives: list[tuple[str, str]]  # (kind, group)
    grad_error: float  # against the single-process gradients


def _list_of_modules_is_one_group():
    torch.manual_seed(0)
    reference = _TwoHeads()
    model = sharded_copy(reference)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    x = torch.randn(4, 8)
    with fsdp_compile.record_collectives() as log:
        model(x).sum().backward()
    reference(x).sum().backward()
    # Every rank saw the same full batch, so the averaged gradient equals the single-process one.
    grad_error = max(
        (mine.grad.full_tensor() - theirs.grad).abs().max().item()
        for mine, theirs in zip(model.parameters(), reference.parameters())
    )
    return OneGroup([(r.kind, r.group) for r in log], grad_error)


def test_list_of_modules_shares_one_group(dist):
    result = dist.run(2, _list_of_modules_is_one_group)[0]
    # [norm, head] are one group: gathered for forward, again for backward, reduced once.
    assert result.collectives.count(("all_gather", "norm")) == 2
    assert result.collectives.count(("reduce_scatter", "norm")) == 1
    assert result.grad_error < 1e-6


def _unshard_copies_per_step(mp: bool) -> dict:
    """Calls of the all-gather and reduce-scatter copy ops in one eager training step, and the
    losses of two steps."""
    from fsdp_compile.kernels import ops

    counted = {"copy_in": 0, "copy_out": 0, "reduce_copy_in": 0, "reduce_copy_out": 0}
    copy_in, copy_out = ops.all_gather_copy_in, ops.all_gather_copy_out
    reduce_copy_in, reduce_copy_out = ops.reduce_scatter_copy_in, ops.reduce_scatter_copy_out

    def counting(name, op):
        def call(*args, **kwargs):
            counted[name] += 1
            return op(*args, **kwargs)
        return call

    policy = fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if mp else None)
    model = shard_model(sharded_copy(build_reference()), fully_shard, mp_policy=policy)
    losses = []
    for step, batch in enumerate(global_batches(2, 2, dist.get_world_size())):
        tokens = local_part(batch)
        if step == 1:
            ops.all_gather_copy_in, ops.all_gather_copy_out = counting("copy_in", copy_in), counting("copy_out", copy_out)
            ops.reduce_scatter_copy_in = counting("reduce_copy_in", reduce_copy_in)
            ops.reduce_scatter_copy_out = counting("reduce_copy_out", reduce_copy_out)
        try:
            loss = next_token_loss(model(tokens), tokens)
            loss.backward()
        finally:
            ops.all_gather_copy_in, ops.all_gather_copy_out = copy_in, copy_out
            ops.reduce_scatter_copy_in, ops.reduce_scatter_copy_out = reduce_copy_in, reduce_copy_out
        losses.append(loss.item())
        for p in model.parameters():
            p.grad = None
    return {**counted, "losses": losses}


def test_a_shard_group_of_one_rank_copies_each_shard_once_into_its_parameter(dist):
    """[Note: an unshard over a shard group of one rank]: no flat buffer, no copy-in or copy-out op at
    world size 1 (two ranks use them); test_parity.py checks world size 1 against the unsharded model."""
    for mp in (False, True):
        one, two = dist.run(1, _unshard_copies_per_step, mp)[0], dist.run(2, _unshard_copies_per_step, mp)[0]
        assert one["copy_in"] == one["copy_out"] == 0, one
        assert two["copy_in"] > 0 and two["copy_out"] > 0, two
        assert all(loss == loss and loss > 0 for loss in one["losses"]), one


def test_a_reduction_over_one_rank_writes_the_sharded_gradients_without_the_flat_buffer(dist):
    """[Note: a reduction over a shard group of one rank]: no reduce-scatter copy-in or copy-out at
    world size 1 (two ranks use them); test_parity.py checks the gradients against the unsharded model."""
    for mp in (False, True):
        one, two = dist.run(1, _unshard_copies_per_step, mp)[0], dist.run(2, _unshard_copies_per_step, mp)[0]
        assert one["reduce_copy_in"] == one["reduce_copy_out"] == 0, one
        assert two["reduce_copy_in"] > 0 and two["reduce_copy_out"] > 0, two


def test_eager_only_group_methods_leave_dynamo_alone_eagerly_and_disable_it_under_a_compiled_call():
    """[Note: Dynamo's disable only where Dynamo runs]: no switch of Dynamo's frame callback per call
    in eager training; inside a compiled function's call the method's frames are still not compiled."""
    import sys

    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    from fsdp_compile.runtime.param_group import _eager_only

    callbacks = []

    class Probe:
        @_eager_only
        def run(self, x: torch.Tensor) -> torch.Tensor:
            callbacks.append(get_eval_frame_callback())
            return x + 1

    probe, switches = Probe(), []

    def count_switches(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") == "set_eval_frame":
            switches.append(arg)

    sys.setprofile(count_switches)
    try:
        probe.run(torch.zeros(2))
    finally:
        sys.setprofile(None)
    assert switches == [] and callbacks == [None]

    compiled = torch.compile(lambda x: probe.run(x * 2) * 3, backend="eager")
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 9.0))
    assert callbacks[1:] == [None], callbacks  # run eagerly, Dynamo disabled inside it


def test_map_tensors_returns_a_container_it_changed_nothing_in_as_it_was():
    from fsdp_compile.runtime.structures import map_tensors, tensors_in

    x = torch.ones(2)
    tree = ((x, [x, 1, None]), {"mask": x, "flag": True})
    assert map_tensors(lambda t: t, tree) is tree
    doubled = map_tensors(lambda t: t * 2, tree)
    assert doubled is not tree and tree[1]["mask"] is x
    assert [t.sum().item() for t in tensors_in(doubled)] == [4.0, 4.0, 4.0]
    assert type(doubled[0][1]) is list and doubled[0][1][1:] == [1, None] and doubled[1]["flag"] is True


class EagerStepCalls(NamedTuple):
    dynamo_switches: int  # calls of set_eval_frame (Dynamo's frame callback switched) in one step
    signature_bindings: int  # calls of inspect.signature in one step
    grads_like_params: bool  # every sharded gradient a DTensor with its parameter's mesh, placements and shape


def _calls_in_an_eager_step() -> EagerStepCalls:
    """What one eager forward and backward calls into (the second step: lazy init is done)."""
    import inspect
    import sys

    model = shard_model(sharded_copy(build_reference()), fully_shard)
    tokens = local_part(global_batches(1, 2, dist.get_world_size())[0])
    next_token_loss(model(tokens), tokens).backward()
    for p in model.parameters():
        p.grad = None
    switches, signatures = [], []

    def count(frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", "") == "set_eval_frame":
            switches.append(arg)
        elif event == "call" and frame.f_code is inspect.signature.__code__:
            signatures.append(frame)

    sys.setprofile(count)
    try:
        next_token_loss(model(tokens), tokens).backward()
    finally:
        sys.setprofile(None)
    grads_like_params = all(
        isinstance(p.grad, torch.distributed.tensor.DTensor) and p.grad.device_mesh == p.device_mesh
        and p.grad.placements == p.placements and p.grad.shape == p.shape and not p.grad.requires_grad
        for p in model.parameters()
    )
    return EagerStepCalls(len(switches), len(signatures), grads_like_params)


def test_an_eager_step_over_one_rank_never_switches_dynamos_frame_callback(dist):
    """[Note: a DTensor made by its __new__] and [Note: Dynamo's disable only where Dynamo runs]: the
    sharded gradients are made without DTensor.__init__'s disable wrapper. Over one rank, where no
    copy kernel runs (a torch.library custom op switches it in its own dispatch), none is left."""
    result = dist.run(1, _calls_in_an_eager_step)[0]
    assert result.grads_like_params, result
    assert result.dynamo_switches == 0, result


def test_an_eager_step_binds_no_signatures_to_apply_the_post_backward_trigger(dist):
    """[Note: applying the post-backward trigger]: autograd.Function.apply's inspect.signature, once per
    module and step, is skipped outside functorch transforms."""
    result = dist.run(1, _calls_in_an_eager_step)[0]
    assert result.signature_bindings == 0, result
