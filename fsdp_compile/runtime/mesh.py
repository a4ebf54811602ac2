"""Which ranks shard and which replicate: the data-parallel view of a ``DeviceMesh``."""
from __future__ import annotations

import math
import os

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "ShardGroup", "MeshInfo", "replicate_mesh", "hybrid_mesh", "PostForwardMeshInfo", "default_mesh", "mesh_info_for",
    "post_forward_mesh_info_for", "mesh_device", "separate_group_of", "DataParallelMeshDims", "TensorParallelLayout", "tensor_parallel_layout",
]

try:  # torch >= 2.13: FSDP2's own class, so scripts written for FSDP2 pass theirs unchanged
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # pragma: no cover - older torch

    @dataclass
    class DataParallelMeshDims:  # type: ignore[no-redef]
        """Which named dims of a full mesh are data parallel (``fully_shard(..., dp_mesh_dims=...)``)."""

        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        def __post_init__(self) -> None:
            if self.shard is None and self.replicate is None:
                raise ValueError("DataParallelMeshDims needs shard, replicate or both")

        @property
        def shard_names(self) -> tuple[str, ...]:
            return () if self.shard is None else (self.shard,) if isinstance(self.shard, str) else tuple(self.shard)

        @property
        def replicate_names(self) -> tuple[str, ...]:
            return () if self.replicate is None else (self.replicate,) if isinstance(self.replicate, str) else tuple(self.replicate)


class ShardGroup(Protocol):
    """The ranks one all-gather / reduce-scatter runs over (a ``MeshInfo`` or ``PostForwardMeshInfo``)."""

    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int


@dataclass(frozen=True)
class MeshInfo:
    """A 1-D mesh shards over all its ranks; a 2-D mesh is (replicate, shard): HSDP."""

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    # fully_shard(mesh=full_mesh, dp_mesh_dims=...): the full mesh, whose parameters are DTensors
    # on it, and the names of its data-parallel dims (``mesh`` is then the dp sub-mesh).
    spmd_mesh: DeviceMesh | None = None
    dp_mesh_dims: DataParallelMeshDims | None = None

    def placements(self, shard_dim: int = 0) -> tuple[Placement, ...]:
        """The DTensor placements of a parameter sharded on ``shard_dim`` (replicated first for HSDP)."""
        return (Shard(shard_dim),) if self.replicate_group is None else (Replicate(), Shard(shard_dim))

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard dim (what FSDP2's all-gather extensions are handed)."""
        return self.mesh if self.mesh.ndim == 1 else self.mesh[self.mesh.mesh_dim_names[1]]

    @property
    def data_parallel_size(self) -> int:
        return self.shard_size * self.replicate_size


@dataclass(frozen=True)
class PostForwardMeshInfo:
    """The smaller group that ``reshard_after_forward=<int>`` keeps parameters sharded over."""

    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


class _MeshesAndGroups:
    """The meshes and process groups fully_shard made, the one owner of all of them. Creating one is
    collective, so every rank makes each once and every later call reuses it; they live as long as
    the process (as the process groups themselves do). Keyed by the default group where a
    re-initialized process group needs new ones."""

    def __init__(self) -> None:
        self.default_meshes: dict[tuple[str, int], DeviceMesh] = {}
        self.fsdp1_meshes: dict[tuple[str, int, int], DeviceMesh] = {}  # FSDP1's sharding strategies (fsdp1_kwargs)
        self.post_forward_groups: dict[tuple[int, ...], tuple[dist.ProcessGroup, list[int]]] = {}
        self.separate_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        # Each pair's meshes are held too, so their ids stay theirs.
        self.joint_meshes: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh, DeviceMesh]] = {}


_made = _MeshesAndGroups()


def default_mesh() -> DeviceMesh:
    """All ranks of the default process group, on CUDA when its backend is NCCL, else CPU."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: call torch.distributed.init_process_group('gloo') "
            "(CPU) or ('nccl') (CUDA) first, or pass mesh=init_device_mesh(...)"
        )
    device_type = _default_device_type()
    key = (device_type, id(dist.group.WORLD))
    if key not in _made.default_meshes:
        _made.default_meshes[key] = init_device_mesh(device_type, (dist.get_world_size(),))
    return _made.default_meshes[key]


def _default_device_type() -> str:
    """CUDA when the default process group runs NCCL, else CPU."""
    return "cuda" if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else "cpu"


# --- FSDP1's sharding strategies (fsdp1_kwargs) ---------------------------------------------------


def _fsdp1_mesh_of_shape(replicate: int, shard: int) -> DeviceMesh:
    device_type = _default_device_type()
    key = (device_type, replicate, shard)
    if key not in _made.fsdp1_meshes:  # creating a mesh is collective: once per shape, on every rank
        _made.fsdp1_meshes[key] = init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    return _made.fsdp1_meshes[key]


def replicate_mesh() -> DeviceMesh:
    """FSDP1's NO_SHARD: every rank a replica, shard groups of one rank: a ``(world, 1)`` mesh."""
    return _fsdp1_mesh_of_shape(dist.get_world_size(), 1)


