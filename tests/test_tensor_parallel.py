"""FSDP over tensor-parallel DTensor parameters (2-D dp x tp, 3-D HSDP + TP), eager.

Ranks of a ``(dp, tp)`` mesh: ``rank = dp_index * tp + tp_index``. Every tp rank of one dp index
sees the same data, so the global batch is split over the dp indices only.
"""
from __future__ import annotations

import copy
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_compile
from fsdp_compile.models import RMSNorm, TransformerConfig, next_token_loss
from fsdp_testing import (
    Parity, assert_matches_reference, global_batches, local_part, max_param_difference, mean_across_ranks, parameter_movement,
)

# The issue asks 1e-5 on losses and 1e-3 on parameters; seen: 2e-7 on parameters (torch 2.13).
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5
# HIDDEN = 22: each TP piece of w1/w3 (11 rows) splits unevenly over dp (6 + 5, padded).
VOCAB, DIM, HEADS, HIDDEN, LAYERS = 32, 16, 4, 22, 2

DATA = TransformerConfig(vocab_size=VOCAB)  # what global_batches reads: the vocabulary size


# --- a small Llama-style model whose attention reads its head count from the TP-local width -------


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: colwise q/k/v hand back this rank's heads only.
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # Biases on w1 (Shard(0) over TP, 1-D) and w2 (Replicate over TP, whose gradient DTensor
        # gives back as it likes; FSDP takes it in the parameter's placements, as FSDP2 does).
        self.w1 = nn.Linear(DIM, HIDDEN, bias=True)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(DIM, 1e-5)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM, 1e-5)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Model(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = RMSNorm(DIM, 1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


TP_PLAN = {
    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
}


def build_model(seed: int = 0, layers: int = LAYERS) -> Model:
    torch.manual_seed(seed)
    return Model(layers)


def parallelize(model: Model, fully_shard, tp_mesh, dp_mesh, **kwargs) -> Model:
    """TP plan on each block, then FSDP bottom-up on the dp mesh (torchtitan's order)."""
    for block in model.layers:
        parallelize_module(block, tp_mesh, TP_PLAN)
        fully_shard(block, mesh=dp_mesh, **kwargs)
    kwargs.pop("reshard_after_forward", None)
    fully_shard(model, mesh=dp_mesh, **kwargs)
    return model


def train(model, batches, data_rank: int, data_world: int, micro_batches: int = 1, lr: float = 0.05) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for batch in batches:
        local = local_part(batch, data_rank, data_world)
        total = 0.0
        micros = local.chunk(micro_batches)
        for index, micro in enumerate(micros):
            if micro_batches > 1:
                model.set_requires_gradient_sync(index == len(micros) - 1)
            loss = next_token_loss(model(micro), micro) / micro_batches
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(mean_across_ranks(total))
    return losses


def _batches(data_world: int, rows_per_dp_rank: int = 4):
    return global_batches(steps=3, batch_per_rank=rows_per_dp_rank, world_size=data_world, config=DATA, seq=8)


class TpParity(NamedTuple):  # Parity's fields, then what the first block's sharding looked like
    losses: list[float]
    reference_losses: list[float]
    max_param_gap: float
    movement: float
    layouts: dict  # parameter name -> (placements, mesh dim names)
    gathered_numels: set[int]  # elements each of the block's all-gathers sent
    shard_numel: int  # elements of this rank's shards of the block


def _tp_parity(reshard_after_forward=None, micro_batches: int = 1, explicit_prefetch: bool = False):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    batches = _batches(2, rows_per_dp_rank=2 * micro_batches)
    reference = build_model()
    initial = copy.deepcopy(reference)
    kwargs = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    model = parallelize(copy.deepcopy(reference), fsdp_compile.fully_shard, mesh["tp"], mesh["dp"], **kwargs)
    if explicit_prefetch:
        for current, following in zip(model.layers, model.layers[1:]):
            current.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([current])
    block = model.layers[0]
    layouts = {
        name: (str(tuple(p.placements)), tuple(p.device_mesh.mesh_dim_names))
        for name, p in block.named_parameters() if name in ("attention.wq.weight", "attention.wo.weight", "ffn_norm.weight")
    }
    with fsdp_compile.record_collectives() as log:
        losses = train(model, batches, dp_rank, 2, micro_batches)
    # The block's all-gather sends this rank's shards of its TP pieces, over dp only (rank 0 holds
    # the larger chunk of every uneven split, so its shards need no padding).
    sent = sum(p.to_local().numel() for p in block.parameters())
    gathers = {r.numel for r in log if r.kind == "all_gather" and r.group == "layers.0"}
    reference_losses = train_reference_sgd(reference, batches)
    return TpParity(losses, reference_losses, max_param_difference(model, reference), parameter_movement(initial, reference), layouts, gathers, sent)


def train_reference_sgd(reference: nn.Module, batches, micro_batches: int = 1) -> list[float]:
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in batches:
        loss = next_token_loss(reference(batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_fsdp_over_tp_matches_single_process_reference(dist):
    results = dist.run(4, _tp_parity)
    assert_matches_reference(results, LOSS_RTOL, PARAM_ATOL)
    first = results[0]
    # FSDP2's layout: dp placement first, TP's kept; colwise (TP on dim 0) needs _StridedShard on dp.
    assert first.layouts["attention.wq.weight"] == ("(_StridedShard(dim=0, sf=2), Shard(dim=0))", ("dp", "tp"))
    assert first.layouts["attention.wo.weight"] == ("(Shard(dim=0), Shard(dim=1))", ("dp", "tp"))
    assert first.layouts["ffn_norm.weight"] == ("(Shard(dim=0),)", ("dp",))
    assert first.gathered_numels == {first.shard_numel}, (
        f"the block's all-gathers sent {first.gathered_numels} elements, its dp shards hold {first.shard_numel}"
    )


def test_fsdp_over_tp_keeps_params_no_sync_and_prefetch_semantics(dist):
    assert_matches_reference(dist.run(4, _tp_parity, False, 2, True), LOSS_RTOL, PARAM_ATOL)


def _cpu_offload_parity():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batches = _batches(2)
    reference = build_model()
    initial = copy.deepcopy(reference)
    offload = fsdp_compile.CPUOffloadPolicy(pin_memory=False)
    model = parallelize(copy.deepcopy(reference), fsdp_compile.fully_shard, mesh["tp"], mesh["dp"], offload_policy=offload)
    losses = train(model, batches, mesh.get_local_rank("dp"), 2)
    reference_losses = train_reference_sgd(reference, batches)
    return Parity(losses, reference_losses, max_param_difference(model, reference), parameter_movement(initial, reference))


def test_cpu_offload_over_tp_matches_single_process_reference(dist):
    assert_matches_reference(dist.run(4, _cpu_offload_parity), LOSS_RTOL, PARAM_ATOL)


def _meta_init_then_load() -> float:
    """torchtitan's order: build on meta, parallelize, fully_shard, to_empty, load the weights."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with torch.device("meta"):
        model = Model()
    model = parallelize(model, fsdp_compile.fully_shard, mesh["tp"], mesh["dp"])
    model.to_empty(device="cpu")
    reference = build_model()
    model.load_state_dict(reference.state_dict())
    tokens = _batches(1)[0]
    return max(max_param_difference(model, reference), (model(tokens) - reference(tokens)).abs().max().item())


def test_meta_device_init_then_load_over_tp(dist):
    assert dist.run(4, _meta_init_then_load)[0] < 1e-6


class TorchParity(NamedTuple):
    our_losses: list[float]
    torch_losses: list[float]  # torch's fully_shard's
    max_param_gap: float
    movement: float  # how far training moved torch's parameters
    placements_match: bool  # every sharded parameter laid out as torch lays it out


def _bf16_against_torch_fsdp2():
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batches = _batches(2)
    reference = build_model()
    initial = copy.deepcopy(reference)
    ours = parallelize(
        copy.deepcopy(reference), fsdp_compile.fully_shard, mesh["tp"], mesh["dp"],
        mp_policy=fsdp_compile.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    theirs = parallelize(
        copy.deepcopy(reference), torch_fully_shard, mesh["tp"], mesh["dp"],
        mp_policy=TorchMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    dp_rank = mesh.get_local_rank("dp")
    our_losses = train(ours, batches, dp_rank, 2)
    their_losses = train(theirs, batches, dp_rank, 2)
    placements_match = all(
        a.placements == b.placements and a.device_mesh == b.device_mesh for a, b in zip(ours.parameters(), theirs.parameters())
    )
    param_diff = max((a.full_tensor() - b.full_tensor()).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    movement = max(
        (b.full_tensor() - a).abs().max().item() for a, b in zip(initial.parameters(), theirs.parameters())
    )
    return TorchParity(our_losses, their_losses, param_diff, movement, placements_match)


# Same TP pieces, shards, casts and collectives as FSDP2: on torch 2.13 the two agree bitwise,
# stronger than the 1e-2 bf16 bound of docs/design.md section 6.
def test_bf16_mixed_precision_over_tp_matches_torch_fsdp2_bitwise(dist):
    result = dist.run(4, _bf16_against_torch_fsdp2)[0]
    assert result.placements_match, "sharded parameters are not laid out as FSDP2 lays them out"
    assert result.our_losses == result.torch_losses
    assert result.max_param_gap == 0.0 and result.movement > 1e-3


# --- 3-D: HSDP + TP --------------------------------------------------------------------------------


class LayoutParity(NamedTuple):  # Parity's fields, then one parameter's placements
    losses: list[float]
    reference_losses: list[float]
    max_param_gap: float
    movement: float
    layout: str  # the first block's first TP-sharded weight's placements


def _hsdp_tp_parity():
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    data_rank = mesh.get_local_rank("replicate") * 2 + mesh.get_local_rank("shard")
    batches = _batches(4, rows_per_dp_rank=1)
    reference = build_model()
    initial = copy.deepcopy(reference)
    model = parallelize(copy.deepcopy(reference), fsdp_compile.fully_shard, mesh["tp"], mesh["replicate", "shard"])
    layout = str(tuple(model.layers[0].attention.wq.weight.placements))
    losses = train(model, batches, data_rank, 4)
    reference_losses = train_reference_sgd(reference, batches)
    return LayoutParity(losses, reference_losses, max_param_difference(model, reference), parameter_movement(initial, reference), layout)


def test_hsdp_over_tp_on_3d_mesh_matches_single_process_reference(dist):
    results = dist.run(8, _hsdp_tp_parity)
    assert_matches_reference(results, LOSS_RTOL, PARAM_ATOL)
    assert results[0].layout == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"


# --- dp_mesh_dims: parameters on the full mesh (FSDP2 2.13's SPMD form) ---------------------------


class SpmdFeedForward(nn.Module):
    """Reads DTensor activations on the full (dp, tp) mesh; its weights are DTensors there too."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(x)))


class SpmdModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SpmdFeedForward() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _spmd_loss(model: nn.Module, x: torch.Tensor, target: torch.Tensor, mesh=None) -> torch.Tensor:
    if mesh is not None:  # the local rows as the dp shard of a DTensor batch, replicated over tp
        rows = [Shard(0)] * (mesh.ndim - 1) + [Replicate()]
        out = model(DTensor.from_local(x, mesh, rows))
        x = out.redistribute(mesh, rows).to_local()
    else:
        x = model(x)
    return F.mse_loss(x, target)


def _dp_mesh_dims_parity(hsdp: bool = False):
    """FSDP on (dp, tp) with dp_mesh_dims=(shard="dp"), or HSDP on (replicate, shard, tp)."""
    from fsdp_compile import DataParallelMeshDims
    from torch.distributed.tensor import distribute_tensor

    if hsdp:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dims = DataParallelMeshDims(shard="shard", replicate="replicate")
        dp_rank, dp_world = mesh.get_local_rank("replicate") * 2 + mesh.get_local_rank("shard"), 4
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dims = DataParallelMeshDims(shard="dp")
        dp_rank, dp_world = mesh.get_local_rank("dp"), 2
    torch.manual_seed(0)
    reference = SpmdModel()
    initial = copy.deepcopy(reference)
    model = copy.deepcopy(reference)
    for layer in model.layers:
        for linear, tp_dim in ((layer.up, 0), (layer.down, 1)):  # colwise up, rowwise down
            placements = [Replicate()] * (mesh.ndim - 1) + [Shard(tp_dim)]
            linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, placements))
        fsdp_compile.fully_shard(layer, mesh=mesh, dp_mesh_dims=dims)
    fsdp_compile.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    layout = str(tuple(model.layers[0].up.weight.placements))
    generator = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, DIM, generator=generator), torch.randn(8, DIM, generator=generator)) for _ in range(3)]
    ours, theirs = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    losses, reference_losses = [], []
    for x, target in data:
        loss = _spmd_loss(model, x.chunk(dp_world)[dp_rank], target.chunk(dp_world)[dp_rank], mesh)
        loss.backward()
        ours.step()
        ours.zero_grad()
        losses.append(mean_across_ranks(loss.item()))
        reference_loss = _spmd_loss(reference, x, target)
        reference_loss.backward()
        theirs.step()
        theirs.zero_grad()
        reference_losses.append(reference_loss.item())
    return LayoutParity(losses, reference_losses, max_param_difference(model, reference), parameter_movement(initial, reference), layout)


