"""A rank that dies mid-step makes the others fail fast, naming the collective: never a hang."""
from __future__ import annotations

import os
import queue
import sys
import time
from datetime import timedelta

import torch.multiprocessing as mp

from conftest import REPO_DIR, TESTS_DIR, free_port

COLLECTIVE_TIMEOUT_S = 10


def _train_then_die(rank: int, port: int, results) -> None:
    sys.path[:0] = [TESTS_DIR, REPO_DIR]
    import torch
    import torch.distributed as dist

    from fsdp_compile import fully_shard
    from fsdp_compile.models import next_token_loss
    from fsdp_testing import build_reference, global_batches, local_part, shard_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    model = shard_model(build_reference(), fully_shard)
    tokens = local_part(global_batches(1, 2, 2)[0])
    next_token_loss(model(tokens), tokens).backward()
    if rank == 1:
        results.close()
        os._exit(1)  # dies between steps, without a word to its peers
    start = time.monotonic()
    try:
        next_token_loss(model(tokens), tokens).backward()
        results.put(("no error", time.monotonic() - start))
    except Exception as error:  # noqa: BLE001
        results.put((str(error), time.monotonic() - start))
    results.close()
    results.join_thread()  # os._exit skips the queue's flush
    os._exit(0)  # the process group cannot be shut down cleanly without its peer


def test_dead_rank_makes_survivor_fail_with_named_collective():
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_train_then_die, args=(rank, port, results)) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        message, seconds = results.get(timeout=COLLECTIVE_TIMEOUT_S * 6)
    except queue.Empty:
        raise AssertionError("the surviving rank hung instead of failing") from None
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    assert "fsdp_compile: all-gather of the fully_shard group 'Transformer' failed on rank 0" in message, message
    assert seconds < COLLECTIVE_TIMEOUT_S * 3
