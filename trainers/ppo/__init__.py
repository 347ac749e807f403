"""`ppo`, ours (TRL dropped its PPO): the stage's config and loop (train.py), its losses and advantages (losses.py) and
its ranks (parallel.py). Imports algorithms/ and everything below it."""
