"""The promotion gate and the MLflow aliases, on real model files."""

from __future__ import annotations

import os

import pytest
from mlflow.tracking import MlflowClient

from rlhf_pipeline.tasks.gate import CANDIDATE, CHAMPION, RegistryConfig, gate, hacking, unmeasured
from rlhf_pipeline.tasks.registry import current_champion, register_policy
from rlhf_pipeline.tasks.store.artifacts import RunContext
from rlhf_pipeline.tasks.tracking import client as tracking
from rlhf_pipeline.tasks.tracking import versions
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.load import save_model
from rlhf_pipeline.trainers.models.tiny import build_tokenizer
from tests.helpers import SMALL_MODEL, recorded_stage


def test_gate_needs_the_value_and_its_lower_bound_above_the_bars():
    cfg = RegistryConfig()
    passed = gate(cfg, {"eval/heldout/win_rate_vs_champion": 0.62, "eval/heldout/win_rate_vs_champion_low": 0.55})
    assert passed == (True, "eval/heldout/win_rate_vs_champion=0.6200 >= 0.5, lower bound 0.5500 >= 0.48")
    passed, why = gate(cfg, {"eval/heldout/win_rate_vs_champion": 0.52, "eval/heldout/win_rate_vs_champion_low": 0.40})
    assert not passed and "lower bound 0.4 is below 0.48 (registry.margin)" in why
    passed, why = gate(cfg, {"eval/heldout/win_rate_vs_champion": 0.3, "eval/heldout/win_rate_vs_champion_low": 0.25})
    assert not passed and "is below 0.5" in why
    assert gate(cfg, {}) == (False, "gate metric 'eval/heldout/win_rate_vs_champion' missing from eval metrics")


def test_against_a_champion_a_gain_needs_a_point_of_at_least_zero_and_a_lower_bound_within_the_margin():
    """The default asks for no loss on the point estimate and a non-inferiority bound of -0.02 (`registry.margin`)."""
    name = "eval/heldout/gold_gain_vs_champion"

    def verdict(cfg, value, low):
        return gate(cfg, {name: value, f"{name}_low": low})

    cfg = RegistryConfig()
    assert verdict(cfg, 0.0, -0.015) == (True, f"{name}=0.0000 >= 0, lower bound -0.0150 >= -0.02")  # as good
    assert verdict(cfg, 0.01, -0.03) == (False, f"{name} lower bound -0.03 is below -0.02 (registry.margin)")
    assert verdict(cfg, -0.001, 0.0) == (False, f"{name}=-0.0010 is below 0")
    assert verdict(RegistryConfig(margin=0.05), 0.01, -0.03)[0]  # a wider margin, configured
    assert not verdict(RegistryConfig(margin=0.05, min_lower_bound=0.0), 0.01, -0.001)[0]  # an explicit bound wins


HACKED = {  # the reward model's score up, exact match down: a policy that games its reward model
    "eval/heldout/policy_mean_reward": 4.99,
    "eval/heldout/sft_mean_reward": 1.66,
    "eval/heldout/policy_exact_match": 0.455,
    "eval/heldout/sft_exact_match": 0.623,
    "eval/heldout/win_rate_vs_champion": 0.9,
    "eval/heldout/win_rate_vs_champion_low": 0.85,
}


