"""How fast this machine is at the three kinds of work the suite and the benches do, so that figures taken on different
VMs can be compared: the Python interpreter, a fresh process importing torch, and a float32 matrix product.

    python -m bench.machine              # ~30 s, on a quiet machine; no verdict (it is a ruler), exit 0

Each figure is the best of `--repeats`: a loop of 5 million additions in Python (ns per iteration), `python -c "import
torch"` in a new process (seconds, wall), and 20 products of two 1024 x 1024 float32 matrices on one thread
(GFLOP/s). PERFORMANCE.md keeps the figures of each VM a suite time was measured on.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

LOOP = 5_000_000


def interpreter() -> float:
    """Nanoseconds per iteration of a plain Python loop."""
    started = time.perf_counter()
    total = 0
    for i in range(LOOP):
        total += i
    return (time.perf_counter() - started) / LOOP * 1e9


def import_torch() -> float:
    """Seconds for a new Python process to import torch and exit."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - started


def matmul(size: int = 1024, products: int = 20) -> float:
    """float32 GFLOP/s of one thread."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    started = time.perf_counter()
    for _ in range(products):
        a @ b
    return 2 * size**3 * products / (time.perf_counter() - started) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.machine", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    loop = min(interpreter() for _ in range(args.repeats))
    started = min(import_torch() for _ in range(args.repeats))
    flops = max(matmul() for _ in range(args.repeats))
    print(
        f"machine: Python loop {loop:.1f} ns/iteration, import torch in a new process {started:.2f} s, float32 matmul "
        f"{flops:.1f} GFLOP/s on one thread (best of {args.repeats})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
