"""PPO's ranks and checkpoints: data-parallel coordination over torch.distributed (gradient averaging, broadcasts,
metric means) and the checkpoint files a resumed update reads back bit for bit (weights, optimizer, scheduler, RNG).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from pathlib import Path

from rlhf_pipeline.trainers.algorithms.loop import COMPLETE


@contextlib.contextmanager
def cpu_threads(num_threads: int | None):
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads or previous)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def tf32(enabled: bool | None):
    """TensorFloat-32 matmuls while training (`tf32`; None: torch's setting), restored after."""
    import torch

    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if enabled is not None:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


class Ranks:
    """This process's place among the ranks of `accelerate launch` (torchrun's RANK / WORLD_SIZE; one rank in-process).

    Our PPO is data-parallel by hand: each rank rolls out its share of every rollout batch, gradients are all-reduced
    (averaged) before clipping, so the weights stay identical on every rank, logged statistics are averaged over the
    ranks, and rank 0 writes checkpoints and the artifact. Engines that shard the model (DeepSpeed, FSDP) are
    refused."""

    def __init__(self, cpu: bool):
        import torch.distributed as dist

        self.world, self.rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        self.started = False
        if self.world > 1:
            sharded = [
                name for name in ("DEEPSPEED", "FSDP") if os.environ.get(f"ACCELERATE_USE_{name}", "").lower() == "true"
            ]
            if sharded:
                raise ValueError(
                    f"ppo is data-parallel (launch.engine=ddp); it does not shard the model with {sharded[0].lower()}"
                )
            if not dist.is_initialized():
                dist.init_process_group("gloo" if cpu else "nccl")
                self.started = True

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def average_gradients(self, params: list) -> None:
        """Every rank's gradients replaced by their mean over the ranks (one flat all-reduce)."""
        if self.world == 1:
            return
        import torch
        import torch.distributed as dist

        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()

    def broadcast(self, models: list) -> None:
        """Rank 0's parameters and buffers into every rank's models."""
        import torch.distributed as dist

        for model in models:
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        """Each value averaged over the ranks (every rank has the same names)."""
        if self.world == 1:
            return values
        import torch
        import torch.distributed as dist

        names = sorted(values)
        stacked = torch.tensor([values[n] for n in names], dtype=torch.float64)
        dist.all_reduce(stacked)
        return {name: value / self.world for name, value in zip(names, stacked.tolist())}

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank says so (a callback's stop must stop them all)."""
        if self.world == 1:
            return flag
        import torch
        import torch.distributed as dist

        found = torch.tensor([int(flag)])
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return bool(found.item())

    def close(self) -> None:
        if self.started:
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()


def rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-{rank}.pt"


def save_checkpoint(
    work_dir: Path, update: int, policy, value_model, optimizer, scheduler, state: dict, ranks: Ranks
) -> None:
    """Written into a hidden sibling and renamed into place when complete (with the COMPLETE marker
    `last_checkpoint` wants), so a half-written one is never used. Keeps the two newest. Every rank writes its
    RNG state; rank 0 the weights and optimizer (identical on every rank) and the marker."""
    import numpy as np
    import torch

    final, tmp = work_dir / f"checkpoint-{update}", work_dir / f".checkpoint-{update}.tmp"
    ranks.barrier()
    if ranks.main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ranks.barrier()
    kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    rng = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),  # (version, 625 ints, None): loads with weights_only
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),  # no numpy array
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(rng, tmp / rng_file(ranks.rank))
    ranks.barrier()
    if ranks.main:
        write_checkpoint(work_dir, tmp, final, update, policy, value_model, optimizer, scheduler, state)
    ranks.barrier()


def write_checkpoint(
    work_dir: Path, tmp: Path, final: Path, update: int, policy, value_model, optimizer, scheduler, state: dict
) -> None:
    import torch
    from safetensors.torch import save_file

    from rlhf_pipeline.trainers.models.load import trainable

    save_file(trainable(policy), tmp / "policy.safetensors")
    save_file(trainable(value_model), tmp / "value_model.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if scheduler is not None:  # an optimizer_factory's scheduler
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    (tmp / COMPLETE).write_text(f"{update}\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    done = sorted(
        (p for p in work_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    for old in done[:-2]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(checkpoint: Path, policy, value_model, optimizer, scheduler, rank: int = 0) -> dict:
    import numpy as np
    import torch
    from safetensors.torch import load_file

    for model, name in ((policy, "policy"), (value_model, "value_model")):
        weights = load_file(checkpoint / f"{name}.safetensors")
        if set(weights) != {n for n, p in model.named_parameters() if p.requires_grad}:
            raise ValueError(
                f"{checkpoint / name}.safetensors does not hold this model's trained weights (was the config, e.g. "
                "lora, changed?)"
            )
        model.load_state_dict(weights, strict=False)
    optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=True))
    if not (checkpoint / rng_file(rank)).is_file():
        raise ValueError(
            f"{checkpoint} has no RNG state of rank {rank}: it was written by fewer ranks; resume with the same "
            "launch.num_processes"
        )
    rng = torch.load(checkpoint / rng_file(rank), weights_only=True)  # tensors, tuples and numbers: nothing runs
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    kind, keys, position, has_gauss, gauss = rng["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads((checkpoint / "trainer_state.json").read_text())
