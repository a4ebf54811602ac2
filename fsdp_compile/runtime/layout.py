"""ShardLayout: how one parameter is split over the ranks of its shard group, in one place.

Every piece that cuts a parameter into shards or puts it back together (the runtime's copy-in /
copy-out, the traced unshard, state dicts, ``unshard_params``, the kernel benchmark) asks this
object, so there is one padding rule and one notion of "this rank's rows".

[Note: shard layout]
A parameter of shape ``S`` is sharded on dim ``d`` (FSDP2's ``Shard(d)``, default 0) over ``W``
ranks like ``torch.chunk(S[d], W)``: ceil-sized chunks of ``chunk = ceil(S[d] / W)`` rows, the last
ranks holding fewer, possibly none. Collectives see every parameter in its *dim-0 view*
(``movedim(d, 0)``), where chunks are contiguous blocks of ``chunk * numel / S[d]`` elements;
rank ``r``'s block is zero-padded to ``chunk`` rows. The unsharded parameter, viewed on dim 0, is
the rank-major concatenation of the blocks cut to ``S[d]`` rows. Sharding on ``d > 0`` must be even
(as in FSDP2), so only dim 0 is ever padded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

__all__ = ["ShardLayout"]


@dataclass(frozen=True)
class ShardLayout:
    """One parameter's split (see [Note: shard layout]); ``rank`` is this process's shard rank."""

    shape: tuple[int, ...]
    dim: int
    world_size: int
    rank: int
    # Derived once: every traced parameter read asks for them, and Dynamo traces each computation.
    size: int = field(init=False, repr=False, compare=False)  # length of the sharded dim
    chunk: int = field(init=False, repr=False, compare=False)  # rows per rank after padding

    def __post_init__(self) -> None:
        size = self.shape[self.dim]
        object.__setattr__(self, "size", size)
        object.__setattr__(self, "chunk", math.ceil(size / self.world_size) if size else 0)

    def start(self, rank: int | None = None) -> int:
        return min((self.rank if rank is None else rank) * self.chunk, self.size)

    def rows(self, rank: int | None = None) -> int:
        """Rows ``rank`` really holds (``chunk`` or fewer)."""
        return max(0, min(self.chunk, self.size - self.start(rank)))

    @property
    def row_numel(self) -> int:
        """Elements per row of the sharded dim."""
        return math.prod(s for i, s in enumerate(self.shape) if i != self.dim)

    @property
    def padded_shard_numel(self) -> int:
        """Elements each rank contributes to the group's flat all-gather buffer."""
        return self.chunk * self.row_numel

    def shard_shape(self, rank: int | None = None) -> tuple[int, ...]:
        return self._with_dim(self.rows(rank))

    @property
    def padded_shard_shape(self) -> tuple[int, ...]:
        return self._with_dim(self.chunk)

    def _with_dim(self, length: int) -> tuple[int, ...]:
        return tuple(length if i == self.dim else s for i, s in enumerate(self.shape))

    def for_group(self, world_size: int, rank: int) -> "ShardLayout":
        """The same parameter split over another group (the post-forward one of an int reshard_after_forward)."""
        return replace(self, world_size=world_size, rank=rank)

    # --- tensors --------------------------------------------------------------------------------
    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full tensor (a view)."""
        return full.narrow(self.dim, self.start(), self.rows())

    def to_dim0(self, tensor: torch.Tensor) -> torch.Tensor:
        """The dim-0 view collectives work on (a view; not contiguous when ``dim > 0``)."""
        return tensor.movedim(self.dim, 0) if self.dim else tensor

    def from_dim0(self, tensor: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_dim0`."""
        return tensor.movedim(0, self.dim) if self.dim else tensor

    def dim0_shape(self, shape: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """``shape`` (default: the full one) in the dim-0 view."""
        shape = self.shape if shape is None else shape
        return (shape[self.dim], *shape[: self.dim], *shape[self.dim + 1 :])

    def padded_dim0_shard(self, shard: torch.Tensor) -> torch.Tensor:
        """This rank's shard in the dim-0 view, contiguous and zero-padded to ``chunk`` rows."""
        dim0 = self.to_dim0(shard)
        missing = self.chunk - dim0.shape[0]
        if missing == 0:
            return dim0.contiguous()
        padded = dim0.new_zeros((self.chunk, *dim0.shape[1:]))
        padded[: dim0.shape[0]].copy_(dim0)
        return padded

    def full_from_gathered(self, gathered: torch.Tensor) -> torch.Tensor:
        """The full tensor from the all-gather of every rank's :meth:`padded_dim0_shard` (dim-0 concat)."""
        return self.from_dim0(gathered.narrow(0, 0, self.size))
