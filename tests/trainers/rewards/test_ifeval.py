"""The instruction-following task: IFEval's checkers as reward and gold metric, the seeded prompt generator, IFBench."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlhf_pipeline.trainers.rewards import ifeval

NO_COMMA = ["punctuation:no_comma"]
TITLE = "detectable_format:title"


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_the_reward_is_the_share_of_constraints_followed():
    prompts = [_messages("Describe a park. Do not use commas. Add a title in <<>>.")] * 3
    ids = [NO_COMMA + [TITLE]] * 3
    kwargs = ["[{}, {}]"] * 3
    completions = [
        [{"role": "assistant", "content": "<<The park>>\nTrees and a pond."}],  # both
        [{"role": "assistant", "content": "Trees and a pond."}],  # no comma, no title
        [{"role": "assistant", "content": "Trees, grass, and a pond."}],  # neither
    ]
    assert ifeval.constraints_followed(prompts, completions, ids, kwargs) == [1.0, 0.5, 0.0]
    assert ifeval.all_followed(prompts, completions, ids, kwargs) == [1.0, 0.0, 0.0]


def test_arguments_reach_the_checker():
    ids = [["keywords:existence"]]
    kwargs = [json.dumps([{"keywords": ["lantern"]}])]
    assert ifeval.all_followed(["p"], ["A lantern glows."], ids, kwargs) == [1.0]
    assert ifeval.all_followed(["p"], ["A candle glows."], ids, kwargs) == [0.0]


def test_an_answer_gets_one_verdict_however_often_it_is_checked():
    # "WE OK" is English to langdetect about half the time when it is not seeded: the start scored twice had two
    # IFEval figures from the same answers.
    import langdetect

    verdicts = {ifeval.check("WE OK", ["change_case:english_capital"], "[{}]").all for _ in range(20)}
    assert len(verdicts) == 1
    assert {langdetect.detect("WE OK") for _ in range(20)} == {langdetect.detect("WE OK")}


def test_a_checker_that_draws_what_its_kwargs_leave_out_draws_the_same_for_the_same_prompt_and_leaves_random_alone():
    # IFEval's prompt 1122 asks for at least 4 '#'; `letter_frequency` takes only a-z and draws a random letter
    # instead: two evals of the start's same answers gave instruction-level loose 0.318 and 0.317.
    import random

    prompt = "Include at least 4 hashtags, starting with '#'"
    kwargs = [{"let_relation": "at least", "letter": "#", "let_frequency": 4}]
    verdicts = set()
    for seed in range(8):
        random.seed(seed)
        before = random.getstate()
        verdicts.add(
            tuple(
                ifeval.check(letters, ["keywords:letter_frequency"], kwargs, prompt).all
                for letters in ("abcdefghijklm " * 4, "nopqrstuvwxyz " * 4)
            )
        )
        assert random.getstate() == before
    assert len(verdicts) == 1 and verdicts != {(True, True)}, verdicts  # one letter, whatever random's state


def test_an_unknown_or_unsupported_checker_is_refused_by_name():
    with pytest.raises(ValueError, match="'format:nonsense' is not one of ifeval's 25 checkers"):
        ifeval.check("text", ["format:nonsense"], "[{}]")
    with pytest.raises(ValueError, match="'words:start_verb' is refused: needs NLTK's averaged_perceptron_tagger"):
        ifeval.check("Run.", ["words:start_verb"], "[{}]", benchmark="ifbench")


def test_checkers_that_read_nltk_data_work_offline():
    """Sentence counting reads punkt's tables, IFBench's stop-word ratio NLTK's stopwords: both from the registry."""
    assert ifeval.check(
        "One. Two. Three.", ["length_constraints:number_sentences"], [{"num_sentences": 3, "relation": "at least"}]
    ).all
    assert not ifeval.check(
        "One.", ["length_constraints:number_sentences"], [{"num_sentences": 3, "relation": "at least"}]
    ).all
    ratio = [{"percentage": 10}]
    assert ifeval.check(
        "the cat and the dog are in the house", ["ratio:stop_words"], ratio, benchmark="ifbench"
    ).followed == [False]
    assert ifeval.check("cats dogs houses gardens", ["ratio:stop_words"], ratio, benchmark="ifbench").followed == [True]


def test_importing_ifbench_checkers_fetches_nothing():
    """IFBench's module calls nltk.download at import for data it lacks: offline that printed '[nltk_data] Error
    loading ...' lines into every eval (and, where a connection hangs, waited on it)."""
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from rlhf_pipeline.trainers.rewards import ifeval; print(len(ifeval.registry('ifbench')))",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "NLTK_DATA": ""},
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 50  # IFBench's checkers loaded
    assert "nltk_data" not in done.stdout + done.stderr, done.stdout + done.stderr


