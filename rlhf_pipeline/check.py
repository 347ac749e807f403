"""`rlhf check`: a preflight of a preset that trains nothing and loads no weights.

It resolves the parameters as `rlhf run` does, loads the base tokenizer, checks every dataset with it
exactly as the data stage will (`validators.stage.check_datasets`), prints the token lengths each stage
will see against its limit, and estimates the memory each stage holds with accelerate's estimator on
a model built on the meta device. Where a training stage runs under Ray (`launch.launcher: ray`), it
says which Ray cluster the stages would use, its nodes, the workers requested and the memory each
worker holds (a DDP rank holds the whole stage: its estimate). It exits 2 on invalid parameters, 1 on
anything else the run would fail on (a data rule, an unreadable dataset, a tokenizer or model config
that cannot be loaded, a stage whose estimate exceeds the free CUDA memory, a Ray cluster that cannot be
reached or cannot hold the workers), 0 with a one-line "ready" verdict otherwise.
"""

from __future__ import annotations

import math
import os
import re
import socket
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlhf_pipeline.flows.plan import describe, stages
from rlhf_pipeline.flows.plan import plan as steps
from rlhf_pipeline.tasks.stages import BY_NAME

PERCENTILES = (50, 90, 99)


def check(preset: str, overrides: list[str], report_dir: Path | None = None) -> int:
    from rlhf_pipeline.explain import missing_files
    from rlhf_pipeline.explain import problems as explained
    from rlhf_pipeline.flows.params import PipelineParams, load_params

    try:
        params = load_params(preset, overrides)
    except (ValidationError, ValueError) as exc:
        lines = explained(exc, PipelineParams) if isinstance(exc, ValidationError) else [str(exc)]
        print("rlhf check: invalid parameters:\n" + "".join(f"  {line}\n" for line in lines), end="")
        print(f"not ready: fix the {len(lines)} problem{'s' * (len(lines) > 1)} above")
        return 2
    plan = stages(params)
    print(f"rlhf check: preset {params.preset}, model {params.model.name_or_path} ({params.model.dtype}); the plan:")
    print(textwrap.indent(describe(steps(params)), "  "))
    problems: list[str] = missing_files(params)
    for line in problems:
        print(f"data: {line}")
    missing = bool(problems)  # the data rules need the files: checked once they are all there

    def part(name: str, check, *arguments, default=None):
        """One part of the check; one that cannot finish is a problem named by its part, never a traceback."""
        try:
            return check(*arguments)
        except Exception as exc:  # the preflight reports what it could not check and goes on
            print(f"{name}: could not be checked: {_first_line(exc)}")
            problems.append(f"{name}: {_first_line(exc)}")
            return default

    part("attention", _check_attention, params, problems)
    tokenizer = part("tokenizer", _tokenizer, params, problems)
    counted = None if missing else part("data", _check_data, params, tokenizer, report_dir, problems)
    if counted:
        part("token lengths", _print_lengths, params, counted)
    build = part("model", _empty_model_builder, params, tokenizer, problems)
    totals = (part("memory", _print_memory, params, build, problems) if build is not None else None) or {}
    cluster = part("ray", _check_ray, params, totals, problems)

    if problems:
        print(
            f"\nnot ready: {len(problems)} problem{'s' if len(problems) > 1 else ''} the run would fail on: "
            f"{'; '.join(problems)}"
        )
        return 1
    print(
        f"\nready: parameters, tokenizer, {len(params.data.sources())} datasets"
        + (f", the Ray cluster at {cluster}" if cluster else "")
        + f" and the memory of {len(plan)} stages checked"
    )
    return 0


# --- device ---------------------------------------------------------------------------------


def _check_attention(params, problems: list[str]) -> None:
    """Each stage's `attn_implementation` against this machine's device (the stage checks it again where it starts):
    FlashAttention without a CUDA GPU of the capability it needs or with float32 inputs, flex attention trained on a
    CPU."""
    import torch

    from rlhf_pipeline.trainers.attention import device_problem

    cuda = torch.cuda.is_available()
    for stage in stages(params):
        cfg = params.config(stage)
        name = getattr(cfg, "attn_implementation", None)
        if name is None:
            continue
        bf16 = getattr(cfg, "bf16", None)
        mixed = bool(
            getattr(cfg, "fp16", False) or (bf16 if bf16 is not None else cuda and torch.cuda.is_bf16_supported())
        )
        problem = device_problem(
            name,
            training=stage != "eval",
            field=f"{stage}.attn_implementation",
            half_precision=params.model.dtype != "float32" or mixed,
        )
        print(f"attention: {stage} {name}" + (f": {problem}" if problem else ""))
        if problem:
            problems.append(f"{stage}.attn_implementation={name!r} cannot run on this device")


