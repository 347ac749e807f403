"""The run's DAG as a value: `plan(params)` lists the steps one run submits, in order, each naming the earlier steps
whose artifacts it takes. The flow body only submits them (flows/rlhf.py); `rlhf params --plan` prints them.

    data -> sft -> [pairs] -> [rm] -> <algorithm> -> ([pairs@r] -> [rm@r] -> <algorithm>@r) x rounds -> eval
         -> [registry]

What runs: the stages the parameters call for (`stages`); who feeds whom: the table's `upstream` (what a stage may
take), narrowed to what this run uses (`upstream`): the reward model only where a stage scores with it, the made pairs
only where a stage trains on them. The order of the first pairs and the reward model follows the labeller: the reward
model that labels the pairs trains first, on the given ones. A feedback round samples the last policy, labels pairs,
and trains again: through a new reward model for an online algorithm, on the pairs directly for an offline one
(docs/ARCHITECTURE.md, "The run's plan").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlhf_pipeline.tasks.stages import BY_NAME, POLICY_STAGE, STAGES

if TYPE_CHECKING:
    from rlhf_pipeline.flows.params import RunSettings


@dataclass(frozen=True)
class Step:
    """One task the flow submits: a stage of the table, in a feedback round or not."""

    name: str
    """How later steps name it: the stage, and its feedback round after `@` (`pairs@1`, `dpo@2`)."""
    stage: str
    inputs: dict[str, str] = field(default_factory=dict)
    """The stage's inputs (`sft`, `rm`, `policy`, ...) -> the earlier step whose artifact each is."""
    after: str | None = None
    """The earlier step it waits for besides its inputs: device stages train one at a time, in this order."""
    round: int = 0
    """The feedback round (0: the first pass)."""
    keep: str | None = None
    """A feedback round's pairs: the earlier pairs step whose pairs it keeps beside its own (`feedback.keep_pairs`)."""


def plan(params: RunSettings) -> list[Step]:
    """The steps of one run, in the order the flow submits them."""
    steps = [Step("data", "data")]
    latest = {"data": "data"}

    def add(stage: str, after: str | None, inputs: dict[str, str] | None = None, round_: int = 0, keep=None) -> str:
        name = f"{stage}@{round_}" if round_ else stage
        if inputs is None:
            inputs = {input_: latest[input_] for input_ in upstream(params, stage)}
        steps.append(Step(name, stage, inputs, after, round_, keep))
        latest[stage] = name
        return name

    sft = add("sft", after="data")
    labels_with_rm = params.config("pairs").labeller == "reward_model"
    pairs = add("pairs", after=sft) if makes_pairs(params) and not labels_with_rm else None
    rm = add("rm", after=pairs or sft) if needs_reward_model(params) else None
    if makes_pairs(params) and labels_with_rm:  # the reward model labels: it trains first, on the given pairs
        pairs = add("pairs", after=rm)
    policy = add(params.algorithm, after=pairs or rm or sft)
    online = BY_NAME[params.algorithm].online
    for round_ in range(1, params.feedback.rounds + 1):
        keep = latest.get("pairs") if params.feedback.keep_pairs else None
        sampled = {"data": "data", "sft": sft, "policy": policy, **({"rm": rm} if labels_with_rm and rm else {})}
        made = add("pairs", after=policy, inputs=sampled, round_=round_, keep=keep)
        start = sft if params.feedback.from_sft else policy
        if online:
            rm = add("rm", after=made, inputs={"data": "data", "sft": sft, "pairs": made}, round_=round_)
            inputs = {"data": "data", "sft": start, "rm": rm}
        else:
            inputs = {"data": "data", "sft": start, "pairs": made}
        policy = add(params.algorithm, after=rm if online else made, inputs=inputs, round_=round_)
    evaluated = {"data": "data", "sft": sft, "policy": policy}
    evaluated |= {"rm": rm} if rm and "rm" in upstream(params, "eval") else {}
    evaluated |= {"pairs": latest["pairs"]} if "pairs" in latest else {}
    add("eval", after=policy, inputs=evaluated)
    if params.config("registry").enabled:
        built = {stage: latest[stage] for stage in stages(params) if stage in latest}
        add("registry", after=None, inputs={"policy": policy, "report": latest["eval"], **built})
    return steps


