"""SFT real (non-pad) tokens per second: padded batches against padding-free and packed ones, same model, same rows, \
same tokens.

    python -m bench.throughput                  # 5 modes, 3 repetitions, interleaved; ~5.5 minutes on 2 shared cores
    python -m bench.throughput --repeats 5 --steps 16

Every mode trains one epoch over the same variable-length demonstrations (prompt-completion "sort the digits" rows,
16..512 tokens, log-normal), so all modes train the same real tokens; packed modes get a per-device batch of packed
rows chosen so that an epoch takes about as many optimizer steps as the padded one (the same tokens per step).
The model is the tiny Llama, widened until compute dominates, built from the same seed each run. Modes:

- padded: the pipeline's default (`SftConfig.packing=False`): rows padded to the longest in the batch.
- grouped: padded, with transformers' `train_sampling_strategy="group_by_length"` (via `trl_overrides`).
- padding_free: `SftConfig.padding_free=True` (TRL's `padding_free`): the batch's rows concatenated into one row,
  `position_ids` restarting at every row; no `max_length` is passed to TRL then (the data stage holds rows to it).
- bfd: `SftConfig.packing=True` (TRL's default `packing_strategy="bfd"`): rows best-fit packed into 512-token rows,
  padding-free, rows never cut.
- wrapped: `packing=True`, `packing_strategy="wrapped"`: the token stream cut into 512-token rows with an all-ones
  attention mask, so documents attend to the ones before them and are cut across rows: a different objective.

Seconds are the trainer's `train_runtime` (model build, tokenization and saving excluded); tokens are TRL's
`num_tokens` (attention-mask sum, or the flat length when padding-free: non-pad tokens in both). After training,
every model is scored on the same held-out rows (completion tokens, padded batches). Before timing, the isolation
check runs one batch of the untrained model through TRL's collator in each layout, under sdpa and eager attention,
and compares every token's loss with the padded batch's: equal within 1e-4 means no token attends across a boundary.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from transformers import TrainerCallback

from rlhf_pipeline.trainers.runtime.trust import allow_imports

allow_imports("bench")  # this bench's callback: the bench is its own operator

MODES = ("padded", "grouped", "padding_free", "bfd", "wrapped")
PADDED = ("padded", "grouped")  # layouts whose per-token losses are the isolation check's reference
MAX_LENGTH = 512  # longest row; every generated row fits, so no mode truncates
TARGET = 1.3  # tokens/s of the fastest mode with equal results over padded (issue 14)
TOLERANCE = 1e-4  # largest per-token loss difference that still proves isolated sequences


class TrainClock(TrainerCallback):
    """Wall and process CPU seconds of `trainer.train` (reached through `SftConfig.callbacks`, the way users add
    theirs). CPU seconds are the contention-robust figure on a shared machine: another process's load stretches the wall
    clock, not this one's work."""

    last: tuple[float, float] = (0.0, 0.0)

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = (time.perf_counter(), time.process_time())

    def on_train_end(self, args, state, control, **kwargs):
        TrainClock.last = (time.perf_counter() - self.started[0], time.process_time() - self.started[1])


def bench_model():
    """The tiny Llama at 4.3M parameters (hidden 256, 4 layers): the vocabulary is 263 bytes and specials, so the blocks
    dominate."""
    from rlhf_pipeline.trainers.config import ModelConfig, TinyModelConfig

    return ModelConfig(
        tiny=TinyModelConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4)
    )


def make_rows(count: int, seed: int) -> list[dict]:
    """Prompt-completion rows of the bundled task, 'sort <digits> -> ' then the sorted digits: n digits cost 2n + 10
    tokens with EOS."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        # Median 64, mean ~90, a tail to 512
        tokens = min(MAX_LENGTH, max(16, round(rng.lognormvariate(math.log(64), 0.8))))
        digits = "".join(rng.choice("0123456789") for _ in range(max(1, (tokens - 10) // 2)))
        rows.append({"prompt": f"sort {digits} -> ", "completion": "".join(sorted(digits))})
    return rows


def token_lengths(rows: list[dict], tokenizer) -> list[int]:
    """Tokens per row as TRL tokenizes a prompt-completion row: prompt + completion + EOS."""
    return [len(tokenizer(row["prompt"] + row["completion"])["input_ids"]) + 1 for row in rows]


def packed_rows(lengths: list[int], strategy: str) -> int:
    """How many rows TRL's `pack_dataset` makes of rows of these lengths (only lengths matter to it)."""
    from datasets import Dataset
    from trl import pack_dataset

    return len(pack_dataset(Dataset.from_dict({"input_ids": [[0] * n for n in lengths]}), MAX_LENGTH, strategy))


