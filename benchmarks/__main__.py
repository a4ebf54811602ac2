"""``python -m benchmarks``: every FSDP mode on one model, data and seed, in one run (``--help`` for flags).

The work lives in importable modules (config, modes, measure, run, report) so spawned ranks find it.
"""
from __future__ import annotations

from benchmarks.config import parse_args
from benchmarks.launch import launch, pick_device_type
from benchmarks.run import worker


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    if config.compile_scaling is not None:
        from benchmarks.scaling import run_compile_scaling

        run_compile_scaling(config, pick_device_type(config.device))
        return
    launch(worker, config.world_size, pick_device_type(config.device), config)


if __name__ == "__main__":
    main()
