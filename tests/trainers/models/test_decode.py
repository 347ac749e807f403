import pytest
import torch

from rlhf_pipeline.trainers.config import ModelConfig
from rlhf_pipeline.trainers.models import decode as decoding
from rlhf_pipeline.trainers.models.base_model import load_base_model
from rlhf_pipeline.trainers.models.decode import Budget, decode, supports
from rlhf_pipeline.trainers.models.text import generate_answers


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_base_model(ModelConfig(seed=1))
    return model.eval(), tokenizer


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (n,), generator=generator).tolist() for n in lengths]


def generated_alone(model, prompt: list[int], budget: Budget) -> list[int]:
    """transformers' `generate` on one prompt (no padding, no batch): the reference."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=budget.max_new_tokens,
            do_sample=False,
            eos_token_id=list(budget.stops),
            pad_token_id=0,
        )
    tokens = out[0, ids.shape[1] :].tolist()
    ends = [k for k, t in enumerate(tokens) if t in budget.stops]
    return tokens[: ends[0] + 1] if ends else tokens


def common_tokens(model, prompts: list[list[int]], count: int) -> tuple[int, ...]:
    """Tokens the untrained model makes often: as stops they end answers at different steps."""
    made = [t for p in prompts[:4] for t in generated_alone(model, p, Budget(24, ()))]
    return tuple(sorted(set(made), key=made.count, reverse=True)[:count])


def grouped_query_model():
    """A two-layer Llama whose query heads share key/value heads two by two, as SmolLM2's three by three."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["sdpa", "eager", "grouped queries"])
def test_greedy_answers_are_those_of_generate_alone_while_rows_end_and_prompts_take_them(tiny, kind):
    model = grouped_query_model() if kind == "grouped queries" else tiny[0]
    model.config._attn_implementation = "eager" if kind == "eager" else "sdpa"
    try:
        # lengths that make the prompts wait for long rows to end, and more prompts than rows
        prompts = prompts_of([40, 3, 17, 9, 33, 5, 12, 25, 7, 21, 14, 2, 30, 11])
        budget = Budget(20, common_tokens(model, prompts, 2))
        ended: list[int] = []
        answers = decode(model, prompts, budget, rows=4, on_done=lambda i, answer: ended.append(i))
        expected = [generated_alone(model, p, budget) for p in prompts]
        assert [a.tokens for a in answers] == expected
        lengths = [len(t) for t in expected]
        assert min(lengths) < 20 and max(lengths) == 20  # some stopped early, some ran to the budget
        assert [a.stopped for a in answers] == [t[-1] in budget.stops for t in expected]
        assert sorted(ended) == list(range(len(prompts)))  # each told once
        assert model.config._attn_implementation == ("eager" if kind == "eager" else "sdpa")  # given back
    finally:
        model.config._attn_implementation = "sdpa"


