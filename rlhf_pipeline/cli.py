"""`rlhf`: the command line.

rlhf run                                   # the embedded default (configs/tiny.yaml)
rlhf run --config my.yaml --set sft.learning_rate=1e-4 --set dpo.beta=0.2
rlhf run --no-cache                        # re-run every stage
rlhf params [--config ...] [--set ...]     # print the resolved parameters (--plan: the run's steps), run nothing
rlhf gc [--dry-run] [--keep-runs N]        # remove what no registered version, live run or recent run uses
rlhf check [--config ...] [--set ...]      # preflight: tokenizer, every data rule, token lengths, memory per stage;
                                           # trains nothing
rlhf eval models:/rlhf-policy@candidate    # evaluate a registered version (or a model folder) on demand
rlhf export models:/rlhf-policy@champion out/  # the model in Hub layout with its card: `hf upload <repo> out/`
rlhf serve                                 # serve the deployments (see deployments/serve.py)
rlhf deploy --pool rlhf-process            # register the same deployments on a work pool, for its workers
rlhf up                                    # a local Prefect server + MLflow UI + `rlhf serve`, until Ctrl-C
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

from pydantic import ValidationError

from rlhf_pipeline.deployments import temporary
from rlhf_pipeline.deployments.env import CONSOLE_SETTINGS, QUIET_ENV
from rlhf_pipeline.interrupt import stop_on_ctrl_c
from rlhf_pipeline.tasks.store.secrets import redact_text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="RLHF post-training pipeline (Prefect + MLflow + TRL).")
    commands = parser.add_subparsers(dest="command", required=True)
    # --config and --set, as run, params and check take them.
    preset = argparse.ArgumentParser(add_help=False)
    preset.add_argument("--config", default="tiny", help="preset name in configs/ or a YAML file (default: tiny)")
    preset.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set sft.learning_rate=1e-4 (repeatable)",
    )
    _pipeline_commands(commands, preset)
    _model_commands(commands)
    _service_commands(commands)
    return parser


def _pipeline_commands(commands, preset: argparse.ArgumentParser) -> None:
    """run, params and check: a preset and its overrides."""
    for name, help_text in (("run", "run the rlhf flow"), ("params", "print the resolved parameters as JSON")):
        sub = commands.add_parser(name, help=help_text, parents=[preset])
        sub.add_argument("--no-cache", action="store_true", help="re-run every stage even if its artifact exists")
        if name == "params":
            sub.add_argument("--plan", action="store_true", help="print the run's steps and their inputs")
        sub.add_argument(
            "--verbose",
            action="store_true",
            help="the libraries' own progress bars, log dicts and warnings, instead of one bar per stage",
        )
    check = commands.add_parser(
        "check", help="check a preset without training: data rules, token lengths, memory per stage", parents=[preset]
    )
    check.add_argument(
        "--report-dir",
        default=None,
        help="keep the validation reports and Data Docs here (default: a temporary folder)",
    )


def _model_commands(commands) -> None:
    """eval, export and label: a model, or a run that waits for labels."""
    evaluate = commands.add_parser("eval", help="evaluate a registered version or a model folder (the rlhf-eval flow)")
    evaluate.add_argument(
        "policy", help="models:/<name>/<version>, models:/<name>@<alias>, a model folder, or a GGUF file or package"
    )
    evaluate.add_argument(
        "--sft", default=None, help="the start to compare with (default: the version's lineage, else the policy)"
    )
    evaluate.add_argument("--rm", default=None, help="reward model (default: from the version's lineage)")
    evaluate.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override an eval field, e.g. --set eval.max_prompts=200",
    )
    export = commands.add_parser(
        "export", help="write a registered version or a model folder in Hub layout, with its model card (hf upload)"
    )
    export.add_argument("model", help="models:/<name>@<alias>, models:/<name>/<version>, or a model folder")
    export.add_argument("out", help="a new or empty folder")
    label = commands.add_parser(
        "label", help="resume a flow run that waits for people's labels of its pairs (as the UI's Resume form does)"
    )
    label.add_argument("flow_run_id", help="the waiting flow run (its id in the Prefect UI)")
    label.add_argument("--file", default=None, help='a JSONL of {"pair": <id>, "label": "A" | "B" | "tie" | null}')
    label.add_argument("labels", nargs="*", metavar="PAIR=LABEL", help="labels given here, e.g. 0=A 1=B 2=tie")
    label.add_argument(
        "--more", action="store_true", help="keep these labels and ask again for the pairs still unlabelled"
    )


def _service_commands(commands) -> None:
    """serve, deploy, gc and up: the pipeline as a service."""
    serve = commands.add_parser(
        "serve", help="serve the deployments (rlhf/full, one per other algorithm, rlhf/retrain, rlhf-eval/eval)"
    )
    deploy = commands.add_parser("deploy", help="register the same deployments on a work pool, for its workers to run")
    deploy.add_argument(
        "--pool",
        required=True,
        help="the work pool (e.g. one made by `prefect work-pool create rlhf-process --type process`)",
    )
    for sub in (serve, deploy):
        sub.add_argument("--config", default="tiny", help="preset whose parameters the deployments carry")
        sub.add_argument("--retrain-cron", default=None, help="cron of the retrain deployment (default: Mondays 03:00)")
        sub.add_argument(
            "--retrain-collision",
            choices=("queue", "cancel"),
            default="queue",
            help="a retrain (cron or rlhf.data.updated event) that finds one running waits for it (queue, the "
            "default) or is cancelled (cancel)",
        )
        sub.add_argument(
            "--retrain-set",
            dest="retrain_overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=(
                "override a field of the retrain deployment, e.g. --retrain-set "
                "'data.preference.path=/data/prefs/*.jsonl'"
            ),
        )
    gc = commands.add_parser(
        "gc", help="remove artifacts, checkpoints and MLflow weight copies nothing references (see --dry-run)"
    )
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed, with sizes; remove nothing")
    gc.add_argument(
        "--keep-runs", type=int, default=5, help="keep what the newest N runs of each experiment used (default 5)"
    )
    up = commands.add_parser(
        "up", help="start a local Prefect server, the MLflow UI and `rlhf serve` together (Ctrl-C stops all)"
    )
    up.add_argument("--port", type=int, default=4200, help="Prefect server port on 127.0.0.1 (default 4200)")
    up.add_argument("--mlflow-port", type=int, default=5000, help="MLflow UI port on 127.0.0.1 (default 5000)")
    up.add_argument("serve_args", nargs=argparse.REMAINDER, help="arguments passed on to `rlhf serve`")


def _label(args) -> int:
    """`rlhf label`: the labels of a file and of PAIR=LABEL items, sent to the waiting run."""
    from pathlib import Path

    from rlhf_pipeline.tasks.pairs import read_labels_file
    from rlhf_pipeline.tasks.people import resume_with_labels
    from rlhf_pipeline.trainers.pairs.stage import LABELS

    labels: dict[int, str] = {}
    if args.file:
        labels |= {k: v for k, v in read_labels_file(Path(args.file), 1 << 30).items() if v is not None}
    for item in args.labels:
        pair, _, label = item.partition("=")
        if not pair.isdigit() or label not in LABELS:
            print(f"rlhf label: {item!r}: expected PAIR=LABEL with LABEL one of {', '.join(LABELS)}", file=sys.stderr)
            return 2
        labels[int(pair)] = label
    resume_with_labels(args.flow_run_id, labels, finish=not args.more)
    print(f"flow run {args.flow_run_id} resumed with {len(labels)} labels")
    return 0


def _export(args) -> int:
    """`rlhf export`: the model in Hub layout (weights, tokenizer, generation config, card with held-out metrics)."""
    from pathlib import Path

    from rlhf_pipeline.tasks.tracking.cards import export

    try:
        export(args.model, Path(args.out))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    _make_state_folders()

    if args.command == "check":
        from rlhf_pipeline.check import check

        return check(args.config, args.overrides, args.report_dir)
    if args.command == "eval":
        return _evaluate(args)
    if args.command == "label":
        return _label(args)
    if args.command == "export":
        return _export(args)
    if args.command == "serve":
        from rlhf_pipeline.deployments.serve import RETRAIN_CRON, serve

        serve(args.config, args.retrain_cron or RETRAIN_CRON, args.retrain_overrides, args.retrain_collision)
        return 0
    if args.command == "deploy":
        from rlhf_pipeline.deployments.serve import RETRAIN_CRON, deploy

        try:
            cron = args.retrain_cron or RETRAIN_CRON
            names = deploy(args.pool, args.config, cron, args.retrain_overrides, args.retrain_collision)
        except (ValidationError, ValueError) as exc:
            print(f"rlhf deploy: {exc}", file=sys.stderr)
            return 2
        print(
            f"registered on work pool {args.pool!r}: {', '.join(names)} (start a worker: prefect worker start --pool "
            f"{args.pool})"
        )
        return 0
    if args.command == "gc":
        return _gc(args.dry_run, args.keep_runs)
    if args.command == "up":
        from rlhf_pipeline.deployments.local import up

        return up(args.port, args.mlflow_port, args.serve_args)

    if args.command == "run":  # the temporary server comes up while the parameters load (~0.3 s of its ~4.5)
        _console(args)
        gc.disable()  # until the imports are done (_settle_heap)
        temporary.start()
        _warm_up_imports()
    try:
        from rlhf_pipeline.flows.params import load_params

        try:
            extra = {"no_cache": True} if args.no_cache else {}
            params = load_params(args.config, args.overrides, **extra)
        except (ValidationError, ValueError) as exc:
            temporary.stop()  # started for nothing
            print(f"rlhf: invalid parameters:\n{redact_text(str(exc))}", file=sys.stderr)
            return 2
        if args.command == "params" and args.plan:
            from rlhf_pipeline.flows.plan import describe, plan

            print(describe(plan(params)))
            return 0
        if args.command == "params":
            from rlhf_pipeline.tasks.store.secrets import redact

            print(json.dumps(redact(params.model_dump(mode="json")), indent=2))
            return 0

        from rlhf_pipeline.flows.rlhf import rlhf

        temporary.wait()
        _settle_heap()
        with stop_on_ctrl_c(temporary.stop):
            summary = rlhf(**dict(params))
    finally:
        _settle_heap()
    _report(summary)
    return 0


def _settle_heap() -> None:
    """After `rlhf run`'s imports: what they made is moved out of the cyclic garbage collector's reach (`gc.freeze`)
    and collection starts again; imports make next to no garbage (docs/ARCHITECTURE.md, the collector's passes). A
    build freezes and unfreezes its own way (`tasks.store.resources.frozen_heap`). No-op when collection is on."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def entry() -> None:
    """The `rlhf` command (and `python -m rlhf_pipeline`): `main`, then exit as soon as everything it leaves behind is
    done. The exit handlers run (Prefect's last logs and events, the temporary server's stop, logging's flush) and the
    threads that are not daemons are joined, as at a normal exit; then the process ends without tearing down the ~3,000
    modules a run imports, ~0.9 s of a cached re-run's ~9 s (bench.cache). `main` itself returns (tests call it)."""
    import atexit
    import threading

    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = 130
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does first at exit: join the threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _console(args) -> None:
    """The terminal a person reads (CONSOLE_SETTINGS, and the console's bars), set when `rlhf run` starts (before its
    parameters load, so the temporary server starts with it): not for a command that only checks or prints, nor with
    --verbose."""
    if not getattr(args, "verbose", False):
        os.environ.update(CONSOLE_SETTINGS)
        from rlhf_pipeline import console

        console.install()


def _make_state_folders() -> None:
    """Create the folders the environment names (a fresh PREFECT_HOME, RLHF_STATE_DIR, a SQLite tracking
    URI's folder): Prefect's temporary server cannot open its database in a folder that does not exist,
    and waits two minutes before it says so."""
    from pathlib import Path

    folders = [os.environ.get("PREFECT_HOME"), os.environ.get("RLHF_STATE_DIR")]
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith("sqlite:///"):
        folders.append(str(Path(uri.removeprefix("sqlite:///")).parent))
    for folder in filter(None, folders):
        Path(folder).expanduser().mkdir(parents=True, exist_ok=True)


def _warm_up_imports() -> None:
    """Import MLflow and matplotlib in the background while Prefect starts its temporary
    server (~4 s of waiting): a fully cached run then takes ~12 s instead of ~16 s."""
    import importlib
    import threading

    def load() -> None:
        # The SQLite store's module (SQLAlchemy, alembic) is ~1.5 s of a cached re-run when first imported by the flow.
        names = ["mlflow.tracking", "mlflow.entities", "matplotlib.figure", "matplotlib.backends.backend_agg"]
        if not os.environ.get("MLFLOW_TRACKING_URI", "sqlite:").startswith(("http:", "https:", "databricks")):
            names.append("mlflow.store.tracking.sqlalchemy_store")
        for name in names:
            importlib.import_module(name)

    threading.Thread(target=load, name="warm-up-imports", daemon=True).start()


def _gc(dry_run: bool, keep_runs: int) -> int:
    from rlhf_pipeline.tasks.tracking import client as tracking
    from rlhf_pipeline.tasks.tracking import gc

    doomed = gc.collect(keep_runs)
    total = sum(item.bytes for item in doomed)
    for item in doomed:
        print(f"{item.bytes / 1e6:9.1f} MB  {item.path}  ({item.why})")
    verb = "would free" if dry_run else "freed"
    freed = total if dry_run else gc.remove(doomed)
    print(f"rlhf gc: {len(doomed)} paths under {tracking.state_dir()}; {verb} {freed / 1e6:.1f} MB")
    return 0


def _evaluate(args) -> int:
    from rlhf_pipeline.flows.evaluate import EvalParams, rlhf_eval
    from rlhf_pipeline.flows.params import apply_overrides
    from rlhf_pipeline.tasks.tracking.resolve import check_model_exists

    values = apply_overrides({"policy": args.policy, "sft_model": args.sft, "reward_model": args.rm}, args.overrides)
    try:
        params = EvalParams.model_validate(values)
    except (ValidationError, ValueError) as exc:
        print(f"rlhf: invalid parameters:\n{redact_text(str(exc))}", file=sys.stderr)
        return 2
    try:
        for role, source in (("policy", params.policy), ("sft", params.sft_model), ("reward", params.reward_model)):
            if source:  # before any server starts: a missing model is said in seconds
                check_model_exists(source, role)
    except ValueError as exc:
        print(f"rlhf eval: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    _console(args)
    temporary.start()
    _warm_up_imports()
    temporary.wait()
    with stop_on_ctrl_c(temporary.stop):
        summary = rlhf_eval(**dict(params))
    _report(summary)
    return 0


def _report(summary: dict) -> None:
    # Send the last log lines to the API now: the temporary server stops at exit,
    # before Prefect's own flush would run, and the late lines would fail noisily.
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    from rlhf_pipeline.console import closing_table

    print("\n" + closing_table(summary))
