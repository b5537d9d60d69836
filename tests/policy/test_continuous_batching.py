"""Continuous batching on the real tiny model: rows join a running batch at token boundaries and
sample exactly what they would alone (tokens, and log-probs equal to teacher forcing), seeded
requests are reproducible whatever they are batched with, and the gateway's batcher answers
each call when its own completion ends."""

import math
import time

import pytest
import torch

from flow_assets.serving.gateway.batcher import ContinuousBatcher, GenerationRequest
from flow_assets.serving.gateway.engine import PolicyEngine
from flow_assets.policy.decode import DecodeRow, RowDecoder, row_streams
from flow_assets.policy.lora import LoraAdapterConfig, add_lora_adapter
from flow_assets.policy.sampling import SamplingConfig, completion_logprobs, sample_token_ids
from flow_assets.policy.tiny_model import TinyModelConfig, load_policy, save_tiny_policy

PREFIX = "S:You are a careful agent. Answer briefly.\nU:"  # longer than MIN_SHARED_PREFIX
QUESTIONS = ["abc=", "hello there=", "x=", "level=", "a much longer question than the rest="]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    model, tok = load_policy(save_tiny_policy(tmp_path_factory.mktemp("policy"), TinyModelConfig(seed=3)))
    model = add_lora_adapter(model, LoraAdapterConfig(rank=4, seed=1))
    with torch.no_grad():  # an adapter that changes the outputs, as a trained one does
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
    return model.eval(), tok


def _prompts(tok):
    return [tok(PREFIX + q)["input_ids"] for q in QUESTIONS]


def test_row_streams_are_splitmix64():
    # SplitMix64 seeded with 0: its first outputs (Vigna's reference implementation)
    assert row_streams(0, 2) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    assert row_streams(-1, 1) == row_streams(2**64 - 1, 1)  # seeds are taken modulo 2^64


def test_greedy_rows_joining_mid_run_decode_exactly_what_sample_token_ids_decodes(policy):
    model, tok = policy
    prompts = _prompts(tok)
    reference = sample_token_ids(model, tok, prompts, SamplingConfig(num_samples=1, temperature=0.0, max_new_tokens=20))
    decoder = RowDecoder(model, tok.eos_token_id, tok.pad_token_id)
    rows = [DecodeRow(p, 0.0, 1.0, 20, s) for p, s in zip(prompts, row_streams(0, len(prompts)))]
    done = decoder.add(rows[:2])  # these two share the prefix: computed once
    for _ in range(3):
        done += decoder.step()
    done += decoder.add(rows[2:4])  # join three tokens later, at a shorter width than the batch
    done += decoder.step()
    done += decoder.add([rows[4], DecodeRow(tok("zz")["input_ids"], 0.0, 1.0, 20, 1)])  # no shared prefix
    while decoder.size:
        done += decoder.step()
    assert len(done) == 6 and decoder.size == 0
    for row, want in zip(rows, reference):
        assert row.tokens == want.completion_ids and row.finished == want.finished
        assert row.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_a_sampled_row_is_the_same_alone_or_joining_others_and_its_logprobs_are_teacher_forcings(policy):
    model, tok = policy
    prompts = _prompts(tok)

    def decode(waves, max_tokens=24):
        decoder = RowDecoder(model, tok.eos_token_id, tok.pad_token_id)
        rows = {}
        for wave in waves:
            new = [DecodeRow(prompts[i], 0.8, 0.9, max_tokens + i, row_streams(40 + i, 1)[0]) for i in wave]
            rows.update(zip(wave, new))
            decoder.add(new)
            decoder.step()
        while decoder.size:
            decoder.step()
        return [rows[i] for i in range(len(prompts))]

    together, staggered = decode([[0, 1, 2, 3, 4]]), decode([[3], [0, 4], [], [1, 2]])
    for a, b in zip(together, staggered):
        assert a.tokens == b.tokens and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert len(a.tokens) == a.max_tokens or a.finished  # each row stops at its own cap
    logp, _ = completion_logprobs(model, prompts, [r.tokens for r in together], tok.pad_token_id, 0.8)
    for i, row in enumerate(together):
        assert torch.allclose(logp[i, : len(row.tokens)], torch.tensor(row.logprobs), atol=1e-4)
    assert len({tuple(r.tokens) for r in together}) == len(prompts)


