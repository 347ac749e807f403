"""Pairwise judges for the eval stage: which of two answers to the same prompt is better, and a win rate from them.

A judge is any callable

    judge(prompts: list, completions_a: list, completions_b: list) -> list[float]

returning, per pair, the probability that answer a is better than answer b.
`JudgeConfig.path` names either a Python function with that signature
(`package.module:function`) or a causal LM (a local folder or a hub id) that is
shown `template` and read for its next-token verdict "A" or "B".

LLM judges favour the answer in one position whatever it says (Zheng et al. 2023,
"Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena", sec. 3.3 "position
bias"; their fix, sec. 3.4, is to judge both orders). `judged_win_rate` swaps
the positions of every pair and reports how biased and how inconsistent the
judge was. torch and transformers are imported inside the LM judge, so this
module stays cheap to import for flows.
"""

from __future__ import annotations

import math
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from pydantic import Field, field_validator, model_validator

from rlhf_pipeline.trainers.config import StrictModel
from rlhf_pipeline.trainers.models.load import load_tokenizer
from rlhf_pipeline.trainers.rewards.metrics import WinRate, bootstrap_mean
from rlhf_pipeline.trainers.runtime.heartbeat import beat

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Judge = Callable[[list, list, list], list[float]]
"""(prompts, completions_a, completions_b) -> P(a is better than b) per pair, each in [0, 1]."""

VERDICTS = ("A", "B")
"""What an LM judge is asked to answer: the letter of the better answer."""

PLACEHOLDERS = frozenset({"prompt", "a", "b"})

DEFAULT_TEMPLATE = (
    "Two answers to the same prompt follow. Which one is better: more helpful, more correct and clearer?\n\n"
    "[Prompt]\n{prompt}\n\n"
    "[Answer A]\n{a}\n\n"
    "[Answer B]\n{b}\n\n"
    'Reply with one letter, "A" or "B".\n'
    # Ends in a space: the verdict is then " A" as written text has it (GPT-2 and Llama vocabularies hold " A" as one
    # token).
    "Better answer: "
)

FUNCTION_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")

SAMPLE = (
    ["Sort the digits 3 1 2.", "Name a colour."],
    ["1 2 3", "Blue."],
    ["3 2 1", "Blue, as the sky on a clear day."],
)
"""The pairs a function judge is checked on before use, when the caller has none of its own."""