def test_the_hacking_gate_reads_the_gold_metric_else_the_ensemble_disagreement():
    cfg = RegistryConfig()
    assert hacking(cfg, HACKED) == (
        "reward hacking: the held-out reward-model score rose from 1.6600 (sft) to 4.9900 (policy) while exact match "
        "fell from 0.6230 to 0.4550 (tolerance 0.0)"
    )
    assert hacking(cfg, {**HACKED, "eval/heldout/policy_exact_match": 0.7}) is None  # both rose: an honest gain
    # The reward fell too: no sign of gaming
    assert hacking(cfg, {**HACKED, "eval/heldout/policy_mean_reward": 1.0}) is None
    assert hacking(cfg.model_copy(update={"hacking_tolerance": 0.2}), HACKED) is None
    assert hacking(cfg.model_copy(update={"hacking_gate": False}), HACKED) is None
    # A verifier named as eval.gold_metric is read before exact match.
    assert "gold fell from 0.9000 to 0.1000" in hacking(
        cfg, {**HACKED, "eval/heldout/policy_gold": 0.1, "eval/heldout/sft_gold": 0.9}
    )
    # Without a reference: the members of a reward-model ensemble disagree more on the policy's answers than on SFT's.
    blind = {k: v for k, v in HACKED.items() if "exact_match" not in k}
    assert hacking(cfg, blind) is None
    why = hacking(cfg, {**blind, "eval/heldout/policy_rm_disagreement": 0.8, "eval/heldout/sft_rm_disagreement": 0.3})
    assert why.endswith(
        "while the reward-model ensemble's disagreement rose from 0.3000 to 0.8000 (no gold metric; tolerance 0.0)"
    )
    assert (
        hacking(cfg, {**blind, "eval/heldout/policy_rm_disagreement": 0.2, "eval/heldout/sft_rm_disagreement": 0.3})
        is None
    )
    # Against the champion: the reward model prefers the policy, the gold metric does not (measured: an ensemble-min
    # policy at SFT's exact match, 0.635, against a 0.898 champion won 0.617 of the reward model's comparisons).
    honest = {**HACKED, "eval/heldout/policy_exact_match": 0.635, "eval/heldout/sft_exact_match": 0.633}
    assert hacking(cfg, honest) is None
    worse = {
        **honest,
        "eval/heldout/win_rate_vs_champion": 0.6167,
        "eval/heldout/exact_match_gain_vs_champion": -0.2633,
    }
    assert hacking(cfg, worse) == (
        "reward hacking: the reward model prefers the policy to the champion (win rate 0.6167) while exact match is "
        "-0.2633 against the champion's (tolerance 0.0)"
    )
    assert hacking(cfg, {**worse, "eval/heldout/exact_match_gain_vs_champion": 0.01}) is None


@pytest.fixture
def ctx(tmp_path, monkeypatch):
    monkeypatch.setenv(tracking.STATE_ENV, str(tmp_path / "state"))
    experiment = tracking.experiment_id("test-registry")
    return RunContext(artifact_root=str(tmp_path / "artifacts"), experiment_id=experiment, parent_run_id="")


MEASURED = {"eval/heldout/exact_match_gain_vs_sft": 0.10, "eval/heldout/exact_match_gain_vs_sft_low": 0.04}
"""A policy that beats its start on held-out exact match: what lets a first version become champion."""


def publish(ctx: RunContext, stage: str, seed: int, metrics: dict, cfg: RegistryConfig | None = None):
    """A policy (a tiny model with its own seed) and an eval report holding `metrics`, compared (as the eval stage
    does) with `cfg`'s champion of the moment."""
    parent = tracking.start_run(ctx.experiment_id, f"flow-{seed}", {})
    ctx = ctx.model_copy(update={"parent_run_id": parent})

    def model(out_dir, work_dir, log):
        save_model(*load_base_model(SMALL_MODEL.model_copy(update={"seed": seed})), out_dir / "model")
        return {}

    policy = recorded_stage(stage, {"seed": seed}, {}, ctx, model).ref
    champion = current_champion(cfg) if cfg else None
    upstream = {"policy": policy, **({"champion": champion} if champion else {})}
    report = recorded_stage("eval", {"seed": seed}, upstream, ctx, lambda out, work, log: metrics).ref
    return policy, report, ctx


