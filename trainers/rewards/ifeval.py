"""Instruction following with verifiable constraints: rewards and gold metrics from IFEval's and IFBench's checkers.

    rewards: {functions: [{path: rlhf_pipeline.trainers.rewards.ifeval:constraints_followed}], reward_model_weight: 0}
    eval:    {gold_metric: {path: rlhf_pipeline.trainers.rewards.ifeval:all_followed}}

The checkers are `if-verifiable`'s (IFEval's 25 and IFBench's 58, Apache-2.0, with no model or service behind them):
one maintained copy of both benchmarks' reference code, where the benchmarks' own packages bring spaCy, LangChain and
an evaluator service. Rows name their checkers and arguments as IFEval does: `instruction_id_list` (ids) and `kwargs`
(one dict per id, or its JSON). Scoring is IFEval's strict mode: the response as it is, every instruction checked.

Some checkers read NLTK data (sentence and word tokenizers, stopwords). They find it in `llama-index-core`'s wheel,
a registry package that ships NLTK's `punkt_tab` and `stopwords` (installed with --no-deps: only its data is read),
or wherever `NLTK_DATA` points. The one checker that needs a part-of-speech tagger (IFBench's
`words:start_verb`), which no registry package ships, is refused by name (`UNSUPPORTED`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
from dataclasses import dataclass
from typing import Any, Literal

Benchmark = Literal["ifeval", "ifbench"]
UNSUPPORTED = {"words:start_verb": "needs NLTK's averaged_perceptron_tagger_eng, which no registry package ships"}
"""Checker ids refused by name, and why."""


def nltk_data() -> str | None:
    """The NLTK data folder the checkers read: `NLTK_DATA`, else the one inside the installed `llama-index-core`."""
    if os.environ.get("NLTK_DATA"):
        return os.environ["NLTK_DATA"]
    from importlib import metadata

    try:
        dist = metadata.distribution("llama-index-core")
    except metadata.PackageNotFoundError:
        return None
    folder = dist.locate_file("llama_index/core/_static/nltk_cache")
    return str(folder) if os.path.isdir(str(folder)) else None


@functools.cache
def registry(benchmark: Benchmark) -> dict[str, Any]:
    """Checker id -> checker class, imported once with the NLTK data path set. IFBench's module calls `nltk.download`
    at import for what it does not find (the old `punkt`, the tagger): nothing is fetched here (no network call, no
    '[nltk_data] Error loading' lines), and the checkers that need the missing data are in `UNSUPPORTED`."""
    import nltk
    from langdetect import DetectorFactory

    # IFEval's language and change_case checkers ask langdetect, which samples: unseeded, the same answer to the same
    # prompt can pass once and fail the next time ("WE OK" is English about half the time), and a start scored twice
    # gets two figures. Seeded, as langdetect's documentation says, each answer gets one verdict.
    DetectorFactory.seed = 0
    folder = nltk_data()
    if folder is not None and folder not in nltk.data.path:
        nltk.data.path.insert(0, folder)
    download, nltk.download = nltk.download, lambda *args, **kwargs: False
    try:
        if benchmark == "ifeval":
            from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT
        else:
            from if_verifiable.ifbench.instructions_registry import INSTRUCTION_DICT
    finally:
        nltk.download = download
    return dict(INSTRUCTION_DICT)


@dataclass(frozen=True)
class Checked:
    instruction_ids: list[str]
    followed: list[bool]

    @property
    def all(self) -> bool:
        return all(self.followed)


def _arguments(kwargs: Any, count: int) -> list[dict]:
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    if kwargs is None:
        return [{} for _ in range(count)]
    if len(kwargs) != count:
        raise ValueError(f"kwargs has {len(kwargs)} entries for {count} instruction ids")
    return [dict(k or {}) for k in kwargs]


def check_supported(instruction_ids: list[str], benchmark: Benchmark = "ifeval") -> None:
    """A ValueError naming the first id the benchmark's registry lacks or this machine cannot check."""
    known = registry(benchmark)
    for instruction_id in instruction_ids:
        if instruction_id in UNSUPPORTED:
            raise ValueError(f"instruction {instruction_id!r} is refused: {UNSUPPORTED[instruction_id]}")
        if instruction_id not in known:
            raise ValueError(f"instruction {instruction_id!r} is not one of {benchmark}'s {len(known)} checkers")


def loose_variants(response: str) -> list[str]:
    """IFEval's loose mode (Zhou et al. 2023, "Instruction-Following Evaluation for Large Language Models", sec. 2.2):
    the response, without its first line, without its last, without both, and each of these with every '*' removed
    (markdown emphasis); an instruction is followed when any variant follows it."""
    lines = response.split("\n")
    cut = [response, "\n".join(lines[1:]).strip(), "\n".join(lines[:-1]).strip(), "\n".join(lines[1:-1]).strip()]
    return cut + [text.replace("*", "") for text in cut]


def check(
    response: str,
    instruction_ids: list[str],
    kwargs: Any,
    prompt: str = "",
    benchmark: Benchmark = "ifeval",
    loose: bool = False,
) -> Checked:
    """IFEval's strict check of one response against each instruction (an empty response follows none); with `loose`,
    its loose check (`loose_variants`)."""
    check_supported(instruction_ids, benchmark)
    known = registry(benchmark)
    responses = loose_variants(response) if loose else [response]
    followed = []
    for instruction_id, arguments in zip(instruction_ids, _arguments(kwargs, len(instruction_ids))):
        checker = known[instruction_id](instruction_id)
        with _drawn_for(f"{instruction_id}\n{prompt}"):
            checker.build_description(**{k: v for k, v in arguments.items() if v is not None})
            if "prompt" in (checker.get_instruction_args() or {}):
                checker.build_description(prompt=prompt)
        followed.append(any(text.strip() and checker.check_following(text) for text in responses))
    return Checked(list(instruction_ids), followed)


@contextlib.contextmanager
def _drawn_for(key: str):
    """Python's `random` seeded by `key` inside, its state as it was outside. A checker draws what its kwargs leave out
    or give out of range (IFEval's prompt 1122 asks for '#' as a "letter": `letter_frequency` then checks a random
    letter), so an unseeded draw gives the same answer two verdicts in two processes."""
    state = random.getstate()
    random.seed(key)
    try:
        yield
    finally:
        random.setstate(state)


def text_of(value: Any) -> str:
    """A completion or prompt as text: a string, or the content of its messages (conversational rows)."""
    if isinstance(value, str):
        return value
    return "\n".join(message["content"] for message in value)


def _checked(prompts: list, completions: list, instruction_id_list: list, kwargs: list) -> list[Checked]:
    return [
        check(text_of(completion), list(ids), arguments, text_of(prompt))
        for prompt, completion, ids, arguments in zip(prompts, completions, instruction_id_list, kwargs)
    ]


def constraints_followed(
    prompts: list, completions: list, instruction_id_list: list, kwargs: list, **_: Any
) -> list[float]:
    """Reward: the share of the prompt's constraints the completion follows (IFEval's instruction-level strict
    score), so a completion that meets one of two constraints beats one that meets none."""
    return [sum(c.followed) / len(c.followed) for c in _checked(prompts, completions, instruction_id_list, kwargs)]


def all_followed(prompts: list, completions: list, instruction_id_list: list, kwargs: list, **_: Any) -> list[float]:
    """Gold metric: 1.0 when the completion follows every constraint of its prompt (IFEval's prompt-level strict
    accuracy), else 0.0."""
    return [float(c.all) for c in _checked(prompts, completions, instruction_id_list, kwargs)]