class JudgeConfig(StrictModel):
    """A pairwise judge: a Python function or a causal LM asked which of two answers is better."""

    path: str = Field(
        description=(
            "'package.module:function' of a function judge(prompts, completions_a, completions_b) -> list[float] "
            "returning P(a is better) per pair, or a causal LM used as the judge: a local model folder or a hub id."
        ),
    )
    template: str = Field(
        DEFAULT_TEMPLATE,
        description=(
            "Prompt shown to an LM judge, with placeholders {prompt}, {a} and {b} (write literal braces as "
            "{{ and }}); the verdict letter follows it directly, so its last characters decide whether the verdict "
            "token is 'A' or ' A'. Sent as a user turn when the judge's tokenizer has a chat template."
        ),
    )
    batch_size: int = Field(
        16, ge=1, description="Pairs per forward pass of an LM judge, per call of a function judge."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of an LM judge.")
    trust_remote_code: bool = Field(
        False,
        description=(
            "Run model code shipped with an LM judge's hub repository. Refused unless the worker's operator allows "
            "the repository (RLHF_ALLOWED_REMOTE_CODE)."
        ),
    )

    @field_validator("template")
    @classmethod
    def _has_placeholders(cls, template: str) -> str:
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as exc:
            raise ValueError(f"judge template: {exc} (write literal braces as {{{{ and }}}})") from exc
        missing, unknown = sorted(PLACEHOLDERS - names), sorted(names - PLACEHOLDERS)
        if missing or unknown:
            raise ValueError(
                "judge template must contain {prompt}, {a} and {b}"
                + (f"; it lacks {', '.join('{' + n + '}' for n in missing)}" if missing else "")
                + (
                    f"; it has unknown placeholders {', '.join('{' + n + '}' for n in unknown)} (write literal braces "
                    "as {{ and }})"
                    if unknown
                    else ""
                )
            )
        return template

    @field_validator("path")
    @classmethod
    def _function_or_model(cls, path: str) -> str:
        if ":" in path and not Path(path).expanduser().exists():
            if not FUNCTION_PATH.match(path):
                raise ValueError(f"judge path {path!r}: a function judge is written 'package.module:function'")
        elif not (HUB_ID.match(path) or path.startswith(("/", ".", "~")) or Path(path).expanduser().exists()):
            raise ValueError(
                f"judge path {path!r} is neither 'package.module:function' nor a model folder or hub id ('owner/name')"
            )
        return path

    @model_validator(mode="after")
    def _model_fields_for_a_model(self):
        if self.is_function:
            from rlhf_pipeline.trainers.runtime.custom import import_callable

            # With the parameters; it is tried on a sample before use too
            import_callable(self.path, "judge function", positional=3)
            given = [name for name in ("template", "revision", "trust_remote_code") if name in self.model_fields_set]
            if given:
                raise ValueError(f"judge {self.path!r} is a function: {', '.join(given)} only apply to an LM judge")
        elif self.trust_remote_code:
            from rlhf_pipeline.trainers.runtime.trust import check_remote_code

            check_remote_code(self.path, "judge")
        return self

    @property
    def is_function(self) -> bool:
        return bool(FUNCTION_PATH.match(self.path)) and not Path(self.path).expanduser().exists()


# --- loading ----------------------------------------------------------------------


def load_judge(cfg: JudgeConfig, sample: tuple[list, list, list] | None = None) -> Judge:
    """The judge `cfg` names, ready to call. A function judge is imported and checked on `sample`
    (prompts, completions_a, completions_b: a few rows of the caller's data; default `SAMPLE`) before use."""
    if cfg.is_function:
        judge = FunctionJudge(cfg)
        judge.check(*(sample or SAMPLE))
        return judge
    return LMJudge(cfg)


class FunctionJudge:
    """A Python function judge, called `batch_size` pairs at a time; every result is checked (count, range) before it is
    used."""

    def __init__(self, cfg: JudgeConfig):
        from rlhf_pipeline.trainers.runtime.custom import import_callable

        self.fn = import_callable(cfg.path, "judge function", positional=3)
        self.path, self.batch_size = cfg.path, cfg.batch_size

    def check(self, prompts: list, completions_a: list, completions_b: list) -> None:
        """One call on a few pairs; a judge that raises or returns the wrong thing fails here, with its path."""
        self(prompts, completions_a, completions_b)

    def __call__(self, prompts: list, completions_a: list, completions_b: list) -> list[float]:
        _same_length(prompts, completions_a, completions_b)
        out: list[float] = []
        for start in range(0, len(prompts), self.batch_size):
            beat()
            rows = slice(start, start + self.batch_size)
            try:
                got = self.fn(prompts[rows], completions_a[rows], completions_b[rows])
            except Exception as exc:
                raise ValueError(
                    f"judge function {self.path!r} raised on {len(prompts[rows])} pairs: {type(exc).__name__}: {exc}"
                ) from exc
            out.extend(self._checked(got, len(prompts[rows])))
        return out

    def _checked(self, got, n: int) -> list:
        if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__len__"):
            raise ValueError(
                f"judge function {self.path!r} returned {type(got).__name__} {str(got)[:60]!r} for {n} pairs; it must "
                "return a list"
            )
        if len(got) != n:
            raise ValueError(
                f"judge function {self.path!r} returned {len(got)} values for {n} pairs; it must return one "
                "probability in [0, 1] per pair"
            )
        values = [_probability(x) for x in got]
        if None in values:
            raise ValueError(
                f"judge function {self.path!r} returned {got[values.index(None)]!r}; it must return P(a is better) in "
                "[0, 1] per pair"
            )
        return values


class LMJudge:
    """A causal LM read for its verdict: P(a better) = softmax over the next-token logits of "A" and "B".

    The rendered template (wrapped as a user turn with the generation prompt when
    the tokenizer has a chat template) is followed directly by the verdict letter.
    Its token is found the way the text would be tokenized: both `context + "A"`
    and `context + "B"` are tokenized, the shared prefix is the context the model
    reads, and the first tokens after it are the two verdicts. So a template ending
    in a space is scored on " A" / " B" where the vocabulary merges the space into
    the letter (GPT-2, Llama), and on "A" / "B" where it does not. Rows are
    left-padded, `batch_size` to a forward pass, and never truncated.
    """

    def __init__(self, cfg: JudgeConfig):
        import torch
        from transformers import AutoModelForCausalLM

        folder = Path(cfg.path).expanduser()
        source = str(folder) if folder.is_dir() else cfg.path
        cuda = torch.cuda.is_available()
        try:
            self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(
                source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
            )
            # Float32 on CPU (half-precision matmuls there are slow or missing); the checkpoint's own dtype on a GPU.
            self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
                source,
                revision=cfg.revision,
                trust_remote_code=cfg.trust_remote_code,
                use_safetensors=True,
                dtype="auto" if cuda else torch.float32,
            )
        except (OSError, ValueError) as exc:
            where = "model folder" if folder.is_dir() else "hub id (no such folder here)"
            raise ValueError(
                f"judge {cfg.path!r}: cannot load it as a causal LM from a {where}: {type(exc).__name__}: {exc}"
            ) from exc
        self.model.to("cuda" if cuda else "cpu").eval().requires_grad_(False)
        self.path, self.template, self.batch_size = cfg.path, cfg.template, cfg.batch_size

    def judge_text(self, prompt, completion_a, completion_b) -> str:
        """The text the judge reads before its verdict."""
        text = self.template.format(
            prompt=render_prompt(prompt), a=render_completion(completion_a), b=render_completion(completion_b)
        )
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        return text

    def verdict_ids(self, text: str) -> tuple[list[int], int, int]:
        """(context ids, id of verdict "A", id of verdict "B") for one judge text."""
        # A chat-rendered text already holds its special tokens (BOS included): do not add them twice.
        special = not getattr(self.tokenizer, "chat_template", None)
        ids_a, ids_b = (list(self.tokenizer(text + v, add_special_tokens=special)["input_ids"]) for v in VERDICTS)
        cut = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), min(len(ids_a), len(ids_b)))
        if cut == 0 or cut == min(len(ids_a), len(ids_b)):
            raise ValueError(
                f"judge {self.path!r}: its tokenizer gives {text[-20:]!r} + 'A' and + 'B' no distinct next token"
            )
        first_a, first_b = (self.tokenizer.decode([ids[cut]]) for ids in (ids_a, ids_b))
        # The verdict tokens must differ only in the letter (" A" / " B"); an uneven split (" A" / " ", "B") would
        # compare unlike things.
        if not (first_a.endswith("A") and first_b.endswith("B") and first_a[:-1] == first_b[:-1]):
            raise ValueError(
                f"judge {self.path!r}: after the template's last characters {text[-20:]!r} its tokenizer splits the "
                f"verdicts unevenly ({first_a!r} vs {first_b!r}); end the template differently (e.g. with a newline)"
            )
        return ids_a[:cut], ids_a[cut], ids_b[cut]

    def __call__(self, prompts: list, completions_a: list, completions_b: list) -> list[float]:
        import torch

        from rlhf_pipeline.trainers.models.text import pad

        _same_length(prompts, completions_a, completions_b)
        rows = [self.verdict_ids(self.judge_text(p, a, b)) for p, a, b in zip(prompts, completions_a, completions_b)]
        order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))  # similar lengths share a batch: less padding
        out = [0.0] * len(rows)
        device = self.model.device
        for start in range(0, len(order), self.batch_size):
            beat()
            batch = [rows[i] for i in order[start : start + self.batch_size]]
            input_ids, attention = pad(
                [ids for ids, _, _ in batch], self.tokenizer.pad_token_id, left=True, device=device
            )
            # Left padding shifts every position; counting positions from the first real token keeps absolute-position
            # models (GPT-2) exact.
            position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                last = (
                    self.model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids)
                    .logits[:, -1]
                    .float()
                )
            verdicts = torch.tensor([[a, b] for _, a, b in batch], device=device)
            p_a = last.gather(-1, verdicts).softmax(-1)[:, 0]
            for i, p in zip(order[start : start + self.batch_size], p_a.tolist()):
                out[i] = p
        return out


