"""`rlhf`: the command line.

rlhf run                                   # the embedded default (configs/tiny.yaml)
rlhf run --config my.yaml --set sft.learning_rate=1e-4 --set dpo.beta=0.2
rlhf run --no-cache                        # re-run every stage
rlhf params [--config ...] [--set ...]     # print the resolved parameters (--plan: the run's steps), run nothing
rlhf params --explain dpo.beta             # a field's help, type, default and value
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
import os
import sys

from rlhf_pipeline import commands, startup
from rlhf_pipeline.deployments.env import QUIET_ENV


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="RLHF post-training pipeline (Prefect + MLflow + TRL).")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
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


class Parser(argparse.ArgumentParser):
    """A command's parser whose help may end with text made only when the help is shown (`choices`)."""

    def __init__(self, *args, choices: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.choices = choices

    def format_help(self) -> str:
        if self.choices and self.epilog is None:
            self.epilog = choices_text()
        return super().format_help()


def choices_text() -> str:
    """The algorithms and presets a run can take, read from the table of stages and configs/ (imported only for
    --help)."""
    from rlhf_pipeline.flows.params import CONFIG_DIR, DEFAULT_PRESET
    from rlhf_pipeline.tasks.stages import STAGES

    offline = ", ".join(stage.name for stage in STAGES if stage.algorithm and not stage.online)
    online = ", ".join(stage.name for stage in STAGES if stage.online)
    presets = ", ".join(
        f"{path.stem} (default)" if path.stem == DEFAULT_PRESET else path.stem
        for path in sorted(CONFIG_DIR.glob("*.yaml"))
    )
    return (
        f"algorithms (--set algorithm=NAME): {offline} (offline, on preference pairs); {online} (online RL, "
        f"against `rewards`)\npresets (--config NAME): {presets}; or a YAML file\n"
        "a field's help: rlhf params --explain KEY (e.g. dpo.beta, or dpo for the block's fields)"
    )


def _pipeline_commands(commands, preset: argparse.ArgumentParser) -> None:
    """run, params and check: a preset and its overrides."""
    for name, help_text in (("run", "run the rlhf flow"), ("params", "print the resolved parameters as JSON")):
        sub = commands.add_parser(
            name, help=help_text, parents=[preset], choices=True, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        sub.add_argument("--no-cache", action="store_true", help="re-run every stage even if its artifact exists")
        if name == "params":
            sub.add_argument("--plan", action="store_true", help="print the run's steps and their inputs")
            sub.add_argument(
                "--explain", metavar="KEY", default=None, help="a field's help, type, default and value (e.g. dpo.beta)"
            )
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    startup.make_state_folders()
    if args.command == "check":
        from rlhf_pipeline.check import check

        return check(args.config, args.overrides, args.report_dir)
    if args.command == "up":
        from rlhf_pipeline.deployments.local import up

        return up(args.port, args.mlflow_port, args.serve_args)
    handlers = {
        "run": commands.run,
        "params": commands.run,
        "eval": commands.evaluate,
        "label": commands.label,
        "export": commands.export,
        "serve": commands.serve,
        "deploy": commands.deploy,
        "gc": commands.collect,
    }
    return handlers[args.command](args)


def entry() -> None:
    """The `rlhf` command (and `python -m rlhf_pipeline`): `main`, then exit as soon as everything it leaves behind is
    done. The exit handlers run (Prefect's last logs and events, the temporary server's stop, logging's flush) and the
    threads that are not daemons are joined, as at a normal exit; then the process ends without tearing down the
    thousands of modules a run imports (docs/PERFORMANCE.md, `bench.cache`). `main` itself returns (tests call it)."""
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
