"""Tests for validators/: every TRL shape passes, every rule fails with a message that names
the source, the rule and the offending 0-based row."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import pytest

from rlhf_pipeline.validators import DatasetFormat, DataValidationError, detect_format, validate_dataset

SOURCE = "data/tiny.jsonl"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


def make(rows, **kwargs) -> datasets.Dataset:
    return datasets.Dataset.from_list(rows, **kwargs)


def sort_rows(n=4):
    """(prompt, right answer, wrong answer) triples in the style of the bundled "sort digits" task."""
    return [(f"sort {i}31", "".join(sorted(f"{i}31")), f"{i}31") for i in range(2, 2 + n)]


def expect_failure(kind, rows_or_dataset, rule, row=None, **kwargs) -> str:
    dataset = rows_or_dataset if isinstance(rows_or_dataset, datasets.Dataset) else make(rows_or_dataset)
    with pytest.raises(DataValidationError) as caught:
        validate_dataset(kind, dataset, source=SOURCE, **kwargs)
    message = str(caught.value)
    assert message.startswith(f"{SOURCE}: rule '{rule}' failed"), message
    if row is not None:
        assert re.search(rf"e\.g\. row {row}( \(0-based\))?:", message), message
        assert message.count("(0-based)") == 1, message
        failed = {r.rule: r for r in caught.value.report.rules if not r.success}
        assert failed[rule].examples[0]["row"] == row
    return message


# --- every shape passes, extra columns included ---------------------------------------------

SHAPES = {
    "sft-text": (
        "sft",
        [{"text": f"{p} -> {a}", "id": i} for i, (p, a, _) in enumerate(sort_rows())],
        (False, "implicit", ("text",)),
    ),
    "sft-messages": (
        "sft",
        [
            {"messages": [system("sort digits"), user(p), assistant(a)], "id": i}
            for i, (p, a, _) in enumerate(sort_rows())
        ],
        (True, "implicit", ("messages",)),
    ),
    "sft-prompt-completion": (
        "sft",
        [{"prompt": p, "completion": a, "id": i} for i, (p, a, _) in enumerate(sort_rows())],
        (False, "explicit", ("prompt", "completion")),
    ),
    "sft-conversational-prompt-completion": (
        "sft",
        [{"prompt": [user(p)], "completion": [assistant(a)], "id": i} for i, (p, a, _) in enumerate(sort_rows())],
        (True, "explicit", ("prompt", "completion")),
    ),
    "preference-explicit": (
        "preference",
        [{"prompt": p, "chosen": a, "rejected": b, "id": i} for i, (p, a, b) in enumerate(sort_rows())],
        (False, "explicit", ("prompt", "chosen", "rejected")),
    ),
    "preference-conversational-explicit": (
        "preference",
        [
            {"prompt": [user(p)], "chosen": [assistant(a)], "rejected": [assistant(b)], "id": i}
            for i, (p, a, b) in enumerate(sort_rows())
        ],
        (True, "explicit", ("prompt", "chosen", "rejected")),
    ),
    "preference-implicit": (
        "preference",
        [{"chosen": f"{p} {a}", "rejected": f"{p} {b}", "id": i} for i, (p, a, b) in enumerate(sort_rows())],
        (False, "implicit", ("chosen", "rejected")),
    ),
    "preference-conversational-implicit": (
        "preference",
        [
            {
                "chosen": [system("sort"), user(p), assistant(a)],
                "rejected": [system("sort"), user(p), assistant(b)],
                "id": i,
            }
            for i, (p, a, b) in enumerate(sort_rows())
        ],
        (True, "implicit", ("chosen", "rejected")),
    ),
    "prompt-only": (
        "prompt",
        [{"prompt": p, "answer": a} for p, a, _ in sort_rows()],
        (False, "explicit", ("prompt",)),
    ),
    "prompt-only-conversational": (
        "prompt",
        [{"prompt": [system("sort digits"), user(p)], "answer": a} for p, a, _ in sort_rows()],
        (True, "explicit", ("prompt",)),
    ),
}


# The rules each shape is checked with: the common ones, those of message lists, those of prompts and pairs.
COMMON = {"non_empty_dataset", "consistent_types", "text_not_blank"}
MESSAGES = {"valid_roles", "text_turns_only", "has_assistant_turn", "ends_with_assistant_turn"}
RULES = {
    "sft-text": COMMON,
    "sft-messages": COMMON | MESSAGES,
    "sft-prompt-completion": COMMON,
    "sft-conversational-prompt-completion": COMMON | MESSAGES | {"prompt_ends_with_user_turn"},
    "preference-explicit": COMMON | {"chosen_differs_from_rejected"},
    "preference-conversational-explicit": COMMON
    | MESSAGES
    | {"prompt_ends_with_user_turn", "chosen_differs_from_rejected"},
    "preference-implicit": COMMON | {"chosen_differs_from_rejected"},
    "preference-conversational-implicit": COMMON
    | MESSAGES
    | {"shared_prompt_turns", "prompt_ends_with_user_turn", "chosen_differs_from_rejected"},
    "prompt-only": COMMON,
    "prompt-only-conversational": COMMON
    | {"valid_roles", "text_turns_only", "prompt_ends_with_user_turn"},  # no assistant turn to check
}


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_passes(shape):
    kind, rows, (conversational, prompt, columns) = SHAPES[shape]
    report = validate_dataset(kind, make(rows), source=SOURCE)
    assert report.success, report.summary()
    assert report.format == DatasetFormat(kind, conversational, prompt, columns)
    assert report.num_rows == len(rows)
    assert {r.rule for r in report.rules} == RULES[shape]


def test_report_files_written_on_success(tmp_path):
    kind, rows, _ = SHAPES["preference-conversational-implicit"]
    report = validate_dataset(kind, make(rows), source=SOURCE, report_dir=tmp_path)
    saved = json.loads((tmp_path / "validation.json").read_text())
    assert saved["success"] is True and saved["format"]["columns"] == ["chosen", "rejected"]
    assert (tmp_path / "data_docs" / "index.html").is_file()
    assert report.data_docs == str(tmp_path / "data_docs" / "index.html")
    assert "| `shared_prompt_turns` | pass | 0 |" in report.summary()


def test_report_files_written_on_failure(tmp_path):
    rows = [{"prompt": p, "chosen": a, "rejected": a} for p, a, _ in sort_rows()]
    expect_failure("preference", rows, "chosen_differs_from_rejected", row=0, report_dir=tmp_path)
    saved = json.loads((tmp_path / "validation.json").read_text())
    assert saved["success"] is False
    failed = [r for r in saved["rules"] if not r["success"]]
    assert [r["rule"] for r in failed] == ["chosen_differs_from_rejected"]
    assert failed[0]["failed_count"] == 4 and len(failed[0]["examples"]) == 4
    assert (tmp_path / "data_docs" / "index.html").is_file()


def test_a_tool_calling_turn_trains_only_with_a_template_that_renders_tool_calls():
    from rlhf_pipeline.trainers.models.templates import CHATML
    from rlhf_pipeline.trainers.models.tiny import build_tokenizer

    call = [{"type": "function", "function": {"name": "sort", "arguments": "{}"}}]
    messages = [
        user("sort 231"),
        {"role": "assistant", "content": "", "tool_calls": call},  # empty content: it only calls a tool
        {"role": "tool", "content": "123"},
        assistant("123"),
    ]
    rows = make([{"messages": messages}])
    expect_failure("sft", rows, "text_turns_only", row=0)  # no template known to render them
    chatml = build_tokenizer()
    chatml.chat_template = CHATML  # the bundled template drops tool_calls
    with pytest.raises(DataValidationError, match=r"messages\[1\] calls tools .* would train as an empty turn"):
        validate_dataset("sft", rows, source=SOURCE, tokenizer=chatml)
    tools = build_tokenizer()
    tools.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.tool_calls %}<tool_call>{{ m.tool_calls | "
        "tojson }}</tool_call>{% endif %}\n{% endfor %}"
    )
    assert validate_dataset("sft", rows, source=SOURCE, tokenizer=tools).success


def test_row_numbers_follow_a_selected_dataset():
    rows = [{"text": f"sort {i}"} for i in range(6)]
    rows[4]["text"] = " "
    dataset = make(rows).select([3, 4, 5])
    expect_failure("sft", dataset, "text_not_blank", row=1)


# --- each rule fails, naming the source, the rule and the row ------------------------------


def test_empty_chosen():
    rows = [{"prompt": p, "chosen": a, "rejected": b} for p, a, b in sort_rows()]
    rows[2]["chosen"] = ""
    message = expect_failure("preference", rows, "text_not_blank", row=2)
    assert "chosen is empty" in message


def test_whitespace_only_prompt():
    rows = [{"prompt": p, "answer": a} for p, a, _ in sort_rows()]
    rows[2]["prompt"] = " \n\t"
    message = expect_failure("prompt", rows, "text_not_blank", row=2)
    assert "prompt is whitespace-only" in message


def test_blank_message_content():
    rows = [{"messages": [user(p), assistant(a)]} for p, a, _ in sort_rows()]
    rows[1]["messages"][0]["content"] = "  "
    message = expect_failure("sft", rows, "text_not_blank", row=1)
    assert "messages[0].content is whitespace-only" in message


def test_chosen_equals_rejected():
    rows = [{"prompt": p, "chosen": a, "rejected": b} for p, a, b in sort_rows()]
    rows[2]["rejected"] = rows[2]["chosen"]
    message = expect_failure("preference", rows, "chosen_differs_from_rejected", row=2)
    assert "for 1 of 4 rows (chosen must differ from rejected)" in message
    assert "chosen == rejected == '134'" in message


def test_implicit_conversational_same_final_turn():
    rows = [{"chosen": [user(p), assistant(a)], "rejected": [user(p), assistant(b)]} for p, a, b in sort_rows()]
    rows[3]["rejected"] = [user(rows[3]["chosen"][0]["content"]), assistant(rows[3]["chosen"][1]["content"])]
    expect_failure("preference", rows, "chosen_differs_from_rejected", row=3)


def test_unknown_role():
    rows = [{"messages": [user(p), assistant(a)]} for p, a, _ in sort_rows()]
    rows[2]["messages"][1]["role"] = "bot"
    message = expect_failure("sft", rows, "valid_roles", row=2)
    assert "messages[1].role is 'bot'" in message


def test_sft_messages_without_assistant_turn():
    rows = [{"messages": [user(p), assistant(a)]} for p, a, _ in sort_rows()]
    rows[2]["messages"] = [system("sort digits"), user("sort 321")]
    message = expect_failure("sft", rows, "has_assistant_turn", row=2)
    assert "roles: system, user" in message
    # One reason per row: the missing answer is not also reported as a wrong last turn.
    assert "ends_with_assistant_turn" not in message


def test_sft_messages_ending_with_user_turn():
    rows = [{"messages": [user(p), assistant(a)]} for p, a, _ in sort_rows()]
    rows[2]["messages"].append(user("and now 987?"))
    message = expect_failure("sft", rows, "ends_with_assistant_turn", row=2)
    assert "the last turn of messages has role 'user'" in message


def test_conversational_prompt_ending_with_assistant_turn():
    rows = [{"prompt": [user(p)], "answer": a} for p, a, _ in sort_rows()]
    rows[1]["prompt"] = [user("sort 321"), assistant("123")]
    expect_failure("prompt", rows, "prompt_ends_with_user_turn", row=1)


def test_implicit_conversational_preference_without_shared_prefix():
    rows = [{"chosen": [user(p), assistant(a)], "rejected": [user(p), assistant(b)]} for p, a, b in sort_rows()]
    rows[2]["rejected"][0] = user("sort 999")
    message = expect_failure("preference", rows, "shared_prompt_turns", row=2)
    assert "share no leading turn" in message


def test_mixed_types_in_one_column():
    # Json columns (datasets >= 5, e.g. load_dataset("json") on mixed data) may mix types.
    # Not digit strings here: a Json column decodes the string "134" as the int 134.
    rows = [{"prompt": p, "chosen": f"answer: {a}", "rejected": f"answer: {b}"} for p, a, b in sort_rows()]
    rows[2]["chosen"] = [assistant("answer: 134")]
    dataset = make(rows, on_mixed_types="use_json")
    message = expect_failure("preference", dataset, "consistent_types", row=2)
    assert "chosen is a list of {role, content} messages, expected a string" in message


def test_missing_value_is_a_type_error():
    rows = [{"prompt": p, "completion": a} for p, a, _ in sort_rows()]
    rows[3]["completion"] = None
    message = expect_failure("sft", rows, "consistent_types", row=3)
    assert "completion is None" in message
    assert "text_not_blank" not in message  # the wrong-typed value is reported once


def test_empty_dataset():
    empty = datasets.Dataset.from_dict(
        {"prompt": [], "chosen": [], "rejected": []},
        features=datasets.Features({c: datasets.Value("string") for c in ("prompt", "chosen", "rejected")}),
    )
    message = expect_failure("preference", empty, "non_empty_dataset")
    assert "the dataset has 0 rows" in message


# --- shapes TRL cannot use here: rule 'format' -----------------------------------------------


def test_unpaired_preference_is_rejected():
    # Unpaired rows are KTO's preference format, but one label only leaves KTO nothing to contrast.
    rows = [{"prompt": p, "completion": a, "label": True} for p, a, _ in sort_rows()]
    assert detect_format("preference", make(rows), SOURCE) == DatasetFormat(
        "preference", False, "explicit", ("prompt", "completion", "label")
    )
    message = expect_failure("preference", rows, "both_labels_present", row=0)
    assert "all 4 labels are True: no undesirable row (label False)" in message


def test_missing_column_names_what_was_found(tmp_path):
    rows = [{"prompt": p, "chosen": a, "answer": a} for p, a, _ in sort_rows()]
    message = expect_failure("preference", rows, "format", report_dir=tmp_path)
    assert "found columns ['prompt', 'chosen', 'answer']" in message
    assert "missing ['rejected']" in message
    saved = json.loads((tmp_path / "validation.json").read_text())
    assert saved["format"] is None and saved["rules"][0]["rule"] == "format"


def test_sft_without_usable_columns():
    message = expect_failure("sft", [{"question": "q", "answer": "a"}], "format")
    assert "'text'" in message and "'messages'" in message and "found columns ['question', 'answer']" in message


def test_columns_must_agree_on_standard_or_conversational():
    rows = [{"prompt": p, "chosen": [assistant(a)], "rejected": [assistant(b)]} for p, a, b in sort_rows()]
    message = expect_failure("preference", rows, "format")
    assert "'prompt' holds strings" in message and "'chosen' holds message lists" in message


def test_column_of_unusable_type():
    message = expect_failure("prompt", [{"prompt": 3}, {"prompt": 4}], "format")
    assert "an int (2 rows)" in message


def test_unknown_kind_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown dataset kind 'dpo'"):
        detect_format("dpo", make([{"text": "x"}]), SOURCE)


def test_import_is_cheap():
    code = (
        "import sys, rlhf_pipeline.validators; print(sorted(m for m in ('great_expectations', 'datasets', 'pandas', "
        "'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert out.stdout.strip() == "[]"


def test_fits_max_length_counts_conversations_with_the_chat_template():
    from rlhf_pipeline.trainers.models.tiny import build_tokenizer

    rows = [{"messages": [user("sort 21"), assistant("12")]}, {"messages": [user("x" * 50), assistant("12")]}]
    # 1 token per byte plus one role token per turn, "<|end|>" after the user turn and EOS after the answer
    message = expect_failure("sft", rows, "fits_max_length", row=1, max_tokens=20, tokenizer=build_tokenizer())
    assert "messages is 56 tokens > 20" in message
    with pytest.raises(ValueError, match="needs the tokenizer"):
        validate_dataset("sft", make(rows), source=SOURCE, max_tokens=20)


def test_no_training_prompt_is_an_ifeval_or_ifbench_test_prompt_and_a_planted_one_fails_naming_file_row_and_rule(
    tmp_path,
):
    """The smollm2 preset's training prompts (data/ifeval) share no 13-word span with a test prompt of the benchmarks
    its eval scores; one planted in them stops the data stage: as a user would write it (other case, other spaces, a
    zero-width space), contained in a longer prompt, or reworded with a sentence of its own added."""
    from rlhf_pipeline.flows.params import load_params
    from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS, benchmark_file
    from rlhf_pipeline.validators.stage import check_datasets

    params = load_params("smollm2")
    assert params.benchmarks() == ("ifeval", "ifbench")
    passed, failures = check_datasets(params.data, None, {}, tmp_path / "clean", benchmarks=params.benchmarks())
    assert not failures and "prompts" in passed, failures

    _, ifbench = benchmark_file(BENCHMARKS["ifbench"])
    _, ifeval = benchmark_file(BENCHMARKS["ifeval"])
    rows = [json.loads(line) for line in pathlib.Path(params.data.prompts.path).read_text().splitlines()][:40]
    planted = {
        17: "  " + ifbench[200]["prompt"].upper().replace(" ", "\u200b ", 1) + " ",  # the prompt, as typed again
        23: f"Please help me with this. {ifeval[7]['prompt']} Thank you!",  # contained in a longer prompt
        # reworded: commas made semicolons, one sentence cut from its end and one of our own added
        31: ifeval[300]["prompt"].replace(",", ";").rsplit(".", 2)[0] + ". Keep it friendly and short.",
    }
    for row, text in planted.items():
        rows.insert(row, {**rows[0], "prompt": [{"role": "user", "content": text}]})
    leaky = tmp_path / "prompts.jsonl"
    leaky.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = params.data.model_copy(update={"prompts": params.data.prompts.model_copy(update={"path": str(leaky)})})
    passed, failures = check_datasets(data, None, {}, tmp_path / "leaky", benchmarks=params.benchmarks())
    assert "prompts" not in passed and len(failures) == 1, failures
    message = str(failures[0])
    assert str(leaky) in message and "no_benchmark_prompt_in_training" in message, message
    report = json.loads((tmp_path / "leaky" / "prompts" / "validation.json").read_text())
    rules = [rule for rule in report["rules"] if rule["rule"] == "no_benchmark_prompt_in_training"]
    assert len(rules) == 2  # IFEval's and IFBench's
    found = {example["row"]: example["value"] for rule in rules for example in rule["examples"]}
    assert sorted(found) == [17, 23, 31], found
    assert "row 200 of IFBench" in found[17] and "row 7 of IFEval" in found[23] and "row 300 of IFEval" in found[31]
    # Without the benchmarks in the run (no eval.instruction_following), the same file passes.
    assert not check_datasets(data, None, {}, tmp_path / "off")[1]