# --- tokenizer and data -------------------------------------------------------------------


def _tokenizer(params, problems: list[str]):
    from rlhf_pipeline.trainers.models.base_model import load_base_tokenizer

    try:
        tokenizer = load_base_tokenizer(params.model)
    except Exception as exc:  # offline without a cache, a missing folder, an unknown template: all stop the run
        print(f"tokenizer: cannot be loaded from {params.model.name_or_path!r}: {_first_line(exc)}")
        problems.append("tokenizer")
        return None
    template = params.model.chat_template or ("the tokenizer's own" if tokenizer.chat_template else "none")
    print(f"tokenizer: {type(tokenizer).__name__}, {len(tokenizer)} tokens, chat template {template}")
    return tokenizer


def _check_data(params, tokenizer, report_dir: Path | None, problems: list[str]) -> dict[str, list[int] | None]:
    """Run the data stage's checks; returns each dataset's token counts (None: it could not be counted)."""
    import datasets

    from rlhf_pipeline.tasks.stages import pair_readers
    from rlhf_pipeline.validators.stage import check_datasets

    datasets.disable_progress_bars()  # one "Generating train split" bar per file would drown the report
    sources = params.data.sources()
    # Without a tokenizer the structural rules still run; lengths and templates cannot be checked.
    limits = params.token_limits() if tokenizer is not None else {}
    with tempfile.TemporaryDirectory(prefix="rlhf-check-") as scratch:
        reports = Path(report_dir) if report_dir is not None else Path(scratch)
        passed, failures = check_datasets(
            params.data,
            params.model if tokenizer is not None else None,
            limits,
            reports,
            pair_readers(stages(params)),
            params.sft.assistant_only_loss,
            tokenizer=tokenizer,
            required_columns=params.required_columns(),
            benchmarks=params.benchmarks(),
        )
        print(f"data: {len(sources)} datasets checked, {len(passed)} passed")
        dropped = False
        for failure in failures:
            message = str(failure)
            if report_dir is None:  # the reports go with the scratch folder
                message, removed = re.subn(r"\n?Data Docs: .*", "", message)
                dropped |= bool(removed)
            print("  FAIL " + message.replace("\n", "\n       "))
        if failures:
            problems.append(f"{len(failures)} data check{'s' if len(failures) > 1 else ''} failed")
        if dropped:
            print("  (rerun with --report-dir DIR to keep the validation reports and their Data Docs)")
        if tokenizer is None:
            return {}
        return {
            name: _token_counts(kind, spec, passed.get(name), tokenizer, limits.get(name, math.inf))
            for name, (kind, spec) in sources.items()
        }


def _token_counts(kind: str, spec, passed: tuple | None, tokenizer, limit: float) -> list[int] | None:
    """Every row's token count, as the data stage counts it (rule `fits_max_length`). A dataset that failed
    is counted too when it can be read: its lengths often say why."""
    from rlhf_pipeline.trainers.data import load_source
    from rlhf_pipeline.validators.formats import read_format
    from rlhf_pipeline.validators.lengths import count_tokens

    try:
        dataset = passed[0].dataset if passed is not None else load_source(spec)
        fmt, values = read_format(kind, dataset, spec.path)
        counts, _ = count_tokens(fmt, values, tokenizer, limit)
    except Exception:  # already reported by the data checks
        return None
    return [count for count in counts if count is not None and count >= 0]  # other rules reject the rest


