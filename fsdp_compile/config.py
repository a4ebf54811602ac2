"""Runtime switches of fsdp_compile, in one place.

Set them as module attributes before the code they affect runs::

    import fsdp_compile
    fsdp_compile.config.skip_fsdp_hooks = True
"""
from __future__ import annotations

from typing import Literal

__all__ = [
    "skip_fsdp_hooks", "graph_check_timeout_s", "block_compile", "BLOCK_COMPILE_CHOICES", "block_compile_is",
    "graphs_outside_blocks", "GRAPHS_OUTSIDE_BLOCKS_CHOICES", "graphs_outside_blocks_is",
]

# Under torch.compile, run the FSDP hooks eagerly between compiled regions (graph breaks)
# instead of tracing collectives into the graph. Numerics equal the eager runtime.
skip_fsdp_hooks: bool = False

# How long a rank that compiled a graph with new collectives waits (in the store, not in a
# collective) for the other ranks to compile the same; see [Note: cross-rank graph check].
graph_check_timeout_s: float = 300.0

# How a whole-model torch.compile under fsdp_inductor (and fsdp_aot_eager) compiles the fully_shard
# blocks inside the model (another backend, trace_context.traced_for_an_fsdp_backend, always traces them inline):
# - "frames" (the default): each block is a Dynamo frame of its own, one graph for all identical blocks
#   (compile time flat with depth); its graph all-gathers the block (a node that takes the all-gather
#   the block before it issued ahead, and issues the next block's), and its backward gathers again and
#   reduce-scatters in its graph. Where a trace may not break (fullgraph=True, a block called inside its
#   caller's checkpoint()), blocks are regions as below. See [Note: blocks compiled as frames] in frames.py.
# - "regions": the whole model is one graph, each block a nested compile region of it whose body is
#   compiled once for all identical blocks ([Note: compile once per block] in regions.py); its
#   collectives are graph nodes that the passes bucket and reorder across blocks, at a compile time
#   that grows with depth.
# - "inline": one graph, every block traced inline.
BLOCK_COMPILE_CHOICES = ("frames", "regions", "inline")
block_compile: Literal["frames", "regions", "inline"] = "frames"


def block_compile_is(mode: str) -> bool:
    """Whether ``block_compile`` is ``mode``; a value outside ``BLOCK_COMPILE_CHOICES`` is refused with
    the values allowed.

    Example::

        fsdp_compile.config.block_compile = "regions"
        assert fsdp_compile.config.block_compile_is("regions")
    """
    return _setting_is("block_compile", block_compile, mode, BLOCK_COMPILE_CHOICES)


def _setting_is(name: str, value: str, asked: str, choices: tuple[str, ...]) -> bool:
    """Whether the setting ``name`` (now ``value``) is ``asked``; a value or question outside ``choices``
    is refused with the values allowed."""
    if value not in choices or asked not in choices:
        wrong = value if value not in choices else asked
        raise ValueError(f"fsdp_compile.config.{name} = {wrong!r}: choose one of {', '.join(map(repr, choices))}")
    return value == asked


# With blocks as frames, the code of a whole-model compile around the blocks (a causal mask, rotary
# embeddings, the final norm, the head) is split by the blocks' graph breaks into frames of its own, a
# graph each; those that hold no FSDP work (no collective, no parameter read that gathers) are:
# - "eager" (the default): run as Dynamo traced them (the graph's own Python code, autograd as eagerly),
#   without AOTAutograd or Inductor, as FSDP2's per-block compile runs the code around its blocks: each
#   such graph cost a code generation forward and backward, most of the cold compile beyond FSDP2 per
#   block's ([Note: graphs outside blocks run as traced] in compile/policy.py);
# - "inductor": compiled by Inductor as any graph.
GRAPHS_OUTSIDE_BLOCKS_CHOICES = ("eager", "inductor")
graphs_outside_blocks: Literal["eager", "inductor"] = "eager"


def graphs_outside_blocks_is(mode: str) -> bool:
    """Whether ``graphs_outside_blocks`` is ``mode``; a value outside ``GRAPHS_OUTSIDE_BLOCKS_CHOICES`` is
    refused with the values allowed."""
    return _setting_is("graphs_outside_blocks", graphs_outside_blocks, mode, GRAPHS_OUTSIDE_BLOCKS_CHOICES)


# --- Graph passes of backend="fsdp_inductor" / "fsdp_aot_eager" (docs/design.md section 5.3) ------

import os as _os  # noqa: E402
from dataclasses import dataclass as _dataclass  # noqa: E402


BUCKET_COPY_CHOICES = ("auto", "ops", "inductor")
# On CUDA the bucket copies are the kernel table's faster: see "Bucket copies on CUDA" in docs/gpu.md.
CUDA_BUCKET_COPY = "ops"


@_dataclass(frozen=True)
class PassConfig:
    """Knobs of the post-grad passes; read once when the backend compiles a graph.

    Example::

        fsdp_compile.config.passes = fsdp_compile.config.PassConfig(prefetch_depth=2)
    """

    # One all-gather and one reduce-scatter (plus one HSDP all-reduce) per fully_shard group.
    bucket: bool = True
    # Merge adjacent groups' buckets while the merged bucket's unsharded bytes stay <= this cap.
    # 0 keeps exactly one bucket per group (what eager FSDP does).
    merge_small_groups_bytes: int = 0
    # Issue all-gathers ahead of their use and wait on collectives late (passes/reorder.py).
    reorder: bool = True
    # All-gathers are issued this many groups ahead of their use, and up to this many
    # reduce-scatters stay in flight before the oldest is waited on (0: no overlap).
    prefetch_depth: int = 1
    # Bound on the bytes of collectives issued and not yet waited on (all-gather outputs and
    # reduce-scatter inputs: the unsharded buckets they keep allocated); None: no bound. A prefetch
    # that does not fit is postponed; a collective that must issue first waits on older ones.
    max_inflight_bytes: int | None = None
    # How a bucket of several parameters is copied into the all-gather input and out of its output:
    # "ops", one extern node each (fsdp_compile's copy-in / copy-out ops: the Triton kernels on CUDA);
    # "inductor", a cat of per-parameter casts and per-parameter slices that Inductor fuses and
    # generates code for; "auto", the one measured faster on the graph's device (CUDA_BUCKET_COPY).
    bucket_copy: str = "auto"
    # FSDP_COMPILE_DUMP=dir: each graph before and after each pass, plus a collectives timeline.
    dump_dir: str | None = None

    def __post_init__(self) -> None:
        if self.bucket_copy not in BUCKET_COPY_CHOICES:
            raise ValueError(f"PassConfig.bucket_copy={self.bucket_copy!r}: choose one of {', '.join(BUCKET_COPY_CHOICES)}")

    def bucket_copy_for(self, device: "torch.device") -> str:
        """``bucket_copy`` with "auto" decided for ``device``: "ops" or "inductor"."""
        if self.bucket_copy != "auto":
            return self.bucket_copy
        return CUDA_BUCKET_COPY if device.type == "cuda" else "ops"

    def resolved(self) -> "PassConfig":
        """This config with ``dump_dir`` taken from ``FSDP_COMPILE_DUMP`` when unset."""
        if self.dump_dir is None and _os.environ.get("FSDP_COMPILE_DUMP"):
            from dataclasses import replace

            return replace(self, dump_dir=_os.environ["FSDP_COMPILE_DUMP"])
        return self


passes: PassConfig = PassConfig()
__all__ += ["PassConfig", "passes"]
