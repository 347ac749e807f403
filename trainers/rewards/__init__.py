"""What scores a completion: the weighted mix of reward model and functions (mix.py), reward-model ensembles
(ensemble.py), judges (judges.py), metrics and intervals (metrics.py), IFEval's checkers (ifeval.py), the bundled task's
verifier (sort_task.py), and the held-out probes that score a policy while it trains, with keep_best (probes.py).
Imports models/, data.py, config.py and runtime/.

Tested through other modules' tests: probes.py (tests/trainers/algorithms/test_online.py), sort_task.py
(tests/trainers/rewards/test_mix.py)."""
