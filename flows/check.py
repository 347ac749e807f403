"""`rlhf check`: a preflight of a preset that trains nothing and loads no weights.

It resolves the parameters as `rlhf run` does, loads the base tokenizer, checks every dataset with it
exactly as the data stage will (`trainers.data.check_datasets`), prints the token lengths each stage
will see against its limit, and estimates the memory each stage holds with accelerate's estimator on
a model built on the meta device. It exits 2 on invalid parameters, 1 on anything else the run would
fail on (a data rule, an unreadable dataset, a tokenizer or model config that cannot be loaded, a
stage whose estimate exceeds the free CUDA memory), 0 with a one-line "ready" verdict otherwise.
"""

from __future__ import annotations

import copy
import math
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlhf_pipeline.tasks.stages import BY_NAME

PERCENTILES = (50, 90, 99)


def check(preset: str, overrides: list[str], report_dir: Path | None = None) -> int:
    from rlhf_pipeline.flows.params import load_params

    try:
        params = load_params(preset, overrides)
    except (ValidationError, ValueError) as exc:
        print(f"rlhf check: invalid parameters:\n{exc}\nnot ready: fix the parameters above")
        return 2
    plan = params.plan()
    print(f"rlhf check: preset {params.preset}, model {params.model.name_or_path} ({params.model.dtype}), plan {' > '.join(plan)}")
    problems: list[str] = []

    tokenizer = _tokenizer(params, problems)
    counted = _check_data(params, tokenizer, report_dir, problems)
    if counted:
        _print_lengths(params, counted)
    build = _empty_model_builder(params, tokenizer, problems)
    if build is not None:
        _print_memory(params, build, problems)

    if problems:
        print(f"\nnot ready: {len(problems)} problem{'s' if len(problems) > 1 else ''} the run would fail on: {'; '.join(problems)}")
        return 1
    print(f"\nready: parameters, tokenizer, {len(params.data.sources())} datasets and the memory of {len(plan)} stages checked")
    return 0


# --- tokenizer and data -------------------------------------------------------------------


def _tokenizer(params, problems: list[str]):
    from rlhf_pipeline.trainers.base import load_base_tokenizer

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
    from rlhf_pipeline.trainers.data import check_datasets

    datasets.disable_progress_bars()  # one "Generating train split" bar per file would drown the report
    sources = params.data.sources()
    # Without a tokenizer the structural rules still run; lengths and templates cannot be checked.
    limits = params.token_limits() if tokenizer is not None else {}
    with tempfile.TemporaryDirectory(prefix="rlhf-check-") as scratch:
        reports = Path(report_dir) if report_dir is not None else Path(scratch)
        passed, failures = check_datasets(
            params.data, params.model if tokenizer is not None else None, limits, reports, pair_readers(params.plan()),
            params.sft.assistant_only_loss, tokenizer=tokenizer,
        )  # fmt: skip
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
        return {name: _token_counts(kind, spec, passed.get(name), tokenizer, limits.get(name, math.inf)) for name, (kind, spec) in sources.items()}


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
    """Nearest-rank percentile of a sorted, non-empty list: the smallest value with at least q% of the values at or below it."""
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _print_lengths(params, counted: dict[str, list[int] | None]) -> None:
    plan = params.plan()
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
            rows.append([name, stage, len(ordered), *(percentile(ordered, q) for q in PERCENTILES), ordered[-1], _or_dash(limit), _or_dash(over)])
    print("\ntoken lengths (counted as the data stage counts them; limit: the stage's row_token_limit, '-': none)")
    _print_table(["dataset", "stage", "rows", *(f"p{q}" for q in PERCENTILES), "max", "limit", "over"], rows)


# --- memory ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """One model a stage holds while it builds."""

    role: str
    classifier: bool
    """A scalar head (AutoModelForSequenceClassification, num_labels=1) instead of the LM head."""
    trained: bool
    lora: Any = None
    """The stage's LoraConfig when its adapters are what is trained."""


def held_models(params, stage: str) -> list[Held]:
    """What each stage keeps in memory at its peak, as its trainer loads it."""
    row, cfg = BY_NAME[stage], params.config(stage)
    if not row.device:
        return []
    if stage == "eval":  # one model at a time for generation; policy and sft together for the KL
        return [Held("policy", False, False), Held("sft", False, False)]
    lora = cfg.lora if cfg.lora.enabled else None
    if stage == "rm":
        return [Held("reward model", True, True, lora)]
    held = [Held("policy", False, True, lora)]
    # TRL (and our PPO) take the reference as the policy with its adapters off under LoRA; GRPO keeps none at beta=0.
    if row.algorithm and lora is None and getattr(cfg, "beta", None) != 0:
        held.append(Held("reference", False, False))
    if stage == "ppo":  # trained beside the policy, from the reward model or the sft model (trainers/ppo.py)
        held.append(Held("value model", True, True))
    if row.online and params.rewards.uses_reward_model:
        held.append(Held("reward model", True, False))
    return held


