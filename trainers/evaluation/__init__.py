"""The `eval` stage: the stage itself (stage.py), greedy answers and their cache (answers.py), IFEval and IFBench
scoring (instructions.py), the report (report.py) and its plots (plots.py). Imports algorithms/ and everything below
it.

Tested through other modules' tests: answers.py and report.py (tests/trainers/evaluation/test_stage.py), instructions.py
(tests/trainers/rewards/test_ifeval.py)."""
