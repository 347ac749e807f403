"""The TRL-backed stages: sft.py, rm.py, dpo.py, kto.py, orpo.py, and the online pair grpo.py and rloo.py (online.py);
the fields they share (fields.py) and the training loop (loop.py). Imports rewards/, models/, data.py, config.py and
runtime/; never ppo/, pairs/ or evaluation/."""