def test_a_step_attends_as_sdpa_does_over_the_cache_views_it_is_given():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    buffers = torch.randn(2, 5, 2, 40, 16)  # keys and values: 5 rows, 2 key/value heads, 40 columns
    keys, values = buffers[0, :4, :, 7:30], buffers[1, :4, :, 7:30]  # live rows and columns: views
    query = torch.randn(4, 6, 1, 16)
    hidden = torch.arange(23)[None, :] < torch.tensor([0, 5, 11, 22])[:, None]
    mask = torch.zeros(4, 1, 1, 23).masked_fill(hidden[:, None, None, :], torch.finfo(torch.float32).min)
    ours, _ = decoding._step_attention(module, query, keys, values, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(module, query, keys, values, ~hidden[:, None, None, :], scaling=0.3)
    assert ours.shape == theirs.shape == (4, 1, 6, 16)
    torch.testing.assert_close(ours, theirs)


def test_the_cache_moves_its_live_columns_and_grows_without_changing_an_answer(tiny, monkeypatch):
    model, _ = tiny
    prompts = prompts_of([6, 50, 4, 8, 45, 5, 7, 3], seed=3)
    budget = Budget(30, ())
    monkeypatch.setattr(decoding, "_room", lambda longest: longest + 2)  # full soon after each move
    # one row of the longest sequence fits, three of the short ones: the buffers grow by rows when they come
    bound = 3 * (6 + 30 + 2) * decoding._per_token_bytes(model)
    moves, grown = [], []
    reserve = decoding._SlotCache._reserve

    def watched(self, *args, **kwargs):
        end, allocated = self.end, self.allocated
        reserve(self, *args, **kwargs)
        moves.append(self.end < end)
        grown.append(self.allocated > allocated > 0)

    monkeypatch.setattr(decoding._SlotCache, "_reserve", watched)
    answers = decode(model, prompts, budget, rows=3, max_cache_bytes=bound)
    assert sum(moves) >= 3 and any(grown)
    assert [a.tokens for a in answers] == [generated_alone(model, p, budget) for p in prompts]


def test_rows_are_bounded_by_the_memory_given_and_the_answers_do_not_change(tiny, monkeypatch):
    model, _ = tiny
    prompts = prompts_of([10, 12, 8, 11, 9, 10], seed=5)
    budget = Budget(12, ())
    per_token = decoding._per_token_bytes(model)
    bound = 2 * decoding._room(12 + 12) * per_token  # two rows of the longest sequence
    seen: list[int] = []
    admit = decoding._SlotCache.admit

    def counted(self, *args, **kwargs):
        logits = admit(self, *args, **kwargs)
        seen.append(self.count)
        return logits

    monkeypatch.setattr(decoding._SlotCache, "admit", counted)
    bounded = decode(model, prompts, budget, rows=6, max_cache_bytes=bound)
    assert max(seen) == 2
    assert [a.tokens for a in bounded] == [generated_alone(model, p, budget) for p in prompts]


def test_nucleus_keeps_the_tokens_transformers_keeps():
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for top_p in (0.3, 0.9):
        theirs = TopPLogitsWarper(top_p)(None, logits.clone()).isfinite()
        drawn = {tuple(decoding._pick(logits, Budget(1, (), sample=True, top_p=top_p)).tolist()) for _ in range(200)}
        kept_rows = [set(torch.nonzero(theirs[r]).flatten().tolist()) for r in range(6)]
        seen_rows = [{draw[r] for draw in drawn} for r in range(6)]
        assert all(seen <= kept for seen, kept in zip(seen_rows, kept_rows))
        assert any(len(kept) > 1 for kept in kept_rows)
    torch.manual_seed(0)
    first = decoding._pick(logits, Budget(1, (), sample=True, top_p=0.9))
    torch.manual_seed(0)
    assert torch.equal(decoding._pick(logits, Budget(1, (), sample=True, top_p=0.9)), first)  # the seed fixes draws


def test_a_seeded_draw_falls_where_its_number_falls_in_the_nucleus():
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)) * 2
    numbers = (torch.arange(2000, dtype=torch.float64) + 0.5) / 2000  # evenly over [0, 1)
    for top_p in (1.0, 0.8):
        kept = TopPLogitsWarper(top_p)(None, logits.clone()) if top_p < 1 else logits
        drawn = decoding._pick(logits.expand(2000, -1), Budget(1, (), sample=True, top_p=top_p), numbers)
        counts = torch.bincount(drawn, minlength=50).double() / 2000
        assert torch.allclose(counts, kept.softmax(-1)[0].double(), atol=1 / 2000 + 1e-9)  # each token its share


def test_seeded_answers_are_each_their_own_whatever_shares_their_steps(tiny):
    model, _ = tiny
    prompts = prompts_of([6, 9, 4, 12, 7, 5], seed=7)
    stops = common_tokens(model, prompts, 2)
    budget = Budget(16, stops, sample=True, temperature=1.0, top_p=0.9)
    seeds = [11, 12, 13, 14, 15, 16]
    torch.manual_seed(0)
    together = [a.tokens for a in decode(model, prompts, budget, rows=6, seeds=seeds)]
    torch.manual_seed(1)  # the global generator plays no part
    two_rows = [a.tokens for a in decode(model, prompts, budget, rows=2, seeds=seeds)]
    the_rest = [a.tokens for a in decode(model, prompts[3:], budget, rows=3, seeds=seeds[3:])]
    assert together == two_rows and together[3:] == the_rest
    assert len({len(tokens) for tokens in together}) > 1  # answers ended at different steps: rows were refilled
    other = [a.tokens for a in decode(model, prompts, budget, rows=6, seeds=[s + 100 for s in seeds])]
    assert other != together  # the seeds decide the draws


