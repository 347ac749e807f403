"""People label pairs in Prefect: the flow run waits with a typed form, outside every task, so no device slot is held.

`ask_people` shows the pairs still unlabelled as a table artifact (`rlhf-pairs-to-label`: pair, prompt, answer A,
answer B) and as a file beside the labels store, then waits for a `PairLabels` form:

- a deployment's run suspends (`suspend_flow_run`): its process exits and the worker is free; resuming reschedules
  the run, which re-runs from the top (every stage before is Cached) and gets the form's input back here;
- any other run (`rlhf run`) pauses (`pause_flow_run`): it polls the API until it is resumed.

Labels come back through the Prefect UI's "Resume" form (one A/B/tie/skip choice per pair), through
`rlhf label <flow-run-id>` (a file, or pair=label items; Prefect 3.9's CLI has no resume command), or as a labels file
named in the form. Each answer is merged into the labels store at once (partial labels are kept); with `finish`
unset the run asks again for the pairs still unlabelled. A wait that times out fails the run saying so; the next run
finds the samples cached and the labels given so far, and asks only for the rest.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhf_pipeline.tasks.labels import LabelsError, read_labels_file, read_store, write_store
from rlhf_pipeline.tasks.orchestration.stage_task import prefect_log
from rlhf_pipeline.tasks.store.artifacts import ArtifactRef
from rlhf_pipeline.trainers.pairs.stage import LABELS, PeopleConfig, people_pairs, read_samples

ARTIFACT_KEY = "rlhf-pairs-to-label"
SKIP = "skip"
PREVIEW = 120


class LabelsTimedOut(RuntimeError):
    """Nobody labelled the pairs within `pairs.people.timeout_s`."""


def field_name(pair: int) -> str:
    return f"pair_{pair}"


def text_of(value: Any) -> str:
    """A prompt or answer as people read it: the text, or the messages' contents."""
    if isinstance(value, list):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in value if isinstance(m, dict))
    return str(value)


def _short(value: Any) -> str:
    text = " ".join(text_of(value).split())
    return text if len(text) <= PREVIEW else text[: PREVIEW - 1] + "…"


def labels_form(pending: list[dict]):
    """The typed form people fill in: one A/B/tie/skip choice per pending pair (its prompt and answers in the
    description), a labels file instead, and whether to finish with what is labelled."""
    from typing import Literal

    from prefect.input import RunInput
    from pydantic import Field, create_model

    choice = Literal[(*LABELS, SKIP)]
    fields: dict[str, Any] = {
        field_name(pair["pair"]): (
            choice,
            Field(
                SKIP,
                title=f"Pair {pair['pair']}",
                description=f"{_short(pair['prompt'])} | A: {_short(pair['a'])} | B: {_short(pair['b'])}",
            ),
        )
        for pair in pending
    }
    fields["labels_file"] = (
        str | None,
        Field(
            None,
            description='A JSONL file of labels on the worker\'s disk instead, one per line: {"pair": 0, "label": "A"} '
            '(label "A", "B", "tie" or null).',
        ),
    )
    fields["finish"] = (
        bool,
        Field(
            True,
            description="Train on what is labelled now (pairs left on skip are dropped); off: keep these labels and "
            "ask again for the rest.",
        ),
    )
    form = create_model("PairLabels", __base__=RunInput, **fields)
    form._description = description(pending)  # shown above the form in the UI's Resume dialog (markdown)
    return form


def description(pending: list[dict]) -> str:
    """The pending pairs as a markdown table: what a person reads before choosing."""

    def cell(value: Any) -> str:
        return text_of(value).replace("|", "\\|").replace("\n", "<br>")

    rows = "".join(f"| {p['pair']} | {cell(p['prompt'])} | {cell(p['a'])} | {cell(p['b'])} |\n" for p in pending)
    return (
        f"**{len(pending)} pairs to label**: for each, choose the better answer, A or B (tie: neither; skip: later)."
        "\n\n"
        f"| pair | prompt | answer A | answer B |\n|---|---|---|---|\n{rows}"
    )


def answered(form: Any, shown: list[dict]) -> dict[int, str]:
    """The labels a submitted form gives: its choices (skip gives none), then its labels file's."""
    given = {
        pair["pair"]: getattr(form, field_name(pair["pair"]), SKIP)
        for pair in shown
        if getattr(form, field_name(pair["pair"]), SKIP) != SKIP
    }
    if getattr(form, "labels_file", None):
        # A path typed into the form: read_labels_file refuses one outside the folders the worker lets runs read
        from_file = read_labels_file(Path(form.labels_file).expanduser(), {p["pair"]: p["hash"] for p in shown})
        given |= {pair: label for pair, label in from_file.items() if label is not None}
    return given