def test_dp_mesh_dims_on_the_full_mesh_matches_single_process_reference(dist):
    results = dist.run(4, _dp_mesh_dims_parity)
    assert_matches_reference(results, LOSS_RTOL, PARAM_ATOL)
    assert results[0].layout == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"


def test_dp_mesh_dims_hsdp_on_3d_mesh_matches_single_process_reference(dist):
    results = dist.run(8, _dp_mesh_dims_parity, True)
    assert_matches_reference(results, LOSS_RTOL, PARAM_ATOL)
    assert results[0].layout == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"


# --- state dicts -----------------------------------------------------------------------------------


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _parallelized(dp: int, tp: int, seed: int, fully_shard=fsdp_compile.fully_shard) -> Model:
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return parallelize(build_model(seed), fully_shard, mesh["tp"], mesh["dp"])


def _dcp_save(directory: str, fully_shard_name: str = "ours") -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    fully_shard = torch_fully_shard if fully_shard_name == "torch" else fsdp_compile.fully_shard
    model = _parallelized(2, 2, seed=1, fully_shard=fully_shard)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=directory)
    return _full_params(model)


def _dcp_load(directory: str, dp: int, tp: int, fully_shard_name: str = "ours") -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    fully_shard = torch_fully_shard if fully_shard_name == "torch" else fsdp_compile.fully_shard
    model = _parallelized(dp, tp, seed=2, fully_shard=fully_shard)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=directory)
    set_model_state_dict(model, state["model"])
    return _full_params(model)


