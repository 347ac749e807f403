"""The TRL-backed stages: sft, rm, dpo, kto, orpo and the online pair grpo and rloo (online.py), the training loop they
share (loop.py) and the held-out probes of online training (probes.py). Imports rewards/, models/, data.py, config.py
and runtime/; never ppo/, pairs/ or evaluation/."""
