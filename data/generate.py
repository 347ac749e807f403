"""Generate the bundled "sort the digits" datasets (seeded, deterministic).

    python -m rlhf_pipeline.data.generate     # rewrites data/sort/*.jsonl

The task is chosen so that alignment has something to fix, as in real RLHF
(measured designs: docs/LIBRARY-FACTS.md,
"The bundled task: measured designs"):

* SFT demonstrations carry a *systematic* mistake tied to a prompt feature:
  when the answer holds a 9, the demonstrator swaps the last two differing
  neighbours ("12399" -> "12939") 80% of the time. About 28% of the demos are
  wrong, lengths are preserved, so SFT learns the mistake as its most likely
  answer and greedy decoding repeats it (random noise would be averaged away).
  The demonstrator is inconsistent, as people are: the 20% correct demos leave
  the right answer in the SFT model's samples, which online RL needs to find
  it (with a fully consistent mistake, GRPO saw no reward variance in 90% of
  its groups and did not move).
* Preference pairs and reference answers prefer the correct output. Rejected
  answers are that same systematic mistake 60% of the time (the mistakes the
  SFT model actually makes) and varied corruptions otherwise, so the reward
  model learns "sorted and complete", not "has no 9 in the last place".
* Held-out prompts (`prompts_eval`, `preference_eval`) never occur in any
  training file.

Files (TRL's standard formats):
  sft.jsonl              prompt, completion          (SFT, prompt-completion)
  preference.jsonl       prompt, chosen, rejected    (explicit-prompt preference)
  preference_eval.jsonl  prompt, chosen, rejected    (held-out pairs)
  prompts.jsonl          prompt, answer              (prompt-only, for online RL)
  prompts_eval.jsonl     prompt, answer              (held-out prompts)
"""

import json
import random
from pathlib import Path

SEED = 1234
SIZES = {
    "sft": 5000,
    "preference": 3000,
    "preference_eval": 500,
    "prompts": 2000,
    "prompts_eval": 600,
}
MIN_DIGITS, MAX_DIGITS = 3, 5
SYSTEMATIC_SHARE_OF_REJECTED = 0.6
MISTAKE_RATE = 0.8  # how often the demonstrator makes the systematic mistake when it applies


def prompt_for(digits: str) -> str:
    return f"sort {digits} -> "


def correct(digits: str) -> str:
    return "".join(sorted(digits))


def systematic_mistake(answer: str) -> str:
    """Swap the last two differing neighbours; unchanged when all digits are equal."""
    for i in range(len(answer) - 2, -1, -1):
        if answer[i] != answer[i + 1]:
            return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
    return answer


def demonstration(digits: str, rng: random.Random) -> str:
    """What the (imperfect, inconsistent) human demonstrator writes."""
    answer = correct(digits)
    return systematic_mistake(answer) if "9" in answer and rng.random() < MISTAKE_RATE else answer


def varied_corruption(digits: str, rng: random.Random) -> str:
    answer = correct(digits)
    i = rng.randrange(len(answer))
    options = [
        lambda: answer[:i] + answer[i + 1 :],  # drop a digit
        lambda: answer[:i] + answer[i] + answer[i:],  # duplicate a digit
        lambda: answer[:i] + rng.choice("0123456789") + answer[i + 1 :],  # replace a digit
        lambda: digits,  # echo the input
        lambda: answer[::-1],  # descending
        lambda: answer[: rng.randrange(1, len(answer))],  # truncated
        lambda: answer + rng.choice("0123456789"),  # extra digit
        lambda: _swap_random_neighbours(answer, rng),  # a random local swap
    ]
    for _ in range(20):
        wrong = rng.choice(options)()
        if wrong and wrong != answer:
            return wrong
    return answer[1:] + answer[0] if answer[1:] + answer[0] != answer else answer + "0"


def _swap_random_neighbours(answer: str, rng: random.Random) -> str:
    pairs = [i for i in range(len(answer) - 1) if answer[i] != answer[i + 1]]
    if not pairs:
        return answer
    i = rng.choice(pairs)
    return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]


def rejected_for(digits: str, rng: random.Random) -> str:
    answer = correct(digits)
    mistake = systematic_mistake(answer)
    if mistake != answer and rng.random() < SYSTEMATIC_SHARE_OF_REJECTED:
        return mistake
    return varied_corruption(digits, rng)


def random_digits(rng: random.Random) -> str:
    n = rng.randint(MIN_DIGITS, MAX_DIGITS)
    return "".join(rng.choice("0123456789") for _ in range(n))


def unique_digits(rng: random.Random, count: int, exclude: set[str]) -> list[str]:
    chosen: list[str] = []
    while len(chosen) < count:
        d = random_digits(rng)
        if d not in exclude:
            exclude.add(d)
            chosen.append(d)
    return chosen


def training_digits(rng: random.Random, count: int, held_out: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        d = random_digits(rng)
        if d not in held_out:
            out.append(d)
    return out


def build(seed: int = SEED) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    held_out: set[str] = set()
    eval_prompts = unique_digits(rng, SIZES["prompts_eval"], held_out)
    eval_pairs = unique_digits(rng, SIZES["preference_eval"], held_out)
    return {
        "sft": [
            {"prompt": prompt_for(d), "completion": demonstration(d, rng)}
            for d in training_digits(rng, SIZES["sft"], held_out)
        ],
        "preference": [
            {"prompt": prompt_for(d), "chosen": correct(d), "rejected": rejected_for(d, rng)}
            for d in training_digits(rng, SIZES["preference"], held_out)
        ],
        "preference_eval": [
            {"prompt": prompt_for(d), "chosen": correct(d), "rejected": rejected_for(d, rng)} for d in eval_pairs
        ],
        "prompts": [
            {"prompt": prompt_for(d), "answer": correct(d)} for d in training_digits(rng, SIZES["prompts"], held_out)
        ],
        "prompts_eval": [{"prompt": prompt_for(d), "answer": correct(d)} for d in eval_prompts],
    }


def main(out_dir: Path = Path(__file__).parent / "sort") -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in build().items():
        with open(out_dir / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"{out_dir / name}.jsonl: {len(rows)} rows")


if __name__ == "__main__":
    main()