@pytest.fixture(scope="module")
def engine(fresh_policy_dir):
    return PolicyEngine(fresh_policy_dir / "base")


def _request(engine, text, adapter, **settings):
    from flow_assets.policy.chat import render_prompt

    _, ids = render_prompt(engine.tokenizer, [{"role": "user", "content": text}])
    return GenerationRequest(adapter, ids, settings.pop("n", 1), settings.pop("temperature", 1.0), 1.0, settings.pop("max_tokens", 16), **settings)


def test_an_identity_adapter_is_served_without_its_lora_layers_and_samples_the_same(fresh_policy_dir, tmp_path):
    """v0 of a fresh policy (every lora_B zero) is served with its LoRA layers skipped, which
    changes no log-prob; switching to an adapter that changes the outputs turns them back on."""
    from flow_assets.policy.lora import save_lora_adapter
    from flow_assets.policy.chat import render_prompt

    engine = PolicyEngine(fresh_policy_dir / "base")
    identity = str(fresh_policy_dir / "adapters" / "v0")
    _, ids = render_prompt(engine.tokenizer, [{"role": "user", "content": "12*34"}])
    config = SamplingConfig(num_samples=2, temperature=1.0, max_new_tokens=12, seed=3)
    skipped = engine.generate(identity, [ids], config)
    assert engine.model.base_model.model.model.layers[0].self_attn.q_proj.disable_adapters
    engine.model.base_model.enable_adapter_layers()  # the same adapter through its LoRA layers
    through = engine._sample_token_ids(engine.model, engine.tokenizer, [ids], config)
    assert [r.completion_ids for r in skipped] == [r.completion_ids for r in through]
    assert [r.logprobs for r in skipped] == [r.logprobs for r in through]  # B A x is exactly 0
    trained = load_policy(fresh_policy_dir / "base")[0]
    trained = add_lora_adapter(trained, LoraAdapterConfig(rank=4, seed=1))
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(7))
    save_lora_adapter(trained, tmp_path / "trained")
    changed = engine.generate(str(tmp_path / "trained"), [ids], config)
    assert not engine.model.base_model.model.model.layers[0].self_attn.q_proj.disable_adapters
    assert [r.logprobs for r in changed] != [r.logprobs for r in skipped]
    engine.generate(identity, [ids], config)  # back to v0: skipped again
    assert engine.model.base_model.model.model.layers[0].self_attn.q_proj.disable_adapters


def test_the_batcher_admits_calls_into_the_running_batch_and_seeds_are_reproducible(engine, fresh_policy_dir):
    adapter = str(fresh_policy_dir / "adapters" / "v0")
    batcher = ContinuousBatcher(engine.activate, engine.tokenizer.eos_token_id, engine.tokenizer.pad_token_id, engine.max_positions)
    try:
        alone = batcher.submit(_request(engine, "12*34", adapter, seed=7, n=2, max_tokens=20)).result(timeout=60)
        long = batcher.submit(_request(engine, "5+5", adapter, seed=1, max_tokens=60, temperature=0.0))
        time.sleep(0.05)  # the long one is decoding
        steps = batcher.steps
        joined = batcher.submit(_request(engine, "12*34", adapter, seed=7, n=2, max_tokens=20)).result(timeout=60)
        long.result(timeout=60)
        # the seeded call samples the same completions, in a batch or alone; its two choices differ
        assert [r.completion_ids for r in joined] == [r.completion_ids for r in alone]
        for a, b in zip(joined, alone):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert alone[0].completion_ids != alone[1].completion_ids
        # it joined the running batch: the 60-token greedy row and its 20-token rows shared steps
        assert batcher.steps - steps < 60 + 19
        assert all(len(r.completion_ids) <= 20 for r in joined)
        # errors: a prompt beyond the context is an error rollout; a missing adapter fails only its call
        too_long = batcher.submit(_request(engine, "1+1", adapter, max_tokens=engine.max_positions)).result(timeout=60)
        assert too_long[0].error and "exceeds" in too_long[0].error
        with pytest.raises((OSError, ValueError)):
            batcher.submit(_request(engine, "1+1", str(fresh_policy_dir / "adapters" / "nowhere"))).result(timeout=60)
        assert len(batcher.submit(_request(engine, "1+1", adapter, max_tokens=3)).result(timeout=60)[0].completion_ids) <= 3
    finally:
        batcher.close()


