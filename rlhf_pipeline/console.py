"""The terminal of `rlhf run` and `rlhf eval`: one bar per training stage, drawn from the trainers' progress records
(`trainers.runtime.progress`), as TRL's caller adds `RichProgressCallback`. Only the CLI imports this module, so nothing
here is in a stage's code version: a change to the display re-keys no stage (docs/ARCHITECTURE.md, "Layers").
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from rlhf_pipeline.trainers.runtime.progress import PROGRESS, TICKS

KEY_METRICS = ("loss", "reward", "accuracy", "kl", "exact_match", "margin")
"""What a stage's bar shows: the first three of these it logs."""
TERMINAL_REFRESH_SECONDS = 0.1
PIPE_REFRESH_SECONDS = 30.0
"""Not a terminal (a pipe, a log file): tqdm writes each refresh as a line of its own, so it refreshes every 30 s
there."""


class ConsoleBars(logging.Handler):
    """Draws one tqdm bar per stage from progress records (step, rate, ETA, key metrics), even where TQDM_DISABLE turns
    the libraries' bars off."""

    def __init__(self, stream=None):
        super().__init__()
        self.stream = stream or sys.stderr
        self.bars: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        progress = getattr(record, "progress", None)
        if progress is None:
            return
        stage, event, step = progress["stage"], progress["event"], progress["step"]
        bar = self.bars.get(stage)
        if event == "begin" or bar is None:
            if bar is not None:
                bar.close()
            bar = self.bars[stage] = self._bar(stage, progress["total"], progress["start"])
        if event == "log":
            shown = [
                (k.rsplit("/", 1)[-1], v) for k, v in progress["values"].items() if k.rsplit("/", 1)[-1] in KEY_METRICS
            ]
            bar.set_postfix_str(" ".join(f"{name}={value:.4g}" for name, value in shown[:3]), refresh=False)
        if step > bar.n:
            bar.update(step - bar.n)
        if event == "end":
            bar.close()
            del self.bars[stage]

    def _bar(self, stage: str, total: int, start: int):
        from tqdm.auto import tqdm

        _keep_progress_lines_off_prefects_console()

        every = TERMINAL_REFRESH_SECONDS if self.stream.isatty() else PIPE_REFRESH_SECONDS
        return tqdm(
            total=total,
            initial=start,
            desc=stage,
            unit="step",
            file=self.stream,
            disable=False,
            dynamic_ncols=True,
            mininterval=every,
        )


class _NotProgress(logging.Filter):
    """Keeps the progress lines off Prefect's console handler (the bar shows them); they still reach the Prefect UI."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name != PROGRESS.name


def install() -> ConsoleBars:
    """Draw the bars on this process's terminal, and keep the library noise a bar replaces off it."""
    handler = ConsoleBars()
    for logger in (PROGRESS, TICKS):
        if not any(isinstance(h, ConsoleBars) for h in logger.handlers):
            logger.addHandler(handler)
    # TRL 1.16's disable_gradient_checkpointing (trl/models/utils.py) reads transformers 5.24's deprecated property on
    # every checkpoint and generation: a FutureWarning we cannot fix at its cause.
    warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    return handler


def _keep_progress_lines_off_prefects_console() -> None:
    """Prefect adds its console handler when a flow starts, so this runs when a stage's bar starts: the bar shows what
    the progress lines say (our handler sees each record before the ones above it)."""
    for handler in logging.getLogger("rlhf_pipeline").handlers + logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler" and not any(
            isinstance(f, _NotProgress) for f in handler.filters
        ):
            handler.addFilter(_NotProgress())


