"""What each `rlhf` command does once its arguments are parsed (rlhf_pipeline/cli.py parses and dispatches)."""

from __future__ import annotations

import sys

from pydantic import ValidationError

from rlhf_pipeline import startup
from rlhf_pipeline.deployments import temporary
from rlhf_pipeline.explain import explain, missing_files
from rlhf_pipeline.explain import problems as explained
from rlhf_pipeline.interrupt import stop_on_ctrl_c
from rlhf_pipeline.tasks.store.secrets import redact_text


def run(args) -> int:
    """`rlhf run` and `rlhf params`: the parameters resolved, then printed, or the flow run with them. A refused
    command starts nothing (no temporary server, no Prefect database, no MLflow store); the temporary server comes up
    once the parameters hold, while the flow and the libraries import."""
    import gc
    import json

    if args.command == "run":
        startup.console(args)
        gc.disable()  # until the imports are done (startup.settle_heap)
    try:
        from rlhf_pipeline.flows.params import PipelineParams, load_params

        try:
            params = load_params(args.config, args.overrides, **({"no_cache": True} if args.no_cache else {}))
        except (ValidationError, ValueError) as exc:
            return refused(exc, PipelineParams)
        missing = missing_files(params) if args.command == "run" else []
        if missing:  # found with the parameters: no flow run, no MLflow run
            return refused(missing)
        if args.command == "run":
            temporary.start()
            startup.warm_up_imports()
        if args.command == "params" and args.explain:
            try:
                print(explain(args.explain, PipelineParams, params))
            except ValueError as exc:
                return refused([str(exc)])
            return 0
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
        startup.settle_heap()
        with stop_on_ctrl_c(temporary.stop):
            summary = rlhf(**dict(params))
    finally:
        startup.settle_heap()
    startup.report(summary)
    return 0


def refused(problems: Exception | list[str], model=None) -> int:
    """Exit 2 after one line per problem of the parameters (a validation error of `model`, or lines already made)."""
    if isinstance(problems, ValidationError):
        problems = explained(problems, model)
    elif isinstance(problems, Exception):
        problems = [redact_text(str(problems))]
    print(
        f"rlhf: {len(problems)} problem{'s' * (len(problems) > 1)} with the parameters; nothing ran:",
        file=sys.stderr,
    )
    for line in problems:
        print(f"  {line}", file=sys.stderr)
    return 2


def serve(args) -> int:
    """`rlhf serve`: the deployments, served until stopped."""
    from rlhf_pipeline.deployments.serve import RETRAIN_CRON, serve

    serve(args.config, args.retrain_cron or RETRAIN_CRON, args.retrain_overrides, args.retrain_collision)
    return 0


def deploy(args) -> int:
    """`rlhf deploy`: the same deployments registered on a work pool."""
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


def evaluate(args) -> int:
    from rlhf_pipeline.flows.evaluate import EvalParams, rlhf_eval
    from rlhf_pipeline.flows.params import apply_overrides
    from rlhf_pipeline.tasks.tracking.resolve import check_model_exists

    values = apply_overrides({"policy": args.policy, "sft_model": args.sft, "reward_model": args.rm}, args.overrides)
    try:
        params = EvalParams.model_validate(values)
    except (ValidationError, ValueError) as exc:
        return refused(exc, EvalParams)
    try:
        for role, source in (("policy", params.policy), ("sft", params.sft_model), ("reward", params.reward_model)):
            if source:  # before any server starts: a missing model is said in seconds
                check_model_exists(source, role)
    except ValueError as exc:
        print(f"rlhf eval: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    startup.console(args)
    temporary.start()
    startup.warm_up_imports()
    temporary.wait()
    with stop_on_ctrl_c(temporary.stop):
        summary = rlhf_eval(**dict(params))
    startup.report(summary)
    return 0


def label(args) -> int:
    """`rlhf label`: the labels of a file and of PAIR=LABEL items, checked against the pairs the run waits for, then
    sent to it; any mistake exits 2 naming the file, the line (or the item) and the rule, and sends nothing."""
    from pathlib import Path

    from rlhf_pipeline.tasks.labels import MAX_PAIR_DIGITS, LabelsError, check_label, read_labels_file
    from rlhf_pipeline.tasks.people import resume_with_labels, waiting_pairs

    try:
        waiting = waiting_pairs(args.flow_run_id)
        labels = read_labels_file(Path(args.file), waiting) if args.file else {}
        for item in args.labels:
            pair, _, label = item.partition("=")
            if not pair.isdigit() or len(pair) > MAX_PAIR_DIGITS:
                raise LabelsError(f"{item[:60]!r}: expected PAIR=LABEL with a pair number, e.g. 0=A")
            check_label(int(pair), label, None, waiting, f"{item!r}")
            if labels.get(int(pair), label) != label:
                raise LabelsError(f"{item!r}: pair {pair} is labelled {labels[int(pair)]!r} in {args.file}")
            labels[int(pair)] = label
    except LabelsError as exc:
        print(f"rlhf label: {exc}", file=sys.stderr)
        return 2
    given = {pair: label for pair, label in labels.items() if label is not None}
    resume_with_labels(args.flow_run_id, given, finish=not args.more)
    print(f"flow run {args.flow_run_id} resumed with {len(given)} labels")
    return 0


def export(args) -> int:
    """`rlhf export`: the model in Hub layout (weights, tokenizer, generation config, card with held-out metrics)."""
    from pathlib import Path

    from rlhf_pipeline.tasks.tracking.cards import export

    try:
        export(args.model, Path(args.out))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return 0


def collect(args) -> int:
    """`rlhf gc`: what no registered version, live run or recent run uses, listed or removed."""
    dry_run, keep_runs = args.dry_run, args.keep_runs
    from rlhf_pipeline.tasks.tracking import client as tracking
    from rlhf_pipeline.tasks.tracking import gc

    try:
        doomed = gc.collect(keep_runs)
    except ValueError as exc:  # a registered version whose lineage cannot be read
        print(f"rlhf gc: {redact_text(str(exc))}", file=sys.stderr)
        return 2
    total = sum(item.bytes for item in doomed)
    for item in doomed:
        print(f"{item.bytes / 1e6:9.1f} MB  {item.path}  ({item.why})")
    verb = "would free" if dry_run else "freed"
    freed = total if dry_run else gc.remove(doomed)
    print(f"rlhf gc: {len(doomed)} paths under {tracking.state_dir()}; {verb} {freed / 1e6:.1f} MB")
    return 0