def test_a_seeded_generation_resumed_draws_what_an_unbroken_one_drew(tiny, monkeypatch):
    model, tokenizer = tiny
    prompts = ["sort 3142 ->", "sort 98 ->", "sort 5 ->", "sort 771 ->", "sort 26 ->"]
    how = {"max_new_tokens": 8, "batch_size": 2, "sample": True, "seeds": [5, 6, 7, 8, 9]}
    for path in ("decode", "generate"):
        if path == "generate":
            monkeypatch.setattr(decoding, "supports", lambda model: False)
        unbroken = generate_answers(model, tokenizer, prompts, **how)
        kept = {i: (unbroken[0][i], unbroken[1][i]) for i in (1, 4)}
        told: list[int] = []
        resumed = generate_answers(
            model, tokenizer, prompts, **how, done_before=kept, on_batch=lambda done, *_: told.extend(done)
        )
        assert resumed == unbroken and sorted(told) == [0, 2, 3], path
    assert generate_answers(model, tokenizer, prompts, **{**how, "seeds": [1, 2, 3, 4, 5]}) != unbroken


def test_a_model_decode_does_not_run_is_answered_by_generate_alike(tiny, monkeypatch):
    model, tokenizer = tiny
    prompts = ["sort 3142 ->", "sort 98 ->", "sort 5 ->"]
    ours = generate_answers(model, tokenizer, prompts, 8, batch_size=2)
    calls = []
    real = model.generate
    monkeypatch.setattr(model, "generate", lambda **kwargs: calls.append(kwargs) or real(**kwargs))
    assert generate_answers(model, tokenizer, prompts, 8, batch_size=2) == ours and not calls
    monkeypatch.setattr(decoding, "supports", lambda model: False)
    assert generate_answers(model, tokenizer, prompts, 8, batch_size=2) == ours and calls


def test_decode_runs_full_attention_through_sdpa_or_eager_only(tiny, monkeypatch):
    model, _ = tiny
    assert supports(model)
    for name, value in (("_attn_implementation", "flex_attention"), ("layer_types", ["sliding_attention"] * 2)):
        with monkeypatch.context() as patched:
            patched.setattr(model.config, name, value, raising=False)
            assert not supports(model)


def test_sigterm_stops_generation_outside_training_at_once_keeping_what_ended(tiny, monkeypatch):
    """Eval's and the pairs stage's generation (`stopping.stoppable`) stop at the next step once SIGTERM reached the
    process (they went on to the end of their prompts before); a rollout, outside, goes on to its training step's end
    and its checkpoint."""
    from rlhf_pipeline.trainers.evaluation.stage import evaluate
    from rlhf_pipeline.trainers.pairs.stage import sample
    from rlhf_pipeline.trainers.runtime import stopping

    model, tokenizer = tiny
    prompts = [f"sort {n} ->" for n in range(3142, 3162)]
    for path in ("decode", "generate"):
        if path == "generate":
            monkeypatch.setattr(decoding, "supports", lambda model: False)
        kept: list[int] = []

        def keep(done, *_):
            kept.extend(done)
            stopping.TERMINATING.set()  # the signal arrives as the first answers end

        try:
            with pytest.raises(stopping.Terminated, match="SIGTERM: eval stopped"), stopping.stoppable("eval"):
                generate_answers(model, tokenizer, prompts, 12, batch_size=4, on_batch=keep)
            assert 1 <= len(kept) < len(prompts), (path, kept)  # what ended before it is kept, the rest not drawn
            answers, _ = generate_answers(model, tokenizer, prompts, 12, batch_size=4)  # as a rollout draws: not cut
            assert len(answers) == len(prompts)
        finally:
            stopping.TERMINATING.clear()
    assert getattr(evaluate, "__wrapped__", None) is not None and getattr(sample, "__wrapped__", None) is not None
