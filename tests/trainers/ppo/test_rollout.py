"""PPO on what users bring: where rollouts stop, what the reward model reads, and that sampling follows the stage alone.

The models are the GPT-2 and Qwen2 fixtures (tests/foreign_models.py) turned into SFT folders the way the pipeline
builds them.
"""

import contextlib
import json
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification

from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.models import decode, text
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.load import load_causal_lm, save_model
from rlhf_pipeline.trainers.models.tiny import build_tokenizer
from rlhf_pipeline.trainers.ppo import rollout as sampling
from rlhf_pipeline.trainers.ppo import train as ppo
from rlhf_pipeline.trainers.rewards import mix as rewards
from rlhf_pipeline.trainers.rewards.mix import RewardFunctionSpec, RewardsConfig, RewardScorer
from tests.foreign_models import chat_data, gpt2_folder, qwen2_folder

P_END_OF_TURN = 0.3
"""The GPT-2 policy's probability of `<|im_end|>` at every position."""


def unigram(policy, token_id: int, p: float) -> None:
    """Make `policy` (GPT-2, tied embeddings) a fixed next-token distribution: `token_id` with probability `p`, the
    rest uniform. The final layer norm outputs a constant h = s * e_0, so logit_v = s * wte[v, 0], and only token_id
    keeps a non-zero wte[v, 0]: e^s / (e^s + V - 1) = p."""
    vocab = policy.get_input_embeddings().weight.shape[0]
    with torch.no_grad():
        policy.transformer.ln_f.weight.zero_()
        policy.transformer.ln_f.bias.zero_()
        policy.transformer.ln_f.bias[0] = math.log(p / (1 - p) * (vocab - 1))
        policy.transformer.wte.weight[:, 0] = 0.0
        policy.transformer.wte.weight[token_id, 0] = 1.0


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A GPT-2 + ChatML SFT folder (EOS and pad `<|endoftext|>`, end of turn `<|im_end|>`), a reward model with its
    backbone and the conversational prompts of the chat fixture."""
    root = tmp_path_factory.mktemp("ppo-gpt2")
    policy, tokenizer = load_base_model(
        ModelConfig(name_or_path=str(gpt2_folder(root / "gpt2")), chat_template="chatml")
    )
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    unigram(policy, im_end, P_END_OF_TURN)
    save_model(policy, tokenizer, root / "sft")
    reward_model = AutoModelForSequenceClassification.from_pretrained(str(root / "sft"), num_labels=1)
    reward_model.config.pad_token_id = tokenizer.pad_token_id
    save_model(reward_model, tokenizer, root / "rm")
    chat_data(root / "chat")
    (root / "data" / "datasets").mkdir(parents=True)
    Dataset.from_json(str(root / "chat" / "prompts.jsonl")).to_parquet(
        str(root / "data" / "datasets" / "prompts.parquet")
    )
    return {
        "sft": root / "sft",
        "rm": root / "rm",
        "data": root / "data",
        "im_end": im_end,
        "eos": tokenizer.eos_token_id,
    }


class ScorerSpy:
    """Records what `RewardScorer` was asked to score (prompts, the token ids the reward model reads) and its answer."""

    def __init__(self, monkeypatch):
        self.calls: list[dict] = []
        original = RewardScorer.__call__

        def spy(scorer, prompts, completions, columns, ids=None, batch_size=64):
            total, components = original(scorer, prompts, completions, columns, ids=ids, batch_size=batch_size)
            self.calls.append({"prompts": prompts, "completions": completions, "ids": ids, "components": components})
            return total, components

        monkeypatch.setattr(RewardScorer, "__call__", spy)


def test_stop_ids_follow_stop_token(gpt2):
    tokenizer = load_causal_lm(gpt2["sft"])[1]
    eos, im_end = gpt2["eos"], gpt2["im_end"]
    assert sampling.stop_ids(ppo.PpoConfig(), tokenizer) == [eos, im_end]  # EOS and the template's end of turn
    assert sampling.stop_ids(ppo.PpoConfig(stop_token="eos"), tokenizer) == [eos]  # TRL's 'eos'
    assert sampling.stop_ids(ppo.PpoConfig(stop_token_id=im_end), tokenizer) == [im_end]
    with pytest.raises(
        ValueError,
        match=rf"stop_token_id={len(tokenizer)} is not a token of the policy's tokenizer \({len(tokenizer)} tokens\)",
    ):
        sampling.stop_ids(ppo.PpoConfig(stop_token_id=len(tokenizer)), tokenizer)


def test_rollouts_are_cut_at_the_end_of_turn(gpt2):
    policy, tokenizer = load_causal_lm(gpt2["sft"])
    prompts = [
        text.prompt_ids(tokenizer, [{"role": "user", "content": f"Describe the {c} cat."}]) for c in ("red", "blue") * 8
    ]
    im_end, pad_id = gpt2["im_end"], tokenizer.pad_token_id

    def rollout(cfg):
        torch.manual_seed(0)
        inputs, mask, ended, *_ = sampling.sample_completions(
            policy, tokenizer, prompts, cfg, sampling.stop_ids(cfg, tokenizer), "cpu"
        )
        return inputs["input_ids"][:, -mask.shape[1] :], mask.bool(), ended

    responses, mask, ended = rollout(ppo.PpoConfig(response_length=3, temperature=1.0))
    # p(<|im_end|>) = .3 per token: P(a row ends within 3) = 1 - .7^3 = .66, so both kinds are in 16 rows (all 16
    # ending: .66^16 = 0.1%).
    assert 0 < ended.sum() < len(prompts)
    for row, real, end in zip(responses.tolist(), mask.tolist(), ended.tolist()):
        n = sum(real)
        assert real == [True] * n + [False] * (len(row) - n)
        if end:  # cut right after its first <|im_end|>, padding after it
            assert row.index(im_end) == n - 1 and row[n:] == [pad_id] * (len(row) - n)
        else:  # ran to response_length without a stop token
            assert n == 3 and im_end not in row and gpt2["eos"] not in row
    # TRL's stop_token='eos': <|im_end|> is an ordinary token, so rows run on past it; only EOS ends one.
    responses, mask, ended = rollout(ppo.PpoConfig(response_length=6, temperature=1.0, stop_token="eos"))
    for row, real, end in zip(responses.tolist(), mask.tolist(), ended.tolist()):
        n = sum(real)
        assert row[n - 1] == gpt2["eos"] if end else n == 6
    assert sum(im_end in row[: sum(real) - 1] for row, real in zip(responses.tolist(), mask.tolist())) > 8


def test_reward_model_scores_the_sampled_ids_and_unfinished_rows_are_penalised(gpt2, tmp_path, monkeypatch):
    spy = ScorerSpy(monkeypatch)
    cfg = ppo.PpoConfig(
        rollout_batch_size=ppo.SAMPLE_ROWS,
        total_episodes=2 * ppo.SAMPLE_ROWS,
        response_length=4,
        num_ppo_epochs=1,
        temperature=1.0,
        logging_steps=1,
        num_threads=1,
    )
    length = RewardFunctionSpec(path="tests.helpers:length_reward", weight=0.5)
    logged: list[dict] = []
    ppo.train(
        cfg,
        RewardsConfig(reward_model_weight=1.0, functions=[length]),
        gpt2["sft"],
        gpt2["rm"],
        gpt2["data"],
        tmp_path / "out",
        tmp_path / "work",
        lambda values, step: logged.append(values),
    )
    tokenizer = load_causal_lm(gpt2["sft"])[1]
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert [row["update"] for row in samples] == [1] * ppo.SAMPLE_ROWS + [2] * ppo.SAMPLE_ROWS  # 2 updates <= 10 tables
    stops = {gpt2["eos"], gpt2["im_end"]}
    ends = []
    for update, call in enumerate(spy.calls, 1):
        rows = [row for row in samples if row["update"] == update]
        for j, (prompt, ids, completion, row) in enumerate(
            zip(call["prompts"], call["ids"], call["completions"], rows)
        ):
            prompt_ids = text.prompt_ids(tokenizer, prompt)
            response = ids[len(prompt_ids) :]
            assert ids[: len(prompt_ids)] == prompt_ids and row["prompt"] == prompt
            ended = response[-1] == gpt2["im_end"]
            if ended:  # the scored ids end at the first stop token, as sampled
                assert [i for i in response if i in stops] == [gpt2["im_end"]]
            else:  # a cut-off answer is scored as it is: response_length tokens, no EOS or end of turn appended
                assert len(response) == cfg.response_length and not stops & set(response)
            assert row["ended"] == ended and row["completion"] == tokenizer.decode(response)
            # Reward functions get the reply as a message, without the stop token.
            assert completion == [
                {
                    "role": "assistant",
                    "content": tokenizer.decode(response[:-1] if ended else response, skip_special_tokens=True),
                }
            ]
            assert row["reward_length_reward"] == len(completion[0]["content"])
            # The score PPO optimises: the weighted rewards, less the default penalty of 1.0 (a reward model scores)
            # for exactly the rows that never ended.
            weighted = call["components"]["reward_model"][j] + 0.5 * call["components"]["length_reward"][j]
            assert row["score"] == pytest.approx(weighted - (0.0 if ended else 1.0), abs=1e-5)
            assert row["reward_model"] == call["components"]["reward_model"][j]
            ends.append(ended)
    assert 0 < sum(ends) < len(ends)  # both kinds were scored
    assert logged[0]["ppo/train/missing_eos"] == pytest.approx(1 - sum(ends[: ppo.SAMPLE_ROWS]) / ppo.SAMPLE_ROWS)


def test_a_reward_model_with_another_tokenizer_fails_before_any_weights_load(gpt2, tmp_path, monkeypatch):
    other = tmp_path / "tiny-rm"
    build_tokenizer().save_pretrained(other)  # tokenizer files only: loading weights from it would fail otherwise
    loaded: list[str] = []
    for cls in ("AutoModelForCausalLM", "AutoModelForSequenceClassification"):
        monkeypatch.setattr(f"transformers.{cls}.from_pretrained", lambda path, *a, **k: loaded.append(str(path)))
    with pytest.raises(ValueError, match="another tokenizer") as failure:
        ppo.train(
            ppo.PpoConfig(rollout_batch_size=8),
            RewardsConfig(),
            gpt2["sft"],
            other,
            gpt2["data"],
            tmp_path / "out",
            tmp_path / "work",
        )
    assert str(other) in str(failure.value) and str(gpt2["sft"]) in str(failure.value)
    assert loaded == []
    # The check itself: same tokenizer files pass, whatever the weights.
    rewards.check_shared_tokenizer(gpt2["sft"], gpt2["rm"])


def test_sampled_logprobs_are_the_ones_ppo_computes(tmp_path, monkeypatch):
    """Where `generate` samples (a model the decoding loop does not run: decode reads no generation_config),
    Qwen2's generation_config (top_k=20, top_p=0.8, repetition_penalty=1.05) must not reach the rollouts: the
    log-probs `generate` reports for the sampled tokens equal `_response_logprobs` at the same temperature."""
    policy, tokenizer = load_base_model(ModelConfig(name_or_path=str(qwen2_folder(tmp_path / "qwen2"))))
    save_model(policy, tokenizer, tmp_path / "sft")  # float32, as the sft stage saves it, Qwen's sampling defaults kept
    policy, tokenizer = load_causal_lm(tmp_path / "sft")
    assert (policy.dtype, policy.generation_config.top_k, policy.generation_config.repetition_penalty) == (
        torch.float32,
        20,
        1.05,
    )
    monkeypatch.setattr(decode, "supports", lambda model: False)
    cfg = ppo.PpoConfig(response_length=12, temperature=0.7)
    prompts = [
        text.prompt_ids(tokenizer, [{"role": "user", "content": f"Describe the {c} {a}."}])
        for c in ("red", "gold")
        for a in ("cat", "owl")
    ]
    reported: list[torch.Tensor] = []
    generate = policy.generate

    def generate_with_scores(**kwargs):
        out = generate(**kwargs, output_scores=True, return_dict_in_generate=True)
        reported.append(torch.stack(out.scores, 1).log_softmax(-1))  # the processed scores: what was sampled from
        return out.sequences

    monkeypatch.setattr(policy, "generate", generate_with_scores)

    def largest_gap() -> float:
        torch.manual_seed(0)
        with torch.no_grad():
            inputs, mask, *_ = sampling.sample_completions(
                policy, tokenizer, prompts, cfg, sampling.stop_ids(cfg, tokenizer), "cpu"
            )
            width = mask.shape[1]
            computed, _ = sampling.response_logprobs(policy, inputs, width, cfg.temperature)
        sampled = reported[-1].gather(-1, inputs["input_ids"][:, -width:, None]).squeeze(-1)
        return (sampled - computed)[mask.bool()].abs().max().item()

    assert largest_gap() < 1e-4
    assert policy.generation_config.top_k == 20  # restored after the rollout
    # Control: without own_sampling the model's repetition_penalty=1.05 leaks in, and the check sees it.
    monkeypatch.setattr(text, "own_sampling", lambda model, tokenizer: contextlib.nullcontext())
    assert largest_gap() > 1e-3


def test_rollout_logprobs_are_generations_own_and_sampling_is_unchanged(tmp_path):
    """With `rollout_logprobs`, Qwen2's rollouts carry the log-probs and entropy of the distribution generation drew
    from; they equal one forward pass's within 1e-4, and the same seed draws the same tokens as without the option."""
    policy, tokenizer = load_base_model(ModelConfig(name_or_path=str(qwen2_folder(tmp_path / "qwen2"))))
    prompts = [
        text.prompt_ids(tokenizer, [{"role": "user", "content": f"Describe the {c} {a}."}])
        for c in ("red", "gold")
        for a in ("cat", "owl", "fox")
    ]

    def rollout(from_generation: bool) -> sampling.Sampled:
        cfg = ppo.PpoConfig(response_length=12, temperature=0.7, rollout_logprobs=from_generation)
        torch.manual_seed(0)
        with torch.no_grad():
            return sampling.sample_completions(
                policy, tokenizer, prompts, cfg, sampling.stop_ids(cfg, tokenizer), "cpu"
            )

    plain, scored = rollout(False), rollout(True)
    assert plain.logprobs is None and plain.entropy is None
    assert torch.equal(plain.inputs["input_ids"], scored.inputs["input_ids"]) and torch.equal(plain.mask, scored.mask)
    real = scored.mask.bool()
    assert real.sum() > len(prompts)  # more than one token a row
    with torch.no_grad():
        computed, entropy = sampling.response_logprobs(
            policy, scored.inputs, scored.mask.shape[1], 0.7, with_entropy=True
        )
    assert (scored.logprobs - computed)[real].abs().max().item() < 1e-4
    assert (scored.entropy - entropy)[real].abs().max().item() < 1e-4
    assert scored.logprobs[real].min() < -0.1  # sampled at temperature 0.7: not every token a near-certainty
