"""SIGTERM ends training with a checkpoint: a Kubernetes eviction, a spot preemption or Prefect's cancel asks the
process to go, and every stage that is training writes a checkpoint at the end of its current step and stops; the
process then ends as the signal would have ended it, at most a grace period later. The retry (the next attempt of the
flow run) resumes from that checkpoint, as from any other.

`checkpoint_on_sigterm()` is entered by the flow run's main thread (`tasks.orchestration.parent_run`) and by each
launched rank (`trainers.runtime.rank`); training loops ask `stop_requested()` after each step, all ranks of a launch
agreeing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

GRACE_ENV = "RLHF_STOP_GRACE_SECONDS"
DEFAULT_GRACE = 25.0
"""Seconds a SIGTERM waits for the stages' checkpoints before the process ends anyway: under Kubernetes' default
terminationGracePeriodSeconds (30), after which SIGKILL comes."""

TERMINATING = threading.Event()
"""Set by SIGTERM; training loops stop at their next step's end."""

_training: set[int] = set()
"""The threads inside `training()`."""
_idle = threading.Condition()


class Terminated(RuntimeError):
    """A stage stopped by SIGTERM after writing its checkpoint: transient (the next attempt resumes from it), and never
    retried in the process that is going away."""


def grace_seconds() -> float:
    return float(os.environ.get(GRACE_ENV) or DEFAULT_GRACE)


@contextlib.contextmanager
def training() -> Iterator[None]:
    """Held while a stage trains: SIGTERM waits (up to the grace period) for every holder to checkpoint and leave."""
    ident = threading.get_ident()
    with _idle:
        _training.add(ident)
    try:
        yield
    finally:
        with _idle:
            _training.discard(ident)
            _idle.notify_all()


def wait_for_checkpoints(grace: float) -> bool:
    """Wait up to `grace` seconds for every stage that is training to checkpoint and leave; whether they all did."""
    with _idle:
        return _idle.wait_for(lambda: not _training, timeout=grace)


def _pass_on(previous, signum: int, frame) -> None:
    """End the process as the signal would have without us: the previous handler (Prefect's raises its
    TerminationSignal), or the default action."""
    signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous in (signal.SIG_DFL, None):
        os.kill(os.getpid(), signum)


@contextlib.contextmanager
def checkpoint_on_sigterm() -> Iterator[None]:
    """While inside (main thread only; elsewhere it does nothing), SIGTERM asks every training stage to checkpoint
    and stop, waits for them up to `grace_seconds()`, then passes the signal on (inside a Prefect flow run: Prefect's
    handler raises TerminationSignal, and the wait happens as it passes through this block). When the main thread
    trains itself, its stage raises `Terminated` after the checkpoint and the signal is passed on as it leaves this
    block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "__module__", "").startswith("prefect."):
        # Prefect's own handler stays: a runner's cancel is acknowledged (and ends CANCELLED, not CRASHED) only while
        # it is the installed one. It raises TerminationSignal here, in the main thread; the stages checkpoint first.
        try:
            yield
        except BaseException as exc:
            if type(exc).__name__ == "TerminationSignal":
                TERMINATING.set()
                wait_for_checkpoints(grace_seconds())
            raise
        return
    passed = threading.Event()

    def handler(signum, frame):
        TERMINATING.set()
        if threading.get_ident() in _training:
            return  # this very thread trains: it checkpoints at its step's end; leaving the block passes it on
        wait_for_checkpoints(grace_seconds())
        passed.set()
        _pass_on(previous, signum, frame)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, previous)
        if TERMINATING.is_set() and not passed.is_set():
            passed.set()
            _pass_on(previous, signal.SIGTERM, None)


_STOPPABLE = threading.local()


@contextlib.contextmanager
def stoppable(what: str) -> Iterator[None]:
    """Inside (a function it decorates, or a block), generation stops at its next step once SIGTERM reached the
    process (`stop_if_asked`): for work that keeps what it finished as it goes and has no step to checkpoint at
    (eval's answers, the pairs stage's samples). Training's rollouts are outside: they run to their step's end and
    its checkpoint (`stop_requested`)."""
    before = getattr(_STOPPABLE, "what", None)
    _STOPPABLE.what = what
    try:
        yield
    finally:
        _STOPPABLE.what = before


def stop_if_asked() -> None:
    """Raise `Terminated` inside `stoppable` once SIGTERM reached this process: the work stops at once instead of
    finishing after the signal (the process waited for it minutes on the real model)."""
    what = getattr(_STOPPABLE, "what", None)
    if what and TERMINATING.is_set():
        raise Terminated(f"SIGTERM: {what} stopped; what it finished is kept and the next attempt resumes from it")


def stop_requested() -> bool:
    """Whether to checkpoint and stop now: SIGTERM reached this process, or (under torch.distributed) any rank. Every
    rank must call it at the same step, as the training loops do at each step's end."""
    asked = TERMINATING.is_set()
    import sys

    if "torch" not in sys.modules:
        return asked
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import torch

        flag = torch.tensor([1.0 if asked else 0.0])
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        asked = bool(flag.item() > 0)
        if asked:
            TERMINATING.set()
    return asked


def checkpoint_callback():
    """The TrainerCallback of every TRL stage: on a stop request, save a checkpoint at this step and end training
    (`trainers.algorithms.loop.fit` then raises `Terminated`)."""
    from transformers import TrainerCallback

    class CheckpointOnSignal(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if stop_requested():
                control.should_save = True
                control.should_training_stop = True
            return control

    return CheckpointOnSignal()