def test_a_cancelled_call_ends_at_the_next_token_and_its_batch_mates_sample_what_they_would_alone(engine, fresh_policy_dir):
    adapter = str(fresh_policy_dir / "adapters" / "v0")
    batcher = ContinuousBatcher(engine.activate, engine.tokenizer.eos_token_id, engine.tokenizer.pad_token_id, engine.max_positions)
    try:
        alone = batcher.submit(_request(engine, "12*34", adapter, seed=7, n=2, max_tokens=40)).result(timeout=60)
        seen = []

        def leave_after_three(i, ids, lps):
            seen.extend(ids)
            if len(seen) >= 3:
                victim.cancelled = True  # set from the worker thread here; any thread may set it

        victim = _request(engine, "5+5", adapter, seed=1, max_tokens=100, temperature=0.0, on_tokens=leave_after_three)
        cancelled = batcher.submit(victim)
        mates = batcher.submit(_request(engine, "12*34", adapter, seed=7, n=2, max_tokens=40))
        (partial,) = cancelled.result(timeout=60)
        # ended at the token boundary after the flag: what was sampled so far, not finished
        assert 3 <= len(partial.completion_ids) <= 4 and not partial.finished and len(partial.logprobs) == len(partial.completion_ids)
        assert partial.completion_ids[:3] == seen[:3]
        assert [r.completion_ids for r in mates.result(timeout=60)] == [r.completion_ids for r in alone]
        # a request cancelled before it is admitted never decodes
        early = _request(engine, "1+1", adapter, max_tokens=5)
        early.cancelled = True
        assert batcher.submit(early).result(timeout=60)[0].completion_ids == []
    finally:
        batcher.close()


def _cache_slots(decoder) -> tuple[int, int]:
    """Token slots of a decoder's cache (rows x capacity) and the bytes its tensors hold."""
    cache = decoder.cache
    tensors = [t for t in cache.keys + cache.values if t is not None]
    return len(decoder.rows) * cache.capacity, sum(t.numel() * t.element_size() for t in tensors)


def test_the_footprint_predicts_the_merged_cache_and_merging_releases_the_old_layers(policy):
    model, tok = policy
    prompts = _prompts(tok)
    decoder = RowDecoder(model, tok.eos_token_id, tok.pad_token_id)
    assert decoder.footprint() == (0, 0, 0)
    decoder.add([DecodeRow(p, 0.8, 1.0, 30, s) for p, s in zip(prompts[:2], row_streams(5, 2))])
    for _ in range(4):
        decoder.step()
    old = decoder.cache
    rows, span, remaining = decoder.footprint()
    assert rows == decoder.size == 2 and remaining == 30 - 5  # 1 token from the prefill, 4 decoded
    new = [DecodeRow(p, 0.8, 1.0, 12, s) for p, s in zip(prompts[2:], row_streams(6, 3))]
    predicted = (rows + len(new)) * (max(span, max(len(p) for p in prompts[2:])) + max(remaining, 12 - 1))
    decoder.add(new)
    slots, nbytes = _cache_slots(decoder)
    assert decoder.size == 5 and slots == predicted  # nothing finished at its first token here
    assert nbytes == slots * decoder.token_bytes  # keys and values of every layer, per slot
    assert all(t is None for t in old.keys + old.values)  # the old cache's layers were let go


