"""Start one process per rank: under ``torchrun`` use its ranks, else spawn them here.

CUDA + NCCL when GPUs are present (one per rank), CPU + gloo otherwise. The project never
writes its own transport: multi-node runs go through ``torchrun`` unchanged.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["launch", "pick_device_type"]


def pick_device_type(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine; use --device cpu")
    return requested


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_rank(rank: int, world_size: int, port: int, device_type: str, worker: Callable[..., Any], args: Any) -> None:
    _init(rank, world_size, device_type, f"tcp://127.0.0.1:{port}")
    try:
        worker(args)
    finally:
        dist.destroy_process_group()


def _init(rank: int, world_size: int, device_type: str, init_method: str | None) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        # Ranks share the machine's cores; more threads per rank only fight each other.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    backend = "nccl" if device_type == "cuda" else "gloo"
    kwargs = {"init_method": init_method} if init_method else {}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=10), **kwargs)


def launch(worker: Callable[[Any], None], world_size: int, device_type: str, args: Any) -> None:
    """Run ``worker(args)`` on every rank with the process group initialized."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        _init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device_type, None)
        try:
            worker(args)
        finally:
            dist.destroy_process_group()
        return
    if device_type == "cuda" and world_size > torch.cuda.device_count():
        raise SystemExit(f"--world-size {world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}")
    mp.spawn(_run_rank, args=(world_size, _free_port(), device_type, worker, args), nprocs=world_size, join=True)
