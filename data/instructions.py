"""Generate the bundled instruction-following task (seeded, deterministic): everyday requests x IFEval constraints.

    python -m rlhf_pipeline.data.instructions      # rewrites data/ifeval/*.jsonl

Each prompt is an everyday request followed by one or two verifiable constraints of IFEval's 25 types, worded in the
project's own words (`own_words`: several wordings a type, none of them the checker library's, which are IFEval's),
with the arguments the checker reads, so the reward and the gold metric check exactly what the prompt asks. Rows
carry the checker ids and their arguments (`instruction_id_list`, `kwargs` as JSON), which
`rlhf_pipeline.trainers.rewards.ifeval`'s reward and gold metric read.

Held-out prompts (`prompts_eval`) are the dev split on which recipes are chosen (docs/PERFORMANCE.md): requests no
training prompt uses, and for each type a wording no training prompt uses. IFEval and IFBench are the test sets, run
on a frozen recipe.

Files (TRL's conversational prompt-only format):
  prompts.jsonl        prompt, instruction_id_list, kwargs     (online RL)
  prompts_eval.jsonl   prompt, instruction_id_list, kwargs     (held-out: the dev split)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlhf_pipeline.data import own_words

SEED = 2025
SIZES = {"prompts": 2000, "prompts_eval": 300}
TWO_CONSTRAINTS = 0.25
"""Share of prompts with a second, non-conflicting constraint (IFEval's prompts carry one to three)."""
TYPES = own_words.TYPES
"""Every IFEval constraint type: those the 135M model always or never follows give GRPO groups of equal rewards
(no gradient) and cost only their sampling; which to train on is a recipe's choice (`docs/PERFORMANCE.md`)."""

REQUESTS = (
    "Write a short note to a neighbour about a parcel you took in for them.",
    "Describe your ideal weekend breakfast.",
    "Give advice to someone starting to run.",
    "Explain why the sky looks blue.",
    "Write a thank-you message to a teacher.",
    "Suggest a name for a small bakery and explain it.",
    "Describe a rainy day in a big city.",
    "Tell a friend how to water houseplants while you are away.",
    "Explain what a budget is to a teenager.",
    "Write a short product description for a reusable water bottle.",
    "Describe the smell of fresh bread.",
    "Give three tips for a job interview.",
    "Write a short poem about autumn leaves.",
    "Explain how to make a cup of tea.",
    "Describe a visit to a farmers market.",
    "Invite your colleagues to a team lunch.",
    "Explain why sleep matters for students.",
    "Write a short review of a pair of running shoes.",
    "Describe your favourite park.",
    "Give advice on packing for a weekend trip.",
    "Write a message cancelling a dentist appointment.",
    "Explain how recycling helps the environment.",
    "Describe a cat sleeping in the sun.",
    "Write a birthday message for a grandparent.",
    "Explain how to plant a tomato seedling.",
    "Describe a train journey through the mountains.",
    "Suggest a plan for a rainy afternoon with children.",
    "Write a short story about a lost umbrella.",
    "Explain what makes a good password.",
    "Describe the view from a lighthouse.",
    "Write an announcement for a community clean-up day.",
    "Give tips for keeping a kitchen tidy.",
    "Explain how a bicycle works.",
    "Describe a busy coffee shop in the morning.",
    "Write a note asking a landlord to fix a heater.",
    "Explain why people enjoy gardening.",
    "Describe a snowy village at night.",
    "Give advice on learning a new language.",
    "Write a welcome message for new members of a book club.",
    "Explain how to fold a paper airplane.",
    "Describe the first day of spring.",
    "Write a short speech for a friend's wedding.",
    "Explain why bees are important.",
    "Describe a picnic by a lake.",
    "Give tips for saving money on groceries.",
    "Write a message to a friend recommending a film.",
    "Explain how to care for a goldfish.",
    "Describe a night sky full of stars.",
    "Write a short letter to your future self.",
    "Explain how to prepare for a long hike.",
    "Describe the sounds of a forest.",
    "Give advice to a new university student.",
    "Write a thank-you note for a birthday gift.",
    "Explain why drinking water is healthy.",
    "Describe a street market at night.",
    "Write an email asking for a day off work.",
    "Explain how to start a vegetable garden on a balcony.",
    "Describe a quiet library.",
    "Give tips for a good night's sleep.",
    "Write a short description of a seaside town.",
    "Explain why reading books is valuable.",
    "Describe your morning routine.",
    "Write a note to a colleague who is leaving the team.",
    "Explain how to make a simple salad.",
    "Describe a thunderstorm over the sea.",
    "Give advice on keeping a journal.",
    "Write a message welcoming a new neighbour.",
    "Explain how a rainbow forms.",
    "Describe an old bookshop.",
    "Give tips for staying focused while studying.",
    "Write a short advertisement for a bicycle repair shop.",
    "Explain why walking is good exercise.",
    "Describe a family dinner on a holiday.",
    "Write a message asking a friend to help you move house.",
    "Explain how to clean a pair of glasses.",
    "Describe a sunrise at the beach.",
    "Give advice on choosing a pet.",
    "Write a short note thanking a bus driver.",
    "Explain how to boil an egg.",
    "Describe a walk through a city at dawn.",
)
HELD_OUT_REQUESTS = 20
"""The last requests serve the held-out prompts only."""


def _conflicts(kind: str) -> set[str]:
    """The types IFEval's checker library says cannot be asked together with `kind` (either way round)."""
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS

    return (
        {kind}
        | set(INSTRUCTION_CONFLICTS.get(kind, ()))
        | {t for t in TYPES if kind in INSTRUCTION_CONFLICTS.get(t, ())}
    )


def make_prompt(request: str, rng: random.Random, held_out: bool = False) -> dict:
    kinds = [rng.choice(TYPES)]
    if rng.random() < TWO_CONSTRAINTS:
        allowed = [kind for kind in TYPES if kind not in _conflicts(kinds[0])]
        if allowed:
            kinds.append(rng.choice(allowed))
    parts, arguments = [request], []
    for kind in kinds:
        text, args = own_words.constraint(kind, rng, request, held_out)
        parts.append(text)
        arguments.append(args)
    return {
        "prompt": [{"role": "user", "content": " ".join(parts)}],
        "instruction_id_list": kinds,
        "kwargs": json.dumps(arguments, sort_keys=True),
    }


def generate(out_dir: Path) -> dict[str, int]:
    rng = random.Random(SEED)
    train_requests, eval_requests = REQUESTS[:-HELD_OUT_REQUESTS], REQUESTS[-HELD_OUT_REQUESTS:]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, requests in (("prompts", train_requests), ("prompts_eval", eval_requests)):
        rows, seen = [], set()
        while len(rows) < SIZES[name]:
            row = make_prompt(rng.choice(requests), rng, held_out=name == "prompts_eval")
            text = row["prompt"][0]["content"]
            if text not in seen:  # a prompt appears once
                seen.add(text)
                rows.append(row)
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        written[name] = len(rows)
    return written


if __name__ == "__main__":
    print(generate(Path(__file__).resolve().parent / "ifeval"))
