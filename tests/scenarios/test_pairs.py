"""Preference pairs made from prompts in a pipeline run (issue 27): DPO on pairs the verifier made from SFT's own
answers beats SFT; people label through a paused run, which times out saying so and resumes from its samples; feedback
rounds of an offline algorithm."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rlhf_pipeline.flows.params import load_params
from tests.flows.helpers import run, task_runs, task_states

pytestmark = pytest.mark.slow

MADE = [
    "data.preference=null",  # the preference file left out: every pair is made
    "pairs.enabled=true",
    "pairs.function=tests.helpers:length_reward",  # varies on an untrained model's answers (exact match does not)
    "pairs.max_prompts=16",
    "pairs.samples_per_prompt=4",
    "pairs.max_new_tokens=4",
]


def children(summary: dict) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    parent = client.get_run(summary["mlflow_run_id"])
    return client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")


def test_dpo_on_pairs_the_verifier_made_from_sfts_answers_beats_sft_by_ten_points(prefect, state):
    """The acceptance run: the embedded default (tiny model, bundled task, its preset's pairs block), no preference
    file; sft's 8 answers to 1,000 training prompts, right vs wrong by exact match, then DPO."""
    from rlhf_pipeline.flows.rlhf import rlhf

    params = load_params(
        "tiny",
        ["data.preference=null", "pairs.enabled=true", "eval.use_reward_model=false", "registry.enabled=false"],
        experiment_name="pairs",
    )
    done = rlhf(**dict(params), return_state=True)
    assert done.is_completed(), done.message
    assert task_states(done) == dict.fromkeys(["data", "sft", "pairs", "dpo", "eval"], "Completed")
    summary = done.result()
    metrics = summary["metrics"]
    sft, policy = metrics["eval/heldout/sft_exact_match"], metrics["eval/heldout/policy_exact_match"]
    assert policy >= sft + 0.10, (sft, policy)
    [labelled] = [r for r in children(summary) if r.data.tags.get("rlhf.part") == "labels"]
    assert labelled.data.metrics["pairs/made"] >= 100 and labelled.data.tags["rlhf.labeller"] == "function"
    # The pairs are an MLflow dataset input of that run, with their digest and labeller, and of the dpo run.
    [logged] = [d for d in labelled.inputs.dataset_inputs if d.dataset.name.startswith("pairs-")]
    manifest = json.loads((Path(labelled.data.tags["rlhf.artifact"]) / "manifest.json").read_text())
    assert logged.dataset.digest == manifest["digest"][:16] and logged.dataset.name == "pairs-function"
    assert {t.key: t.value for t in logged.tags}["rlhf.labeller"] == "function"
    [dpo] = [r for r in children(summary) if r.data.tags.get("rlhf.stage") == "dpo"]
    trained_on = {d.dataset.name: d.dataset.digest for d in dpo.inputs.dataset_inputs}
    assert trained_on.get("pairs") == manifest["digest"][:16], trained_on
    print(f"held-out exact match: sft {sft:.3f}, dpo on made pairs {policy:.3f}")


def test_people_who_never_answer_time_the_run_out_and_a_rerun_with_their_file_samples_nothing(prefect, state, tmp_path):
    people = [*MADE, "pairs.labeller=people", "pairs.people.max_pairs=4", "registry.enabled=false"]
    waited = run(*people, "pairs.people.timeout_s=2")
    assert waited.is_failed()
    assert "no labels came within pairs.people.timeout_s=2s for 4 of 4 pairs" in waited.message, waited.message
    assert task_states(waited) == {"data": "Completed", "sft": "Completed", "pairs": "AwaitingLabels"}
    [store] = (state / "artifacts" / "pairs" / ".labels").glob("*.to_label.jsonl")
    shown = [json.loads(line) for line in store.read_text().splitlines()]
    assert [pair["pair"] for pair in shown] == [0, 1, 2, 3] and all(pair["a"] != pair["b"] for pair in shown)
    samples_before = sorted((state / "artifacts" / "pairs").glob("*/samples.jsonl"))

    labels = tmp_path / "labels.jsonl"
    chosen = ["A", "B", "tie", None]
    labels.write_text("".join(json.dumps({"pair": i, "label": label}) + "\n" for i, label in enumerate(chosen)))
    done = run(*people, f"pairs.people.labels_file={labels}")
    assert done.is_completed(), done.message
    states = task_states(done)
    assert states["pairs"] == "Completed" and states["dpo"] == "Completed"
    # Nothing sampled again: the samples are the cached artifact of the run that timed out.
    assert sorted((state / "artifacts" / "pairs").glob("*/samples.jsonl")) == samples_before
    runs = children(done.result())
    [sampled] = [r for r in runs if r.data.tags.get("rlhf.part") == "samples"]
    assert sampled.data.tags["rlhf.cached"] == "true"
    [labelled] = [r for r in runs if r.data.tags.get("rlhf.part") == "labels"]
    pairs = [
        json.loads(line)
        for line in (Path(labelled.data.tags["rlhf.artifact"]) / "pairs.jsonl").read_text().splitlines()
    ]
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [
        (shown[0]["a"], shown[0]["b"]),
        (shown[1]["b"], shown[1]["a"]),
    ]
    assert labelled.data.metrics["pairs/dropped/ties"] == 1 and labelled.data.metrics["pairs/dropped/unlabelled"] == 1


def test_feedback_rounds_of_dpo_sample_the_last_policy_and_train_on_every_rounds_pairs(prefect, state):
    done = run(*MADE, "feedback.rounds=1", "eval.use_reward_model=false", "registry.enabled=false")
    assert done.is_completed(), done.message
    assert task_states(done) == {
        "data": "Completed",
        "sft": "Completed",
        "pairs": "Completed",
        "dpo": "Completed",
        "pairs (round 1)": "Completed",
        "dpo (round 1)": "Completed",
        "eval": "Completed",
    }
    runs = {
        (r.info.run_name, r.data.tags.get("rlhf.round", "0"), r.data.tags.get("rlhf.part", "")): r
        for r in children(done.result())
    }
    first, second = runs[("pairs", "0", "labels")], runs[("pairs", "1", "labels")]
    assert second.data.metrics["pairs/earlier_rounds"] == first.data.metrics["pairs/made"]
    assert (
        second.data.metrics["pairs/train_rows"] == first.data.metrics["pairs/made"] + second.data.metrics["pairs/made"]
    )
    # Round 1 sampled the first DPO policy, and its DPO started from it.
    sampled = json.loads(
        (Path(runs[("pairs", "1", "samples")].data.tags["rlhf.artifact"]) / "manifest.json").read_text()
    )
    assert sampled["upstream"]["model"]["key"] == runs[("dpo", "0", "")].data.tags["rlhf.key"]
    trained = json.loads((Path(runs[("dpo", "1", "")].data.tags["rlhf.artifact"]) / "manifest.json").read_text())
    assert trained["upstream"]["sft"]["key"] == runs[("dpo", "0", "")].data.tags["rlhf.key"]
    assert trained["upstream"]["pairs"]["key"] == second.data.tags["rlhf.key"]


def test_people_answer_an_rlhf_run_in_two_goes_with_rlhf_label_and_partial_labels_are_kept(
    prefect, state, tmp_path, capsys
):
    """`rlhf run` pauses (no deployment to suspend for); `rlhf label` refuses every mistake, naming it, and sends
    nothing; `rlhf label --more` keeps a partial answer and the run asks again for the rest only; the second answer
    finishes it. The store keeps each label with its pair's hash."""
    import threading

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType

    from rlhf_pipeline.cli import main

    finished: dict = {}
    people = [*MADE, "pairs.labeller=people", "pairs.people.max_pairs=3", "registry.enabled=false"]
    thread = threading.Thread(target=lambda: finished.update(state=run(*people)))
    thread.start()

    def paused(timeout: float = 120):
        deadline = time.monotonic() + timeout
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                runs = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(
                        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=["PAUSED"]))
                    )
                )
                if runs:
                    return runs[0]
                assert thread.is_alive(), finished
                time.sleep(0.5)
        raise AssertionError(f"no run paused within {timeout}s")

    first = paused()
    assert first.state.name == "Paused"  # not Suspended: an `rlhf run` run has no deployment
    refused_every_mistake_and_sent_nothing(main, str(first.id), state, tmp_path, capsys)
    assert main(["label", str(first.id), "0=A", "--more"]) == 0
    second = paused()
    assert second.id == first.id
    [to_label] = (state / "artifacts" / "pairs" / ".labels").glob("*.to_label.jsonl")
    assert [json.loads(line)["pair"] for line in to_label.read_text().splitlines()] == [1, 2]  # pair 0 is kept
    assert main(["label", str(first.id), "1=B", "2=tie"]) == 0
    thread.join(timeout=300)
    done = finished["state"]
    assert done.is_completed(), done.message
    [store] = (state / "artifacts" / "pairs" / ".labels").glob("*[0-9a-f].json")
    shown = {pair["pair"]: pair["hash"] for pair in map(json.loads, (store.with_suffix(".to_label.jsonl")).open())}
    kept = json.loads(store.read_text())
    assert {pair: entry["label"] for pair, entry in kept["labels"].items()} == {"0": "A", "1": "B", "2": "tie"}
    assert kept["labels"]["1"]["hash"] == shown[1] and kept["finished"] is True
    assert task_states(done)["pairs labelled"] == "Completed"