@dataclass(frozen=True)
class StageMemory:
    holds: str
    trained_params: int
    weights: int
    training: int
    """Gradients and AdamW states of the trained parameters."""

    @property
    def total(self) -> int:
        return self.weights + self.training


def stage_memory(params, stage: str, build) -> StageMemory:
    """Weights of every model the stage holds in `model.dtype` (LoRA adapters in float32, as peft keeps them), plus
    accelerate's `estimate_training_usage` gradients and optimizer states of the trained ones. No activations."""
    import peft
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import compute_module_sizes, is_bf16_available, is_cuda_available

    cfg = params.config(stage)
    bf16 = getattr(cfg, "bf16", None)
    autocast = bf16 if bf16 is not None else is_cuda_available() and is_bf16_available()  # trl_arguments' rule
    names, trained_params, weights, training = [], 0, 0, 0
    for held in held_models(params, stage):
        model = build(held.classifier)
        if held.lora is not None:
            with init_empty_weights(), warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers a deprecated question
                model = peft.get_peft_model(model, held.lora.peft_config("SEQ_CLS" if held.classifier else "CAUSAL_LM"))
        trainable = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad} if held.trained else {}
        adapters = {name: "float32" for name in trainable} if held.lora is not None else None
        sizes = compute_module_sizes(model, dtype=params.model.dtype, special_dtypes=adapters)
        weights += sizes[""]
        if trainable:
            trained_bytes = sum(sizes[name] for name in trainable)
            # accelerate's mixed-precision case adds the bf16 copies autocast makes of float32 weights.
            float32 = held.lora is not None or params.model.dtype == "float32"
            usage = estimate_training_usage(trained_bytes, "bfloat16" if autocast and float32 else "float32")
            training += usage["gradients"] + usage["optimizer"]
            trained_params += sum(trainable.values())
        names.append(held.role + (" (LoRA)" if held.lora is not None else " (trained)" if held.trained else ""))
    return StageMemory(" + ".join(names) or "no model", trained_params, weights, training)


def _empty_model_builder(params, tokenizer, problems: list[str]):
    """A function building the base model on the meta device (a causal LM, or with a scalar head), or None."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_pipeline.trainers.common import TINY

    model = params.model
    try:
        if model.name_or_path == TINY:
            from rlhf_pipeline.trainers.tiny import build_model

            if tokenizer is None:
                return None
            with init_empty_weights():
                config = build_model(model.tiny, tokenizer, seed=model.seed).config
        else:
            config = AutoConfig.from_pretrained(model.name_or_path, revision=model.revision, trust_remote_code=model.trust_remote_code)
    except Exception as exc:
        print(f"\nmodel config: cannot be loaded from {model.name_or_path!r}: {_first_line(exc)}")
        problems.append("model config")
        return None
    if tokenizer is not None and len(tokenizer) > config.vocab_size:  # load_base_model grows the embeddings to the template's tokens
        config.vocab_size = len(tokenizer)
    classifier_config = copy.deepcopy(config)
    classifier_config.num_labels = 1  # TRL's reward model, our value model

    def build(classifier: bool):
        # float32 on the meta device: compute_module_sizes then counts each tensor in the dtype asked for.
        with init_empty_weights():
            auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
            empty = auto.from_config(classifier_config if classifier else config, dtype="float32", trust_remote_code=model.trust_remote_code)
        empty.tie_weights()  # init_empty_weights copies the parameter that tying shares: a tied LM head would count twice
        return empty

    return build


def _print_memory(params, build, problems: list[str]) -> None:
    from accelerate.utils import convert_bytes, get_max_memory, is_cuda_available

    free = get_max_memory().get(0) if is_cuda_available() else None
    print(
        f"\nmemory per stage (accelerate's estimator on the meta model: weights in {params.model.dtype}, plus gradients and AdamW states "
        "of what the stage trains; activations, KV cache and batches NOT included)"
    )
    rows = []
    for stage in params.plan():
        estimate = stage_memory(params, stage, build)
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
                problems.append(f"{stage} needs more than {convert_bytes(estimate.total)} of {convert_bytes(free)} free on cuda:0")
        rows.append(row)
    _print_table(["stage", "holds", "trained", "weights", "grads+AdamW", "total"] + (["fits"] if free is not None else []), rows)
    if free is None:
        print("device: cpu (no CUDA): the estimate is not compared with any device memory")
    else:
        print(f"device: cuda:0 with {convert_bytes(free)} free (a stage that fits may still run out of memory on activations)")


# --- output ---------------------------------------------------------------------------------


def _print_table(headers: list[str], rows: list[list[Any]]) -> None:
    """Plain text, ' | ' between columns; the first two (names) left-aligned, the figures right-aligned."""
    cells = [headers] + [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print(" | ".join(cell.ljust(width) if i < 2 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))).rstrip())


def _count(n: int) -> str:
    return next(f"{n / scale:.3g}{unit}" for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K"), (1, "")) if n >= scale)


def _or_dash(value: Any) -> Any:
    return "-" if value is None else value


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