def stages(params: RunSettings) -> list[str]:
    """The stages this run builds, in the table's order: data, sft, pairs and rm (when used), the algorithm's, eval,
    registry (when enabled)."""
    wanted = {"data", "sft", params.algorithm, "eval"}
    if makes_pairs(params) or params.feedback.rounds:
        wanted.add("pairs")
    if needs_reward_model(params):
        wanted.add("rm")
    if params.config("registry").enabled:
        wanted.add("registry")
    return [stage.name for stage in STAGES if stage.name in wanted]


def upstream(params: RunSettings, stage: str) -> tuple[str, ...]:
    """The stages whose artifacts `stage` takes in this run: the table's, the policy stage named, and the reward model
    only where the stage uses it (the online stages' rewards, eval's `use_reward_model`, the pairs' labeller)."""
    row = BY_NAME[stage]
    if stage == "eval":
        uses_reward_model = params.config("eval").use_reward_model
    elif stage == "pairs":
        uses_reward_model = params.config("pairs").labeller == "reward_model"
    else:
        uses_reward_model = row.online and params.rewards.uses_reward_model
    names = [params.algorithm if name == POLICY_STAGE else name for name in row.upstream]
    return tuple(
        name for name in names if (name != "rm" or uses_reward_model) and (name != "pairs" or pairs_feed(params, stage))
    )


def makes_pairs(params: RunSettings) -> bool:
    """The `pairs` stage runs before the policy: it is on and a stage of this run reads pairs."""
    readers = (params.algorithm, *(("rm",) if needs_reward_model(params) else ()))
    return params.config("pairs").enabled and any(pairs_feed(params, stage) for stage in readers)


def pairs_feed(params: RunSettings, stage: str) -> bool:
    """Whether `stage` trains on the made pairs: a pair-reading stage, except the reward model that labels them."""
    pairs = params.config("pairs")
    if not pairs.enabled or "pairs" not in BY_NAME[stage].upstream:
        return False
    return not (stage == "rm" and pairs.labeller == "reward_model")


def needs_reward_model(params: RunSettings) -> bool:
    """The rm stage runs when evaluation, the online stage's rewards or the pairs' labeller use it."""
    online_uses_it = BY_NAME[params.algorithm].online and params.rewards.uses_reward_model
    pairs = params.config("pairs")
    labels_with_it = (pairs.enabled or params.feedback.rounds > 0) and pairs.labeller == "reward_model"
    return online_uses_it or params.config("eval").use_reward_model or labels_with_it


def describe(steps: list[Step]) -> str:
    """The plan as `rlhf params --plan` and `rlhf check` print it: one line per step, its inputs and what it waits
    for."""
    lines = []
    for step in steps:
        inputs = ", ".join(f"{name}={source}" if name != source else name for name, source in step.inputs.items())
        waits = f"  (after {step.after})" if step.after and step.after not in step.inputs.values() else ""
        kept = f"  (keeps {step.keep})" if step.keep else ""
        lines.append(f"{step.name:12} <- {inputs or '-'}{waits}{kept}")
    return "\n".join(lines)


def last_policy_and_report(steps: list[Step]) -> tuple[str, str]:
    """The steps whose artifacts the run ends with: the last policy, and its evaluation."""
    report = next(step for step in reversed(steps) if step.stage == "eval")
    return report.inputs["policy"], report.name


def check_adapter_handoff(params: RunSettings) -> None:
    """sft that keeps its LoRA adapter hands it on merged or stacked: each stage of the run that starts from sft's
    model says which, before anything trains."""
    sft = params.config("sft").lora
    if sft.handoff is not None:
        raise ValueError("sft.lora.handoff: sft starts from the base model; handoff is chosen by the stages after it")
    if not (sft.enabled and sft.keep_adapter):
        return
    for stage in stages(params):
        lora = params.config(stage).adapters()
        if lora is None or "sft" not in BY_NAME[stage].upstream:
            continue
        if lora.handoff is None:
            raise ValueError(
                f"sft keeps its LoRA adapter (sft.lora.keep_adapter=true): choose how {stage} continues from it: "
                f"{stage}.lora.handoff=merge "
                "(folded into the weights) or stack (the adapter trains on, a frozen copy is the reference)"
            )
        if stage == "rm" and lora.handoff == "stack":
            raise ValueError(
                "rm.lora.handoff=stack: the reward model starts from sft's adapter merged (a score head is added): "
                "use merge"
            )
