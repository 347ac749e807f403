"""Failures no retry can fix, told apart from those a retry can: out of device memory, corrupt weights, refused
credentials, a missing or gated repository, the hub switched off, no permission, a full disk. Each gets a sentence
that says what to do; everything else (a dropped connection, a lost device, a killed process) is retried by the
stage's task.

No torch, transformers or huggingface_hub import: exceptions are recognised by class name and errno, so the flow's
retry condition can classify them cheaply.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

HUB_REFUSALS = frozenset(
    {
        "RepositoryNotFoundError",
        "GatedRepoError",
        "RevisionNotFoundError",
        "EntryNotFoundError",
        "DatasetNotFoundError",
        "DisabledRepoError",
    }
)
CORRUPT = ("SafetensorError", "HeaderTooLarge", "Error while deserializing header", "incomplete metadata")


def causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception and those it was raised from or during, outermost first (each once)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def permanent_reason(exc: BaseException) -> str | None:
    """Why no retry can help, in words, or None when a retry may."""
    for cause in causes(exc):
        name, text = type(cause).__name__, str(cause)
        first = text.strip().splitlines()[0] if text.strip() else name
        if name == "OutOfMemoryError" or "out of memory" in text.lower():
            return (
                "out of device memory: the same config runs out again; lower per_device_train_batch_size or "
                f"max_length, or train LoRA adapters ({first})"
            )
        if "OfflineModeIsEnabled" in (name, text) or "(OfflineModeIsEnabled)" in text:  # a ConnectionError by
            # class (datasets re-raises it as a bare one, naming it), but no retry reaches the hub
            return f"the hub is switched off here (HF_HUB_OFFLINE=1) and this is not in the local cache: {first}"
        if name in HUB_REFUSALS:
            return f"the hub has no such repository or revision, or refuses this token (gated or private): {first}"
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if status in (401, 403):
            return f"credentials refused (HTTP {status}): {first}"
        if name in CORRUPT or any(mark in text for mark in CORRUPT):
            return f"a weights file is corrupt or truncated: {first}"
        if isinstance(cause, PermissionError):
            return f"no permission: {first}"
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"the disk is full: {first}"
    return None


PERMANENT = (ValueError, TypeError, KeyError, ImportError, NotImplementedError)
"""Errors no retry can fix (bad config or data); `tasks.orchestration.stage_task` retries every other one."""
