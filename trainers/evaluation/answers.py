"""Greedy answers kept by content: the same model, prompts and settings answer once per run state.

Every run that trains a new policy from the same start (each seed, each bench) evaluates that start again, and its
greedy answers to IFEval's 541 prompts at a 512-token budget take about half an hour on two cores. `greedy_answers`
keeps them in `cache_root()/answers/<key>.jsonl` (the run state's `models/answers/`), written whole or not at all; the
key is a sha256 over

- the model's tensors as loaded (names, dtypes, shapes, bytes): the same weights are the same model whether they came
  from a GGUF's converted folder or from sft's saved copy of it, and an edited weight is another model;
- the prompts' token ids (what the tokenizer and the chat template made of them) and the stop tokens;
- the budget and the batch size (a batch's padding and shapes can tip a near tie), the device type, the torch and
  transformers versions, and the source of the modules that render, batch and generate (`CODE`).

Sampled answers are never kept. A model whose tensors cannot be read as bytes (a quantized one) answers uncached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

LOG = logging.getLogger(__name__)
CODE = (
    "rlhf_pipeline.trainers.evaluation.answers",
    "rlhf_pipeline.trainers.models.text",
    "rlhf_pipeline.trainers.models.templates",
)
"""The modules whose source keys the answers: an edit to how prompts are rendered or answers generated makes new
ones."""


def answering(what: str, every: float = 60.0) -> dict[str, Any]:
    """`greedy_answers`' `progress` and `log` for a stage's log: "eval: IFEval, sft: 128/541 answers (~12 min left)"
    at most every `every` seconds, and where the answers came from."""
    started = time.monotonic()
    last = [started]

    def progress(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= every or done == total:
            last[0] = now
            left = (now - started) / done * (total - done)
            LOG.info(f"eval: {what}: {done}/{total} answers (~{left / 60:.0f} min left)")

    return {"progress": progress, "log": lambda line: LOG.info(f"eval: {what}: {line}")}


def weights_digest(model: PreTrainedModel) -> str | None:
    """sha256 over the model's state dict (sorted names, dtype, shape, bytes); None when a tensor has no plain bytes."""
    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta or tensor.is_quantized:
            return None
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}\0{flat.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def answers_key(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list, max_new_tokens: int, batch_size: int
) -> str | None:
    import torch
    import transformers

    from rlhf_pipeline.trainers.models.text import blank_generation_config, prompt_ids

    weights = weights_digest(model)
    if weights is None:
        return None
    stops = blank_generation_config(model, tokenizer).eos_token_id
    settings = {
        "weights": weights,
        "prompts": hashlib.sha256(json.dumps([prompt_ids(tokenizer, p) for p in prompts]).encode()).hexdigest(),
        "stops": stops,
        "pad": tokenizer.pad_token_id,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "device": model.device.type,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "code": [hashlib.sha256(Path(find_spec(name).origin).read_bytes()).hexdigest() for name in CODE],
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:32]


def answers_dir() -> Path:
    from rlhf_pipeline.trainers.models.checkpoints import cache_root

    return cache_root() / "answers"


def greedy_answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    max_new_tokens: int,
    batch_size: int,
    progress: Callable[[int, int], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[list[str], list[bool]]:
    """`trainers.models.text.generate_answers`' greedy answers and cut flags, from the cache when this model answered
    these prompts with these settings before (`log` says so), else generated (`progress(done, total)` after each batch)
    and kept."""
    from rlhf_pipeline.trainers.models.text import generate_answers, keeping, kept_answers

    key = answers_key(model, tokenizer, prompts, max_new_tokens, batch_size)
    path = answers_dir() / f"{key}.jsonl"
    if key is not None and path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        if len(rows) == len(prompts):
            if log is not None:
                log(f"{len(rows)} answers from the answer cache ({path})")
            return [r["answer"] for r in rows], [r["cut"] for r in rows]
    started = time.perf_counter()
    if key is None:
        return generate_answers(model, tokenizer, prompts, max_new_tokens, batch_size, progress=progress)
    # Each answer is kept as it ends: a run killed here resumes with the answers it had not given, the same answers.
    batches = path.with_suffix(".partial.jsonl")
    before = kept_answers(batches)
    if before and log is not None:
        log(f"resuming: {len(before)} of {len(prompts)} answers kept from a run that stopped ({batches})")
    with keeping(batches) as keep:
        answers, cut = generate_answers(
            model, tokenizer, prompts, max_new_tokens, batch_size, progress=progress, done_before=before, on_batch=keep
        )
    whole = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}"
    whole.write_text("".join(json.dumps({"answer": a, "cut": c}) + "\n" for a, c in zip(answers, cut)))
    whole.rename(path)
    batches.unlink(missing_ok=True)
    if log is not None:
        log(f"{len(answers)} answers in {time.perf_counter() - started:.0f} s, kept in {path}")
    return answers, cut
