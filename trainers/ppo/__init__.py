"""`ppo`, ours (TRL dropped its PPO): the loop (train.py: set up, the phases of an update, publish), its config
(config.py), rollouts and their log-probabilities and values (rollout.py), the models and optimizer (models.py), the
losses and advantages (losses.py) and the ranks and checkpoints (parallel.py). Imports algorithms/ and everything
below it.

Tested through other modules' tests: config.py, models.py and parallel.py (tests/trainers/ppo/test_train.py)."""
