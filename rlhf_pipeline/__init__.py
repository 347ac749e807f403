"""rlhf-pipeline: RLHF post-training as Prefect flows (data -> sft -> rm -> dpo | kto | orpo | grpo | rloo | ppo -> eval
-> registry).

The one import package of the distribution. Its subpackages are the repository's top-level folders, linked here
(`rlhf_pipeline/flows` -> `../flows`, ...), so the editable install, the wheel and static tools all see the same names.
The application (`cli`, `check`, `console`, `python -m rlhf_pipeline`) sits on top of the layers described in
docs/ARCHITECTURE.md ("Layers"). Start at `rlhf_pipeline.tasks.stages`, the table of stages.
"""