def test_the_generator_is_seeded_and_holds_requests_out(tmp_path):
    from rlhf_pipeline.data import instructions as generator

    first, second = tmp_path / "a", tmp_path / "b"
    generator.generate(first)
    generator.generate(second)
    for name in ("prompts", "prompts_eval"):
        assert (first / f"{name}.jsonl").read_bytes() == (second / f"{name}.jsonl").read_bytes()
    bundled = Path(generator.__file__).parent / "ifeval"
    assert (first / "prompts.jsonl").read_bytes() == (bundled / "prompts.jsonl").read_bytes(), "bundled data is stale"
    rows = {
        name: [json.loads(line) for line in (first / f"{name}.jsonl").open()] for name in ("prompts", "prompts_eval")
    }
    held_out = set(generator.REQUESTS[-generator.HELD_OUT_REQUESTS :])

    def request(row):
        return next(r for r in generator.REQUESTS if row["prompt"][0]["content"].startswith(r))

    assert {request(r) for r in rows["prompts_eval"]} <= held_out
    assert not {request(r) for r in rows["prompts"]} & held_out
    for row in rows["prompts_eval"][:50]:  # every row checks with the checkers it names
        ifeval.check("An answer.", row["instruction_id_list"], row["kwargs"], row["prompt"][0]["content"])


def test_the_benchmarks_are_ifevals_541_and_ifbenchs_current_300_prompts_and_julys_unchanged_rows_compare():
    from rlhf_pipeline.trainers.evaluation.instructions import (
        BENCHMARKS,
        _earlier,
        benchmark_rows,
        score,
        unchanged_rows,
    )

    ifeval_rows, ifeval_refused = benchmark_rows(BENCHMARKS["ifeval"])
    assert len(ifeval_rows) == 541 and ifeval_refused == 0
    assert len({i for row in ifeval_rows for i in row["instruction_id_list"]}) == 25  # IFEval's 25 instruction types
    ifbench_rows, ifbench_refused = benchmark_rows(BENCHMARKS["ifbench"])
    assert len(ifbench_rows) + ifbench_refused == 300 and ifbench_refused == 6
    assert all("words:start_verb" not in row["instruction_id_list"] for row in ifbench_rows)
    assert len({i for row in ifbench_rows for i in row["instruction_id_list"]}) == 57  # 58 ids, start_verb refused
    # July 2025's file: 288 of its 294 rows were scored; 284 of them are unchanged in the current file. Rows 0, 1 and
    # 153 were reworded since, and row 268 carried rows 269-274 as a tab-separated tail.
    earlier = BENCHMARKS["ifbench"].earlier
    unchanged = unchanged_rows(earlier, ifbench_rows)
    changed = {row["key"] for row in ifbench_rows} - {ifbench_rows[i]["key"] for i in unchanged}
    assert len(unchanged) == 284 and changed == {"0", "1", "153", *map(str, range(268, 275))}, changed
    # Their figures come from the same answers, under the earlier release's prefix and label.
    answers = {"sft": ["A short answer."] * 294, "policy": ["Another answer, much like the first."] * 294}
    cut = {model: [False] * 294 for model in answers}
    boot = {"n_bootstrap": 50, "seed": 0}
    july = _earlier(earlier, ifbench_rows, answers, cut, boot, seed=0)
    picked = [ifbench_rows[i] for i in unchanged]
    again = score(earlier.prefix, picked, {m: [a[i] for i in unchanged] for m, a in answers.items()}, "ifbench", boot)
    assert earlier.prefix == "eval/ifbench_2025_07/" and july[f"{earlier.prefix}num_prompts"] == 284
    assert (
        july[f"{earlier.prefix}policy_if_instruction_strict"] == again[f"{earlier.prefix}policy_if_instruction_strict"]
    )
    from rlhf_pipeline.trainers.evaluation.report import benchmark_label

    assert benchmark_label(july, earlier.prefix) == "IFBench, July 2025 rows unchanged (284 of 294)"


def test_a_subset_is_a_seeded_stratified_sample_covering_every_instruction_id_never_the_first_rows():
    from rlhf_pipeline.trainers.evaluation.instructions import (
        BENCHMARKS,
        benchmark_rows,
        ids_covered,
        stratified_sample,
    )

    rows, _ = benchmark_rows(BENCHMARKS["ifbench"])  # sorted by constraint type: its first 60 cover 12 ids
    assert ids_covered(rows[:60]) < 20
    picked = stratified_sample(rows, 60, seed=0)
    assert len(set(picked)) == 60 and ids_covered([rows[i] for i in picked]) == ids_covered(rows)
    assert picked == stratified_sample(rows, 60, seed=0) and picked != stratified_sample(rows, 60, seed=1)
    assert stratified_sample(rows, 1000, seed=0) == list(range(len(rows)))
    # The strata (rows by first id) keep their shares: the largest stratum gets its share of the sample, +-2.
    first = [row["instruction_id_list"][0] for row in rows]
    largest = max(set(first), key=first.count)
    share = first.count(largest) * 60 / len(rows)
    assert abs(sum(1 for i in picked if first[i] == largest) - share) <= 2, (largest, share)


