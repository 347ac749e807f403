"""Every run parameter that names a cluster, a file outside the run state or code is the worker's operator's to allow
(flows/ownership.py): the schema holds no such field that `OWNED` misses, docs/SERVICE.md lists them all, and a value
the worker does not allow is refused with the parameters, before a stage runs."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from rlhf_pipeline.flows.evaluate import EvalParams
from rlhf_pipeline.flows.ownership import OWNED, REFUSED_TRL, owner
from rlhf_pipeline.flows.params import PipelineParams, load_params
from rlhf_pipeline.trainers.algorithms.fields import MANAGED_ARGUMENTS, trl_config_fields
from rlhf_pipeline.trainers.runtime.trust import PATHS_ENV, RAY_ADDRESSES_ENV, REMOTE_CODE_ENV

ROOT = Path(__file__).resolve().parents[2]
# fmt: off
ADDRESS_WORDS = {
    "path", "file", "dir", "address", "url", "uri", "host", "port", "endpoint", "hub", "remote", "server", "factory",
    "callbacks", "function", "judge", "engine", "preset", "template", "metrics", "deepspeed", "fsdp", "push", "resume",
    "init", "accelerator",
}
# fmt: on
"""Words of a field's name that suggest it names something outside the run."""
MODELS = {"policy", "sft_model", "reward_model"}  # `rlhf eval`'s models
NAMES_NOTHING_OUTSIDE = {
    "*.judge.template": "the judge's prompt text",
}
"""Fields whose names have such a word but whose values name nothing outside the run."""
# fmt: off
TRL_NAMES_NOTHING_OUTSIDE = {
    "activation_checkpointing_kwargs", "chat_template_kwargs", "dataset_kwargs", "eos_token", "pad_token",
    "generation_kwargs", "gradient_checkpointing_kwargs", "length_column_name", "liger_kernel_config",
    "lr_scheduler_kwargs", "parallelism_config", "run_name", "transformers_continuous_batching_config", "fsdp",
    "model_init_kwargs_for_ref", "batch_eval_metrics", "include_for_metrics", "skip_memory_metrics",
    "vllm_server_timeout",
}
# fmt: on
TRL_CONFIGS = ("SFTConfig", "RewardConfig", "DPOConfig", "KTOConfig", "experimental.orpo.ORPOConfig", "GRPOConfig")


