"""Text to token ids, the one place that renders prompts, pads batches and generates (and keeps what a stopped
generation had made: `keeping`, `kept_answers`).

Rows are rendered exactly as TRL renders them, so a score or a sample here
means what it meant in training: a standard row is `prompt + completion + eos`;
a conversational row goes through the chat template (the prompt with the
generation prompt, the reply closed by the template).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlhf_pipeline.trainers.runtime.heartbeat import beat
from rlhf_pipeline.trainers.runtime.stopping import stop_if_asked

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt) -> list[int]:
    """A standard (string) or conversational (messages) prompt, ready for the reply."""
    if isinstance(prompt, list):
        return list(
            tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        )
    return list(tokenizer(prompt)["input_ids"])


def completion_ids(tokenizer: PreTrainedTokenizerBase, prompt, completion) -> tuple[list[int], int]:
    """Token ids of prompt + completion and where the completion starts."""
    if isinstance(prompt, list):
        reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
        full = tokenizer.apply_chat_template(prompt + reply, tokenize=True, return_dict=True)["input_ids"]
        return list(full), len(
            prompt_ids(tokenizer, prompt)
        ) if prompt else 0  # no turns before the reply: all of it is the completion
    # TRL's standard rows: the completion gets an explicit EOS, which is scored too
    return list(tokenizer(prompt + completion + tokenizer.eos_token)["input_ids"]), len(prompt_ids(tokenizer, prompt))


def pad(rows: list[list[int]], pad_id: int, left: bool = False, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of rows padded to the longest; left padding for generation."""
    import torch

    width = max(map(len, rows))
    fill = [[pad_id] * (width - len(row)) for row in rows]
    ids = [f + row if left else row + f for f, row in zip(fill, rows)]
    mask = [[0] * len(f) + [1] * len(row) if left else [1] * len(row) + [0] * len(f) for f, row in zip(fill, rows)]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)


def blank_generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
    """A generation config with nothing but the stop tokens (EOS and the template's end of turn), pad and BOS."""
    from transformers import GenerationConfig

    from rlhf_pipeline.trainers.models.templates import stop_token_ids

    bos = getattr(model.generation_config, "bos_token_id", None)
    return GenerationConfig(
        eos_token_id=stop_token_ids(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=bos
    )


@contextlib.contextmanager
def own_sampling(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase):
    """Generate with only the settings the caller names: the model's `generation_config` (Qwen's ships top_k=20,
    top_p=0.8, repetition_penalty=1.05) is swapped for a blank one that stops at EOS and the template's end of turn.
    transformers fills every setting a call leaves unset from the model's config, so passing ours is not enough."""
    # peft's generate copies the inner model's
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = target.generation_config
    target.generation_config = blank_generation_config(target, tokenizer)
    try:
        yield target.generation_config.eos_token_id
    finally:
        target.generation_config = saved


def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    max_new_tokens: int,
    batch_size: int,
    sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
) -> list[str]:
    """Greedy (or, with `sample`, at `temperature` with nucleus `top_p`; by default pure) completions for standard or
    conversational prompts, stopped at EOS or the chat template's end of turn; nothing is inherited from the model's
    generation config."""
    return generate_answers(model, tokenizer, prompts, max_new_tokens, batch_size, sample, temperature, top_p)[0]


def generate_answers(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    max_new_tokens: int,
    batch_size: int,
    sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    progress: Callable[[int, int], None] | None = None,
    done_before: dict[int, tuple[str, bool]] | None = None,
    on_batch: Callable[[list[int], list[str], list[bool]], None] | None = None,
    seeds: list[int] | None = None,
) -> tuple[list[str], list[bool]]:
    """`generate`'s completions, and for each whether the budget cut it (it reached `max_new_tokens` without a stop
    token), by `decode.decode` (`batch_size` answers decoding at once) where it runs the model, else by transformers'
    `generate`. Resumable: `done_before` holds the answers (and cut flags) of prompts answered before, by index, which
    are not generated again; `on_batch(indices, answers, cut)` is told the answers as they end, to keep them, and
    `progress(done, total)` after each. Sampling with `seeds` (one a prompt) draws each answer as `decode.decode` does
    with them, so that a resumed generation draws what an unbroken one would have; through `generate`, each batch
    draws from torch's generator seeded with its first prompt's seed."""
    from rlhf_pipeline.trainers.models.decode import supports

    model.eval()
    rendered = [prompt_ids(tokenizer, p) for p in prompts]
    out: list[str] = [""] * len(rendered)
    cut: list[bool] = [False] * len(rendered)
    for i, (text, was_cut) in (done_before or {}).items():
        out[i], cut[i] = text, was_cut
    todo = [i for i in range(len(rendered)) if i not in (done_before or {})]
    how = (model, tokenizer, rendered, max_new_tokens, batch_size)
    drawn = {"sample": sample, "temperature": temperature, "top_p": top_p, "seeds": seeds}
    made = _decoded if supports(model) else _generated
    made(*how, todo, drawn, out, cut, _told(len(rendered), len(rendered) - len(todo), progress, on_batch))
    return out, cut


def _told(total: int, done: int, progress, on_batch):
    """What `generate_answers` calls as answers come: `on_batch`, then `progress` with the running count."""
    count = [done]

    def tell(indices: list[int], answers: list[str], cut: list[bool]) -> None:
        beat()
        if on_batch is not None:
            on_batch(indices, answers, cut)
        stop_if_asked()  # after the answers are kept (`generate`'s batches end here)
        count[0] += len(indices)
        if progress is not None:
            progress(count[0], total)

    return tell


