"""What a build costs and leaves behind: its peak memory (this process, its children, the GPU) and the child processes a
failed build must not leave running.
"""

from __future__ import annotations

import contextlib
from typing import Callable


@contextlib.contextmanager
def frozen_heap():
    """While a build runs, the objects alive before it are out of the cyclic garbage collector's reach (`gc.freeze`),
    so that its full passes, which TRL's Trainer asks for at each `train()`, walk the build's own objects only
    (docs/ARCHITECTURE.md, the collector's passes). At the end, while they are still out of reach, one pass frees the
    build's own cyclic garbage (its trainer and model); then they are unfrozen, so nothing stays out of reach."""
    import gc

    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()


class PeakMemory:
    """The most resident memory the build held: this process and every process under it (a launch's ranks), sampled by a
    thread every `interval` seconds, and this process's own exact peak where Linux keeps it (VmHWM, reset at the start
    through /proc/self/clear_refs); what this process held when the build began; and the most GPU memory torch allocated
    (in this process, or rank 0's from its `training.json`). Sampling more often than every 0.5 s cost measurable CPU
    (bench.overhead)."""

    def __init__(self, interval: float = 0.5):
        import threading

        self.interval, self.peak, self.before = interval, 0, 0
        self._stop, self._thread = (
            threading.Event(),
            threading.Thread(target=self._sample, name="rlhf-peak-memory", daemon=True),
        )

    def __enter__(self) -> PeakMemory:
        import psutil

        self._process = psutil.Process()
        self.before = self.peak = self._process.memory_info().rss
        # Processes already running (a temporary Prefect server, a test's servers) are not the build's.
        self._others = {child.pid for child in self._process.children(recursive=True)}
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # resets VmHWM, the process's peak resident set, to what it holds now
            self._hwm = True
        except OSError:
            self._hwm = False
        self._torch = _cuda_torch()
        if self._torch is not None:
            self._torch.cuda.reset_peak_memory_stats()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._measure()
        if self._hwm:
            with open("/proc/self/status") as status:
                kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
            self.peak = max(self.peak, kib * 1024)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._measure()

    def _measure(self) -> None:
        import psutil

        total = 0
        for process in [
            self._process,
            *(child for child in self._process.children(recursive=True) if child.pid not in self._others),
        ]:
            with contextlib.suppress(psutil.Error):
                total += process.memory_info().rss
        self.peak = max(self.peak, total)

    def figures(self, training: dict | None) -> dict[str, float]:
        """MiB, for the manifest's `resources` and the `<stage>/memory/*` metrics."""
        from rlhf_pipeline.trainers.algorithms.loop import PEAK_GPU

        mib = 2**20
        figures = {"peak_rss_mb": round(self.peak / mib, 1), "rss_before_mb": round(self.before / mib, 1)}
        gpu = (training or {}).get(PEAK_GPU)
        if gpu is None and self._torch is not None:
            gpu = self._torch.cuda.max_memory_allocated()
        if gpu is not None:
            figures["peak_gpu_mb"] = round(gpu / mib, 1)
        return figures


def _cuda_torch():
    """torch, when a trainer already imported it and a GPU is there (the Prefect side never imports torch itself)."""
    import sys

    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_available() else None


def child_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def kill_process(pid: int, log: Callable[[str], None]) -> None:
    import psutil

    try:
        process = psutil.Process(pid)
        name = process.name()
        process.kill()
        process.wait(10)
        log(f"killed child process {pid} ({name}) left by the failed stage")
    except psutil.Error:
        pass  # already gone


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it): for a server this project starts."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