def fields(model: type[BaseModel], prefix: str = "") -> typing.Iterator[str]:
    """Every leaf field's dotted name; a block, a list of blocks and an optional block are walked into."""
    for name, info in model.model_fields.items():
        inner = [
            a for a in (info.annotation, *_args(info.annotation)) if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if inner:
            yield from fields(inner[0], f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def _args(annotation) -> list:
    found = []
    for arg in typing.get_args(annotation):
        found += [arg, *_args(arg)]
    return found


def address_like(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last in MODELS or bool(set(last.split("_")) & ADDRESS_WORDS)


@pytest.mark.parametrize("params", [PipelineParams, EvalParams])
def test_every_address_like_field_of_the_parameters_is_owned_or_said_to_name_nothing_outside(params):
    unlisted = [
        name
        for name in fields(params)
        if address_like(name)
        and owner(name) is None
        and not any(re.fullmatch(p.replace(".", r"\.").replace("*", ".*"), name) for p in NAMES_NOTHING_OUTSIDE)
    ]
    assert unlisted == [], "fields that may name a host, a file or code: add them to flows/ownership.py's OWNED"
    assert "launch.ray_address" in list(fields(PipelineParams))  # the walk reaches the blocks


# fmt: off
SINKS = {
    "from_pretrained", "load_dataset", "open", "read_text", "read_bytes", "load_file", "safe_open",
    "set_attn_implementation", "import_module", "import_object", "hf_hub_download", "snapshot_download", "urlopen",
}
# fmt: on
"""Calls that load a file, import code, fetch from a hub or connect (and `ray.init`): where a value names something
outside the run."""
REACH_A_SINK_AND_NAME_NOTHING_OUTSIDE = {
    "name": "a hub dataset's configuration, within the dataset `path` names",
    "split": "a split of the dataset `path` names",
    "revision": "a revision of the hub repository its block names (the worker's HF_ENDPOINT serves it)",
    "dtype": "the precision weights load in",
    "handoff": "how an adapter is handed to the next stage ('merge' or 'adapter')",
    "quantization": "how weights are quantised on load",
    "kwargs": "keyword arguments of a callback the operator allowed (`*.callbacks.path`)",
}
"""Fields whose values reach a sink (`SINKS`) but name nothing outside the run, by their field's last name."""
PRODUCT = ("rlhf_pipeline", "trainers", "tasks", "flows", "validators", "deployments")


def sink_names(source: str) -> set[str]:
    """The names (attributes, variables, keywords) in the arguments of every sink call of `source`: what reaches a
    load, an import, a fetch or a connection."""
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        ray_init = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "ray"
        if name not in SINKS and not (ray_init and name == "init"):
            continue
        found |= {keyword.arg for keyword in node.keywords if keyword.arg}
        for part in [*node.args, *(keyword.value for keyword in node.keywords)]:
            for sub in ast.walk(part):
                if isinstance(sub, ast.Attribute):
                    found.add(sub.attr)
                elif isinstance(sub, ast.Name):
                    found.add(sub.id)
    return found


def unowned_sink_fields(params: type[BaseModel], reached: set[str]) -> list[str]:
    return [
        name
        for name in fields(params)
        if name.rsplit(".", 1)[-1] in reached
        and owner(name) is None
        and name.rsplit(".", 1)[-1] not in REACH_A_SINK_AND_NAME_NOTHING_OUTSIDE
    ]


@pytest.mark.parametrize("params", [PipelineParams, EvalParams])
def test_every_field_whose_value_reaches_a_load_an_import_a_fetch_or_a_connection_is_owned(params):
    """Found by what the product code does with a field, not by words in its name."""
    reached = set().union(*(sink_names(path.read_text()) for d in PRODUCT for path in (ROOT / d).rglob("*.py")))
    assert {"attn_implementation", "name_or_path", "path", "trust_remote_code"} <= reached  # the scan sees loads
    assert unowned_sink_fields(params, reached) == [], "add them to flows/ownership.py's OWNED"
    # A new field that reaches a sink, planted: the scan finds it.
    planted = "model = AutoModel.from_pretrained(cfg.name_or_path, kernel_source=cfg.kernel_source)"

    class Planted(params):  # type: ignore[misc, valid-type]
        kernel_source: str | None = None

    assert unowned_sink_fields(Planted, reached | sink_names(planted)) == ["kernel_source"]


def test_an_attention_that_runs_hub_code_is_refused_unless_the_operator_allows_its_repository(monkeypatch):
    """`*.attn_implementation` may name a Hub kernel, whose code transformers downloads and runs where the `kernels`
    package is installed, or a FlashAttention version whose missing package falls back to kernels-community's build."""
    import transformers.utils

    monkeypatch.setattr(transformers.utils, "is_kernels_available", lambda: True)  # as where `kernels` is installed
    monkeypatch.delenv(REMOTE_CODE_ENV, raising=False)
    kernel = "sft.attn_implementation=my-org/attention@v1:forward"
    with pytest.raises(ValidationError, match=rf"'my-org/attention' is not allowed on this worker.*{REMOTE_CODE_ENV}"):
        load_params("tiny", [kernel])
    with pytest.raises(ValidationError, match=r"kernels-community/"):
        load_params("tiny", ["grpo.attn_implementation=flash_attention_2"])  # flash-attn is not installed here
    monkeypatch.setenv(REMOTE_CODE_ENV, "my-org/*")
    assert load_params("tiny", [kernel]).sft.attn_implementation == "my-org/attention@v1:forward"
    assert load_params("tiny", ["sft.attn_implementation=sdpa"])  # installed code: nothing to allow


def test_every_trl_argument_a_run_could_set_that_names_a_host_a_file_or_code_is_refused():
    names = set().union(*(trl_config_fields(config) for config in TRL_CONFIGS))
    suspect = {name for name in names if set(name.split("_")) & (ADDRESS_WORDS | {"token", "config", "kwargs"})}
    assert suspect - REFUSED_TRL - MANAGED_ARGUMENTS - TRL_NAMES_NOTHING_OUTSIDE == set()
    assert REFUSED_TRL <= names, "a refused name TRL no longer has"


def test_the_operators_table_in_docs_lists_every_owned_parameter():
    service = (ROOT / "docs" / "SERVICE.md").read_text()
    missing = [pattern for pattern in OWNED if f"`{pattern}`" not in service]
    assert missing == []


def test_a_ray_cluster_the_operator_did_not_list_is_refused_and_a_listed_one_or_ray_address_is_not(monkeypatch):
    monkeypatch.delenv(RAY_ADDRESSES_ENV)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    foreign = "launch.ray_address=ray://cluster.elsewhere:10001"
    with pytest.raises(ValidationError, match=f"not allowed on this worker.*{RAY_ADDRESSES_ENV}.*now: none"):
        load_params("tiny", [foreign])
    monkeypatch.setenv(RAY_ADDRESSES_ENV, "ray://ours:10001,ray://cluster.elsewhere:10001")
    assert load_params("tiny", [foreign]).launch.ray_address == "ray://cluster.elsewhere:10001"
    monkeypatch.setenv(RAY_ADDRESSES_ENV, "ray://ours:10001")
    with pytest.raises(ValidationError, match="now: ray://ours:10001"):
        load_params("tiny", [foreign])
    monkeypatch.setenv("RAY_ADDRESS", "ray://cluster.elsewhere:10001")  # the worker's own cluster
    assert load_params("tiny", [foreign])


def test_a_file_outside_the_allowed_folders_is_refused_whichever_field_names_it(tmp_path, monkeypatch):
    outside, inside = tmp_path / "outside", tmp_path / "inside"
    outside.mkdir(), inside.mkdir()
    (outside / "rows.jsonl").write_text('{"text": "a"}\n')
    (inside / "rows.jsonl").write_text('{"text": "a"}\n')
    (inside / "link.jsonl").symlink_to(outside / "rows.jsonl")  # a link out of an allowed folder
    monkeypatch.setenv(PATHS_ENV, str(inside))
    for given in (
        f"data.sft.path={outside / 'rows.jsonl'}",
        f"data.sft.path={outside}/*.jsonl",
        f"data.sft.path={outside}",
        f"data.sft.path={inside / 'link.jsonl'}",
        f"data.sft.path={inside}",  # the folder holds the link
        f"model.name_or_path={outside}",
        f"model.chat_template={outside / 'rows.jsonl'}",
        f"pairs.people.labels_file={outside / 'rows.jsonl'}",
        f"launch.engine={outside / 'rows.jsonl'}",
        f"eval.judge={{path: {outside}}}",
    ):
        with pytest.raises(ValidationError, match=f"is outside the folders a run may read.*{PATHS_ENV}"):
            load_params("tiny", [given])
    (inside / "link.jsonl").unlink()
    assert load_params("tiny", [f"data.sft.path={inside / 'rows.jsonl'}"])
    assert load_params("tiny", [f"data.sft.path={inside}/*.jsonl"])
    assert load_params("smollm2")  # bundled files, a package's GGUF and hub ids are no files of the run's choosing
    monkeypatch.setenv(PATHS_ENV, "*")
    assert load_params("tiny", [f"data.sft.path={outside / 'rows.jsonl'}"])
    # Unset: the worker's working directory.
    monkeypatch.delenv(PATHS_ENV)
    monkeypatch.chdir(inside)
    assert load_params("tiny", ["data.sft.path=rows.jsonl"])
    with pytest.raises(ValidationError, match="now: unset, so the working directory"):
        load_params("tiny", [f"data.sft.path={outside / 'rows.jsonl'}"])
    preset = outside / "mine.yaml"
    preset.write_text("extends: tiny\n")
    with pytest.raises(ValueError, match="preset .* is outside the folders"):  # refused before it is read
        load_params(str(preset))


def test_trl_overrides_that_name_a_hub_a_server_or_a_file_are_refused():
    for overrides in ("{push_to_hub: true, hub_model_id: someone/x}", "{deepspeed: /etc/ds.json}"):
        with pytest.raises(ValidationError, match="which a run may not choose"):
            load_params("tiny", [f"sft.trl_overrides={overrides}"])
    with pytest.raises(ValidationError, match=r"vllm_server_host"):
        load_params("tiny", ["algorithm=grpo", "grpo.trl_overrides={vllm_server_host: 10.0.0.9}"])


def test_a_flow_run_naming_a_foreign_ray_cluster_fails_with_its_parameters_and_runs_no_stage(
    prefect, state, monkeypatch
):
    from rlhf_pipeline.flows.rlhf import rlhf

    monkeypatch.delenv(RAY_ADDRESSES_ENV)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    outcome = rlhf(launch={"launcher": "ray", "ray_address": "ray://cluster.elsewhere:10001"}, return_state=True)
    assert outcome.is_failed()
    assert RAY_ADDRESSES_ENV in str(outcome.message) + repr(outcome.result(raise_on_failure=False))
    assert not (state / "artifacts").exists(), "a stage ran"


def test_a_file_made_outside_the_allowed_folders_after_the_parameters_were_read_is_refused_where_it_is_read(
    tmp_path, monkeypatch
):
    """The parameters' check sees only the files that exist then: a labels file or a data file written later outside
    the folders the worker allows is refused by the code that reads it (the labels after a pause, the data stage)."""
    from rlhf_pipeline.tasks.data import _check_readable
    from rlhf_pipeline.tasks.labels import LabelsError, read_labels_file

    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir(), outside.mkdir()
    monkeypatch.setenv(PATHS_ENV, str(inside))
    labels, rows = outside / "labels.jsonl", outside / "sft.jsonl"
    params = load_params("tiny", [f"pairs.people.labels_file={labels}", f"data.sft.path={rows}"])  # not there yet
    labels.write_text('{"pair": 0, "label": "A"}\n')
    rows.write_text('{"text": "a"}\n')
    with pytest.raises(LabelsError, match=f"labels file: {labels} is outside the folders a run may read.*{PATHS_ENV}"):
        read_labels_file(labels, {0: "3f2a9c1e0b7d"})
    with pytest.raises(ValueError, match=f"data.sft.path='{rows}': {rows} is outside the folders a run may read"):
        _check_readable(params.data)
    monkeypatch.setenv(PATHS_ENV, str(outside))
    assert read_labels_file(labels, {0: "3f2a9c1e0b7d"}) == {0: "A"}
    _check_readable(params.data)
