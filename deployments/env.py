"""The environment of the pipeline's processes, in one place: read by the CLI (`rlhf run`, `rlhf serve`) and by the
deployments (`rlhf deploy`, checked against prefect.yaml by a test)."""

WORKER_ENV = {
    # Library logs (and our progress lines, logger `trainers`) reach the Prefect UI only when named here
    # (docs/LIBRARY-FACTS.md, Prefect).
    "PREFECT_LOGGING_EXTRA_LOGGERS": "transformers,trl,peft,accelerate,rlhf_pipeline",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}
"""What every flow run's process needs: `rlhf run`, `rlhf serve` (QUIET_ENV) and a work pool's runs (`rlhf deploy`,
prefect.yaml)."""

QUIET_ENV = {
    **WORKER_ENV,
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    # The temporary server's first start migrates a fresh database: 20 s (the default) is too
    # short on a busy 2-core machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


CONSOLE_SETTINGS = {
    # every library's tqdm bar (transformers, datasets, hub, Great Expectations); ours draws regardless
    "TQDM_DISABLE": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",  # load reports and advisories; --verbose brings them back
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # "Creating initial MLflow database tables...", the migrations of a fresh store
}
"""What `rlhf run` and `rlhf eval` set unless --verbose: a terminal a person reads."""
