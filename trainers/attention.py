"""The attention implementation of the models a stage loads (`attn_implementation`, transformers' name for it).

A choice is checked twice before any weights load: against what is installed when the parameters are read (a
FlashAttention package, the `kernels` package for a Hub kernel), and against this machine's device when the stage
starts (`rlhf check` runs the same check), because transformers would otherwise fail only while loading, or, for
flex attention on a CPU, at the first backward pass.
"""

from __future__ import annotations

import difflib
from typing import Any

BUILT_IN = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
"""transformers 5.24's own implementations (`AttentionInterface._global_mapping` and "eager"); a Hub kernel is named
`org/repo[@revision][:function]` (`integrations.hub_kernels.is_kernel`)."""

FLASH_PACKAGES = {
    "flash_attention_2": "flash-attn (pip install flash-attn --no-build-isolation)",
    "flash_attention_3": "flash-attn-3 (built from flash-attention's hopper/ folder)",
    "flash_attention_4": "flash-attn-4 (pip install flash-attn-4)",
}
"""What each FlashAttention version needs installed (transformers' `FLASH_ATTENTION_COMPATIBILITY_MATRIX` checks the
same distributions)."""

DEFAULT_CHOICES = "choose 'sdpa' (transformers' default) or 'eager'"


def check_installed(name: str | None) -> str | None:
    """`name` if transformers knows it and what it needs is installed; else a ValueError that names the field, the
    reason and the fix (read with the parameters: no device is looked at)."""
    if name is None:
        return None
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.utils import is_kernels_available

    if is_kernel(name):
        if not is_kernels_available():
            raise ValueError(
                f"attn_implementation={name!r} is a Hub kernel, which transformers loads with the `kernels` package: "
                f"it is not installed (or not a version transformers accepts): pip install kernels, or "
                f"{DEFAULT_CHOICES}"
            )
        return name
    if name not in BUILT_IN:
        close = difflib.get_close_matches(name, BUILT_IN, n=1)
        raise ValueError(
            f"attn_implementation={name!r} is not an attention of transformers"
            + (f" (did you mean {close[0]!r}?)" if close else "")
            + f": one of {', '.join(BUILT_IN)}, or a Hub kernel 'org/repo'"
        )
    if name in FLASH_PACKAGES:
        from transformers.modeling_flash_attention_utils import (
            FLASH_ATTENTION_COMPATIBILITY_MATRIX,
            FLASH_ATTN_KERNEL_FALLBACK,
        )

        version = int(name[-1])
        # Without the package, transformers loads the kernels-community build from the Hub when `kernels` is there.
        if not (FLASH_ATTENTION_COMPATIBILITY_MATRIX[version]["pkg_availability_check"]() or is_kernels_available()):
            raise ValueError(
                f"attn_implementation={name!r} needs FlashAttention {version}, which is not installed: install "
                f"{FLASH_PACKAGES[name]} on the CUDA machine that trains, or the `kernels` package (transformers then "
                f"loads {FLASH_ATTN_KERNEL_FALLBACK[name]} from the Hub), or {DEFAULT_CHOICES}"
            )
    return name


def hub_kernel(name: str | None) -> str | None:
    """The Hub repository whose code transformers downloads and runs for attention `name`: a Hub kernel's
    (`org/repo[@revision][:function]`), or the kernels-community build a FlashAttention name falls back to where its
    package is missing and `kernels` is installed; None for attention that runs installed code only."""
    if name is None or name in ("eager", "sdpa", "flex_attention"):
        return None
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.utils import is_kernels_available

    if is_kernel(name):
        return name.split(":", 1)[0].split("@", 1)[0]
    if name in FLASH_PACKAGES and is_kernels_available():
        from transformers.modeling_flash_attention_utils import (
            FLASH_ATTENTION_COMPATIBILITY_MATRIX,
            FLASH_ATTN_KERNEL_FALLBACK,
        )

        if not FLASH_ATTENTION_COMPATIBILITY_MATRIX[int(name[-1])]["pkg_availability_check"]():
            return FLASH_ATTN_KERNEL_FALLBACK[name].split(":", 1)[0].split("@", 1)[0]
    return None


def device_problem(
    name: str | None, training: bool = True, field: str = "attn_implementation", half_precision: bool | None = None
) -> str | None:
    """Why `name` cannot run on this machine's device (None: it can, or transformers chooses). `training`: the stage
    takes gradients through it (torch's flex attention has no backward pass on a CPU); `field`: how the message names
    the setting; `half_precision`: whether the attention's inputs are bf16/fp16 (bf16/fp16 weights or mixed
    precision; None: not known here)."""
    if name is None or name in ("eager", "sdpa"):
        return None
    import torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    if name in FLASH_PACKAGES:
        from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX

        if not cuda:
            return f"{field}={name!r} runs on a CUDA GPU, and this machine has {device}: {DEFAULT_CHOICES}"
        needed = FLASH_ATTENTION_COMPATIBILITY_MATRIX[int(name[-1])].get("cuda_min_major_version")
        major, minor = torch.cuda.get_device_capability()
        if needed and major < needed:
            return (
                f"{field}={name!r} needs a GPU of compute capability {needed}.0 or newer, and {device} "
                f"has {major}.{minor}: choose 'flash_attention_2' or 'sdpa'"
            )
        if half_precision is False:  # transformers hands FlashAttention float32 inputs as they are, and it refuses them
            return (
                f"{field}={name!r} computes in bfloat16/float16, and this stage's weights and precision are float32: "
                "turn its bf16 (or fp16) on, or set model.dtype=bfloat16"
            )
    if name == "flex_attention" and training and not cuda:
        return (
            f"{field}='flex_attention' cannot train on a CPU (torch 2.13's flex_attention has no backward "
            f"pass there): {DEFAULT_CHOICES}"
        )
    return None


def check_device(name: str | None, training: bool = True) -> None:
    """Raise `device_problem` (called where a stage starts, before any weights load)."""
    problem = device_problem(name, training)
    if problem is not None:
        raise ValueError(problem)


def loading(name: str | None) -> dict[str, Any]:
    """`from_pretrained` arguments: the implementation when one is chosen, else none (transformers' own choice: sdpa
    where the architecture has it)."""
    return {} if name is None else {"attn_implementation": name}
