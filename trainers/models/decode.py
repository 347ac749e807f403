"""The decoding loop of eval's answers, the pairs stage's samples and the online stages' rollouts (GRPO's and RLOO's
through TRL's trainer, PPO's): continuous batching over a KV cache written in place.

`transformers`' `generate` decodes a batch until its last answer stops, each finished row still multiplied and
attended every step, and its dynamic cache concatenates every layer's keys and values again at every step (a copy of
the whole cache per token; what each part of a step costs: docs/PERFORMANCE.md, `bench.decode_step`). Here a
finished answer leaves its row at once and a waiting prompt takes it (its prefill run apart, its keys and values
copied in), so every step multiplies rows that still answer, and each step writes one column of the cache instead of
copying it.

The cache holds `rows` answers side by side. Every row writes its next token's keys and values at the same column
(`end`); a row's own tokens are the columns from its `start` (its prompt placed so that it ends at `end`, as left
padding places it), and the mask hides the columns before it. A row's positions count its own tokens, as `generate`
numbers left-padded rows, so its keys (rotated when they were computed) are the same wherever the row sits.
Columns before the oldest row's start are dropped when the cache is full (the live ones moved to the front). A
sdpa model's step attends by `_step_attention` (one query per row: two batched matmuls over the key/value heads); a
prefill, and an eager model's step, by the model's own.

Which prompts share the cache follows `text.length_batches`' rule: none whose sequence (prompt and budget) is under
half the longest running one's, so one long prompt does not make every short one attend its length; and no more rows
than `max_cache_bytes` holds at the longest running sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from rlhf_pipeline.trainers.runtime.heartbeat import beat
from rlhf_pipeline.trainers.runtime.stopping import stop_if_asked

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

PREFILL_TOKENS = 4096
"""Padded prompt tokens per prefill forward: bounds its activations; a prompt longer than this is prefilled alone."""
REFILL_SHARE = 8
"""Free rows wait until 1/8 of the rows are free (or no row runs) before prompts are prefilled into them: a prefill
is a forward of its own, so prompts enter a few at a time."""


@dataclass(frozen=True)
class Budget:
    """How an answer is drawn and when it stops."""

    max_new_tokens: int
    stops: tuple[int, ...]
    """Token ids that end an answer (kept as its last token)."""
    sample: bool = False
    """Draw from the distribution (at `temperature`, nucleus `top_p`); else greedy."""
    temperature: float = 1.0
    top_p: float = 1.0
    scores: bool = False
    """Keep each drawn token's log-probability and the entropy under the tempered distribution (the logits over
    `temperature`, before the nucleus), as a trainer computes them from the same logits."""


@dataclass
class Answer:
    tokens: list[int] = field(default_factory=list)
    """The new tokens, the stop token last where one ended it."""
    stopped: bool = False
    """It ended at a stop token (else the budget ended it)."""
    logprobs: list[float] = field(default_factory=list)
    """With `Budget.scores`: each token's log-probability."""
    entropy: list[float] = field(default_factory=list)
    """With `Budget.scores`: the entropy of each step's distribution."""


def fast_dtype(name: str | None, device: str = "cpu") -> str | None:
    """`name`, with "fast" resolved for `device`: bfloat16 where it multiplies bf16 natively (a CUDA device that
    supports it, a CPU with AVX512-BF16 or AMX), else float32: on a CPU with AVX2 alone torch's bf16 matmuls run
    several times slower than float32's, where with AVX512-BF16 they ran faster (docs/PERFORMANCE.md)."""
    if name != "fast":
        return name
    import torch

    if str(device).startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bfloat16" if native else "float32"