def _decoded(model, tokenizer, rendered, max_new_tokens, batch_size, todo, drawn, out, cut, tell) -> None:
    """The answers to `todo` by `decode.decode` (continuous batching, `batch_size` rows), into `out` and `cut`."""
    from rlhf_pipeline.trainers.models.decode import Budget, decode
    from rlhf_pipeline.trainers.models.templates import stop_token_ids

    stops = stop_token_ids(tokenizer)
    how = {key: value for key, value in drawn.items() if key != "seeds"}
    budget = Budget(max_new_tokens, tuple(stops) if isinstance(stops, (list, tuple)) else (stops,), **how)
    seeds = None if drawn["seeds"] is None else [drawn["seeds"][i] for i in todo]

    def done(k: int, answer) -> None:
        i = todo[k]
        out[i] = tokenizer.decode(answer.tokens, skip_special_tokens=True)
        cut[i] = not answer.stopped
        tell([i], [out[i]], [cut[i]])

    decode(model, [rendered[i] for i in todo], budget, batch_size, on_done=done, seeds=seeds)


def _generated(model, tokenizer, rendered, max_new_tokens, batch_size, todo, drawn, out, cut, tell) -> None:
    """The answers to `todo` by transformers' `generate`, in `length_batches`, for models `decode` does not run. The
    batches are those of every prompt, done or not, so that a resumed generation batches (and, with seeds, draws) as
    an unbroken one did."""
    import torch

    settings = (
        {"do_sample": True, "temperature": drawn["temperature"], "top_k": 0, "top_p": drawn["top_p"]}
        if drawn["sample"]
        else {"do_sample": False}
    )
    with own_sampling(model, tokenizer) as stops:
        stop_ids = torch.tensor(list(stops) if isinstance(stops, (list, tuple)) else [stops], device=model.device)
        waiting = set(todo)
        for batch in length_batches([len(p) for p in rendered], batch_size, max_new_tokens):
            if waiting.isdisjoint(batch):
                continue
            if drawn["seeds"] is not None:
                torch.manual_seed(drawn["seeds"][batch[0]])
            input_ids, attention = pad(
                [rendered[i] for i in batch], tokenizer.pad_token_id, left=True, device=model.device
            )
            with torch.no_grad():
                generated = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=stops,
                    **settings,
                )
            answers = generated[:, input_ids.shape[1] :]
            stopped = torch.isin(answers, stop_ids).any(dim=1)
            budget = answers.shape[1] >= max_new_tokens
            texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
            for i, text, ended in zip(batch, texts, stopped):
                if i in waiting:
                    out[i], cut[i] = text, bool(not ended and budget)
            new = [i for i in batch if i in waiting]
            tell(new, [out[i] for i in new], [cut[i] for i in new])


def length_batches(lengths: list[int], batch_size: int, max_new_tokens: int = 0) -> list[list[int]]:
    """Indices of prompts of these token lengths in generation batches: longest first, at most `batch_size` to a
    batch, none whose sequence (its prompt and the `max_new_tokens` budget) is shorter than half its batch's longest.
    A batch pads to its longest prompt and runs until its last answer stops, so one long prompt among short ones would
    cost each of them its length (IFBench holds a 2,591-token prompt among prompts of ~100); but a batch of its own
    costs a short prompt the budget's decoding steps again, at fewer rows a step, where a CPU's matmuls run slower
    (`python -m bench.generation` prints their rate by rows), so a prompt twice as long as another shares its batch
    when the budget dwarfs both. The longest batch first also finds a too small memory at once."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        longest = lengths[batches[-1][0]] if batches else 0
        if batches and len(batches[-1]) < batch_size and 2 * (lengths[i] + max_new_tokens) >= longest + max_new_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def reward_scores(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list, completions: list, batch_size: int
) -> list[float]:
    """Scalar rewards of prompt + completion, formatted as TRL's RewardTrainer formats them."""
    import torch

    rows = [completion_ids(tokenizer, p, c)[0] for p, c in zip(prompts, completions)]
    model.eval()
    scores: list[float] = []
    for start in range(0, len(rows), batch_size):
        beat()
        input_ids, attention = pad(rows[start : start + batch_size], tokenizer.pad_token_id, device=model.device)
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention).logits
        scores.extend(logits[:, 0].float().tolist())
    return scores


@contextlib.contextmanager
def keeping(path: Path):
    """`generate_answers`' `on_batch` that keeps each answer as it ends, a line of `path` each (which `kept_answers`
    reads back), flushed at once: a generation killed mid-way loses none of the answers it had told."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as journal:

        def keep(indices: list[int], answers: list[str], cut: list[bool]) -> None:
            rows = [{"index": i, "answer": a, "cut": c} for i, a, c in zip(indices, answers, cut)]
            journal.write("".join(json.dumps(row) + "\n" for row in rows))
            journal.flush()

        yield keep


def kept_answers(path: Path) -> dict[int, tuple[str, bool]]:
    """The answers a stopped generation kept one line each (index -> answer, cut), as `generate_answers`'
    `done_before` takes them (eval's answers, the pairs stage's samples); a last line cut short by a kill, and lines of
    another layout (a journal an older version kept), are left out."""
    return {row["index"]: (row["answer"], row["cut"]) for row in kept_rows(path) if "index" in row}


def kept_rows(path: Path) -> list[dict]:
    """The rows of a JSONL file kept line by line as work went on; a last line cut short by a kill is left out."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
