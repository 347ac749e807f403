"""`rlhf up`: a local Prefect server, the MLflow UI and `rlhf serve`, started together and stopped together.

    rlhf up                     # Prefect UI http://127.0.0.1:4200, MLflow UI http://127.0.0.1:5000
    prefect deployment run rlhf/full -p ppo='{"kl_coef": 0.1}'   # in another shell, with
                                # PREFECT_API_URL=http://127.0.0.1:4200/api

Every server binds 127.0.0.1. Prefect's CSRF protection is on, CORS admits only the UI's origin, a request whose
`Host` is not the server's is refused (`deployments.prefect_app`; MLflow's server does the same), and basic
authentication is on, for Prefect and for the MLflow UI alike, when PREFECT_SERVER_API_AUTH_STRING is set (`guarded`,
`mlflow_auth`). Ctrl-C (or SIGTERM) stops the three processes by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from rlhf_pipeline.tasks.tracking import client as tracking

HOST = "127.0.0.1"


def wait_until_up(url: str, process: subprocess.Popen, timeout: float = 120) -> None:
    """Poll `url` until it answers 200; fail early, with the process's exit code, if it dies first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with code {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


def stop(processes: list[subprocess.Popen], grace: float = 20) -> None:
    """SIGTERM each process (by pid), then SIGKILL what is still alive after `grace` seconds."""
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
    deadline = time.time() + grace
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()


AUTH_ENV, CLIENT_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING"


def guarded(env: dict[str, str], ui: str) -> dict[str, str]:
    """Prefect's own protections on, where the operator has not set them: CSRF tokens on every changing request, CORS
    only for the UI's origin, and basic authentication when a secret is configured (`PREFECT_SERVER_API_AUTH_STRING`
    = `user:password`; the processes started here get it as clients too)."""
    guarded = {
        "PREFECT_SERVER_CSRF_PROTECTION_ENABLED": "true",
        "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": ui,
        **env,
    }
    if guarded.get(AUTH_ENV) and not guarded.get(CLIENT_AUTH_ENV):
        guarded[CLIENT_AUTH_ENV] = guarded[AUTH_ENV]
    return guarded


def mlflow_auth(auth_string: str) -> tuple[list[str], dict[str, str]]:
    """The MLflow server's arguments and environment that put its UI and API behind the same user and password as
    Prefect's: MLflow's basic-auth app, whose one user, its admin, is made afresh at every start (a changed password
    takes effect). The user and password reach MLflow in its environment (`MLFLOW_AUTH_ADMIN_USERNAME`/`_PASSWORD`,
    which MLflow reads before its config file): no file holds them, and the file, read by `configparser`, never meets
    a `%` of theirs. Its users database (a password hash) is removed at stop (`forget_mlflow_auth`)."""
    import secrets

    user, _, password = auth_string.partition(":")
    folder = tracking.state_dir() / "mlflow-auth"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    (folder / "users.db").unlink(missing_ok=True)
    config = folder / "basic_auth.ini"
    config.touch(mode=0o600)
    config.write_text(
        "[mlflow]\ndefault_permission = NO_PERMISSIONS\n"
        f"database_uri = sqlite:///{folder / 'users.db'}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    env = {
        "MLFLOW_AUTH_CONFIG_PATH": str(config),
        "MLFLOW_AUTH_ADMIN_USERNAME": user,
        "MLFLOW_AUTH_ADMIN_PASSWORD": password,
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32),
    }
    return ["--app-name", "basic-auth"], env


def forget_mlflow_auth() -> None:
    """What `mlflow_auth` left in the state folder once its server has stopped: the users database (the password's
    hash) and the config file."""
    import shutil

    shutil.rmtree(tracking.state_dir() / "mlflow-auth", ignore_errors=True)


MLFLOW_NO_JOBS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
"""The environment an MLflow server is started with unless the operator's says otherwise: without MLflow's job runner
(GenAI jobs; the pipeline submits none), eight or more processes that import MLflow and poll (`python -m
bench.mlflow_jobs`: an idle server's first minute, 28 CPU seconds with it, 6 without; docs/PERFORMANCE.md)."""


def mlflow_server(port: int, extra: list[str] = ()) -> list[str]:
    """The MLflow server `rlhf up` starts on the state folder's store: its UI, and the artifacts of the local store's
    runs served over http (a Data Docs page opens from the Prefect UI, `tracking.artifact_page`). Its uvicorn writes no
    line per request: the terminal keeps what people read."""
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        tracking.tracking_uri(),
        "--artifacts-destination",
        tracking.artifacts_root().as_uri(),
        "--host",
        HOST,
        "--port",
        str(port),
        "--uvicorn-opts=--no-access-log",
        *extra,
    ]


def up(port: int = 4200, mlflow_port: int = 5000, serve_args: list[str] = ()) -> int:
    api = f"http://{HOST}:{port}/api"
    mlflow_ui = f"http://{HOST}:{mlflow_port}"
    env = guarded({**os.environ, "PREFECT_API_URL": api}, f"http://{HOST}:{port}")
    if not tracking.tracking_uri().startswith("http"):
        env[tracking.UI_ENV] = mlflow_ui  # stages link their MLflow runs on the Prefect UI
    processes: list[subprocess.Popen] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run the `finally` below
    try:
        # Prefect's own server app, as `prefect server start` runs it, behind a check of the Host header
        app = [*("--factory", "rlhf_pipeline.deployments.prefect_app:create_app", "--lifespan", "on")]
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", *app, "--host", HOST, "--port", str(port)],
            env={**env, "PREFECT__SERVER_FINAL": "1"},
        )
        processes.append(server)
        if not tracking.tracking_uri().startswith("http"):
            tracking.state_dir().mkdir(parents=True, exist_ok=True)
            auth_args, auth_env = mlflow_auth(env[AUTH_ENV]) if env.get(AUTH_ENV) else ([], {})
            mlflow_env = {**MLFLOW_NO_JOBS, **env, **auth_env}
            processes.append(subprocess.Popen(mlflow_server(mlflow_port, auth_args), env=mlflow_env))
        wait_until_up(f"{api}/health", server)
        processes.append(subprocess.Popen([sys.executable, "-m", "rlhf_pipeline", "serve", *serve_args], env=env))
        print(f"\nPrefect UI: http://{HOST}:{port}   MLflow UI: {env.get(tracking.UI_ENV, tracking.shown_uri())}")
        if env.get(AUTH_ENV):
            print(
                f"Basic authentication on ({AUTH_ENV}) for the Prefect and the MLflow UI; clients set "
                f"{CLIENT_AUTH_ENV}=user:password."
            )
        else:
            print(
                f"No authentication: whoever reaches {HOST}:{port} can start runs. To require a password, restart with "
                f"{AUTH_ENV}=user:password (clients set {CLIENT_AUTH_ENV} to the same)."
            )
        print(f"Run:  PREFECT_API_URL={api} prefect deployment run rlhf/full\nCtrl-C stops everything.\n", flush=True)
        while all(process.poll() is None for process in processes):
            time.sleep(1)
        dead = next(process for process in processes if process.poll() is not None)
        print(
            f"{' '.join(map(str, dead.args[:4]))} exited with code {dead.returncode}; stopping the others",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop(processes)
        if env.get(AUTH_ENV) and not tracking.tracking_uri().startswith("http"):
            forget_mlflow_auth()
