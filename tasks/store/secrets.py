"""Secrets never reach MLflow, manifests or logs.

A value is a secret when its config key is named like one (`hub_token`,
`password`, `api_key`, `aws_secret_access_key`, `Authorization`, ...), when it
is the value of an environment variable named like one (`HF_TOKEN`,
`MLFLOW_TRACKING_PASSWORD`, `AZURE_STORAGE_CONNECTION_STRING`, ...), or when it
is the user info of a URI (`postgresql://user:password@host/db`) or a secret in its
query (an Azure SAS or presigned URL's signature, `?token=`), wherever the URI appears.
Secrets belong in the environment or a Prefect Secret block: flow-run
parameters are stored by Prefect as given.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

MASK = "***"
# Not `pad_token` or `max_new_tokens`: tokenizer words are not secrets
SECRET_KEY = re.compile(
    r"^(token|password|passwd|secret|api_?key|credentials?|private_key|authorization|cookie|x-api-key|dsn)$"
    r"|(hub|hf|auth|access|api|bearer|refresh|session|sas|id)_token$"
    r"|(^|_)(secret_access_key|access_key(_id)?|connection_string|auth_string)$"
    r"|_(password|passwd|secret|api_?key|secret_key|credentials?)$",
    re.IGNORECASE,
)
SECRET_ENV = re.compile(
    r"token|password|passwd|secret|api_?key|credential|private_key|access_key|auth_string|authorization"
    r"|connection_string$|_dsn$",
    re.IGNORECASE,
)
MIN_SECRET_LENGTH = 8  # a shorter value is masked too unless it reads as a setting ("false", "1", "none")
SETTINGS = frozenset({"true", "false", "yes", "no", "on", "off", "none", "null", "auto"})
URI_CREDENTIALS = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^\s/@?#]+)@")
"""`scheme://user:password@host`: the user info, masked whole wherever a URI appears (a database URI, a tracking
server's, a proxy's)."""


QUERY_SECRET = re.compile(
    r"([?&](?:sig|signature|x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|x-goog-credential"
    r"|password|passwd|pwd|token|access_token|id_token|api_?key|apikey|secret|client_secret|code|auth|key)=)"
    r"[^&#\s'\"]+",
    re.IGNORECASE,
)
"""A secret in a URI's query: an Azure SAS or a presigned S3/GCS URL's signature and credential, a password or token
parameter. Masked wherever a URI appears, as the user info is."""


def secret_like(value: str) -> bool:
    return len(value) >= MIN_SECRET_LENGTH or (
        len(value) >= 4 and not value.isdigit() and value.lower() not in SETTINGS
    )


def credentials(text: str) -> set[str]:
    """The user info of every URI in `text` that holds a password or a token, and each password alone (as given and
    URL-decoded)."""
    from urllib.parse import unquote

    found = set()
    for match in URI_CREDENTIALS.finditer(text):
        userinfo = match.group(2)
        user, colon, password = userinfo.partition(":")
        if colon:
            found.add(userinfo)
            found.update(word for word in (password, unquote(password)) if secret_like(word))
        elif len(user) >= MIN_SECRET_LENGTH:  # `https://<token>@host`; a short user name alone is no secret
            found.add(user)
    return found


def secret_values() -> list[str]:
    """The values of secret-named environment variables, and the credentials inside any variable's URIs
    (`DATABASE_URL`, `MLFLOW_TRACKING_URI`, `HTTPS_PROXY`), longest first."""
    found: set[str] = set()
    for name, value in os.environ.items():
        if SECRET_ENV.search(name) and secret_like(value):
            found.add(value)
        if "://" in value:
            found.update(credentials(value))
    return sorted(found, key=len, reverse=True)


def mask_uri(uri: str) -> str:
    """`uri` with its user info and its query's secrets masked: `postgresql://***@db:5432/mlflow`,
    `https://acct.blob.core.windows.net/c/f?sv=2022-11-02&sig=***`."""
    return QUERY_SECRET.sub(rf"\1{MASK}", URI_CREDENTIALS.sub(rf"\1{MASK}@", uri))


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
    """`text` with every URI's user info, every secret value of the environment and `extra` masked."""
    text = mask_uri(text)
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
        if record.exc_info and not record.exc_text:  # the traceback, which formatters take from exc_text once set
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
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
