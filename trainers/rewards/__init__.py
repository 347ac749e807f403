"""What scores a completion: the weighted mix of reward model and functions (mix.py), reward-model ensembles
(ensemble.py), judges (judges.py), metrics and intervals (metrics.py), IFEval's checkers (ifeval.py) and the bundled
task's verifier (sort_task.py). Imports models/, data.py, config.py and runtime/."""
