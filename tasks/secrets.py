"""Secrets never reach MLflow, manifests or logs.

A value is a secret when its config key is named like one (`hub_token`,
`password`, `api_key`, ...) or when it is the value of an environment
variable named like one (`HF_TOKEN`, `MLFLOW_TRACKING_PASSWORD`, ...).
Secrets belong in the environment or a Prefect Secret block: flow-run
parameters are stored by Prefect as given.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

MASK = "***"
SECRET_KEY = re.compile(
    r"^(token|password|passwd|secret|api_?key|credentials?|private_key)$"
    r"|(hub|hf|auth|access|api|bearer|refresh|session)_token$"
    r"|_(password|passwd|secret|api_?key|secret_key|credentials?)$",
    re.IGNORECASE,
)  # not `pad_token` or `max_new_tokens`: tokenizer words are not secrets
SECRET_ENV = re.compile(r"token|password|passwd|secret|api_?key|credential|private_key", re.IGNORECASE)
MIN_SECRET_LENGTH = 8  # shorter env values ("false", "1") are settings, not secrets


def secret_values() -> list[str]:
    found = {value for name, value in os.environ.items() if SECRET_ENV.search(name) and len(value) >= MIN_SECRET_LENGTH}
    return sorted(found, key=len, reverse=True)


def redact(value: Any, key: str = "") -> Any:
    """A copy of a config (dicts, lists, scalars) with secret values masked."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, key) for v in value]
    if key and SECRET_KEY.search(key) and value not in (None, ""):
        return MASK
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_text(text: str, extra: list[str] = ()) -> str:
    for secret in [*secret_values(), *extra]:
        text = text.replace(secret, MASK)
    return text


class RedactSecrets(logging.Filter):
    """Masks secrets in every record a handler emits (the Prefect UI's logs, the console)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def install_log_filter() -> None:
    """Attach RedactSecrets to every handler of the `prefect` and library loggers (idempotent)."""
    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, RedactSecrets) for f in handler.filters):
                handler.addFilter(RedactSecrets())