def test_a_batch_token_budget_holds_rows_back_and_changes_no_completion(engine, fresh_policy_dir):
    adapter = str(fresh_policy_dir / "adapters" / "v0")
    texts = ["12*34", "5+5", "7*8+1", "99-3", "2*2*2", "40/8"]

    def run(budget):
        batcher = ContinuousBatcher(engine.activate, engine.tokenizer.eos_token_id, engine.tokenizer.pad_token_id,
                                    engine.max_positions, max_batch_total_tokens=budget)  # fmt: skip
        try:
            futures = [batcher.submit(_request(engine, t, adapter, seed=i, n=2, max_tokens=24)) for i, t in enumerate(texts)]
            return [[r.completion_ids for r in f.result(timeout=120)] for f in futures], batcher.peak_total_tokens, batcher.batches
        finally:
            batcher.close()

    one = _request(engine, texts[0], adapter, max_tokens=24)
    per_row = len(one.prompt_ids) + 24 - 1  # a lone row's slots
    free, free_peak, _ = run(None)  # the default budget holds all 12 rows of these short prompts
    tight, tight_peak, admissions = run(4 * per_row + 8)
    assert tight == free  # seeded rows sample the same whatever the batch they join
    assert free_peak >= 12 * per_row - 12 * 4  # every row admitted together (prompts differ by a few tokens)
    assert tight_peak <= 4 * per_row + 8 and admissions >= 3  # at most 4 rows at a time, so several admissions
    with pytest.raises(ValueError, match="max_batch_total_tokens"):
        ContinuousBatcher(engine.activate, 0, 0, max_batch_total_tokens=0)


def test_rows_with_the_same_prompt_are_prefilled_once_and_sample_what_they_would_alone(policy):
    model, tok = policy
    prompts = _prompts(tok)[:2]
    other = tok("zz")["input_ids"]  # no prefix in common with the others

    def row(prompt, stream, temperature=0.8):
        return DecodeRow(list(prompt), temperature, 0.95, 14, stream)

    # four rows: each of two prompts twice (different streams), one greedy, and a prompt with no shared prefix
    specs = [(prompts[0], 1), (prompts[1], 2), (prompts[0], 3), (prompts[1], 4), (prompts[0], 5, 0.0), (other, 6)]
    decoder = RowDecoder(model, tok.eos_token_id, tok.pad_token_id)
    together = [row(*spec) for spec in specs]
    decoder.add(together)
    while decoder.size:
        decoder.step()
    # "zz" is far shorter: a prefill of its own (length_buckets), not padded to the others' width;
    # the two other prompts once each, their shared prefix once: three prompts prefilled, not six rows
    from flow_assets.policy.sampling import shared_prefix_length

    shared = shared_prefix_length(prompts)
    assert decoder.prefill_tokens == len(other) + shared + 2 * (max(len(p) for p in prompts) - shared)
    for spec, got in zip(specs, together):
        alone = RowDecoder(model, tok.eos_token_id, tok.pad_token_id)
        want = row(*spec)
        alone.add([want])
        while alone.size:
            alone.step()
        assert got.tokens == want.tokens and got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert together[0].tokens != together[2].tokens  # the same prompt, other streams: other samples


def test_a_prefix_computed_in_one_admission_is_reused_by_later_ones_with_the_same_samples(policy):
    """A later admission whose prompt starts with an earlier one's (a few-shot prefix, an agent's
    next turn) copies those keys and values instead of computing them, and samples what a decoder
    without kept prefixes samples; the kept prefixes stay within their byte budget."""
    model, tok = policy
    prompts = _prompts(tok)
    first = DecodeRow(prompts[0], 0.8, 0.95, 12, row_streams(5, 1)[0])
    later = [DecodeRow(prompts[1], 0.8, 0.95, 12, row_streams(6, 1)[0])]

    def run(decoder, rows):
        decoder.add(rows)
        while decoder.size:
            decoder.step()

    decoder = RowDecoder(model, tok.eos_token_id, tok.pad_token_id)
    run(decoder, [first])
    assert decoder.prefix_reused == 0
    run(decoder, later)
    common = len(tok(PREFIX)["input_ids"]) - 1  # the tokenizer may merge PREFIX's last token with the question's
    assert decoder.prefix_reused >= common >= 16
    # the next turn: the first call's prompt and completion, then more
    turn = prompts[0] + first.tokens + tok(" and then=")["input_ids"]
    later.append(DecodeRow(turn, 0.8, 0.95, 12, row_streams(7, 1)[0]))
    before = decoder.prefix_reused
    run(decoder, later[1:])
    assert decoder.prefix_reused - before == len(prompts[0]) - 1  # all of the first prompt but the token fed last time
    for row in later:
        fresh = DecodeRow(row.prompt_ids, 0.8, 0.95, 12, row.stream)
        run(RowDecoder(model, tok.eos_token_id, tok.pad_token_id, prefix_cache_bytes=0), [fresh])
        assert row.tokens == fresh.tokens and row.logprobs == pytest.approx(fresh.logprobs, abs=1e-5)
    # a budget for one prompt's prefix keeps only the most recent one
    a, b = prompts[4], tok("zzzz zzzz zzzz zzzz zzzz zzzz zzzz zzzz")["input_ids"]
    small = RowDecoder(model, tok.eos_token_id, tok.pad_token_id, prefix_cache_bytes=max(len(a), len(b)) * decoder.token_bytes)
    for p in (a, b):
        run(small, [DecodeRow(p, 0.0, 1.0, 2, 0)])
    assert list(small._prefixes) == [tuple(b[:-1])]
    none = RowDecoder(model, tok.eos_token_id, tok.pad_token_id, prefix_cache_bytes=0)
    run(none, [DecodeRow(prompts[0], 0.0, 1.0, 2, 0)])
    run(none, [DecodeRow(prompts[1], 0.0, 1.0, 2, 0)])
    assert none.prefix_reused == 0