def closing_table(summary: dict) -> str:
    """What a run ends with: each stage, whether it ran or came from the cache, its time; the held-out figures with
    their 95% intervals; then where to look (MLflow, the artifacts, the registry's decision)."""
    metrics, stages = summary["metrics"], summary.get("stages", {})
    lines = ["== finished ==", "", f"{'stage':16} {'state':10} {'seconds':>8}  artifact"]
    for stage, uri in summary["artifacts"].items():
        info = stages.get(stage, {})
        seconds = f"{info['seconds']:.1f}" if info.get("seconds") is not None else "-"
        lines.append(f"{stage:16} {info.get('state') or '-':10} {seconds:>8}  {uri}")  # a resolved input has no state
    from rlhf_pipeline.trainers.evaluation.instructions import BENCHMARKS
    from rlhf_pipeline.trainers.evaluation.report import benchmark_label
    from rlhf_pipeline.trainers.evaluation.stage import HELDOUT as held

    def section(title: str, prefix: str, rows: tuple[tuple[str, str], ...]) -> None:
        """The rows `metrics` has under `prefix`, each with its 95% interval where it has one."""
        present = [(label, name) for label, name in rows if prefix + name in metrics]
        if not present:
            return
        lines.extend(["", f"{title:38} {'value':>8}  95% interval"])
        for label, name in present:
            low, high = metrics.get(f"{prefix}{name}_low"), metrics.get(f"{prefix}{name}_high")
            sign = "+" if "gain" in name else ""
            interval = f"[{low:{sign}.3f}, {high:{sign}.3f}]" if low is not None and high is not None else ""
            lines.append(f"{label:38} {metrics[prefix + name]:{sign}8.3f}  {interval}")

    section(
        f"held-out ({int(metrics.get(held + 'num_prompts', 0))} prompts)",
        held,
        (
            ("exact match: policy", "policy_exact_match"),
            ("exact match: sft", "sft_exact_match"),
            ("exact match: base", "base_exact_match"),
            ("exact match: gain over sft", "exact_match_gain_vs_sft"),
            ("gold: policy", "policy_gold"),
            ("gold: sft", "sft_gold"),
            ("gold: gain over sft", "gold_gain_vs_sft"),
            ("instructions, prompt-level: policy", "policy_if_prompt_strict"),
            ("instructions, prompt-level: start", "sft_if_prompt_strict"),
            ("instructions, prompt-level: gain", "if_prompt_strict_gain"),
            ("instructions, each: policy", "policy_if_instruction_strict"),
            ("instructions, each: start", "sft_if_instruction_strict"),
            ("win rate vs sft (reward model)", "win_rate_vs_sft"),
            ("win rate vs champion", "win_rate_vs_champion"),
            ("judge win rate vs sft", "judge_win_rate_vs_sft"),
            ("reward: policy", "policy_mean_reward"),
            ("reward: sft", "sft_mean_reward"),
            ("KL(policy || sft), nats", "kl_to_sft"),
        ),
    )
    for benchmark in BENCHMARKS.values():  # as the model cards report them: strict and loose, start vs policy
        rows = tuple(
            (f"{level.replace('_', ' ')}: {label}", f"{model}_if_{level}")
            for level in ("prompt_strict", "instruction_strict", "prompt_loose", "instruction_loose")
            for label, model in (("start", "sft"), ("policy", "policy"), ("champion", "champion"))
        )
        gains = (("prompt strict: gain", "if_prompt_strict_gain"), ("prompt loose: gain", "if_prompt_loose_gain"))
        cut = tuple(
            (f"cut by the budget: {label}", f"{model}_if_cut")
            for label, model in (("start", "sft"), ("policy", "policy"))
        )
        section(benchmark_label(metrics, benchmark.prefix), benchmark.prefix, rows + gains + cut)
    warnings = summary.get("warnings") or []
    lines.append(
        f"{'hacking warnings':34} {len(warnings) if warnings else int(metrics.get(held + 'hacking_warnings', 0)):8d}"
    )
    lines += [f"  ! {w}" for w in warnings]
    lines += ["", f"MLflow run: {summary['mlflow']}"]
    if summary.get("registry"):
        r = summary["registry"]
        lines.append(
            f"Registry: {r['model_name']} v{r['version']} is candidate; champion "
            f"{'-> v' + str(r['version']) if r['promoted'] else 'unchanged'} ({r['reason']})"
        )
    return "\n".join(lines)
