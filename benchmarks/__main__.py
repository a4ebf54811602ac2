"""Entry point of ``python -m benchmarks``; the work lives in an importable module so spawned ranks can find it."""
from benchmarks.demo import main

if __name__ == "__main__":
    main()