def sft_config(mode: str, steps: int, batch: int, seed: int):
    from rlhf_pipeline.trainers.algorithms.sft import SftConfig
    from rlhf_pipeline.trainers.config import CallbackSpec

    overrides = {"train_sampling_strategy": "group_by_length"} if mode == "grouped" else {}
    overrides |= {"packing_strategy": "wrapped"} if mode == "wrapped" else {}
    return SftConfig(
        learning_rate=1e-3,
        max_steps=steps,
        per_device_train_batch_size=batch,
        warmup_steps=2,
        lr_scheduler_type="cosine",
        max_length=MAX_LENGTH,
        logging_steps=max(1, steps // 4),
        save_steps=10**6,  # no checkpoint inside the timed loop
        packing=mode in ("bfd", "wrapped"),
        padding_free=mode == "padding_free",
        seed=seed,
        trl_overrides=overrides,
        callbacks=[CallbackSpec(path="bench.throughput:TrainClock")],
    )


def run_mode(mode: str, steps: int, batch: int, seed: int, data_dir: Path, out: Path) -> dict:
    from bench.throughput import TrainClock  # the class the callback spec imports (this file may be __main__)
    from rlhf_pipeline.trainers.algorithms import sft

    losses: list[float] = []

    def log_metrics(values: dict[str, float], step: int) -> None:
        if "sft/train/loss" in values:
            losses.append(values["sft/train/loss"])

    cfg = sft_config(mode, steps, batch, seed)
    with contextlib.redirect_stdout(io.StringIO()):  # transformers prints every log line
        metrics = sft.train(cfg, bench_model(), data_dir, out / "out", out / "work", log_metrics=log_metrics)
    return {
        "seconds": metrics["sft/train/runtime"],
        "cpu_seconds": TrainClock.last[1],
        "tokens": int(metrics["sft/train/num_tokens"]),
        "train_loss": losses[-1],
        "model": out / "out" / "model",
    }


def heldout_loss(model_dir: Path, rows: list[dict], batch: int = 16) -> float:
    """Mean loss per completion token (completion + EOS, what SFT trains on) of held-out rows, in padded batches."""
    import torch
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from rlhf_pipeline.trainers.models.load import load_causal_lm

    model, tokenizer = load_causal_lm(model_dir)
    model.eval()
    collate = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    total, count = 0.0, 0
    for start in range(0, len(rows), batch):
        examples = []
        for row in rows[start : start + batch]:
            prompt = tokenizer(row["prompt"])["input_ids"]
            completion = tokenizer(row["completion"])["input_ids"] + [tokenizer.eos_token_id]
            examples.append({"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion})
        inputs = collate(examples)
        with torch.no_grad():
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        labels = inputs["labels"][:, 1:]
        losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        total, count = total + losses.item(), count + int((labels != -100).sum())
    return total / count


def document_losses(model, inputs: dict, starts: list[int], lengths: list[int]) -> list:
    """Per-token next-token losses of each document, given where it starts in the flattened batch and its length."""
    import torch

    with torch.no_grad():
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits.flatten(0, 1)
    ids = inputs["input_ids"].flatten()
    token = torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")
    return [token[s : s + n - 1] for s, n in zip(starts, lengths)]


def isolation_check(rows: list[dict]) -> dict[tuple[str, str], float]:
    """Largest |per-token loss - padded per-token loss| of one batch in each layout, under sdpa and eager attention.

    Documents are found by their ids, so a layout may reorder them (bfd sorts by length). Wrapped rows hold a document
    cut in two: its second part is compared on the tokens whose predecessor is in the same row, with its earlier context
    missing.
    """
    import torch
    from datasets import Dataset
    from trl import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from rlhf_pipeline.trainers.models.base_model import load_base_model

    worst: dict[tuple[str, str], float] = {}
    model, tokenizer = load_base_model(bench_model())
    model.eval()
    documents = [tokenizer(row["prompt"] + row["completion"])["input_ids"] + [tokenizer.eos_token_id] for row in rows]
    padded, flat = (
        DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id, padding_free=free)
        for free in (False, True)
    )
    width = max(map(len, documents))
    for attention in ("sdpa", "eager"):
        model.set_attn_implementation(attention)
        reference = document_losses(
            model,
            padded([{"input_ids": d} for d in documents]),
            [i * width for i in range(len(documents))],
            list(map(len, documents)),
        )
        by_ids = {tuple(d): loss for d, loss in zip(documents, reference)}
        # padding_free: the rows in order, one flattened row
        lengths = list(map(len, documents))
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        mine = document_losses(model, flat([{"input_ids": d} for d in documents]), starts, lengths)
        worst[("padding_free", attention)] = max(float((a - b).abs().max()) for a, b in zip(mine, reference))
        # bfd: TRL's packing, then its padding-free collator, as SFTTrainer does
        packed = pack_dataset(Dataset.from_dict({"input_ids": documents}), MAX_LENGTH, "bfd")
        segments = [(row["input_ids"][o : o + n], n) for row in packed for o, n in zip(*_offsets(row["seq_lengths"]))]
        lengths = [n for _, n in segments]
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        mine = document_losses(model, flat([dict(row) for row in packed]), starts, lengths)
        worst[("bfd", attention)] = max(
            float((loss - by_ids[tuple(ids)]).abs().max()) for (ids, _), loss in zip(segments, mine)
        )
        # wrapped: 512-token rows of the token stream, all-ones attention mask (the padded collator)
        wrapped = pack_dataset(Dataset.from_dict({"input_ids": documents}), MAX_LENGTH, "wrapped")
        inputs = padded([{"input_ids": row["input_ids"]} for row in wrapped])
        with torch.no_grad():
            logits = model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
            ).logits
        token = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), inputs["input_ids"][:, 1:].flatten(), reduction="none"
        ).view(len(wrapped), -1)
        gaps, offset = [], 0
        for doc, loss in zip(documents, reference):
            for position in range(len(doc) - 1):  # the token at stream index offset+position predicts the next one
                row, column = divmod(offset + position, MAX_LENGTH)
                if column + 1 < MAX_LENGTH:  # its successor sits in the same row
                    gaps.append(abs(float(token[row, column]) - float(loss[position])))
            offset += len(doc)
        worst[("wrapped", attention)] = max(gaps)
    return worst


