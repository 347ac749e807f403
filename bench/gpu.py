"""sft, dpo and grpo on the Qwen2.5-0.5B architecture (random weights, bf16) on one GPU: trained tokens/s and MFU.

    bash bench/gpu.sh                    # on a lent GPU machine: install, then this; under 8 minutes on one H200
    python -m bench.gpu --tiny           # the same on a CPU with a 2-layer model (a dry run of the script)

Each stage runs through its own trainer (`trainers.algorithms.sft.train`, `dpo.train`, `grpo.train`), in this process,
with the settings below and nothing downloaded: the model folder comes from `bench.gpu_launch.build_model`
(Qwen2.5-0.5B's configuration, a ChatML tokenizer trained here) and the data is the tests' conversational set
(`tests.foreign_models`). A callback (`Throughput`, passed as a stage callback like a user's) counts every sequence the
model trains on: a forward pre-hook reads each batch's attention mask while gradients are on (generation and reference
passes do not count).
- tokens/s: the real (unpadded) tokens of those training forwards over the seconds of `train()`.
- MFU as NeMo-RL defines it (`nemo_rl/utils/flops_tracker.py`, `flops_formulas.qwen2`): the model FLOPs of a forward
  and backward pass of each sequence at its length (3 x 2 x the GEMMs of attention, MLP and vocabulary, causal attention
  halved), summed, over seconds x the GPU's dense bf16 peak. For grpo the seconds include generation, as `train()` does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from rlhf_pipeline.trainers.runtime.trust import allow_imports

allow_imports("bench")  # this bench's callback: the bench is its own operator

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16_TFLOPS = {"H100": 989.5, "H200": 989.5, "H800": 989.5, "A100": 312.0, "L40S": 362.05, "B200": 2250.0}
"""Dense bf16 peak per GPU (vendor datasheets; NeMo-RL's table holds 1979 / 2 for the H100)."""


def qwen2_flops(config, seq_len: int) -> float:
    """Training FLOPs of one sequence of `seq_len` tokens (NeMo-RL's `flops_formulas.qwen2`, gbs=1)."""
    h, layers, ffn, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    attention = 3 * 2 * layers * seq_len * h * h * ((2 + 1) + seq_len / h * 2 * 0.5 + 1)
    mlp = 3 * 2 * layers * seq_len * h * (1 + 2) * ffn
    logits = 3 * 2 * seq_len * h * vocab
    return attention + mlp + logits


class Throughput(TrainerCallback):
    """Counts the tokens and FLOPs of every training forward and writes them with the seconds of train() to `out`."""

    def __init__(self, out: str):
        self.out, self.tokens, self.flops, self.sequences = Path(out), 0, 0.0, 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import torch

        config = model.config

        def count(module, positional, keyword):
            if not torch.is_grad_enabled():
                return
            mask, positions = keyword.get("attention_mask"), keyword.get("position_ids")
            if mask is not None and mask.dim() == 2:
                lengths = mask.sum(dim=1).tolist()
            # Padding-free or packed rows: a sequence starts where its positions restart at 0
            elif positions is not None:
                starts = (positions.flatten() == 0).nonzero().flatten().tolist() + [positions.numel()]
                lengths = [end - start for start, end in zip(starts, starts[1:])]
            else:
                return
            self.tokens += int(sum(lengths))
            self.sequences += len(lengths)
            self.flops += sum(qwen2_flops(config, int(n)) for n in lengths)

        self.hook = model.register_forward_pre_hook(count, with_kwargs=True)
        self.started = time.perf_counter()

    def on_train_end(self, args, state, control, **kwargs):
        seconds = time.perf_counter() - self.started
        self.hook.remove()
        figures = {
            "seconds": seconds,
            "tokens": self.tokens,
            "sequences": self.sequences,
            "flops": self.flops,
            "steps": state.global_step,
        }
        self.out.write_text(json.dumps(figures))


def device_peak() -> tuple[str, float | None]:
    import torch

    if not torch.cuda.is_available():
        return "cpu", None
    name = torch.cuda.get_device_name()
    return name, next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("state-gpu-bench"), help="folder for the model, data and artifacts"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer model in float32 on the CPU: check the script without a GPU"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from datasets import Dataset

    from bench.gpu_launch import build_model
    from rlhf_pipeline.trainers.algorithms import dpo, grpo, sft
    from rlhf_pipeline.trainers.config import CallbackSpec, ModelConfig
    from rlhf_pipeline.trainers.rewards.mix import RewardFunctionSpec, RewardsConfig
    from tests.foreign_models import chat_data

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    folder = build_model(out / "qwen2.5-0.5b-random", args.tiny)
    chat_data(out / "chat")
    data = out / "data"
    (data / "datasets").mkdir(parents=True, exist_ok=True)
    for name in ("sft", "preference", "prompts"):
        Dataset.from_json(str(out / "chat" / f"{name}.jsonl")).to_parquet(str(data / "datasets" / f"{name}.parquet"))
    precision = {} if args.tiny else {"bf16": True}
    model = ModelConfig(name_or_path=str(folder), dtype="float32" if args.tiny else "bfloat16")

    def callback(stage: str) -> dict:
        return {
            "callbacks": [
                CallbackSpec(path="bench.gpu:Throughput", kwargs={"out": str(out / f"{stage}-throughput.json")})
            ]
        }

    steps = 3 if args.tiny else 30
    common = {"logging_steps": 5, "save_steps": 10_000, "max_length": 256, **precision}
    sft.train(
        sft.SftConfig(max_steps=steps, per_device_train_batch_size=16, learning_rate=1e-5, **common, **callback("sft")),
        model,
        data,
        out / "sft",
        out / "sft-work",
    )
    dpo.train(
        dpo.DpoConfig(max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-6, **common, **callback("dpo")),
        out / "sft" / "model",
        data,
        out / "dpo",
        out / "dpo-work",
    )
    rewards = RewardsConfig(reward_model_weight=0, functions=[RewardFunctionSpec(path="tests.helpers:length_reward")])
    grpo_cfg = grpo.GrpoConfig(
        max_steps=max(2, steps // 3),
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=64,
        learning_rate=1e-6,
        **common,
        **callback("grpo"),
    )
    grpo.train(grpo_cfg, rewards, out / "sft" / "model", None, data, out / "grpo", out / "grpo-work")

    device, peak = device_peak()
    print(
        f"\n{device}; dense bf16 peak {peak or 'unknown'} TFLOPS; Qwen2.5-0.5B architecture, random weights, "
        f"{'float32' if args.tiny else 'bf16'}"
    )
    print(f"{'stage':6} {'steps':>6} {'sequences':>10} {'tokens':>10} {'seconds':>8} {'tokens/s':>10} {'MFU':>7}")
    for stage in ("sft", "dpo", "grpo"):
        figures = json.loads((out / f"{stage}-throughput.json").read_text())
        rate = figures["tokens"] / figures["seconds"]
        mfu = f"{figures['flops'] / figures['seconds'] / (peak * 1e12):7.1%}" if peak else "      -"
        print(
            f"{stage:6} {figures['steps']:6d} {figures['sequences']:10d} {figures['tokens']:10d} "
            f"{figures['seconds']:8.1f} {rate:10.0f} {mfu}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
