"""Keys of the FSDP annotation that traced nodes carry in ``node.meta["custom"]``.

``fsdp_compile.compile.param_reads`` writes the per-parameter keys on every node of a parameter's traced
unshard; ``passes/bucket.py`` writes all of them on the nodes of a bucket. The passes read them
through ``fsdp_compile.passes.graph`` (which re-exports these names). The keys live in a module of
their own because compile/param_reads.py is imported before ``fsdp_compile.passes`` can be (a source
checkout maps ``passes/`` in late, see ``_find_checkout_passes``).

Example::

    {FSDP_ANNOTATION_KEY: True, GROUP_KEY: "layers.0", PARAM_KEY: "attention.wq.weight",
     RESHARD_AFTER_FORWARD_KEY: True, STATE_KEY: 7}
"""
from __future__ import annotations

__all__ = [
    "FSDP_ANNOTATION_KEY", "GROUP_KEY", "PARAM_KEY", "RESHARD_AFTER_FORWARD_KEY", "STATE_KEY", "KEEPS_GATHERED_KEY",
    "BUCKET_KEY", "GROUPS_KEY", "PARAMS_KEY", "BLOCK_FRAME_TOKEN", "fsdp_annotation",
]

# Per parameter (compile/param_reads.py).
FSDP_ANNOTATION_KEY = "fsdp"  # True: the tag that makes a node an FSDP node
GROUP_KEY = "fsdp_group"  # the fully_shard group's label; a merged bucket's labels joined by "+"
PARAM_KEY = "fsdp_param"  # the parameter's FQN in its module
RESHARD_AFTER_FORWARD_KEY = "fsdp_reshard_after_forward"
# The FSDPState's process-unique token: tells apart groups of the same label in two models.
STATE_KEY = "fsdp_state"
# STATE_KEY of every block compiled as a frame: one graph serves them all, so none is named in it
# ([Note: blocks compiled as frames] in frames.py).
BLOCK_FRAME_TOKEN = -1
# Present (True) on the reads of a group outside blocks compiled as frames whose all-gather goes through
# the runtime, which may serve it from, or keep, the parameters gathered across a backward
# (set_reshard_after_backward(False): [Note: keeping parameters gathered across a backward] in kept_gathers.py),
# or copies its CPU-offloaded shards to the device ([Note: offloaded shards under whole-model compile] in param_reads.py).
KEEPS_GATHERED_KEY = "fsdp_keeps_gathered"

# Per bucket (passes/bucket.py), beside the keys above.
BUCKET_KEY = "fsdp_bucket"  # "all_gather" | "reduce_scatter": present once a node is bucketed
GROUPS_KEY = "fsdp_groups"  # the group labels in the bucket, in order
PARAMS_KEY = "fsdp_params"  # the parameter FQNs in the bucket, in copy-in order


def fsdp_annotation(node: object) -> dict | None:
    """The FSDP annotation of an FX node (``node.meta["custom"]`` with the FSDP tag), or None."""
    custom = node.meta.get("custom")  # type: ignore[attr-defined]
    if isinstance(custom, dict) and custom.get(FSDP_ANNOTATION_KEY):
        return custom
    return None
