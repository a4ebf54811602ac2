"""``python -m benchmarks`` (see __main__.py): train a small Llama-style model with fsdp_compile on 2 ranks.

Prints the global loss and the step time of every step (rank 0).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks.launch import launch, pick_device_type
from fsdp_compile import MixedPrecisionPolicy, fully_shard
from fsdp_compile.models import Transformer, TransformerConfig, next_token_loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn when not started by torchrun (default 2)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA+NCCL if available, else CPU+gloo")
    parser.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step (default 4)")
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters for compute (fp32 reduction)")
    return parser.parse_args()


def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq)
    model = Transformer(config)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1 + rank)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"fsdp_compile demo: {params / 1e6:.1f}M parameters, {world} ranks, device {model.rope_cos.device}")
    for step in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        start = time.perf_counter()
        loss = next_token_loss(model(tokens), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        elapsed = time.perf_counter() - start
        if rank == 0:
            print(f"step {step:3d}  loss {global_loss.item() / world:.4f}  step time {elapsed * 1000:.1f} ms", flush=True)


def main() -> None:
    args = parse_args()
    launch(train, args.world_size, pick_device_type(args.device), args)


if __name__ == "__main__":
    main()
