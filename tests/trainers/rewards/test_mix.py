import sys

import pytest
from pydantic import ValidationError

from rlhf_pipeline.trainers.rewards import sort_task
from rlhf_pipeline.trainers.rewards.mix import RewardFunctionSpec, RewardsConfig, load_functions, trl_reward_funcs
from rlhf_pipeline.trainers.runtime.custom import source_digests

PROMPTS = ["sort 21 -> ", "sort 312 -> "]
COLUMNS = {"answer": ["12", "123"]}


def test_bundled_task_rewards_score_standard_and_conversational_completions():
    assert sort_task.exact_match(PROMPTS, ["12", " 132"], **COLUMNS) == [1.0, 0.0]
    assert sort_task.digits_format(PROMPTS, ["12", "13x"], **COLUMNS) == [1.0, 0.0]
    chat = [[{"role": "assistant", "content": "12"}], [{"role": "assistant", "content": "123"}]]
    assert sort_task.exact_match(PROMPTS, chat, **COLUMNS) == [1.0, 1.0]


def test_at_least_one_reward_and_well_formed_paths():
    with pytest.raises(ValidationError, match="no reward functions"):
        RewardsConfig(reward_model_weight=0)
    with pytest.raises(ValidationError, match="expected 'package.module:name'"):
        RewardFunctionSpec(path="rlhf_pipeline.trainers.rewards.sort_task.exact_match")


def _check(path: str):
    cfg = RewardsConfig(reward_model_weight=0, functions=[RewardFunctionSpec(path=path)])
    return load_functions(cfg, PROMPTS, ["12", "123"], COLUMNS)


def test_broken_reward_functions_fail_with_their_name(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def two(a, b):\n    return [1.0]\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n"
        "def boom(prompts, completions, **kw):\n    raise KeyError('answer_text')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"'no_such_module:f'.*does not import"):
        _check("no_such_module:f")
    with pytest.raises(ValueError, match=r"'my_rewards:missing'.*has no 'missing'"):
        _check("my_rewards:missing")
    # The path and the signature fail with the parameters, before any sample call.
    with pytest.raises(
        ValidationError, match=r"'my_rewards:two' has the signature two\(a, b\).*prompts=..., completions=..."
    ):
        RewardFunctionSpec(path="my_rewards:two")
    with pytest.raises(ValueError, match=r"'my_rewards:short' returned 1 scores for 2 completions"):
        _check("my_rewards:short")
    with pytest.raises(ValueError, match=r"'my_rewards:nan' returned non-numeric or non-finite"):
        _check("my_rewards:nan")
    with pytest.raises(ValueError, match=r"'my_rewards:boom' raised.*answer_text"):
        _check("my_rewards:boom")
    sys.modules.pop("my_rewards", None)


def test_trl_reward_funcs_put_the_reward_model_last_with_its_weight(tmp_path):
    cfg = RewardsConfig(
        reward_model_weight=0.5,
        functions=[RewardFunctionSpec(path="rlhf_pipeline.trainers.rewards.sort_task:exact_match", weight=2.0)],
    )
    funcs, weights = trl_reward_funcs(cfg, tmp_path / "rm", {"prompt": PROMPTS, **COLUMNS})
    assert funcs[0] is sort_task.exact_match and funcs[1] == str(tmp_path / "rm")
    assert weights == [2.0, 0.5]
    with pytest.raises(ValueError, match="no reward model was trained"):
        trl_reward_funcs(cfg, None, {"prompt": PROMPTS, **COLUMNS})


def test_fingerprint_follows_the_reward_module_source(tmp_path, monkeypatch):
    module = tmp_path / "edited_rewards.py"
    module.write_text("def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = RewardsConfig(reward_model_weight=0, functions=[RewardFunctionSpec(path="edited_rewards:f")])
    before = source_digests(cfg.code_paths())
    module.write_text("def f(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    assert source_digests(cfg.code_paths()) != before
    with pytest.raises(ValueError, match="not found|does not import"):
        source_digests(["nowhere_module:f"])