def refused_every_mistake_and_sent_nothing(main, run_id: str, state: Path, tmp_path: Path, capsys) -> None:
    """Each mistake a person makes with `rlhf label` exits 2 naming the file, line or item and the rule; the run stays
    paused and no label is stored."""
    import uuid

    [to_label] = (state / "artifacts" / "pairs" / ".labels").glob("*.to_label.jsonl")
    hashes = [json.loads(line)["hash"] for line in to_label.read_text().splitlines()]
    files = {
        "poisoned": ['{"pair": true, "label": "A"}', "line 1: the pair is an integer pair number, got True"],
        "range": ['{"pair": 0, "label": "A"}\n{"pair": 7, "label": "B"}', "line 2: pair 7 is not one of the 3 pairs"],
        "label": ['{"pair": 0, "label": "a"}', "line 1: label 'a' of pair 0 is not one of A, B, tie or null"],
        "json": ['{"pair": 0, "label": "A"', "line 1: not JSON"],
        "twice": ['{"pair": 0, "label": "A"}\n\n{"pair": 0, "label": "B"}', "line 3: pair 0 is labelled 'B' here"],
        "hash": [
            json.dumps({"pair": 0, "label": "A", "hash": hashes[1]}),
            f"line 1: hash {hashes[1]!r} is not pair 0's ({hashes[0]})",
        ],
    }
    for name, (text, rule) in files.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(text + "\n")
        assert main(["label", run_id, "--file", str(path)]) == 2, name
        err = capsys.readouterr().err
        assert f"labels file {path} {rule}" in err and "Traceback" not in err, (name, err)
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:
        f.truncate(9 << 20)  # sparse: refused by its size, never read
    assert main(["label", run_id, "--file", str(big)]) == 2
    assert "over the 8 MiB a labels file may be" in capsys.readouterr().err
    for argv, says in (
        ([run_id, "9=A"], "pair 9 is not one of the 3 pairs"),
        ([run_id, "0=best"], "label 'best' of pair 0 is not one of"),
        ([str(uuid.uuid4()), "0=A"], "no such flow run"),
        (["not-a-run", "0=A"], "'not-a-run' is not a flow run id"),
    ):
        assert main(["label", *argv]) == 2, argv
        assert says in capsys.readouterr().err, argv
    assert not list((state / "artifacts" / "pairs" / ".labels").glob("*[0-9a-f].json")), "a label was stored"


