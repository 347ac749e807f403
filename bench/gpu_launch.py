"""sft, dpo and grpo under the accelerate launcher on the Qwen2.5-0.5B architecture (random weights, bf16), in one \
command.

    python -m bench.gpu_launch           # on a GPU machine: every GPU, launch.engine=ddp (under 8 minutes on one H200)
    python -m bench.gpu_launch --engine zero2
    python -m bench.gpu_launch --tiny    # the same pipeline on a CPU: a 2-layer model, 2 gloo processes (a dry run)

With vLLM installed (`pip install '.[vllm]'`), grpo runs a second time with `grpo.use_vllm=true`.

Nothing is downloaded: the model folder is built from Qwen2.5-0.5B's configuration (hidden 896, 24 layers, 14 heads,
2 KV heads, vocabulary 151936, tied embeddings) with random weights, and a ChatML tokenizer is trained locally with
`tokenizers`; the data is the tests' conversational set without references. It prints, per stage, the state, the
seconds and the world size the ranks reported, and writes the whole log to <out>/run.log.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
)


def build_model(folder: Path, tiny: bool) -> Path:
    """A Qwen2-architecture folder with random bf16 weights and a ChatML tokenizer trained here."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from tests.foreign_models import QWEN_TEMPLATE, train_tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(specials, vocab_size=2000),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
        chat_template=QWEN_TEMPLATE,
        model_max_length=1024,
    )
    shape = TINY | {"vocab_size": len(tokenizer), "max_position_embeddings": 1024} if tiny else QWEN25_05B
    config = Qwen2Config(
        **shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("state-gpu-check"), help="folder for the model, data, state and log"
    )
    parser.add_argument("--engine", default="ddp", help="launch.engine: ddp, zero2, zero3, fsdp2")
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer model on 2 CPU processes: check the script without a GPU"
    )
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from tests.foreign_models import chat_data

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    folder = build_model(out / "qwen2.5-0.5b-random", args.tiny)
    common = [
        *chat_data(out / "data"),
        f"model.name_or_path={folder}",
        "model.dtype=" + ("float32" if args.tiny else "bfloat16"),
        "launch.launcher=accelerate",
        f"launch.engine={args.engine}",
        *(["launch.num_processes=2"] if args.tiny else []),
        "rewards.functions=[{path: 'tests.helpers:length_reward'}]",
        "rewards.reward_model_weight=0",
        "eval.use_reward_model=false",
        "eval.max_prompts=16",
        "eval.max_new_tokens=16",
        "registry.enabled=false",
        "sft.max_steps=30",
        "sft.max_length=256",
        "sft.logging_steps=5",
        "sft.learning_rate=1e-5",
        "dpo.max_steps=20",
        "dpo.max_length=256",
        "dpo.logging_steps=5",
        "dpo.learning_rate=1e-6",
        "grpo.max_steps=10",
        "grpo.max_length=256",
        "grpo.max_completion_length=32",
        "grpo.logging_steps=2",
        "grpo.per_device_train_batch_size=8",
        "grpo.num_generations=4",
    ]
    env = {**os.environ, "RLHF_STATE_DIR": str(out / "state"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{out / 'mlflow.db'}")
    rows = []
    with open(out / "run.log", "w") as log:
        import importlib.util

        runs = {"dpo": ["algorithm=dpo"], "grpo": ["algorithm=grpo"]}
        if importlib.util.find_spec("vllm") is not None:  # pip install '.[vllm]': grpo once more with vLLM rollouts
            runs["grpo-vllm"] = ["algorithm=grpo", "grpo.use_vllm=true"]
        for algorithm, extra in runs.items():
            command = [
                sys.executable,
                "-m",
                "rlhf_pipeline",
                "run",
                *(f"--set={item}" for item in [*common, *extra]),
            ]
            started = time.time()
            done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
            log.write(done.stdout + done.stderr)
            text = done.stdout + done.stderr
            worlds = dict(re.findall(r"(\w+): world size (\d+)", text))
            rows.append(
                {
                    "run": algorithm,
                    "rc": done.returncode,
                    "seconds": round(time.time() - started, 1),
                    "world_sizes": worlds,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            if done.returncode != 0:
                print(text[-4000:], file=sys.stderr)
                return 1
    print(f"log: {out / 'run.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