def _mismatched(loaded: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> list[str]:
    assert list(loaded) == list(saved)
    return [name for name in saved if not torch.equal(loaded[name], saved[name])]


@pytest.fixture(scope="module")
def checkpoint_2x2(dist, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tp_dcp") / "dp2_tp2")
    return directory, dist.run(4, _dcp_save, directory)[0]


@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 1)])
def test_dcp_checkpoint_at_dp2_tp2_loads_bitwise_at(dist, checkpoint_2x2, dp, tp):
    directory, saved = checkpoint_2x2
    assert _mismatched(dist.run(2, _dcp_load, directory, dp, tp)[0], saved) == []


def test_fsdp2_tp_checkpoint_loads_into_ours_and_back_bitwise(dist, tmp_path):
    theirs_dir, ours_dir = str(tmp_path / "theirs"), str(tmp_path / "ours")
    saved = dist.run(4, _dcp_save, theirs_dir, "torch")[0]
    assert _mismatched(dist.run(4, _dcp_load, theirs_dir, 2, 2)[0], saved) == []
    ours = dist.run(4, _dcp_save, ours_dir)[0]
    assert _mismatched(dist.run(4, _dcp_load, ours_dir, 2, 2, "torch")[0], ours) == []


class FullAcrossTp(NamedTuple):
    plain_tensors: bool  # the full state dict holds plain tensors only
    state_mismatch: list[str]  # state-dict entries that differ from the full parameters
    exposed_mismatch: list[str]  # parameters unshard_params exposed that differ from them
    edit_written_back: bool  # an in-place edit under unshard_params reached the TP shards
    full_state_loaded: bool  # an edited full state dict loaded into the TP shards