def test_the_reward_model_labels_sfts_answers_after_training_on_the_given_pairs_and_dpo_learns_them(prefect, state):
    done = run(
        *[o for o in MADE if not o.startswith(("data.preference", "pairs.function"))],
        "pairs.labeller=reward_model",
        "eval.use_reward_model=false",
        "registry.enabled=false",
    )
    assert done.is_completed(), done.message
    started = sorted(task_runs(done.state_details.flow_run_id), key=lambda t: t.start_time)
    assert [t.name for t in started] == ["data", "sft", "rm", "pairs", "dpo", "eval"]
    runs = {(r.info.run_name, r.data.tags.get("rlhf.part", "")): r for r in children(done.result())}
    labelled, rm = runs[("pairs", "labels")], runs[("rm", "")]
    manifest = json.loads((Path(labelled.data.tags["rlhf.artifact"]) / "manifest.json").read_text())
    assert manifest["upstream"]["rm"]["key"] == rm.data.tags["rlhf.key"]  # labelled by the trained reward model
    rm_manifest = json.loads((Path(rm.data.tags["rlhf.artifact"]) / "manifest.json").read_text())
    assert "pairs" not in rm_manifest["upstream"]  # which trained on the given pairs, not on its own labels
    # Scores of an untrained head are all different: every prompt with two distinct answers makes a pair, and the
    # reward model is scored against the held-out preferences.
    assert labelled.data.metrics["pairs/made"] > 0 and labelled.data.tags["rlhf.labeller"] == "reward_model"
    # every held-out preference scored once, each agreeing (1), tied (0.5) or not (0)
    held_out = len(Path(load_params().data.preference_eval.path).read_text().splitlines())
    scored = labelled.data.metrics["pairs/labeller_agreement_pairs"]
    assert scored == held_out > 0
    assert (2 * labelled.data.metrics["pairs/labeller_agreement"] * scored) % 1 < 1e-6
    dpo = json.loads((Path(runs[("dpo", "")].data.tags["rlhf.artifact"]) / "manifest.json").read_text())
    assert dpo["upstream"]["pairs"]["key"] == labelled.data.tags["rlhf.key"]
    # and learns them: after a few steps on them the policy prefers their chosen answers over the rejected ones by
    # more than its reference does (a policy equal to its reference starts at a margin of 0, right on half of them)
    trained = {k: v for k, v in runs[("dpo", "")].data.metrics.items() if "/rewards_" in k}
    assert trained["dpo/train/rewards_margins"] > 0 and trained["dpo/train/rewards_accuracies"] > 0.5, trained