def render_prompt(prompt) -> str:
    """A string prompt as is; a list of chat messages as readable turns ("User: ...", blank line between turns)."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(f"{str(m['role']).capitalize()}: {m['content']}" for m in prompt)


def render_completion(completion) -> str:
    """A string completion as is; a conversational one (assistant messages) as the text of its messages."""
    if isinstance(completion, str):
        return completion
    return "\n\n".join(str(m["content"]) for m in completion)


def _same_length(prompts: Sequence, completions_a: Sequence, completions_b: Sequence) -> None:
    if not len(prompts) == len(completions_a) == len(completions_b):
        raise ValueError(
            f"a judge needs as many prompts as answers, got {len(prompts)} prompts, {len(completions_a)} and "
            f"{len(completions_b)} answers"
        )


# --- win rate ---------------------------------------------------------------------


@dataclass(frozen=True)
class JudgedWinRate:
    """A judge's win rate of a over b, with the position effects it was corrected for."""

    win_rate: WinRate
    """Mean per-item preference for a (a probability; identical answers count 0.5), 95% bootstrap interval over items;
    `ties` counts items judged exactly 0.5."""
    position_bias: float
    """Mean P(the answer shown first is better) over both orders of the judged items, minus 0.5: 0 unbiased, +0.5 always
    the first, -0.5 always the second (0 when no item was judged)."""
    order_disagreement: float
    """Share of judged items whose verdict (a, b or tie) changes when the order is swapped (Zheng et al. 2023's
    inconsistency; 0 when no item was judged)."""
    judged: int
    """Items sent to the judge (identical answers are not)."""
    preferences: tuple[float, ...]
    """Per-item preference for a: mean of p(a, b) and 1 - p(b, a)."""

    def metrics(self, name: str) -> dict[str, float]:
        """`{name, name_low, name_high, name_position_bias, name_order_disagreement}`, e.g. name =
        'eval/heldout/judge_win_rate_vs_sft'."""
        w = self.win_rate
        return {
            name: w.rate,
            f"{name}_low": w.low,
            f"{name}_high": w.high,
            f"{name}_position_bias": self.position_bias,
            f"{name}_order_disagreement": self.order_disagreement,
        }