def test_loose_scoring_forgives_a_first_line_and_markdown_as_ifeval_defines_it():
    ids, kwargs = ["detectable_format:title", "punctuation:no_comma"], "[{}, {}]"
    answer = "Sure, here it is:\n<<The park>>\nTrees and a pond."  # the first line holds a comma
    assert ifeval.check(answer, ids, kwargs).followed == [True, False]
    assert ifeval.check(answer, ids, kwargs, loose=True).followed == [True, True]
    quoted = '*"Trees and a pond"*'  # wrapped in quotes inside markdown emphasis: the loose variants drop the '*'
    assert ifeval.check(quoted, ["startend:quotation"], "[{}]").followed == [False]
    assert ifeval.check(quoted, ["startend:quotation"], "[{}]", loose=True).followed == [True]


def test_instruction_level_intervals_resample_prompts_as_a_ratio():
    from rlhf_pipeline.trainers.rewards.metrics import bootstrap_ratio

    # Two prompts: one with 3 instructions all followed, one with 1 not followed: 3 of 4 instructions.
    interval = bootstrap_ratio([3.0, 0.0], [3.0, 1.0], n_bootstrap=2000, seed=0)
    assert interval.mean == 0.75 and interval.n == 2
    # A resample is (a, a), (b, b) or a mix: 1.0, 0.0 or 0.75; nothing else can come out.
    assert interval.low == 0.0 and interval.high == 1.0
    with pytest.raises(ValueError, match="denominators > 0"):
        bootstrap_ratio([1.0], [0.0])


def test_eval_scores_prompts_instructions_strict_and_loose_families_ids_cut_and_the_paired_gain():
    from rlhf_pipeline.trainers.evaluation.instructions import InstructionFollowing, planned, score
    from rlhf_pipeline.trainers.evaluation.report import summary_markdown

    rows = [
        {"prompt": _messages("Describe a park without commas."), "instruction_id_list": NO_COMMA, "kwargs": "[{}]"},
        {"prompt": "Title it and skip commas.", "instruction_id_list": [TITLE, *NO_COMMA], "kwargs": "[{}, {}]"},
    ] * 5
    completions = {
        "sft": ["Trees, a pond.", "<<Park>> trees, a pond."] * 5,  # follows 1 of 3 constraints, no prompt
        "policy": ["Trees and a pond.", "<<Park>> trees and a pond."] * 5,  # follows all
    }
    cut = {"sft": [True, False] * 5, "policy": [False] * 10}
    metrics = score("eval/heldout/", rows, completions, "ifeval", {"n_bootstrap": 200, "seed": 0}, cut)
    assert metrics["eval/heldout/sft_if_prompt_strict"] == 0.0
    assert metrics["eval/heldout/sft_if_instruction_strict"] == 1 / 3
    assert metrics["eval/heldout/policy_if_prompt_strict"] == 1.0
    assert metrics["eval/heldout/sft_if_cut"] == 0.5 and metrics["eval/heldout/policy_if_cut"] == 0.0
    assert (
        metrics["eval/heldout/if_prompt_strict_gain"] == 1.0 and metrics["eval/heldout/if_prompt_strict_gain_low"] > 0
    )
    assert metrics["eval/heldout/if_family/sft/detectable_format"] == 1.0
    assert metrics["eval/heldout/if_family/sft/punctuation"] == 0.0
    assert metrics["eval/heldout/if_instruction/sft/punctuation:no_comma"] == 0.0
    assert metrics["eval/heldout/if_instruction/policy/punctuation:no_comma"] == 1.0
    table = summary_markdown(metrics, [])
    assert "| `punctuation:no_comma` | 0.000 | 1.000 | +1.000 |" in table, table
    expected = planned(InstructionFollowing(ifeval_prompts=0, ifbench_prompts=0), ["sft", "policy"])
    assert expected == {name for name in metrics if "/if_family/" not in name and "/if_instruction/" not in name}


def test_the_gate_may_use_instruction_following_and_only_when_eval_measures_it():
    from pydantic import ValidationError

    from rlhf_pipeline.flows.params import load_params

    gate = "registry.gate_metric=eval/ifbench/if_prompt_strict_gain"
    params = load_params("smollm2", [gate])
    assert params.gate().gate_metric == "eval/ifbench/if_prompt_strict_gain"
    assert "eval/heldout/policy_if_instruction_strict_low" in params.eval_metrics()
    with pytest.raises(ValidationError, match="eval/ifbench/if_prompt_strict_gain"):
        load_params("smollm2", [gate, "eval.instruction_following=null"])


def test_a_stage_that_reads_a_null_dataset_is_refused_with_the_parameters():
    from pydantic import ValidationError

    from rlhf_pipeline.flows.params import load_params

    with pytest.raises(ValidationError, match="data.sft is null and sft reads it.*sft.enabled=false"):
        load_params("smollm2", ["sft.enabled=true"])
    with pytest.raises(ValidationError, match="data.preference is null and dpo reads it"):
        load_params("smollm2", ["algorithm=dpo"])