def test_first_version_is_champion_a_loser_is_refused_a_winner_promoted(ctx):
    cfg = RegistryConfig(model_name="test-policy")
    client = MlflowClient()

    # Even a first version is refused when it games its reward model, with the numbers.
    policy, report, run_ctx = publish(ctx, "ppo", 0, HACKED, cfg)
    hacked = register_policy(cfg, policy, report, [policy, report], run_ctx)
    assert not hacked["promoted"] and hacked["reason"] == hacking(cfg, HACKED)
    assert client.get_registered_model("test-policy").aliases == {CANDIDATE: int(hacked["version"])}  # no champion

    # A first version that nothing measured against its start (no gold metric, no reference answers) stays a candidate.
    policy, report, run_ctx = publish(ctx, "dpo", 4, {}, cfg)
    unknown = register_policy(cfg, policy, report, [policy, report], run_ctx)
    assert (
        not unknown["promoted"]
        and unknown["reason"] == unmeasured(cfg, {})
        and "stays a candidate" in unknown["reason"]
    )
    assert CHAMPION not in client.get_registered_model("test-policy").aliases

    policy, report, run_ctx = publish(ctx, "dpo", 1, MEASURED, cfg)
    first = register_policy(cfg, policy, report, [policy, report], run_ctx)
    assert first["promoted"] and "first version" in first["reason"]
    assert str(client.get_model_version_by_alias("test-policy", CHAMPION).version) == first["version"]

    worse = {"eval/heldout/win_rate_vs_champion": 0.21, "eval/heldout/win_rate_vs_champion_low": 0.17}
    policy, report, run_ctx = publish(ctx, "dpo", 2, worse, cfg)
    refused = register_policy(cfg, policy, report, [policy, report], run_ctx)
    assert not refused["promoted"] and refused["reason"] == "eval/heldout/win_rate_vs_champion=0.2100 is below 0.5"
    assert str(client.get_model_version_by_alias("test-policy", CANDIDATE).version) == refused["version"]
    assert str(client.get_model_version_by_alias("test-policy", CHAMPION).version) == first["version"]
    tags = client.get_model_version("test-policy", refused["version"]).tags
    assert tags["rlhf.policy_digest"] == policy.digest and tags["eval/heldout/win_rate_vs_champion"] == "0.21"

    better = {"eval/heldout/win_rate_vs_champion": 0.71, "eval/heldout/win_rate_vs_champion_low": 0.64}
    policy, report, run_ctx = publish(ctx, "ppo", 3, better, cfg)
    promoted = register_policy(cfg, policy, report, [policy, report], run_ctx)
    assert promoted["promoted"] and promoted["previous_champion"] == first["version"]
    assert str(client.get_model_version_by_alias("test-policy", CHAMPION).version) == promoted["version"]

    # Same bytes again: the version is reused, not duplicated.
    again = register_policy(cfg, policy, report, [policy, report], run_ctx)
    assert (again["version"], again["promoted"], again["reason"]) == (promoted["version"], True, "already champion")

    # models:/test-policy@champion loads with from_pretrained (model + tokenizer).
    import mlflow
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # MLflow resolves models:/ through MLFLOW_TRACKING_URI, the store tracking_uri() names (tests/conftest.py).
    assert os.environ["MLFLOW_TRACKING_URI"] == tracking.tracking_uri()
    local = mlflow.artifacts.download_artifacts(artifact_uri="models:/test-policy@champion")
    assert AutoModelForCausalLM.from_pretrained(local).config.hidden_size == 32
    # 10 bytes, 10 ids
    assert (
        AutoTokenizer.from_pretrained(local)("sort 3 -> ")["input_ids"] == build_tokenizer()("sort 3 -> ")["input_ids"]
    )
    champion = current_champion(cfg)
    assert champion.digest == policy.digest and (champion.path / "model" / "model.safetensors").is_file()


def test_a_policy_that_does_not_beat_its_start_on_the_gold_metric_is_no_champion_even_as_the_first_version(ctx):
    """A training reward that rose (the reward model's win rate over sft) does not promote a policy whose held-out
    gold metric did not beat its start: not as the first version, not against a champion."""
    cfg = RegistryConfig(model_name="start-gate")
    client = MlflowClient()
    pleases_its_reward = {"eval/heldout/win_rate_vs_sft": 0.81, "eval/heldout/win_rate_vs_sft_low": 0.74}
    flat = {
        **pleases_its_reward,
        "eval/heldout/gold_gain_vs_sft": 0.02,
        "eval/heldout/gold_gain_vs_sft_low": -0.03,
        "eval/heldout/gold_gain_vs_sft_high": 0.07,
    }
    policy, report, run_ctx = publish(ctx, "grpo", 10, flat, cfg)
    refused = register_policy(cfg, policy, report, [policy, report], run_ctx)
    assert not refused["promoted"], refused
    assert refused["reason"] == (
        "it does not beat its start on the held-out gold metric: eval/heldout/gold_gain_vs_sft=+0.0200, lower bound "
        "-0.0300 is not above 0 (registry.beat_start)"
    )
    assert CHAMPION not in client.get_registered_model("start-gate").aliases
    # The same figures with the check off: the first version becomes champion, as before.
    lenient = cfg.model_copy(update={"beat_start": False})
    policy, report, run_ctx = publish(ctx, "grpo", 11, flat, lenient)
    assert register_policy(lenient, policy, report, [policy, report], run_ctx)["promoted"]
    # Against a champion: a win over it does not promote a policy that falls short of its own start.
    beats_champion = {
        **flat,
        "eval/heldout/gold_gain_vs_champion": 0.05,
        "eval/heldout/gold_gain_vs_champion_low": 0.01,
        "eval/heldout/gold_gain_vs_sft_low": 0.0,
    }
    policy, report, run_ctx = publish(ctx, "grpo", 12, beats_champion, cfg)
    outcome = register_policy(cfg, policy, report, [policy, report], run_ctx)
    assert not outcome["promoted"] and "lower bound +0.0000 is not above 0" in outcome["reason"], outcome
    better = {**beats_champion, "eval/heldout/gold_gain_vs_sft_low": 0.01}
    policy, report, run_ctx = publish(ctx, "grpo", 13, better, cfg)
    assert register_policy(cfg, policy, report, [policy, report], run_ctx)["promoted"]