def _full_state_dict_and_unshard_params():
    model = _parallelized(2, 2, seed=1)
    full = _full_params(model)
    with fsdp_compile.state_dict_type(model, fsdp_compile.StateDictType.FULL_STATE_DICT):
        state = model.state_dict()
    plain = all(type(v) is torch.Tensor for v in state.values())
    state_mismatch = [k for k, v in state.items() if not torch.equal(v, full[k])]
    with fsdp_compile.unshard_params(model), torch.no_grad():
        exposed_mismatch = [k for k, p in model.named_parameters() if not torch.equal(p.detach(), full[k])]
        model.layers[0].attention.wq.weight.mul_(2)
    written = torch.equal(model.layers[0].attention.wq.weight.full_tensor(), 2 * full["layers.0.attention.wq.weight"])
    state["layers.1.feed_forward.w2.weight"] = state["layers.1.feed_forward.w2.weight"] + 1
    model.load_state_dict(state)
    loaded = torch.equal(model.layers[1].feed_forward.w2.weight.full_tensor(), full["layers.1.feed_forward.w2.weight"] + 1)
    return FullAcrossTp(plain, state_mismatch, exposed_mismatch, written, loaded)


def test_full_state_dict_and_unshard_params_are_full_across_tp(dist):
    result = dist.run(4, _full_state_dict_and_unshard_params)[0]
    assert result.plain_tensors and result.state_mismatch == [] and result.exposed_mismatch == []
    assert result.edit_written_back, "unshard_params did not write an edit back into the TP shards"
    assert result.full_state_loaded, "a full state dict did not load into the TP shards"