def hybrid_mesh() -> DeviceMesh:
    """FSDP1's HYBRID_SHARD default: shard within a node, replicate across nodes."""
    world = dist.get_world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if per_node < 1 or world % per_node != 0:
        raise ValueError(
            "HYBRID_SHARD shards within a node and replicates across nodes, but the ranks per node are unknown "
            f"(LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')!r}, world size {world}). Pass "
            "device_mesh=init_device_mesh(device, (num_nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard')) to fsdp1_kwargs."
        )
    return _fsdp1_mesh_of_shape(world // per_node, per_node)


def mesh_info_for(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims | None = None) -> MeshInfo:
    if dp_mesh_dims is not None:
        return _spmd_mesh_info(mesh, dp_mesh_dims)
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        return MeshInfo(mesh, group, mesh.size(0), mesh.get_local_rank(0), None, 1)
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            # FSDP2's exception type and words (_fsdp_init.py), then ours.
            raise AssertionError(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified. fully_shard: a 2-D mesh means HSDP "
                "(replicate, shard): init_device_mesh(device_type, (replicas, shards), "
                "mesh_dim_names=('replicate', 'shard'))"
            )
        return MeshInfo(
            mesh,
            shard_group=mesh.get_group(1),
            shard_size=mesh.size(1),
            shard_rank=mesh.get_local_rank(1),
            replicate_group=mesh.get_group(0),
            replicate_size=mesh.size(0),
        )
    raise ValueError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got a {mesh.ndim}-D mesh: it takes a 1-D mesh (FSDP) or a 2-D "
        "(replicate, shard) mesh (HSDP); "
        "pass mesh[dim] or mesh[(replicate_dim, shard_dim)]"
    )


def post_forward_mesh_info_for(info: MeshInfo, post_forward_size: int) -> PostForwardMeshInfo:
    """Consecutive blocks of ``post_forward_size`` ranks of each shard group (e.g. one node each).

    Every rank creates every block (``new_subgroups_by_enumeration`` is collective over the
    world), so all ranks must make the same ``fully_shard`` calls in the same order.
    """
    mesh_ranks = info.mesh.mesh.reshape(-1, info.shard_size)  # one row per shard group
    blocks = [row[start : start + post_forward_size].tolist() for row in mesh_ranks for start in range(0, info.shard_size, post_forward_size)]
    key = (id(dist.group.WORLD), post_forward_size) + tuple(rank for block in blocks for rank in block)
    if key not in _made.post_forward_groups:
        my_group, _ = dist.new_subgroups_by_enumeration(blocks)
        my_block = next(block for block in blocks if dist.get_rank() in block)
        _made.post_forward_groups[key] = (my_group, my_block)
    group, block = _made.post_forward_groups[key]
    return PostForwardMeshInfo(group, post_forward_size, block.index(dist.get_rank()))


def separate_group_of(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second process group over ``group``'s ranks (another communicator), one per rank set.

    Created by the member ranks only (``use_local_synchronization``), so shard groups that do
    not include this rank need not take part.
    """
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (id(dist.group.WORLD),) + ranks
    if key not in _made.separate_groups:
        _made.separate_groups[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _made.separate_groups[key]


def _spmd_mesh_info(mesh: DeviceMesh, dims: DataParallelMeshDims) -> MeshInfo:
    """FSDP2 2.13's ``dp_mesh_dims``: FSDP (or HSDP) over named dims of the full mesh the parameters live on."""
    if not hasattr(dims, "shard_names"):
        raise TypeError(f"fully_shard: dp_mesh_dims takes a DataParallelMeshDims, got {type(dims).__name__}")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "fully_shard: dp_mesh_dims names dims of the mesh, but this mesh has no dim names; build it with "
            "init_device_mesh(device_type, shape, mesh_dim_names=(...))"
        )
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in names:
            raise ValueError(f"fully_shard: dp_mesh_dims names '{name}', which is not a dim of the mesh {names}")
    if not dims.shard_names:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims={dims} names no shard dim (pure replication, FSDP2's DDP mode), which "
            "fsdp_compile does not support; name the dim to shard over: DataParallelMeshDims(shard=...)."
        )
    if len(dims.shard_names) > 1 or len(dims.replicate_names) > 1:
        raise NotImplementedError(
            f"fully_shard: dp_mesh_dims={dims} names several shard or replicate dims; fsdp_compile takes one of each. "
            "Flatten them into one named dim first (mesh[('dp_shard', 'cp')]._flatten('dp_shard_cp')) and name that."
        )
    (shard,) = dims.shard_names
    dp_names = (*dims.replicate_names, shard)
    if names.index(dp_names[0]) > names.index(shard):
        raise ValueError(f"fully_shard: dp_mesh_dims: the replicate dim '{dp_names[0]}' must come before the shard dim '{shard}' in the mesh {names}")
    dp_mesh = mesh[dp_names[0]] if len(dp_names) == 1 else mesh[dp_names]
    info = mesh_info_for(dp_mesh)
    return MeshInfo(
        info.mesh, info.shard_group, info.shard_size, info.shard_rank, info.replicate_group, info.replicate_size,
        spmd_mesh=mesh, dp_mesh_dims=dims,
    )


