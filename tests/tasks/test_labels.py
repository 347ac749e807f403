"""People's labels (tasks/labels.py): a labels file is checked line by line against the pairs waiting, and the store
holds only labels that passed, each with its pair's hash."""

from __future__ import annotations

import json

import pytest

from rlhf_pipeline.tasks.labels import LabelsError, read_labels_file, read_store, write_store
from rlhf_pipeline.trainers.pairs.stage import people_pairs

SAMPLES = [
    {"id": i, "prompt": f"prompt {i}", "completions": [f"answer {i}a", f"answer {i}b", f"answer {i}a"]}
    for i in range(3)
]


@pytest.fixture
def waiting() -> dict[int, str]:
    return {pair["pair"]: pair["hash"] for pair in people_pairs(SAMPLES, max_pairs=10)}


def test_each_pair_is_bound_to_its_content_by_a_hash(waiting):
    assert sorted(waiting) == [0, 1, 2] and len(set(waiting.values())) == 3
    changed = [{**SAMPLES[0], "completions": ["answer 0a", "another answer"]}, *SAMPLES[1:]]
    again = {pair["pair"]: pair["hash"] for pair in people_pairs(changed, max_pairs=10)}
    assert again[0] != waiting[0] and again[1] == waiting[1]


def test_a_labels_file_passes_with_the_hashes_it_copied_and_fails_with_a_line_and_rule_otherwise(tmp_path, waiting):
    good = tmp_path / "good.jsonl"
    lines = [{"pair": 0, "label": "A", "hash": waiting[0]}, {"pair": 1, "label": None}, {"pair": 2, "label": "tie"}]
    good.write_text("".join(json.dumps(line) + "\n" for line in [*lines, lines[0]]))  # a repeated line agrees
    assert read_labels_file(good, waiting) == {0: "A", 1: None, 2: "tie"}
    for text, rule in (
        ('{"pair": true, "label": "A"}', "line 1: the pair is an integer pair number, got True"),
        ('{"pair": "0", "label": "A"}', "line 1: the pair is an integer pair number, got '0'"),
        ('{"pair": 3, "label": "A"}', "line 1: pair 3 is not one of the 3 pairs waiting for labels (0..2)"),
        ('{"pair": -1, "label": "A"}', "line 1: pair -1 is not one of the 3 pairs"),
        ('["pair", 0]', "line 1: each line is an object"),
        ('{"pair": 1, "label": "B", "hash": "000000000000"}', "line 1: hash '000000000000' is not pair 1's"),
        (
            '{"pair": 1, "label": "B"}\n{"pair": 1, "label": "A"}',
            "line 2: pair 1 is labelled 'A' here and 'B' on line 1",
        ),
        # Hostile lines: each said with its line and rule (a RecursionError or Python's 4,300-digit limit before)
        ('{"pair": 0, "label": ' + "[" * 5000 + "]" * 5000 + "}", "line 1: nested 5001 deep; each line is one flat"),
        ('{"pair": ' + "9" * 5000 + ', "label": "A"}', "line 1: a number of 5000 digits; a pair number has at most 18"),
        ('{"pair": 0, "label": "B", "label": "A"}', "line 1: key 'label' given twice"),
    ):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text + "\n")
        with pytest.raises(LabelsError, match=f"labels file {bad} {rule}".replace("(", r"\(").replace(")", r"\)")):
            read_labels_file(bad, waiting)


def test_a_labels_file_over_the_limit_is_refused_unread(tmp_path, waiting):
    import tracemalloc

    big = tmp_path / "big.jsonl"
    line = json.dumps({"pair": 0, "label": "A"}) + "\n"
    with big.open("w") as f:
        for _ in range(64):  # 64 MB of good lines
            f.write(line * (1024 * 1024 // len(line)))
    tracemalloc.start()
    try:
        with pytest.raises(LabelsError, match=r"labels file .*big.jsonl: 6\d\.\d MB, over the 8 MiB"):
            read_labels_file(big, waiting)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20  # its peak: the file was not read into memory
    finally:
        tracemalloc.stop()


def test_the_store_keeps_only_checked_labels_and_names_one_it_cannot_read(tmp_path, waiting):
    store = tmp_path / "store.json"
    write_store(store, {0: "A", 2: None}, False, waiting)
    assert read_store(store, waiting) == ({0: "A", 2: None}, False)
    with pytest.raises(LabelsError, match="pair 5 is not one of the 3 pairs"):
        write_store(store, {5: "A"}, True, waiting)
    assert read_store(store, waiting) == ({0: "A", 2: None}, False)  # the refused write left it as it was
    # Labels kept for other content than the pair shows now are not applied to it.
    assert read_store(store, {**waiting, 0: "ffffffffffff"}) == ({2: None}, False)
    # A store poisoned by an earlier version (a pair stored as "True") is named, with what to do, not a traceback.
    store.write_text(json.dumps({"labels": {"True": "A"}, "finished": True}))
    with pytest.raises(LabelsError, match=f"labels store {store}: unreadable .*move it aside and label again"):
        read_store(store, waiting)


def test_a_finish_with_no_pair_labelled_is_not_stored_as_finished_and_the_run_asks_again(tmp_path, monkeypatch):
    """The Resume form submitted as shown (every pair on skip, finish on) stored "finished" with no labels, and every
    later run of these samples then failed until the store was edited by hand: now it is not a finish, the run says
    so and asks again, and the next answer's labels are kept."""
    from types import SimpleNamespace

    import prefect.flow_runs
    from prefect.runtime import deployment

    from rlhf_pipeline.tasks import people
    from rlhf_pipeline.tasks.store.artifacts import ArtifactRef

    samples = tmp_path / "samples"
    samples.mkdir()
    (samples / "samples.jsonl").write_text("".join(json.dumps(row) + "\n" for row in SAMPLES))
    ref = ArtifactRef(stage="pairs", key="k" * 32, uri=str(samples))
    said: list[str] = []
    answers = iter([SimpleNamespace(finish=True), SimpleNamespace(finish=True, pair_1="B")])  # all skip, then one B
    monkeypatch.setattr(prefect.flow_runs, "pause_flow_run", lambda **kwargs: next(answers))
    monkeypatch.setattr(deployment, "get_id", lambda: None)
    monkeypatch.setattr(people, "_show", lambda *args: None)
    monkeypatch.setattr(people, "prefect_log", said.append)
    store = tmp_path / "store.json"
    people.ask_people(ref, store, people.PeopleConfig(timeout_s=60))
    assert any("no pair labelled A or B" in line and "asking again" in line for line in said), said
    shown = {pair["pair"]: pair["hash"] for pair in people_pairs(SAMPLES, max_pairs=10)}
    assert read_store(store, shown) == ({1: "B"}, True)


def test_rlhf_label_refuses_a_hostile_pair_item_or_file_with_exit_2_and_no_traceback(tmp_path, monkeypatch, capsys):
    from rlhf_pipeline.cli import main
    from rlhf_pipeline.tasks import people

    monkeypatch.setattr(people, "waiting_pairs", lambda run: {0: "3f2a9c1e0b7d"})
    monkeypatch.setattr(people, "resume_with_labels", lambda *args, **kwargs: pytest.fail("resumed"))
    nested = tmp_path / "nested.jsonl"
    nested.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    run = "0b6d7c1e-4a0e-4a55-9d51-5f1f3b0c2a11"
    for argv, says in (
        ([run, "9" * 5000 + "=A"], "expected PAIR=LABEL with a pair number"),
        ([run, "--file", str(nested)], "line 1: nested 100000 deep"),
    ):
        assert main(["label", *argv]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, err