def judged_win_rate(
    judge: Judge,
    prompts: list,
    completions_a: list,
    completions_b: list,
    *,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> JudgedWinRate:
    """Win rate of a over b by `judge`, each pair judged in both orders (Zheng et al. 2023, sec. 3.4, "swap positions").

    With p1 = judge(a, b) and p2 = judge(b, a), both "P(the first is better)", the
    item's preference for a is (p1 + (1 - p2)) / 2: a judge that always picks the
    first position scores 0.5, where one order alone would have said 1.0. Its bias
    is (p1 + p2) / 2 - 0.5, averaged over items. Identical answers are a tie (0.5)
    and never reach the judge. Both orders go to the judge in one call.
    """
    _same_length(prompts, completions_a, completions_b)
    if not prompts:
        raise ValueError("judged_win_rate needs at least one pair")
    judged = [i for i, (a, b) in enumerate(zip(completions_a, completions_b)) if a != b]
    n = len(judged)
    p = [prompts[i] for i in judged]
    a = [completions_a[i] for i in judged]
    b = [completions_b[i] for i in judged]
    scores = judge(p + p, a + b, b + a) if judged else []
    if len(scores) != 2 * n:
        raise ValueError(f"the judge returned {len(scores)} values for {2 * n} pairs (both orders of {n} items)")
    values = [_probability(x) for x in scores]
    if None in values:
        raise ValueError(
            f"the judge returned {scores[values.index(None)]!r}; it must return P(a is better) in [0, 1] per pair"
        )
    first, swapped = values[:n], values[n:]
    preferences = [0.5] * len(prompts)
    for i, p1, p2 in zip(judged, first, swapped):
        preferences[i] = (p1 + 1 - p2) / 2
    interval = bootstrap_mean(preferences, n_bootstrap=n_bootstrap, confidence=confidence, seed=seed)
    ties = sum(x == 0.5 for x in preferences)
    bias = sum(p1 + p2 for p1, p2 in zip(first, swapped)) / (2 * n) - 0.5 if n else 0.0
    # The verdict for a: +1 a, 0 tie, -1 b, read from each order.
    flips = sum(_sign(p1 - 0.5) != _sign(0.5 - p2) for p1, p2 in zip(first, swapped))
    return JudgedWinRate(
        win_rate=WinRate(interval.mean, interval.low, interval.high, interval.n, ties),
        position_bias=bias,
        order_disagreement=flips / n if n else 0.0,
        judged=n,
        preferences=tuple(preferences),
    )


def _probability(x) -> float | None:
    """x as a float in [0, 1] (a Python, numpy or torch number), or None."""
    if isinstance(x, (str, bytes)):
        return None
    try:
        value = float(x)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and 0 <= value <= 1 else None


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)