def test_two_registrations_at_once_move_champion_once_and_the_other_stays_candidate_saying_why(ctx):
    """Both runs' evals beat the same champion; whichever registers first becomes champion, the other was never
    compared with it and stays a candidate (compare and set)."""
    import threading

    cfg = RegistryConfig(model_name="raced-policy")
    policy, report, run_ctx = publish(ctx, "dpo", 10, MEASURED, cfg)
    first = register_policy(cfg, policy, report, [policy, report], run_ctx)
    better = {"eval/heldout/win_rate_vs_champion": 0.71, "eval/heldout/win_rate_vs_champion_low": 0.64}
    racers = [publish(ctx, "dpo", seed, better, cfg) for seed in (11, 12)]  # both evaluated against `first`
    start, outcomes = threading.Barrier(2), {}

    def register(index: int) -> None:
        policy, report, run_ctx = racers[index]
        start.wait()
        outcomes[index] = register_policy(cfg, policy, report, [policy, report], run_ctx)

    threads = [threading.Thread(target=register, args=(index,)) for index in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    [won] = [outcome for outcome in outcomes.values() if outcome["promoted"]]
    [lost] = [outcome for outcome in outcomes.values() if not outcome["promoted"]]
    assert won["previous_champion"] == first["version"]
    assert MlflowClient().get_model_version_by_alias("raced-policy", CHAMPION).version == int(won["version"])
    assert lost["reason"] == (
        f"the champion moved to v{won['version']} after eval compared this policy with v{first['version']}: it stays "
        f"a candidate (a new run evaluates it against v{won['version']})"
    )


def test_a_lock_released_while_the_store_reads_it_back_is_free_and_the_registration_goes_on(ctx, monkeypatch):
    """Creating `<name>.promoting` while another run holds it fails, and the store reads the holder's model back to say
    so; when the holder releases it in between, the answer is RESOURCE_DOES_NOT_EXIST (a real `mlflow server` gave it
    17 times in ~2,500 contended creates). That is a free lock, not an error: the registration takes it and goes on."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    cfg = RegistryConfig(model_name="released-policy")
    policy, report, run_ctx = publish(ctx, "dpo", 30, MEASURED, cfg)
    real_client, answered = tracking.client, []

    class ReleasedMeanwhile:  # the real client, whose first lock creation meets a holder that releases it meanwhile
        def __init__(self):
            self.inner = real_client()

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def create_registered_model(self, name, **kwargs):
            if name.endswith(".promoting") and not answered:
                answered.append(name)
                raise MlflowException(f"Registered Model with name={name} not found", RESOURCE_DOES_NOT_EXIST)
            return self.inner.create_registered_model(name, **kwargs)

    monkeypatch.setattr(tracking, "client", ReleasedMeanwhile)
    outcome = register_policy(cfg, policy, report, [policy, report], run_ctx)
    assert answered == ["released-policy.promoting"]
    assert outcome["promoted"] and "first version" in outcome["reason"]
    assert "released-policy.promoting" not in [m.name for m in MlflowClient().search_registered_models()]  # released


def test_a_clock_running_ahead_cannot_take_over_a_live_promotion_lock_but_a_dead_holders_lock_is_taken(
    ctx, monkeypatch
):
    """The promotion lock is judged by what this waiter watched on its own monotonic clock and by whether a holder on
    this machine still runs, never by comparing two machines' clocks: with the waiter's clock 700 s ahead (the lock's
    creation time is the holder's), a live holder elsewhere keeps the lock."""
    import json
    import os
    import socket
    import time

    from rlhf_pipeline.tasks import registry

    client = MlflowClient()
    elsewhere = json.dumps({"host": "another-machine", "pid": 1, "state": "/elsewhere"})
    client.create_registered_model("skew-policy.promoting", tags={"rlhf.holder": elsewhere})
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 700.0)  # this machine's clock runs ahead
    with pytest.raises(TimeoutError, match="was held for over 1s by"):
        with registry.champion_lock("skew-policy", wait_seconds=1.0):
            pass
    monkeypatch.setattr(time, "time", real_time)
    # Watched for longer than STALE_LOCK_SECONDS by this waiter: its holder is taken to have died.
    monkeypatch.setattr(registry, "STALE_LOCK_SECONDS", 0.5)
    with registry.champion_lock("skew-policy", wait_seconds=10.0):
        assert (
            json.loads(client.get_registered_model("skew-policy.promoting").tags["rlhf.holder"])["pid"] == os.getpid()
        )
    # A holder of this machine that no longer runs: taken over at once.
    monkeypatch.setattr(registry, "STALE_LOCK_SECONDS", 600.0)
    dead = json.dumps({"host": socket.gethostname(), "pid": 2**22 + 12345, "state": "/gone"})
    client.create_registered_model("dead-policy.promoting", tags={"rlhf.holder": dead})
    started = time.monotonic()
    with registry.champion_lock("dead-policy", wait_seconds=10.0):
        assert time.monotonic() - started < 5
    assert not [m for m in client.search_registered_models() if m.name.endswith(".promoting")]  # both released


@pytest.mark.slow  # trains the full tiny model for 60 steps and runs 4 evaluations: minutes on a CPU
def test_gate_on_measured_exact_match_refuses_the_untrained_base_and_promotes_a_trained_model(ctx, tmp_path):
    """Every number the gate sees here is measured by the eval stage's code, on purpose-built models."""
    from rlhf_pipeline.trainers.algorithms import sft
    from rlhf_pipeline.trainers.config import ModelConfig
    from rlhf_pipeline.trainers.evaluation import stage as evaluation
    from rlhf_pipeline.trainers.evaluation.stage import EvalConfig
    from tests.helpers import write_data_dir

    data = write_data_dir(tmp_path / "data", rows=600)
    base = ModelConfig()  # the full tiny model: it learns the task in a few dozen steps
    cfg = RegistryConfig(
        model_name="gate-test",
        gate_metric="eval/heldout/exact_match_gain_vs_champion",
        min_value=0.0,
        min_lower_bound=0.0,
        beat_start=False,  # the policies here are evaluated against themselves as sft: the champion gate alone
    )
    eval_cfg = EvalConfig(max_prompts=100, max_new_tokens=8, perplexity_rows=0, n_bootstrap=200)
    parent = tracking.start_run(ctx.experiment_id, "gate", {})
    run_ctx = ctx.model_copy(update={"parent_run_id": parent})

    def untrained(out_dir, work_dir, log):
        save_model(*load_base_model(base), out_dir / "model")
        return {}

    def trained(out_dir, work_dir, log):
        config = sft.SftConfig(
            max_steps=60, learning_rate=3e-3, per_device_train_batch_size=64, max_length=64, save_steps=1000
        )
        return sft.train(config, base, data, out_dir, work_dir)

    base_ref = recorded_stage("sft", {"untrained": True}, {}, run_ctx, untrained).ref
    sft_ref = recorded_stage("sft", {"steps": 60}, {}, run_ctx, trained).ref

    def evaluate(policy, tag):
        champion = current_champion(cfg)
        compared = {"champion": champion} if champion and champion.digest != policy.digest else {}  # as eval does
        build = lambda out, work, log: evaluation.evaluate(  # noqa: E731
            eval_cfg,
            base,
            sft_ref.path / "model",
            policy.path / "model",
            None,
            data,
            out,
            "dpo",
            champion_model=champion.path / "model" if compared else None,
        )
        return recorded_stage("eval", {"tag": tag}, {"policy": policy, **compared}, run_ctx, build).ref

    first = register_policy(cfg, sft_ref, evaluate(sft_ref, "first"), [sft_ref], run_ctx)
    assert first["promoted"]  # the first version is champion

    report = evaluate(base_ref, "base vs trained champion")
    metrics = report.manifest()["metrics"]
    assert metrics["eval/heldout/exact_match_gain_vs_champion"] < 0 < metrics["eval/heldout/champion_exact_match"]
    refused = register_policy(cfg, base_ref, report, [base_ref], run_ctx)
    assert not refused["promoted"] and "is below 0" in refused["reason"]
    client = MlflowClient()
    assert str(client.get_model_version_by_alias("gate-test", CHAMPION).version) == first["version"]
    assert str(client.get_model_version_by_alias("gate-test", CANDIDATE).version) == refused["version"]

    # And the other way round: the untrained base as champion, the trained model wins and moves it.
    cfg = cfg.model_copy(update={"model_name": "gate-test-promote"})
    assert register_policy(cfg, base_ref, evaluate(base_ref, "base first"), [base_ref], run_ctx)["promoted"]
    report = evaluate(sft_ref, "trained vs untrained champion")
    assert report.manifest()["metrics"]["eval/heldout/exact_match_gain_vs_champion_low"] > 0
    promoted = register_policy(cfg, sft_ref, report, [sft_ref], run_ctx)
    assert promoted["promoted"]
    assert str(client.get_model_version_by_alias("gate-test-promote", CHAMPION).version) == promoted["version"]


@pytest.mark.slow  # a tracking server of its own
def test_runs_with_their_own_state_folders_and_one_tracking_server_make_exactly_one_champion(
    ctx, tmp_path, monkeypatch
):
    """Two machines (two state folders, no shared file lock) register at once against one `mlflow server`: the lock
    lives on the server, so one moves `champion` and the other stays a candidate, saying why."""
    import threading
    import time

    from rlhf_pipeline.tasks.store.resources import free_port
    from tests import mlflow_server

    port, pid_file = free_port(), tmp_path / "mlflow.pid"
    mlflow_server.start(f"sqlite:///{tmp_path / 'server.db'}", port, pid_file, artifacts=tmp_path / "server-artifacts")
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
        ctx = ctx.model_copy(update={"experiment_id": tracking.experiment_id("two-machines")})
        cfg = RegistryConfig(model_name="shared-policy")
        policy, report, run_ctx = publish(ctx, "dpo", 20, MEASURED, cfg)
        first = register_policy(cfg, policy, report, [policy, report], run_ctx)
        better = {"eval/heldout/win_rate_vs_champion": 0.71, "eval/heldout/win_rate_vs_champion_low": 0.64}
        racers = [publish(ctx, "dpo", seed, better, cfg) for seed in (21, 22)]

        machine, real_state_dir, real_alias = threading.local(), tracking.state_dir, versions.alias_version
        monkeypatch.setattr(tracking, "state_dir", lambda: getattr(machine, "state", None) or real_state_dir())

        def slow_alias(name: str, alias: str):  # each racer reads the champion, then is slow to decide
            found = real_alias(name, alias)
            time.sleep(1.0)
            return found

        monkeypatch.setattr(versions, "alias_version", slow_alias)
        start, outcomes = threading.Barrier(2), {}

        def register(index: int) -> None:
            machine.state = tmp_path / f"machine-{index}" / "state"
            policy, report, run_ctx = racers[index]
            start.wait()
            outcomes[index] = register_policy(cfg, policy, report, [policy, report], run_ctx)

        threads = [threading.Thread(target=register, args=(index,)) for index in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [outcome["promoted"] for outcome in outcomes.values()].count(True) == 1, outcomes
        [won] = [outcome for outcome in outcomes.values() if outcome["promoted"]]
        [lost] = [outcome for outcome in outcomes.values() if not outcome["promoted"]]
        assert won["previous_champion"] == first["version"]
        assert int(MlflowClient().get_model_version_by_alias("shared-policy", CHAMPION).version) == int(won["version"])
        assert lost["reason"].startswith(f"the champion moved to v{won['version']} after eval compared this policy")
        assert [m.name for m in MlflowClient().search_registered_models()] == ["shared-policy"]  # the lock is gone
    finally:
        mlflow_server.stop(pid_file)


def test_a_damaged_copy_of_the_champion_is_fetched_again_and_damaged_stored_files_are_named(ctx, caplog):
    from pathlib import Path
    from urllib.parse import unquote, urlparse

    cfg = RegistryConfig(model_name="checked-policy")
    policy, report, run_ctx = publish(ctx, "dpo", 30, MEASURED, cfg)
    register_policy(cfg, policy, report, [policy, report], run_ctx)
    weights = current_champion(cfg).path / "model" / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])  # a download cut short, or a disk that filled up
    assert (current_champion(cfg).path / "model" / "model.safetensors").read_bytes() == whole
    assert f"{weights}: not the registered bytes" in caplog.text and "fetched again" in caplog.text

    version = versions.alias_version(cfg.model_name, CHAMPION)
    stored = urlparse(tracking.client().get_model_version_download_uri(cfg.model_name, version))
    assert stored.scheme in ("", "file"), stored  # the session's store keeps artifacts in files
    (Path(unquote(stored.path)) / "model.safetensors").write_bytes(b"damaged")
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match=r"do not match their digests \(.*model.safetensors: not the registered"):
        current_champion(cfg)
