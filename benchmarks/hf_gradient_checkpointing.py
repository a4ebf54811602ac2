"""``python -m benchmarks.hf_gradient_checkpointing [LAYERS ...]``: a Hugging Face Llama under gradient
checkpointing, compiled whole with ``fsdp_inductor``, its layers as block frames (the default) and as
regions of one graph (``fsdp_compile.config.block_compile = "regions"``).

Each (depth, mode) runs in fresh rank processes with an empty Inductor cache of its own; it prints
the first step's seconds (cold compile and one step) and the later steps' milliseconds. Needs
``transformers`` (``pip install transformers``), which the project does not install. 2 CPU ranks (gloo)
by default, or the launcher's ranks under ``torchrun``. See [Note: a block that checkpoints itself in
__call__] in fsdp_compile/module.py.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.launch import launch, pick_device_type

__all__ = ["main"]

STEPS = 4


@dataclass(frozen=True)
class _Run:
    layers: int
    as_frames: bool
    cache_dir: str
    device_type: str


def _one_run(run: _Run) -> None:
    import transformers

    from fsdp_compile import config, fully_shard

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = run.cache_dir
    config.block_compile = "frames" if run.as_frames else "regions"
    device = torch.device(run.device_type, torch.cuda.current_device()) if run.device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    model_config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=run.layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )
    model = transformers.LlamaForCausalLM(model_config).to(device)
    with warnings.catch_warnings():  # transformers 5.x deprecates the name, which Trainer still calls
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    runner = torch.compile(model, backend="fsdp_inductor")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    seconds = []
    for _ in range(STEPS):
        dist.barrier()
        start = time.perf_counter()
        runner(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        seconds.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        mode = "block frames" if run.as_frames else "regions"
        later = ", ".join(f"{s * 1000:.0f}" for s in seconds[1:])
        print(f"| {run.layers} | {mode} | {seconds[0]:.1f} | {later} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layers", nargs="*", type=int, default=[2, 8, 32], help="depths to run (default: 2 8 32)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("this benchmark needs transformers: pip install transformers") from None
    device_type = pick_device_type(args.device)
    print("| layers | mode | first step s (cold compile) | later steps ms |\n|---|---|---|---|", flush=True)
    scratch = tempfile.mkdtemp(prefix="fsdp_compile_hf_gc_")
    for layers in args.layers:
        for as_frames in (True, False):
            cache_dir = os.path.join(scratch, f"{layers}-{'frames' if as_frames else 'regions'}")
            launch(_one_run, args.world_size, device_type, _Run(layers, as_frames, cache_dir, device_type))


if __name__ == "__main__":
    main()
