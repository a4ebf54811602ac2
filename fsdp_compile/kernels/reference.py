"""Plain-torch copy-in / copy-out for one parameter group: the definition of what the kernels compute.

Layout shared by all four operations (see docs/design.md section 4). A group of N parameters
is sharded on dim 0 over ``world`` ranks; parameter ``i`` has ``padded_numels[i]`` elements
per rank (``ceil(dim0 / world) * prod(shape[1:])``) and starts at column
``offsets[i] = sum(padded_numels[:i])`` of the flat per-rank buffer of
``total = sum(padded_numels)`` elements. The unsharded parameter, flattened, is the
rank-major concatenation of its ``world`` padded chunks, cut to its true numel::

    all-gather output [world, total]     rank r's row:  | p0 chunk r | p1 chunk r | ... |
    unsharded p_i (flat)                 = row 0 chunk i ++ row 1 chunk i ++ ... [: numel_i]

Every cast rounds to nearest even (``Tensor.to`` / ``copy_`` semantics). These functions
run on any device; they are the CPU implementation and the reference for the Triton ones.
"""
from __future__ import annotations

import torch

__all__ = [
    "all_gather_copy_in",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_out",
]


def _offsets(padded_numels: list[int]) -> list[int]:
    offsets, running = [], 0
    for padded in padded_numels:
        offsets.append(running)
        running += padded
    return offsets


def all_gather_copy_in(shards: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor) -> None:
    """Write each shard, cast to ``out.dtype``, then zeros up to its padded size, into flat ``out``."""
    for shard, padded, offset in zip(shards, padded_numels, _offsets(padded_numels)):
        numel = shard.numel()
        out[offset : offset + numel].copy_(shard.reshape(-1))
        out[offset + numel : offset + padded].zero_()


def all_gather_copy_out(gathered: torch.Tensor, padded_numels: list[int], outs: list[torch.Tensor]) -> None:
    """Fill each unsharded ``outs[i]`` (contiguous) from ``gathered`` [world, total], casting to its dtype."""
    for out, padded, offset in zip(outs, padded_numels, _offsets(padded_numels)):
        flat_out = out.view(-1)
        numel = flat_out.numel()
        if numel == 0:
            continue
        full_rows, remainder = divmod(numel, padded)
        columns = gathered[:, offset : offset + padded]
        flat_out[: full_rows * padded].view(full_rows, padded).copy_(columns[:full_rows])
        if remainder:
            flat_out[full_rows * padded :].copy_(columns[full_rows, :remainder])


def reduce_scatter_copy_in(
    grads: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor, pre_divide: float
) -> None:
    """Lay each unsharded gradient into ``out`` [world, total] (cast, zero-padded), then divide by ``pre_divide``."""
    world = out.shape[0]
    for grad, padded, offset in zip(grads, padded_numels, _offsets(padded_numels)):
        if padded == 0:
            continue
        flat_grad = grad.reshape(-1)
        full_rows, remainder = divmod(flat_grad.numel(), padded)
        columns = out[:, offset : offset + padded]
        columns[:full_rows].copy_(flat_grad[: full_rows * padded].view(full_rows, padded))
        if full_rows < world:
            columns[full_rows, :remainder].copy_(flat_grad[full_rows * padded :])
            columns[full_rows, remainder:].zero_()
            columns[full_rows + 1 :].zero_()
    if pre_divide != 1.0:
        out.div_(pre_divide)


def reduce_scatter_copy_out(
    reduced: torch.Tensor,
    padded_numels: list[int],
    outs: list[torch.Tensor],
    post_divide: float,
    accumulate: bool,
) -> None:
    """Write (or add) ``reduced[offset_i : offset_i + outs[i].numel()] / post_divide`` into each sharded grad.

    The divide happens in ``reduced.dtype``, then the cast to the gradient's dtype, then the add.
    """
    for out, offset in zip(outs, _offsets(padded_numels)):
        numel = out.numel()
        value = reduced[offset : offset + numel]
        if post_divide != 1.0:
            value = value / post_divide
        value = value.to(out.dtype).view(out.shape)
        if accumulate:
            out.add_(value)
        else:
            out.copy_(value)