# --- tensor parallelism --------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorParallelLayout:
    """How FSDP composes with a parameter that is already a DTensor (tensor/sequence parallel).

    [Note: FSDP over tensor-parallel parameters]
    FSDP shards the parameter's *local* tensor (this rank's TP piece) on ``shard_dim`` over the
    data-parallel group only; the TP collectives stay DTensor's own. So:

    - the sharded parameter is a DTensor on the joint mesh (dp dims, then the TP dims) whose
      placements are FSDP's on the dp dims and the user's on the others, as FSDP2 lays it out (so
      ``full_tensor()`` and checkpoints interchange with FSDP2's). When TP also splits
      ``shard_dim``, FSDP's chunks are chunks *of TP's chunks*, which DTensor spells
      ``_StridedShard(shard_dim, split_factor=<TP ways on that dim>)`` on the dp dim;
    - the unsharded parameter is a DTensor with the user's own mesh and placements whose local
      tensor is the all-gather output (see [Note: unsharded parameter storage] in param.py);
    - its gradient is redistributed to the user's placements on the non-dp dims (a ``Partial`` TP
      gradient is summed over TP first, as in FSDP2) before its local tensor is reduce-scattered.

    Two ways in, as in FSDP2: ``fully_shard(m, mesh=dp_mesh)`` with parameters on a sibling TP
    mesh (``param_mesh``: that TP mesh), or ``fully_shard(m, mesh=full, dp_mesh_dims=...)`` with
    parameters on the full mesh, replicated on its dp dims (``param_mesh``: the full mesh).
    """

    param_mesh: DeviceMesh  # the user's DTensor mesh: what the unsharded parameter lives on
    param_placements: tuple[Placement, ...]
    sharded_mesh: DeviceMesh
    sharded_placements: tuple[Placement, ...]
    dp_dims: frozenset[int]  # dims of param_mesh that are data parallel (dp_mesh_dims only)
    shape: torch.Size  # the global shape
    stride: tuple[int, ...]

    def unsharded(self, local: torch.Tensor) -> DTensor:
        """The unsharded parameter: ``local`` (this rank's TP piece, all-gathered over dp) as the user's DTensor."""
        return DTensor.from_local(local, self.param_mesh, self.param_placements, run_check=False, shape=self.shape, stride=self.stride)

    def sharded(self, local: torch.Tensor) -> DTensor:
        """This rank's FSDP shard of its TP piece as the DTensor on the joint mesh."""
        return DTensor.from_local(local, self.sharded_mesh, self.sharded_placements, run_check=False, shape=self.shape, stride=self.stride)

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The local tensor of the unsharded gradient, laid out like the parameter's TP piece."""
        if not isinstance(grad, DTensor):
            raise RuntimeError(
                f"fsdp_compile: a tensor-parallel parameter got a {type(grad).__name__} gradient; expected a DTensor "
                f"on {self.param_mesh} (was the parameter used outside the DTensor it was registered as?)"
            )
        target = tuple(
            current if dim in self.dp_dims else wanted
            for dim, (current, wanted) in enumerate(zip(grad.placements, self.param_placements))
        )
        if target != tuple(grad.placements):
            grad = grad.redistribute(placements=target)
        local = grad._local_tensor
        wait = getattr(local, "wait", None)  # an AsyncCollectiveTensor from the redistribution
        return wait() if callable(wait) else local

    def local_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP piece of a full (global) tensor, without communication."""
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.detach(), self.param_mesh, self.param_placements, src_data_rank=None)._local_tensor

    def full_of_local(self, local: torch.Tensor) -> torch.Tensor:
        """The full (global) tensor from every TP rank's piece (a collective over the TP dims)."""
        return self.unsharded(local).full_tensor()


def _joint_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    key = (id(dp_mesh), id(tp_mesh))
    if key not in _made.joint_meshes:
        _made.joint_meshes[key] = (dp_mesh, tp_mesh, DeviceMesh._concatenate([dp_mesh, tp_mesh]))
    return _made.joint_meshes[key][2]


