"""Which ranks shard and which replicate: the data-parallel view of a ``DeviceMesh``."""
from __future__ import annotations

import os

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

__all__ = ["ShardGroup", "MeshInfo", "replicate_mesh", "hybrid_mesh", "PostForwardMeshInfo", "default_mesh", "mesh_info_for", "post_forward_mesh_info_for", "mesh_device", "separate_group_of"]


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


# Keyed by the default group too: a re-initialized process group needs new meshes.
_default_meshes: dict[tuple[str, int], DeviceMesh] = {}


def default_mesh() -> DeviceMesh:
    """All ranks of the default process group, on CUDA when its backend is NCCL, else CPU."""
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: call torch.distributed.init_process_group('gloo') "
            "(CPU) or ('nccl') (CUDA) first, or pass mesh=init_device_mesh(...)"
        )
    device_type = _default_device_type()
    key = (device_type, id(dist.group.WORLD))
    if key not in _default_meshes:
        _default_meshes[key] = init_device_mesh(device_type, (dist.get_world_size(),))
    return _default_meshes[key]


def _default_device_type() -> str:
    """CUDA when the default process group runs NCCL, else CPU."""
    return "cuda" if "nccl" in str(dist.get_backend()) and torch.cuda.is_available() else "cpu"


# --- FSDP1's sharding strategies (fsdp1_kwargs) ---------------------------------------------------
_fsdp1_meshes: dict[tuple[str, int, int], DeviceMesh] = {}


def _fsdp1_mesh_of_shape(replicate: int, shard: int) -> DeviceMesh:
    device_type = _default_device_type()
    key = (device_type, replicate, shard)
    if key not in _fsdp1_meshes:  # creating a mesh is collective: once per shape, on every rank
        _fsdp1_meshes[key] = init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    return _fsdp1_meshes[key]


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


def mesh_info_for(mesh: DeviceMesh) -> MeshInfo:
    if mesh.ndim == 1:
        group = mesh.get_group(0)
        return MeshInfo(mesh, group, mesh.size(0), mesh.get_local_rank(0), None, 1)
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise ValueError(
                "fully_shard: a 2-D mesh means HSDP (replicate, shard) and needs dimension names, as in FSDP2: "
                "init_device_mesh(device_type, (replicas, shards), mesh_dim_names=('replicate', 'shard'))"
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
        f"fully_shard takes a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), got a {mesh.ndim}-D mesh; "
        "pass mesh[dim] or mesh[(replicate_dim, shard_dim)]"
    )


_post_forward_groups: dict[tuple[int, ...], tuple[dist.ProcessGroup, list[int]]] = {}


def post_forward_mesh_info_for(info: MeshInfo, post_forward_size: int) -> PostForwardMeshInfo:
    """Consecutive blocks of ``post_forward_size`` ranks of each shard group (e.g. one node each).

    Every rank creates every block (``new_subgroups_by_enumeration`` is collective over the
    world), so all ranks must make the same ``fully_shard`` calls in the same order.
    """
    mesh_ranks = info.mesh.mesh.reshape(-1, info.shard_size)  # one row per shard group
    blocks = [row[start : start + post_forward_size].tolist() for row in mesh_ranks for start in range(0, info.shard_size, post_forward_size)]
    key = (id(dist.group.WORLD), post_forward_size) + tuple(rank for block in blocks for rank in block)
    if key not in _post_forward_groups:
        my_group, _ = dist.new_subgroups_by_enumeration(blocks)
        my_block = next(block for block in blocks if dist.get_rank() in block)
        _post_forward_groups[key] = (my_group, my_block)
    group, block = _post_forward_groups[key]
    return PostForwardMeshInfo(group, post_forward_size, block.index(dist.get_rank()))


_separate_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def separate_group_of(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second process group over ``group``'s ranks (another communicator), one per rank set.

    Created by the member ranks only (``use_local_synchronization``), so shard groups that do
    not include this rank need not take part.
    """
    ranks = tuple(dist.get_process_group_ranks(group))
    key = (id(dist.group.WORLD),) + ranks
    if key not in _separate_groups:
        _separate_groups[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _separate_groups[key]