def ask_people(samples: ArtifactRef, store: Path, people: PeopleConfig) -> None:
    """Wait for people's labels of the pairs made from `samples`, merging each answer into `store`, until every pair
    is labelled or an answer says finish. Raises LabelsTimedOut after `people.timeout_s`."""
    from prefect.exceptions import FlowPauseTimeout
    from prefect.flow_runs import pause_flow_run, suspend_flow_run
    from prefect.runtime import deployment

    shown = people_pairs(read_samples(samples.path), people.max_pairs)
    hashes = {pair["pair"]: pair["hash"] for pair in shown}
    deployed = bool(deployment.get_id())  # suspending needs a deployment to run the flow again
    for attempt in range(len(shown) + 1):
        labels, finished = read_store(store, hashes)
        pending = [pair for pair in shown if labels.get(pair["pair"]) is None]
        if finished or not pending:
            if not finished:
                write_store(store, labels, True, hashes)
            return
        to_label = store.with_suffix(".to_label.jsonl")
        to_label.parent.mkdir(parents=True, exist_ok=True)
        to_label.write_text("".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pending), encoding="utf-8")
        _show(pending, len(shown), to_label)
        form = labels_form(pending)
        key = f"labels-{samples.key[:16]}-{attempt}"  # the same on a suspended run's re-run: its input comes back
        prefect_log(
            f"pairs: waiting up to {people.timeout_s:.0f}s for labels of {len(pending)} of {len(shown)} pairs "
            f"({to_label}); {'suspending' if deployed else 'pausing'} the flow run: resume it with the form in the "
            "Prefect UI or `rlhf label <flow-run-id> --file <labels.jsonl>`"
        )
        try:
            if deployed:
                got = suspend_flow_run(wait_for_input=form, timeout=int(people.timeout_s), key=key)
            else:
                got = pause_flow_run(wait_for_input=form, timeout=int(people.timeout_s), poll_interval=5, key=key)
        except FlowPauseTimeout as exc:
            message = (
                f"pairs: no labels came within pairs.people.timeout_s={people.timeout_s:.0f}s for {len(pending)} of "
                f"{len(shown)} pairs ({to_label}); the labels given so far are kept in {store}. Run again to be asked "
                "for the rest, or with pairs.people.labels_file=<labels.jsonl> (nothing is sampled again)"
            )
            _fail_saying(message)
            raise LabelsTimedOut(message) from exc
        try:
            given = answered(got, shown)
        except (LabelsError, ValueError) as exc:  # a bad labels file typed into the form: nothing is stored
            prefect_log(f"pairs: the labels were refused, none stored: {exc}")
            continue
        merged, finish = labels | given, bool(getattr(got, "finish", True))
        if finish and not any(label in ("A", "B") for label in merged.values()):
            # Finished with nothing to train on would stop every later run of these samples: not a finish
            prefect_log(
                "pairs: 'finish' came with no pair labelled A or B, so nothing could be trained on: not finished; "
                "asking again (label at least one pair, or cancel the run)"
            )
            finish = False
        write_store(store, merged, finish, hashes)
        prefect_log(f"pairs: {len(given)} labels received ({len(merged)} of {len(shown)} pairs labelled)")
    raise RuntimeError(f"pairs: asked for labels {len(shown) + 1} times without an answer that labels a pair")


def _fail_saying(message: str) -> None:
    """The run's final state says why: the server has already failed the expired pause with "The flow was failed and
    never resumed.", and the engine cannot change a final state, so the state is replaced, forced, with ours."""
    from prefect import get_client
    from prefect.runtime import flow_run
    from prefect.states import Failed

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.get_id(), Failed(name="TimedOut", message=message), force=True)


def _show(pending: list[dict], total: int, to_label: Path) -> None:
    """The pending pairs as a table artifact on the flow run (the UI's Artifacts tab)."""
    from prefect.artifacts import create_table_artifact

    create_table_artifact(
        key=ARTIFACT_KEY,
        table=[
            {
                "pair": pair["pair"],
                "prompt": text_of(pair["prompt"]),
                "answer A": text_of(pair["a"]),
                "answer B": text_of(pair["b"]),
                "hash": pair["hash"],
            }
            for pair in pending
        ],
        description=(
            f"{len(pending)} of {total} pairs to label: choose A, B or tie for each in the flow run's Resume form "
            f"(also in {to_label})."
        ),
    )


def waiting_pairs(flow_run_id: str) -> dict[int, str]:
    """The pairs a paused or suspended flow run waits for labels of (pair -> hash), from its table artifact;
    LabelsError where there is no such run or it does not wait."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import ArtifactSort
    from prefect.exceptions import ObjectNotFound

    try:
        run_id = UUID(flow_run_id)
    except ValueError:
        raise LabelsError(f"{flow_run_id!r} is not a flow run id (a UUID, as the Prefect UI shows it)") from None
    with get_client(sync_client=True) as client:
        try:
            run = client.read_flow_run(run_id)
        except ObjectNotFound:
            raise LabelsError(f"flow run {flow_run_id}: no such flow run on {client.api_url}") from None
        if run.state is None or not run.state.is_paused():
            state = run.state.name if run.state else "not started"
            raise LabelsError(f"flow run {flow_run_id} ({run.name}) is not waiting for labels: it is {state}")
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])),
            sort=ArtifactSort.UPDATED_DESC,
            limit=1,
        )
    if not artifacts:
        raise LabelsError(f"flow run {flow_run_id} ({run.name}) is paused, but not for labels of pairs")
    table = json.loads(artifacts[0].data) if isinstance(artifacts[0].data, str) else artifacts[0].data
    return {int(row["pair"]): str(row.get("hash")) for row in table}


def resume_with_labels(flow_run_id: str, labels: dict[int, str], finish: bool = True) -> None:
    """`rlhf label`: resume a waiting flow run with labels, as the form would."""
    from uuid import UUID

    from prefect.flow_runs import resume_flow_run

    run_input: dict[str, Any] = {field_name(pair): label for pair, label in labels.items()}
    resume_flow_run(UUID(flow_run_id), run_input={**run_input, "finish": finish})