# --- errors ----------------------------------------------------------------------------------------


def _raises(action) -> str:
    try:
        action()
    except (ValueError, RuntimeError, TypeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def _error_messages() -> dict[str, str]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    from fsdp_compile import DataParallelMeshDims
    from fsdp_compile.compile.backend import fsdp_inductor

    fully_shard = fsdp_compile.fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}
    messages = {}
    # Ranks laid out differently: its "b" groups are mesh's dp groups.
    transposed = DeviceMesh("cpu", torch.arange(4).view(2, 2).t().contiguous(), mesh_dim_names=("a", "b"))
    module = parallelize_module(FeedForward(), transposed["b"], plan)
    messages["not_sibling"] = _raises(lambda: fully_shard(module, mesh=mesh["dp"]))
    module = parallelize_module(FeedForward(), mesh["dp"], plan)
    messages["overlapping"] = _raises(lambda: fully_shard(module, mesh=mesh["dp"]))
    module = nn.Linear(4, 4, bias=False)
    module.weight = nn.Parameter(DTensor.from_local(torch.randn(4, 4), mesh["tp"], [Partial()]))
    messages["partial"] = _raises(lambda: fully_shard(module, mesh=mesh["dp"]))
    module = nn.Linear(4, 4, bias=False)
    strided = DTensor.from_local(torch.randn(2, 4), mesh["tp"], [_StridedShard(0, split_factor=2)], shape=(4, 4), stride=(4, 1))
    module.weight = nn.Parameter(strided)
    messages["strided"] = _raises(lambda: fully_shard(module, mesh=mesh["dp"]))
    messages["spmd_plain"] = _raises(lambda: fully_shard(FeedForward(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")))
    # Tied across two groups: still reported, naming the group that has it.
    first = parallelize_module(FeedForward(), mesh["tp"], plan)
    second = parallelize_module(FeedForward(), mesh["tp"], plan)
    second.w1.weight = first.w1.weight
    pair = nn.Sequential(first, second)
    fully_shard(first, mesh=mesh["dp"])
    messages["tied"] = _raises(lambda: fully_shard(pair, mesh=mesh["dp"]))
    # A graph reading a TP parameter reaching the backend (the eager fallback's graphs take the
    # unsharded TP parameters as inputs).
    graph = torch.fx.symbolic_trace(nn.Identity())
    first.unshard()
    messages["dtensor_graph"] = _raises(lambda: fsdp_inductor(graph, [first.w1.weight]))
    first.reshard()
    return messages


@pytest.fixture(scope="module")
def error_messages(dist) -> dict[str, str]:
    return dist.run(4, _error_messages)[0]


def test_tp_mesh_from_another_mesh_names_parameter_and_fix(error_messages):
    message = error_messages["not_sibling"]
    assert "'w1.weight'" in message and "not a sibling" in message and "init_device_mesh" in message


def test_tp_plan_on_the_dp_mesh_is_refused(error_messages):
    message = error_messages["overlapping"]
    assert "'w1.weight'" in message and "already distributed over the data-parallel ranks" in message


@pytest.mark.parametrize("case", ["partial", "strided"])
def test_placements_fsdp_cannot_compose_with_are_refused(error_messages, case):
    message = error_messages[case]
    assert "'weight'" in message and "Shard(dim) and Replicate()" in message


def test_dp_mesh_dims_needs_dtensor_parameters(error_messages):
    assert "'w1.weight' is a plain tensor" in error_messages["spmd_plain"] and "distribute_tensor" in error_messages["spmd_plain"]


def test_already_managed_error_only_when_true(error_messages):
    assert "'1.w1.weight' is already managed by fully_shard(FeedForward)" in error_messages["tied"]


class CompiledTpParity(NamedTuple):
    losses: list[float]  # compiled
    reference_losses: list[float]
    max_param_gap: float  # between the compiled model's and the reference's parameters
    eager_losses: list[float]
    collectives: dict  # (graph kind, "fsdp" or "tp", collective) -> count in the compiled graphs
    graph_breaks: int


def _compiled_tp_parity():
    """The whole model under fsdp_aot_eager (fsdp_inductor's tracing, checks and passes without code
    generation) against eager and the single-process reference; what the graphs hold."""
    from fsdp_compile.compile.backend import observe_graphs
    from fsdp_compile.passes.graph import ALL_GATHER, ALL_REDUCE, FRAME_GATHER, REDUCE_SCATTER, collective_nodes, fsdp_annotation

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    batches = _batches(2, rows_per_dp_rank=2)
    reference = build_model(layers=1)  # one block: the compile is this test's cost
    eager = parallelize(copy.deepcopy(reference), fsdp_compile.fully_shard, mesh["tp"], mesh["dp"])
    model = parallelize(copy.deepcopy(reference), fsdp_compile.fully_shard, mesh["tp"], mesh["dp"])
    eager_losses = train(eager, batches, dp_rank, 2)
    with observe_graphs() as graphs:
        losses = train(torch.compile(model, backend="fsdp_aot_eager"), batches, dp_rank, 2)
    reference_losses = train_reference_sgd(reference, batches)
    kinds = {}
    for kind, gm in graphs:
        if kind in ("forward", "backward"):
            # A block frame's all-gather is one opaque call after the passes ([Note: prefetch across
            # block frames] in module.py), an all-gather still.
            for name, targets in (("all_gather", (ALL_GATHER, FRAME_GATHER)), ("reduce_scatter", (REDUCE_SCATTER,)), ("all_reduce", (ALL_REDUCE,))):
                for node in (node for target in targets for node in collective_nodes(gm.graph, target)):
                    owner = "fsdp" if fsdp_annotation(node) is not None else "tp"
                    kinds[(kind, owner, name)] = kinds.get((kind, owner, name), 0) + 1
    counters = torch._dynamo.utils.counters
    # Blocks compiled as frames (the default) break the graph where a block's frame is entered, where
    # the root's hooks hand their bookkeeping to eager calls and where the root calls its forward
    # ([Note: a forward that breaks at its blocks' frames] in compiled_state.py), by design; no other break.
    by_design = (
        "FSDPState.enter_block_frame", "FSDPState._frames_root_pre_forward", "FSDPState._frames_root_post_forward",
        "call_forward_breaking_at_block_frames",
    )
    breaks = sum(n for reason, n in counters["graph_break"].items() if not any(f"{name} at" in reason for name in by_design))
    torch._dynamo.reset()
    return CompiledTpParity(losses, reference_losses, max_param_difference(model, reference), eager_losses, kinds, breaks)


def test_compiled_fsdp_over_tp_holds_both_kinds_of_collectives_and_matches_eager(dist):
    results = dist.run(4, _compiled_tp_parity)
    result = results[0]
    kinds = result.collectives
    for ours, eager, ref in zip(result.losses, result.eager_losses, result.reference_losses):
        assert abs(ours - eager) <= LOSS_RTOL * abs(eager) and abs(ours - ref) <= LOSS_RTOL * abs(ref), (result.losses, result.eager_losses)
    assert result.max_param_gap <= PARAM_ATOL, result.max_param_gap
    assert result.graph_breaks == 0
    # FSDP's: one bucketed all-gather per group in forward (the block + root), a re-gather of the
    # block and one reduce-scatter per group in backward. TP's own: the rowwise all-reduces
    # (attention.wo, feed_forward.w2) forward, the colwise input-gradient ones backward.
    assert kinds[("forward", "fsdp", "all_gather")] == 2 and kinds[("backward", "fsdp", "reduce_scatter")] == 2, kinds
    assert kinds[("backward", "fsdp", "all_gather")] == 1, kinds
    assert kinds[("forward", "tp", "all_reduce")] == 2 and kinds.get(("backward", "tp", "all_reduce"), 0) >= 2, kinds
    assert not any(owner == "tp" and name != "all_reduce" for _, owner, name in kinds), kinds


def test_compiled_backend_refuses_the_fallbacks_unsharded_tp_graphs(error_messages):
    message = error_messages["dtensor_graph"]
    assert message.startswith("NotImplementedError") and "parameter 'w1.weight'" in message and "train eagerly" in message
