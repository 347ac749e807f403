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