def percentile(ordered: list[int], q: float) -> int:
    """Nearest-rank percentile of a sorted, non-empty list: the smallest value with at least q% of the values at or
    below it."""
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _print_lengths(params, counted: dict[str, list[int] | None]) -> None:
    plan = stages(params)
    rows = []
    for name, counts in counted.items():
        readers = [stage for stage in plan if name in BY_NAME[stage].reads] or ["-"]
        ordered = sorted(counts or [])
        for stage in readers:
            bound = getattr(params.config(stage), "row_token_limit", None) if stage != "-" else None
            limit = bound() if bound is not None else None
            if not ordered:
                rows.append([name, stage, "-", "-", "-", "-", "-", _or_dash(limit), "-"])
                continue
            over = sum(count > limit for count in ordered) if limit is not None else None
            rows.append(
                [
                    name,
                    stage,
                    len(ordered),
                    *(percentile(ordered, q) for q in PERCENTILES),
                    ordered[-1],
                    _or_dash(limit),
                    _or_dash(over),
                ]
            )
    print("\ntoken lengths (counted as the data stage counts them; limit: the stage's row_token_limit, '-': none)")
    _print_table(["dataset", "stage", "rows", *(f"p{q}" for q in PERCENTILES), "max", "limit", "over"], rows)


# --- memory ---------------------------------------------------------------------------------


def held_models(params, stage: str) -> list:
    """What the stage keeps in memory at its peak in this run: the table's `holds`, less the reference under LoRA (the
    policy with its adapters off is the reference) or at beta=0 (GRPO keeps none), and less the reward model where the
    rewards do not use it; the stage's LoRA on what its adapters train."""
    from dataclasses import replace

    from rlhf_pipeline.tasks.stages import BY_NAME
    from rlhf_pipeline.trainers.models.memory import REFERENCE, REWARD_MODEL, Held

    cfg = params.config(stage)
    if stage == "pairs":  # planned for feedback rounds even when the first round's pairs are off
        return list(BY_NAME[stage].holds)
    if cfg.switched_off():  # switched off (sft): it loads the base model and saves it, untrained
        return [Held("base model, saved untrained (switched off)", classifier=False, trained=False)]
    lora = cfg.adapters()
    lora = lora if lora is not None and lora.enabled else None
    held = []
    for model in BY_NAME[stage].holds:
        if model == REFERENCE and (lora is not None or getattr(cfg, "beta", None) == 0):
            continue
        if model == REWARD_MODEL and not params.rewards.uses_reward_model:
            continue
        held.append(replace(model, lora=lora) if model.adapted and lora is not None else model)
    return held


def _empty_model_builder(params, tokenizer, problems: list[str]):
    from rlhf_pipeline.trainers.models.memory import empty_model_builder

    try:
        return empty_model_builder(params, tokenizer)
    except Exception as exc:
        print(f"\nmodel config: cannot be loaded from {params.model.name_or_path!r}: {_first_line(exc)}")
        problems.append("model config")
        return None


def _print_memory(params, build, problems: list[str]) -> dict[str, int]:
    """Prints the estimate of every stage; returns each stage's total in bytes."""
    from accelerate.utils import convert_bytes, get_max_memory, is_cuda_available

    from rlhf_pipeline.trainers.models.memory import stage_memory

    free = get_max_memory().get(0) if is_cuda_available() else None
    print(
        f"\nmemory per stage (accelerate's estimator on the meta model: weights in {params.model.dtype}, plus "
        "gradients and AdamW states of what the stage trains; activations, KV cache and batches NOT included)"
    )
    rows = []
    totals: dict[str, int] = {}
    for stage in stages(params):
        estimate = stage_memory(
            held_models(params, stage), params.model.dtype, getattr(params.config(stage), "bf16", None), build
        )
        totals[stage] = estimate.total
        if not estimate.total:
            rows.append([stage, estimate.holds, "-", "-", "-", "-"] + ([""] if free is not None else []))
            continue
        trained = _count(estimate.trained_params) if estimate.trained_params else "-"
        training = convert_bytes(estimate.training) if estimate.training else "-"
        row = [stage, estimate.holds, trained, convert_bytes(estimate.weights), training, convert_bytes(estimate.total)]
        if free is not None:
            fits = estimate.total <= free
            row.append("yes" if fits else "NO")
            if not fits:
                problems.append(
                    f"{stage} needs more than {convert_bytes(estimate.total)} of {convert_bytes(free)} free on cuda:0"
                )
        rows.append(row)
    _print_table(
        ["stage", "holds", "trained", "weights", "grads+AdamW", "total"] + (["fits"] if free is not None else []), rows
    )
    if free is None:
        print("device: cpu (no CUDA): the estimate is not compared with any device memory")
    else:
        print(
            f"device: cuda:0 with {convert_bytes(free)} free (a stage that fits may still run out of memory on "
            "activations)"
        )
    return totals


# --- Ray ------------------------------------------------------------------------------------