def supports(model: PreTrainedModel) -> bool:
    """Whether `decode` can run this model: a decoder whose every layer attends all earlier tokens through a plain
    key/value cache, with sdpa or eager attention (a sliding window, linear attention or another attention kernel
    would need its own cache here; such models go through `generate`)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    sliding = getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None)
    return kinds == {"full_attention"} and not sliding and config._attn_implementation in ("sdpa", "eager")


def decode(
    model: PreTrainedModel,
    prompts: list[list[int]],
    budget: Budget,
    rows: int,
    max_cache_bytes: int = 4 << 30,
    on_done: Callable[[int, Answer], None] | None = None,
    seeds: list[int] | None = None,
) -> list[Answer]:
    """Answers to the prompt ids `prompts` (in their order), at most `rows` at once; `on_done(index, answer)` as
    each ends. Sampling draws from torch's global generator, so a seed set before the call fixes the draws; with
    `seeds`, prompt i's tokens are drawn from a generator of its own seeded with `seeds[i]` (one uniform number a
    token), so its answer is the same whatever other prompts, rows or earlier calls share its steps: a generation
    that stopped resumes with the answers it had not yet drawn, drawn as an unbroken one draws them."""
    import random

    import torch

    answers = [Answer() for _ in prompts]
    own = None if seeds is None else [random.Random(seed) for seed in seeds]

    def pick(logits: torch.Tensor, indices: list[int]) -> torch.Tensor:
        if own is None or not budget.sample:
            return _pick(logits, budget)
        return _pick(logits, budget, torch.tensor([own[i].random() for i in indices], dtype=torch.float64))

    queue = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    whole = [len(p) + budget.max_new_tokens for p in prompts]
    cache = _SlotCache(model, rows, _per_token_bytes(model), max_cache_bytes)
    running: list[int] = []  # the prompt index in each row
    last = torch.empty(0, dtype=torch.long, device=model.device)  # each row's newest token, fed next step
    with torch.inference_mode():
        while queue or running:
            beat()
            stop_if_asked()
            admitted = _admissible(queue, running, whole, rows, cache)
            if admitted and (not running or not queue[len(admitted) :] or len(admitted) >= rows // REFILL_SHARE):
                for chunk in _prefill_chunks(admitted, prompts):
                    for i in chunk:
                        queue.remove(i)
                    running += chunk
                    first = cache.admit(model, [prompts[i] for i in chunk], max(whole[i] for i in running))
                    drawn = pick(first, chunk)
                    last = torch.cat([last, drawn])
                    _record(answers, chunk, first, drawn, budget)
            else:
                logits = cache.step(model, last, max(whole[i] for i in running))
                last = pick(logits, running)
                _record(answers, running, logits, last, budget)
            for r in reversed(range(len(running))):  # from the end: a removal moves the last row into its place
                i = running[r]
                if not _ended(answers[i], budget):
                    continue
                cache.remove(r)
                last[r], running[r] = last[len(running) - 1], running[-1]
                running.pop()
                last = last[: len(running)]
                if on_done is not None:
                    on_done(i, answers[i])
    return answers


def _record(answers: list[Answer], indices: list[int], logits: torch.Tensor, tokens: torch.Tensor, budget: Budget):
    """Each row's drawn token (and with `budget.scores` its log-probability and the entropy) onto its answer."""
    import torch

    for i, token in zip(indices, tokens.tolist()):
        answers[i].tokens.append(token)
        answers[i].stopped = token in budget.stops
    if budget.scores:
        logp = torch.log_softmax(logits.float() / budget.temperature, dim=-1)
        chosen = logp.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        entropy = (-(logp.exp() * logp).sum(-1)).tolist()
        for i, value, spread in zip(indices, chosen, entropy):
            answers[i].logprobs.append(value)
            answers[i].entropy.append(spread)


def _ended(answer: Answer, budget: Budget) -> bool:
    return answer.stopped or len(answer.tokens) >= budget.max_new_tokens


def _admissible(queue: list[int], running: list[int], whole: list[int], rows: int, cache: _SlotCache) -> list[int]:
    """The waiting prompts that may take free rows now, longest first (`queue` is sorted so): none whose sequence
    (`whole`: prompt and budget) is under half the longest running one's, and no more than memory holds."""
    chosen: list[int] = []
    longest = max((whole[i] for i in running), default=0)
    for i in queue:
        longest = max(longest, whole[i])
        if len(running) + len(chosen) >= min(rows, cache.rows_that_fit(longest)) or 2 * whole[i] < longest:
            break
        chosen.append(i)
    if not chosen and not running and queue:
        chosen = [queue[0]]  # alone it runs whatever it costs
    return chosen


def _prefill_chunks(indices: list[int], prompts: list[list[int]]) -> list[list[int]]:
    """`indices` (longest first) in prefill forwards of at most `PREFILL_TOKENS` padded tokens each."""
    chunks: list[list[int]] = []
    for i in indices:
        if chunks and (len(chunks[-1]) + 1) * len(prompts[chunks[-1][0]]) <= PREFILL_TOKENS:
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks


def _pick(logits: torch.Tensor, budget: Budget, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """The next token of each row: the argmax, or a draw at the temperature from the nucleus (as `generate` does
    with `top_k=0`: transformers' TopPLogitsWarper keeps the smallest set of tokens whose probability exceeds
    `top_p`, the most likely token always). The draw is torch's `multinomial`, or with `uniforms` (one number in
    [0, 1) a row) the token where that number falls in the row's cumulative distribution."""
    import torch

    scores = logits.float()
    if not budget.sample:
        return scores.argmax(-1)
    scores = scores / budget.temperature
    if budget.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - budget.top_p
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if uniforms is None:
        return torch.multinomial(scores.softmax(-1), 1).squeeze(-1)
    cumulative = scores.softmax(-1).double().cumsum(-1)
    # the first token whose cumulative probability exceeds the number: never one of probability 0
    where = (uniforms.to(cumulative.device) * cumulative[:, -1])[:, None]
    return torch.searchsorted(cumulative, where, right=True).squeeze(-1).clamp(max=scores.shape[-1] - 1)


def _per_token_bytes(model) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


class _SlotCache:
    """Every layer's keys and values for the running rows, as (rows, kv heads, columns, head dim) buffers written in
    place; rows `0..count-1` are live, and the columns `begin..end-1` hold their tokens."""

    def __init__(self, model, rows: int, per_token_bytes: int, max_bytes: int):
        config = model.config
        self.rows, self.per_token_bytes, self.max_bytes = rows, per_token_bytes, max_bytes
        self.layers = config.num_hidden_layers
        self.heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype, self.device = next(model.parameters()).dtype, model.device
        self.count = self.begin = self.end = self.capacity = self.allocated = 0
        self.starts: list[int] = []
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    # --- a decoding step -------------------------------------------------------------------------------------------

    def step(self, model, tokens: torch.Tensor, longest: int) -> torch.Tensor:
        """One token for each running row (`longest`: the longest running sequence, prompt and budget): the
        next-token logits."""
        import torch

        self._reserve(front=0, rows=0, longest=longest)
        device = tokens.device
        columns = torch.arange(self.begin, self.end + 1, device=device)
        starts = torch.tensor(self.starts, device=device)
        hidden = (columns[None, :] < starts[:, None])[:, None, None, :]
        mask = torch.zeros(hidden.shape, dtype=self.dtype, device=device)
        mask.masked_fill_(hidden, torch.finfo(self.dtype).min)  # added to the scores
        config, kernel = model.config, model.config._attn_implementation
        if kernel == "sdpa":  # the same arithmetic, faster; another kernel is the user's choice and is kept
            config._attn_implementation = _step_attention_name()
        try:
            out = model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=(self.end - starts)[:, None],
                cache=_Layers(self),
                use_cache=True,
                logits_to_keep=1,
            )
        finally:
            config._attn_implementation = kernel
        self.end += 1
        return out.logits[:, -1]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """A layer's new column (the step's token), then what its attention reads: the live rows and columns."""
        self.keys[layer][: self.count, :, self.end] = keys[:, :, 0]
        self.values[layer][: self.count, :, self.end] = values[:, :, 0]
        live = (slice(0, self.count), slice(None), slice(self.begin, self.end + 1))
        return self.keys[layer][live], self.values[layer][live]

    # --- rows in and out -------------------------------------------------------------------------------------------

    def admit(self, model, prompts: list[list[int]], longest: int) -> torch.Tensor:
        """Prefill `prompts` (left padded, numbered as `generate` numbers them) into new rows ending at `end`
        (`longest` as `step` takes it, these rows counted): the next-token logits of each."""
        import torch
        from torch.nn.utils.rnn import pad_sequence

        rows = [torch.tensor(prompt, device=self.device) for prompt in prompts]
        ids = pad_sequence(rows, batch_first=True, padding_value=0, padding_side="left")  # any id: masked
        mask = pad_sequence([torch.ones_like(r) for r in rows], batch_first=True, padding_side="left")
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
        )
        width = ids.shape[1]
        self._reserve(front=width, rows=len(prompts), longest=longest)
        for layer in range(self.layers):
            made = out.cache.layers[layer]
            for j, prompt in enumerate(prompts):
                row, n = self.count + j, len(prompt)
                self.keys[layer][row, :, self.end - n : self.end] = made.keys[j, :, width - n :]
                self.values[layer][row, :, self.end - n : self.end] = made.values[j, :, width - n :]
        self.starts += [self.end - len(prompt) for prompt in prompts]
        self.count += len(prompts)
        self.begin = min(self.starts)
        return out.logits[:, -1]

    def remove(self, row: int) -> None:
        """Row `row` ends: the last row moves into its place."""
        last = self.count - 1
        if row != last:
            for buffers in (self.keys, self.values):
                for buffer in buffers:
                    buffer[row] = buffer[last]
            self.starts[row] = self.starts[last]
        self.starts.pop()
        self.count -= 1
        self.begin = min(self.starts) if self.starts else self.end

    def rows_that_fit(self, longest: int) -> int:
        """Rows the memory bound holds when every one may grow to `longest` columns."""
        return max(1, self.max_bytes // (_room(longest) * self.per_token_bytes))

    def _reserve(self, front: int, rows: int, longest: int) -> None:
        """Room for `rows` more rows whose prompts take the `front` columns before `end`, and for the step's column
        at `end`. When it is missing the live columns move to the front (new buffers where more rows or columns are
        needed: `_room(longest)` columns)."""
        import torch

        live = self.end - self.begin if self.count else 0
        if self.keys and front <= self.end < self.capacity and self.count + rows <= self.allocated:
            return
        new_end = max(live, front)
        if self.keys and new_end < self.capacity and self.count + rows <= self.allocated:
            for buffers in (self.keys, self.values):  # the same buffers, the live columns moved to the front
                for buffer in buffers:
                    moved = buffer[: self.count, :, self.begin : self.end].clone()
                    buffer[: self.count, :, new_end - live : new_end] = moved
        else:
            capacity = max(new_end + 1, _room(longest))
            allocated = max(self.count + rows, min(self.rows, self.max_bytes // (capacity * self.per_token_bytes)))
            shape = (allocated, self.heads, capacity, self.dim)
            fresh: tuple[list, list] = ([], [])
            for old, new in zip((self.keys, self.values), fresh):
                for layer in range(self.layers):
                    buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)  # finite where masked
                    if old and self.count:
                        buffer[: self.count, :, new_end - live : new_end] = old[layer][
                            : self.count, :, self.begin : self.end
                        ]
                    new.append(buffer)
            self.keys, self.values = fresh
            self.capacity, self.allocated = capacity, allocated
        shift = new_end - self.end
        self.starts = [s + shift for s in self.starts]
        self.end = new_end
        self.begin = min(self.starts) if self.starts else self.end


def _step_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A decoding step's attention: one query per row against its row's columns, as two batched matmuls over the
    key/value heads, each head's queries side by side (no key/value copy per query head). `key` and `value` are
    views of the cache's buffers; `attention_mask` is the step's additive (rows, 1, 1, columns) mask. On the
    project's 2-core CPU a step of SmolLM2 at 64 rows took 23% less time than through sdpa's at 128 columns and about
    the same at 448, where both are bound by reading the cache (the same answers; `bench.decode_ab`). A call it was
    not made for (more than one query, a softcap, attention sinks) goes to sdpa."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, heads, length, dim = query.shape
    if length != 1 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    kv_heads, columns = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    queries = (query * scale).reshape(rows * kv_heads, groups, dim)
    scores = torch.bmm(queries, key.reshape(rows * kv_heads, columns, dim).transpose(1, 2))
    scores.view(rows, kv_heads, groups, columns).add_(attention_mask)
    weights = scores.float().softmax(-1).to(value.dtype)
    out = torch.bmm(weights, value.reshape(rows * kv_heads, columns, dim))
    return out.view(rows, heads, 1, dim).transpose(1, 2), None


def _step_attention_name() -> str:
    from transformers import AttentionInterface

    if "rlhf_decode_step" not in AttentionInterface._global_mapping:
        AttentionInterface.register("rlhf_decode_step", _step_attention)
    return "rlhf_decode_step"


def _room(longest: int) -> int:
    """Columns a buffer gets for sequences up to `longest`: half as many again to decode into, so that the live
    columns move to the front at most once every `longest / 2` steps."""
    return longest + max(longest // 2, 16)


def _layers_class():
    from transformers.cache_utils import Cache, DynamicLayer

    class SlotLayer(DynamicLayer):
        """One layer of a `_SlotCache`, as transformers' attention calls its cache."""

        def __init__(self, slots: _SlotCache, index: int):
            super().__init__()
            self.slots, self.index = slots, index
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            return self.slots.write(self.index, key_states, value_states)

        def get_seq_length(self) -> int:
            return self.slots.end - self.slots.begin

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

    class Layers(Cache):
        def __init__(self, slots: _SlotCache):
            super().__init__(layers=[SlotLayer(slots, i) for i in range(slots.layers)])

    return Layers


def _Layers(slots: _SlotCache):
    global _LAYERS
    if _LAYERS is None:
        _LAYERS = _layers_class()
    return _LAYERS(slots)


_LAYERS = None