def test_length_buckets_keep_every_row_once_and_bound_the_padding():
    from flow_assets.policy.decode import length_buckets

    lengths = [300, 1100, 310, 390, 1000, 300, 640, 700]
    rows = [DecodeRow(list(range(n)), 0.0, 1.0, 4, i) for i, n in enumerate(lengths)]
    buckets = length_buckets(rows, 1.3)
    assert [[len(r.prompt_ids) for r in b] for b in buckets] == [[300, 300, 310, 390], [640, 700], [1000, 1100]]
    assert sorted(id(r) for b in buckets for r in b) == sorted(id(r) for r in rows)  # each row exactly once
    assert all(len(b[-1].prompt_ids) <= 1.3 * len(b[0].prompt_ids) for b in buckets)
    assert length_buckets(rows, float("inf")) == [sorted(rows, key=lambda r: len(r.prompt_ids))]  # one prefill
    with pytest.raises(ValueError, match="ratio"):
        length_buckets(rows, 0.5)


def _join_mid_run(decoder, rows):
    """The schedule of the greedy test above: two rows, three steps, two more join, one step,
    one more plus a lone prompt, then to the end. Returns the rows done."""
    done = decoder.add(rows[:2])
    for _ in range(3):
        done += decoder.step()
    done += decoder.add(rows[2:4])
    done += decoder.step()
    done += decoder.add(rows[4:])
    while decoder.size:
        done += decoder.step()
    return done


def test_bfloat16_steps_over_the_whole_cache_decode_what_steps_over_the_written_columns_decode(tmp_path):
    """A bfloat16 decoder on the CPU attends over every column of its cache in a one-token step
    (the unwritten ones masked; see ``_RowCache``): rows that join mid-run, whose merged caches
    hold columns no step has written, get the tokens and log-probs they get when each step sees
    only the written columns."""
    model, tok = load_policy(save_tiny_policy(tmp_path / "policy", TinyModelConfig(seed=3)), dtype="bfloat16")
    prompts = [*_prompts(tok), tok("zz")["input_ids"]]
    results = {}
    for whole in (True, False):
        decoder = RowDecoder(model.eval(), tok.eos_token_id, tok.pad_token_id)
        assert decoder.whole_steps  # bfloat16 on the CPU
        decoder.whole_steps = whole
        rows = [DecodeRow(p, t, 1.0, 24, s) for p, s, t in zip(prompts, row_streams(5, len(prompts)), [0.0, 0.9] * 3)]
        assert len(_join_mid_run(decoder, rows)) == len(rows)
        results[whole] = rows
    for a, b in zip(results[True], results[False]):
        assert a.tokens == b.tokens and a.finished == b.finished
        assert all(math.isfinite(x) for x in a.logprobs)
        assert a.logprobs == pytest.approx(b.logprobs, abs=0.02)
    assert sum(len(r.tokens) for r in results[True]) > 2 * len(prompts)  # steps were taken, and merged