LOCAL_CLUSTER = "a local cluster on this machine, started for each stage"
LOCAL_NODE = "127.0.0.1 (this machine)"


def _check_ray(params, totals: dict[str, int], problems: list[str]) -> str | None:
    """The Ray cluster the stages under `launch.launcher: ray` would use (`trainers.runtime.ray_job` joins the same):
    its nodes, whether it can hold `launch.num_workers` workers of `launch.resources_per_worker` each as placed, and the
    memory of each worker. Each worker is a DDP rank that holds the whole stage: the stage's estimate. Returns where the
    cluster is (None: no stage runs under Ray)."""
    launch = params.launch
    on_ray = [
        stage
        for stage in stages(params)
        if BY_NAME[stage].builds_with == "train" and launch.launcher_of(stage) == "ray"
    ]
    if not on_ray:
        return None
    from rlhf_pipeline.trainers.runtime.ray_job import describe, shown, too_small

    address = launch.ray_address or os.environ.get("RAY_ADDRESS") or None
    where = address or LOCAL_NODE
    print(f"\nRay: {', '.join(on_ray)} run as Ray Train jobs on {address or LOCAL_CLUSTER}")
    if address is None:  # not started here: the stage's driver starts one; this machine is its only node
        nodes, error = [_this_machine()], None
    else:
        nodes, error = _ray_nodes(address)
    if error is not None:
        print(f"Ray cluster at {address}: cannot be reached: {error}")
        problems.append(f"the Ray cluster at {address} cannot be reached")
    else:
        print(describe(nodes, where))
        _print_table(
            ["Ray node", "address", "CPUs", "GPUs"],
            [
                [
                    node.get("NodeID", "-")[:12],
                    node.get("NodeManagerAddress", "-"),
                    f"{node['Resources'].get('CPU', 0):g}",
                    f"{node['Resources'].get('GPU', 0):g}",
                ]
                for node in nodes
                if node.get("Alive")
            ],
        )
    workers, resources = launch.num_workers, launch.resources_per_worker
    print(
        f"workers: launch.num_workers={workers} x launch.resources_per_worker={shown(resources)}, placement_strategy "
        f"{launch.placement_strategy}; each a DDP rank holding the whole stage"
    )
    refused = too_small(nodes, workers, resources, launch.placement_strategy) if error is None else None
    if refused:
        print(f"  cannot hold the workers: {refused}")
        problems.append(f"the Ray cluster at {where} cannot hold the workers: {refused}")
    from accelerate.utils import convert_bytes

    rows = []
    for stage in on_ray:
        total = totals.get(stage)
        rows.append(
            [stage, convert_bytes(total), workers, convert_bytes(total * workers)]
            if total
            else [stage, "-", workers, "-"]
        )
    _print_table(["Ray stage", "per worker", "workers", "in all"], rows)
    return where


def _this_machine() -> dict:
    """This machine as the one node of a local Ray cluster, in the shape `ray.nodes()` gives a node."""
    import torch

    resources = {"CPU": float(os.cpu_count() or 1), "node:127.0.0.1": 1.0}
    gpus = torch.cuda.device_count()
    if gpus:  # Ray lists a GPU resource only where there is one
        resources["GPU"] = float(gpus)
    return {
        "NodeID": "this machine",
        "Alive": True,
        "NodeManagerAddress": "127.0.0.1",
        "NodeManagerHostname": socket.gethostname(),
        "Resources": resources,
    }


def _ray_nodes(address: str) -> tuple[list[dict], str | None]:
    """`ray.nodes()` of the cluster at `address`, or why it cannot be reached."""
    from rlhf_pipeline.trainers.runtime.ray_job import unreachable

    problem = unreachable(address)
    if problem is not None:
        return [], problem[0]
    import logging

    import ray

    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        return ray.nodes(), None
    except Exception as exc:  # refused token, not a Ray address, a version mismatch
        return [], _first_line(exc)
    finally:
        ray.shutdown()


# --- output ---------------------------------------------------------------------------------


def _print_table(headers: list[str], rows: list[list[Any]]) -> None:
    """Plain text, ' | ' between columns; the first two (names) left-aligned, the figures right-aligned."""
    cells = [headers] + [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print(
            " | ".join(
                cell.ljust(width) if i < 2 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
        )


def _count(n: int) -> str:
    return next(f"{n / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, "")) if n >= scale)


def _or_dash(value: Any) -> Any:
    return "-" if value is None else value


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