def tensor_parallel_layout(param: DTensor, info: MeshInfo, shard_dim: int, where: str) -> TensorParallelLayout:
    """Check that FSDP (over ``info``) can compose with the DTensor ``param`` and say how.

    ``where`` names the parameter in errors (``"fully_shard(Block): parameter 'up.weight'"``).
    See [Note: FSDP over tensor-parallel parameters].
    """
    mesh, placements = param.device_mesh, tuple(param.placements)
    for placement in placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"{where} is a DTensor with placements {placements}; FSDP composes only with Shard(dim) and Replicate() "
                "placements (tensor/sequence parallel). Redistribute it (param.redistribute(placements=...)) or build "
                "the tensor-parallel plan with ColwiseParallel/RowwiseParallel before fully_shard."
            )
    if mesh.device_type != info.mesh.device_type:
        raise ValueError(
            f"{where} is a DTensor on a '{mesh.device_type}' mesh but fully_shard's mesh is on '{info.mesh.device_type}'; "
            "build both from one init_device_mesh(...)."
        )
    if info.spmd_mesh is not None:
        return _spmd_layout(param, info, shard_dim, where)
    if mesh.mesh_dim_names is None or info.mesh.mesh_dim_names is None:
        raise ValueError(
            f"{where} is a DTensor on a mesh without dim names; FSDP over tensor parallel needs the data-parallel and "
            "tensor-parallel meshes to be named dims of one mesh: mesh = init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')), then parallelize_module(..., mesh['tp'], plan) and fully_shard(..., mesh=mesh['dp'])."
        )
    joint = _sibling_joint_mesh(info.mesh, mesh, where)
    dp_placements = info.placements(shard_dim)
    split = math.prod(mesh.size(i) for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == shard_dim)
    if split > 1:
        dp_placements = (*dp_placements[:-1], _StridedShard(shard_dim, split_factor=split))
    return TensorParallelLayout(
        mesh, placements, joint, (*dp_placements, *placements), frozenset(), param.shape, param.stride(),
    )


def _sibling_joint_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, where: str) -> DeviceMesh:
    fix = (
        "FSDP over tensor parallel needs both meshes cut from one mesh: mesh = init_device_mesh(device, (dp, tp), "
        "mesh_dim_names=('dp', 'tp')), then parallelize_module(..., mesh['tp'], plan) and fully_shard(..., mesh=mesh['dp'])"
    )
    if dp_mesh._get_root_mesh() is not tp_mesh._get_root_mesh() and dp_mesh._get_root_mesh() != tp_mesh._get_root_mesh():
        raise ValueError(
            f"{where} is a DTensor on {tp_mesh}, which is not a sibling of fully_shard's data-parallel mesh {dp_mesh} "
            f"(they come from different init_device_mesh calls). {fix}."
        )
    try:
        return _joint_mesh(dp_mesh, tp_mesh)
    except RuntimeError as error:
        raise ValueError(
            f"{where} is a DTensor on {tp_mesh}, which shares ranks along the same dims as fully_shard's data-parallel "
            f"mesh {dp_mesh} ({error}): it is already distributed over the data-parallel ranks (a parameter another "
            f"fully_shard call sharded, or a TP plan applied on the dp mesh). {fix}."
        ) from None


def _spmd_layout(param: DTensor, info: MeshInfo, shard_dim: int, where: str) -> TensorParallelLayout:
    """``dp_mesh_dims``: ``param`` lives on the full mesh, replicated on its dp dims."""
    full, dims = info.spmd_mesh, info.dp_mesh_dims
    assert full is not None and dims is not None and full.mesh_dim_names is not None
    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh != full:
        raise ValueError(
            f"{where} is a DTensor on {mesh}, but with dp_mesh_dims every parameter must be a DTensor on the mesh passed "
            f"to fully_shard ({full}); distribute it on that mesh, or pass mesh=<the dp sub-mesh> without dp_mesh_dims."
        )
    names = full.mesh_dim_names
    dp_indices = [names.index(n) for n in (*dims.replicate_names, *dims.shard_names)]
    for index in dp_indices:
        if not isinstance(placements[index], Replicate):
            raise ValueError(
                f"{where} has placement {placements[index]} on the data-parallel dim '{names[index]}'; with dp_mesh_dims "
                "parameters must be Replicate() on the dp dims (FSDP does the sharding there)."
            )
    shard_index = names.index(dims.shard_names[0])
    split = math.prod(
        full.size(i) for i, p in enumerate(placements) if i > shard_index and isinstance(p, Shard) and p.dim == shard_dim
    )
    sharded = list(placements)
    sharded[shard_index] = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
    return TensorParallelLayout(
        full, placements, full, tuple(sharded), frozenset(dp_indices), param.shape, param.stride(),
    )