def _offsets(seq_lengths: list[int]) -> tuple[list[int], list[int]]:
    return [sum(seq_lengths[:i]) for i in range(len(seq_lengths))], list(seq_lengths)


def report(
    results: dict[str, list[dict]], plan: dict[str, tuple[int, int]], isolation: dict[tuple[str, str], float], real: int
) -> bool:
    """The table, the ratios of medians against padded, and whether the fastest mode with equal results reaches
    TARGET (True where padded did not run: nothing to compare)."""
    import torch

    med = statistics.median
    wall = {mode: [r["tokens"] / r["seconds"] for r in runs] for mode, runs in results.items()}
    cpu = {mode: [r["tokens"] / r["cpu_seconds"] for r in runs] for mode, runs in results.items()}
    heldout = {mode: [r["heldout"] for r in runs] for mode, runs in results.items()}
    # Padded layouts: the reference itself
    gap = {mode: max(isolation.get((mode, a), 0.0) for a in ("sdpa", "eager")) for mode in results}
    repeats = len(next(iter(results.values())))
    print(
        f"\nSFT real (non-pad) tokens/s, {repeats} interleaved repetitions (data-order seeds 42..{41 + repeats}), "
        f"CPU, sdpa, {torch.get_num_threads()} thread(s), {bench_model().tiny}"
    )
    print(
        "mode          steps x batch  real tokens   wall tok/s median [min, max]  vs padded   CPU-s tok/s  vs padded   "
        "train loss  held-out [min, max]      isolated"
    )
    for mode, runs in results.items():
        tokens = ",".join(f"{t:,}" for t in sorted({r["tokens"] for r in runs}))
        ratios = (
            (med(wall[mode]) / med(wall["padded"]), med(cpu[mode]) / med(cpu["padded"]))
            if "padded" in results
            else (math.nan, math.nan)
        )
        print(
            f"{mode:12}  {plan[mode][0]:4} x {plan[mode][1]:<5}  {tokens:>11}   {med(wall[mode]):7.0f} "
            f"[{min(wall[mode]):5.0f}, {max(wall[mode]):5.0f}]"
            f"         {ratios[0]:5.2f}x   {med(cpu[mode]):11.0f}  {ratios[1]:5.2f}x   "
            f"{med(r['train_loss'] for r in runs):10.4f}  {med(heldout[mode]):.4f} [{min(heldout[mode]):.4f}, "
            f"{max(heldout[mode]):.4f}]  "
            f"{'reference' if mode in PADDED else 'yes' if gap[mode] <= TOLERANCE else f'NO ({gap[mode]:.1e})'}"
        )
    if any(r["tokens"] != real for runs in results.values() for r in runs):
        print(f"note: a mode trained other than the epoch's {real:,} real tokens")
    if "padded" not in results:
        return True
    spread = max(heldout["padded"]) - min(heldout["padded"])  # the seed-to-seed yardstick for "equal results"
    delta = {mode: med(heldout[mode]) - med(heldout["padded"]) for mode in results}
    for mode in results:
        if mode != "padded":
            print(
                f"{mode}: held-out {delta[mode]:+.4f} vs padded (padded's own range over data-order seeds: "
                f"{spread:.4f})"
            )
    equal = [mode for mode in results if mode != "padded" and gap[mode] <= TOLERANCE and abs(delta[mode]) <= spread]
    if equal:
        best = max(equal, key=lambda mode: med(wall[mode]))
        ratio = med(wall[best]) / med(wall["padded"])
        verdict = "holds" if ratio >= TARGET else "does NOT hold"
        print(
            f"fastest mode with isolated sequences and a held-out loss within padded's seed range: {best}, "
            f"{ratio:.2f}x padded real tokens/s (wall; {med(cpu[best]) / med(cpu['padded']):.2f}x per CPU second): "
            f"the {TARGET}x target {verdict}"
        )
        return ratio >= TARGET
    else:
        print(
            f"no mode has isolated sequences and a held-out loss within padded's seed range: the {TARGET}x target is "
            "not met with equal results"
        )
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs per mode, interleaved (median and range shown)"
    )
    parser.add_argument(
        "--steps", type=int, default=8, help="optimizer steps of the padded epoch (rows = steps * batch)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=16,
        help=(
            "rows per padded (and padding-free) batch; 16 rows of ~90 tokens fill 3 packed rows, so packing takes as "
            "many steps"
        ),
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help=(
            "torch threads; 1 by default: on a shared machine a descheduled OpenMP thread stalls the other at every "
            "barrier (2 threads measured slower and ~10x noisier here, on 2 busy cores)"
        ),
    )
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args(argv)
    import logging
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in ("transformers", "trl", "rlhf_pipeline"):
        logging.getLogger(name).setLevel(logging.ERROR)
    import datasets
    import torch
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()  # loading and saving bars
    torch.set_num_threads(args.threads)
    from rlhf_pipeline.trainers.models.tiny import build_tokenizer

    started = time.perf_counter()
    rows, heldout = make_rows(args.steps * args.batch, seed=0), make_rows(64, seed=1)
    lengths = token_lengths(rows, build_tokenizer())
    real = sum(lengths)
    padded_tokens = sum(
        max(lengths[i : i + args.batch]) * len(lengths[i : i + args.batch]) for i in range(0, len(lengths), args.batch)
    )
    print(
        f"{len(rows)} rows, {real:,} tokens (min {min(lengths)}, median {statistics.median(lengths):.0f}, max "
        f"{max(lengths)}); a padded epoch of {args.steps} steps * {args.batch} rows; padding fills "
        f"~{1 - real / padded_tokens:.0%} of the padded tokens (in this order)"
    )
    plan = {mode: (args.steps, args.batch) for mode in args.modes}
    for strategy in {"bfd", "wrapped"} & set(args.modes):
        packed = packed_rows(lengths, strategy)
        per_step = max(1, round(packed / args.steps))  # packed rows per step: about the padded epoch's tokens per step
        plan[strategy] = (math.ceil(packed / per_step), per_step)
        print(
            f"{strategy}: {packed} rows of <= {MAX_LENGTH} tokens, {per_step} per step, {plan[strategy][0]} steps "
            "(one epoch)"
        )

    isolation = isolation_check(rows[: args.batch])
    print("\nisolation check (max |per-token loss - padded|, untrained model, one batch):")
    for (mode, attention), gap in sorted(isolation.items()):
        print(
            f"  {mode:12} {attention:5} {gap:.2e}  "
            f"{'isolated' if gap <= TOLERANCE else 'ATTENDS ACROSS BOUNDARIES / DIFFERENT CONTEXT'}"
        )

    scratch = Path(tempfile.mkdtemp(prefix="throughput-"))
    results: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    try:
        (scratch / "data" / "datasets").mkdir(parents=True)
        datasets.Dataset.from_list(rows).to_parquet(str(scratch / "data" / "datasets" / "sft.parquet"))
        # One-off costs (kernels, allocator) outside the timings
        run_mode("padded", 2, args.batch, 0, scratch / "data", scratch / "warm-up")
        for repeat in range(args.repeats):
            # Rotated: each mode goes first once
            order = args.modes[repeat % len(args.modes) :] + args.modes[: repeat % len(args.modes)]
            for mode in order:
                steps, batch = plan[mode]
                result = run_mode(mode, steps, batch, 42 + repeat, scratch / "data", scratch / f"{mode}-{repeat}")
                result["heldout"] = heldout_loss(result.pop("model"), heldout)
                results[mode].append(result)
                print(
                    f"repeat {repeat + 1} {mode:12} {result['seconds']:6.1f}s ({result['cpu_seconds']:5.1f} CPU-s) "
                    f"{result['tokens'] / result['seconds']:7.0f} tok/s train loss {result['train_loss']:.4f} "
                    f"held-out {result['heldout']:.4f}",
                    flush=True,
                )
                shutil.rmtree(scratch / f"{mode}-{repeat}", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    held = report(results, plan, isolation, real)
    print(f"wall time {time.perf_counter() - started:.0f}s")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
