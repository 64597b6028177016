"""Speculative decoding inside the braided step is lossless and shares the token budget."""

from __future__ import annotations

import pytest
import torch

from braid.config import ConfigError, EngineConfig
from braid.core.scheduler import SchedulerOutput
from braid.models.qwen2 import can_pack, native_bf16
from braid.sampling_params import SamplingParams
from braid.spec_decode.build import resolve_draft_dtype
from braid.spec_decode.cost_model import StepCostModel, attention_work
from braid.spec_decode.goodput import WARMUP_DRAFT, WARMUP_TARGET
from tests.engine.test_engine import CFG, STAGGERED, WEIGHTS, make_engine, prompts, run
from tests.tiny import braid_model, random_weights, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


class FixedStepCosts(StepCostModel):
    """The real cost model fed forward times of a fixed shape instead of measured ones: a
    target forward of `target[0]` seconds plus `target[1]` a query token, a draft forward of
    `draft[0]` plus `draft[1]` a token (by default a memory-bound target and a draft fifty
    times cheaper). What the goodput policy chooses then does not depend on the machine's
    timing or load (measured, the tiny draft costs as much as its target, drafting barely
    pays, and a clean CI run once saw the policy never draft). It starts anchored at the
    warm-up's sizes, as the engine's warm-up would anchor it."""

    def __init__(self, target: tuple[float, float] = (0.05, 0.0005),
                 draft: tuple[float, float] = (0.001, 0.0001)) -> None:
        super().__init__()
        self.shape = {"target": target, "draft": draft}
        for n, rows in WARMUP_TARGET:
            self.observe_target(n, attention_work(n, 0), rows, 0.0, anchor=True)
        for n, rows in WARMUP_DRAFT:
            self.observe_draft(n, rows, 0.0, anchor=True)

    def seconds(self, forward: str, tokens: int) -> float:
        fixed, per_token = self.shape[forward]
        return fixed + per_token * tokens

    def observe_target(self, tokens: int, attention: int, rows: int, seconds: float,
                       anchor: bool = False) -> None:
        super().observe_target(tokens, attention, rows, self.seconds("target", tokens), anchor)

    def observe_draft(self, tokens: int, rows: int, seconds: float, anchor: bool = False
                      ) -> None:
        super().observe_draft(tokens, rows, self.seconds("draft", tokens), anchor)


def spec_engine(method: str, k: int, draft_weights=WEIGHTS, draft_cfg=CFG, policy="fixed",
                **options):
    """A tiny speculating engine; under the goodput policy its cost model sees
    FixedStepCosts (a test may set another)."""
    spec = {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "policy": policy}
    # lookups beside the draft only where a test asks: the rest test the draft model itself
    lookups = options.pop("draft_prompt_lookup", False)
    if method == "draft_model":
        spec["draft_prompt_lookup"] = lookups
    for key in ("draft_sampling", "verification", "draft_vocab_size",
                "prompt_lookup_min", "draft_suffix_decoding"):  # speculative_config
        if key in options:
            spec[key] = options.pop(key)
    if method == "draft_model":
        spec["model"] = "tiny-draft"
    draft = braid_model(draft_cfg, draft_weights) if method == "draft_model" else None
    engine = make_engine(speculative_config=spec, draft_model=draft, **options)
    if policy == "goodput":
        engine.speculator.policy.cost = FixedStepCosts()
    return engine


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return run(make_engine(max_num_batched_tokens=256), STAGGERED, GREEDY)


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("budget", [8, 32])
def test_draft_equal_to_target_accepts_everything(reference, k: int, budget: int) -> None:
    engine = spec_engine("draft_model", k, max_num_batched_tokens=budget)
    assert run(engine, STAGGERED, GREEDY) == reference
    spec = engine.stats.spec_stats
    assert spec.num_drafts > 0 and spec.acceptance_rate == 1.0


def drafted_tokens(engine) -> list[int]:
    """Every draft token the engine's proposer returns from now on (a list it appends to)."""
    proposer, seen = engine.speculator.proposer, []
    propose = proposer.propose

    def recording(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        seen.extend(t for drafts in proposal.drafts for t in drafts)
        return proposal

    proposer.propose = recording
    return seen


class LinearCost:
    """Synthetic step cost: a target step of `base` seconds plus `per_token` a query token, a
    draft forward of `draft` seconds."""

    error_ema = 0.0

    def __init__(self, base: float, per_token: float, draft: float) -> None:
        self.base, self.per_token, self.draft = base, per_token, draft

    def target_time(self, tokens: float, attention: float = 0.0, rows: float | None = None
                    ) -> float:
        return self.base + self.per_token * tokens

    def target_time_without_attention(self, tokens: float, rows: float | None = None
                                      ) -> float:
        return self.target_time(tokens)

    target_seconds_per_attention = 0.0

    def draft_time(self, tokens: float, rows: float | None = None) -> float:
        return self.draft

    def observe_target(self, *args, **kwargs) -> None:
        pass

    def observe_draft(self, *args, **kwargs) -> None:
        pass


def test_greedy_drafts_see_the_request_s_penalties_and_bias() -> None:
    """A greedy request's token is the argmax after its penalties, logit_bias and
    min_tokens: the draft's proposals are too, so a draft equal to the target has every
    draft accepted (the plain argmax drafted tokens the penalty turned away), and the output
    is the same as without speculation."""
    shaped = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=4,
                            repetition_penalty=1.8, presence_penalty=0.5,
                            frequency_penalty=0.3, logit_bias={7: 3.0, 11: -2.0})
    expected = run(make_engine(max_num_batched_tokens=64), STAGGERED, shaped)
    engine = spec_engine("draft_model", 3, max_num_batched_tokens=64)
    assert run(engine, STAGGERED, shaped) == expected
    spec = engine.stats.spec_stats
    assert spec.num_draft_tokens > 0 and spec.acceptance_rate == 1.0


@pytest.mark.parametrize("limit", [16, 100, 272])
def test_a_draft_vocabulary_limit_is_lossless(reference, limit: int) -> None:
    """The draft scores only ids below the limit: it never proposes others, and the target's
    own tokens above it are rejected drafts, never wrong output."""
    engine = spec_engine("draft_model", 3, max_num_batched_tokens=32, draft_vocab_size=limit)
    drafted = drafted_tokens(engine)
    assert run(engine, STAGGERED, GREEDY) == reference
    assert drafted and max(drafted) < limit
    spec = engine.stats.spec_stats
    assert spec.num_draft_tokens > 0
    outputs = [t for tokens in reference.values() for t in tokens]
    if max(outputs) < limit:  # the same model drafting: all accepted
        assert spec.acceptance_rate == 1.0
    else:
        assert spec.acceptance_rate < 1.0


def test_a_bad_draft_vocabulary_limit_is_refused() -> None:
    for bad in (0, -5, 2.5, "32k"):
        with pytest.raises(ConfigError, match="draft_vocab_size"):
            spec_engine("draft_model", 3, draft_vocab_size=bad)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        spec_engine("ngram", 3, draft_vocab_size=64)
    with pytest.raises(ConfigError, match="exceeds the vocabulary"):
        spec_engine("draft_model", 3, draft_vocab_size=100_000)


def test_a_draft_with_a_shorter_context_than_max_model_len_is_refused() -> None:
    """Its rotary table ends before the target's last position: an IndexError failed the
    requests that got there (a 500 on the server) before this check."""
    from dataclasses import replace

    short = replace(CFG, max_position_embeddings=128)
    with pytest.raises(ConfigError, match=r"draft model's context \(128 tokens\) is shorter "
                       r"than --max-model-len 256"):
        spec_engine("draft_model", 3, draft_cfg=short, max_model_len=256)
    spec_engine("draft_model", 3, draft_cfg=short, max_model_len=128)


def test_the_draft_s_weights_and_kv_cache_count_against_the_memory(monkeypatch) -> None:
    """The KV caches are mapped lazily, so one too large would only fail under load: the
    engine refuses weights + KV caches beyond the machine's memory, the draft's included."""
    import os

    plain = make_engine()
    need = sum(t.numel() * t.element_size() for t in (plain.runner.kv_cache,)) + \
        plain.runner.model.weight_bytes()
    sysconf = os.sysconf
    fake = {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": int(need * 1.5)}
    monkeypatch.setattr(os, "sysconf", lambda name: fake.get(name) or sysconf(name))
    make_engine()  # the target alone fits
    make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(ConfigError, match=r"--num-kv-blocks: the weights and KV caches \(the "
                       r"draft's included\) take"):
        spec_engine("draft_model", 3)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_unrelated_draft_is_still_lossless(reference, k: int) -> None:
    other = tiny_config("qwen2")
    engine = spec_engine(
        "draft_model",
        k,
        draft_weights=random_weights(other, seed=5),
        draft_cfg=other,
        max_num_batched_tokens=16,
    )
    assert run(engine, STAGGERED, GREEDY) == reference
    assert engine.stats.spec_stats.num_draft_tokens > 0
    assert engine.stats.spec_stats.acceptance_rate < 0.3


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("budget", [8, 32])
def test_ngram_is_lossless(reference, k: int, budget: int) -> None:
    engine = spec_engine("ngram", k, max_num_batched_tokens=budget)
    assert run(engine, STAGGERED, GREEDY) == reference
    assert engine.stats.spec_stats.num_drafts > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_lossless_under_preemption(reference, method: str) -> None:
    engine = spec_engine(method, 3, num_kv_blocks=64, max_num_batched_tokens=32)
    assert run(engine, STAGGERED, GREEDY) == reference
    assert engine.stats.num_preemptions > 0


def test_one_forward_holds_a_prefill_chunk_and_a_verification_window() -> None:
    engine = spec_engine("draft_model", 3, max_num_batched_tokens=16)
    ps = prompts()
    engine.add_request("a", ps[0], GREEDY)
    engine.step()  # "a" prefilled; drafts proposed for the next step
    assert len(engine.requests["a"].spec_token_ids) == 3
    engine.add_request("b", ps[4], GREEDY)
    engine.step()
    last = engine.stats.recent[-1]
    assert last.num_spec_tokens == 3  # a's window: 1 + 3 tokens
    assert last.num_prefill_tokens == 16 - 4  # b's first chunk fills the rest of the budget


def test_drafts_are_trimmed_to_the_budget() -> None:
    engine = spec_engine("draft_model", 7, max_num_batched_tokens=4)
    engine.add_request("a", prompts()[0], GREEDY)
    engine.step()
    engine.step()
    assert engine.stats.recent[-1].num_spec_tokens == 3


def test_vocabulary_mismatch_is_a_config_error() -> None:
    other = tiny_config("qwen2", vocab_size=300)
    with pytest.raises(ConfigError, match="vocabulary"):
        spec_engine("draft_model", 3, draft_weights=random_weights(other), draft_cfg=other)


def test_bfloat16_draft_is_lossless(reference) -> None:
    """The target's own weights as a bf16 draft (packed where the CPU runs bf16 natively, as
    draft_dtype "auto" loads it): rounding costs a little acceptance, never an output token."""
    draft = braid_model(CFG, WEIGHTS).to(torch.bfloat16)
    if can_pack("cpu", torch.bfloat16):
        draft.pack_linear_weights()
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed",
            "model": "tiny-draft", "draft_dtype": "bfloat16"}
    engine = make_engine(speculative_config=spec, draft_model=draft,
                         max_num_batched_tokens=32)
    assert run(engine, STAGGERED, GREEDY) == reference
    assert engine.stats.spec_stats.num_drafts > 0 and engine.stats.spec_stats.acceptance_rate > 0.8


@pytest.mark.parametrize("field, value", [
    ("num_speculative_tokens", True), ("num_speculative_tokens", "3"),
    ("num_speculative_tokens", 2.0), ("prompt_lookup_min", "2"), ("prompt_lookup_max", None),
    ("prompt_lookup_max", False)])
def test_integer_fields_refuse_other_types(field: str, value: object) -> None:
    """A bool is not k = 1, and a string is a ConfigError naming the field, not a TypeError."""
    config = {"method": "ngram", "num_speculative_tokens": 3, field: value}
    with pytest.raises(ConfigError, match=f"{field} must be an integer"):
        EngineConfig(model="tiny", speculative_config=config)


def test_draft_dtype_resolution_and_errors() -> None:
    assert resolve_draft_dtype("float32", torch.float32) == torch.float32
    assert resolve_draft_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert resolve_draft_dtype("auto", torch.float16) == torch.float16  # follows the target
    assert resolve_draft_dtype("auto", torch.float32) == (
        torch.bfloat16 if native_bf16() else torch.float32)
    with pytest.raises(ConfigError, match="draft_dtype must be one of"):
        EngineConfig(model="tiny", speculative_config={
            "method": "draft_model", "num_speculative_tokens": 3, "draft_dtype": "int8"})


def test_per_request_figures_in_output() -> None:
    engine = spec_engine("draft_model", 3)
    engine.add_request("a", prompts()[1], GREEDY)
    final = [o for o in engine.run_until_done() if o.finished][0]
    spec = final.metrics.spec_stats
    assert spec["acceptance_rate"] == 1.0 and spec["num_drafts"] > 0
    assert spec["mean_acceptance_length"] > 3


def test_seeded_sampling_with_speculation_is_reproducible() -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    outs = []
    for _ in range(2):
        engine = spec_engine("draft_model", 3)
        engine.add_request("a", prompts()[1], params)
        outs.append([o for o in engine.run_until_done() if o.finished][0].outputs[0].token_ids)
    assert outs[0] == outs[1]
    torch.testing.assert_close(torch.tensor(len(outs[0])), torch.tensor(16))


def _first_tokens(engine, prompt: list[int], n: int) -> torch.Tensor:
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    for i in range(n):
        engine.add_request(str(i), prompt, params)
    out = {o.request_id: o.outputs[0].token_ids for o in engine.run_until_done() if o.finished}
    return torch.tensor([out[str(i)][:3] for i in range(n)])  # [n, 3]


def _chi_square_p(a: torch.Tensor, b: torch.Tensor, vocab: int) -> float:
    """p-value of the two-sample chi-square test that a and b share one distribution."""
    counts = torch.stack([torch.bincount(a, minlength=vocab), torch.bincount(b, minlength=vocab)])
    counts = counts[:, counts.sum(0) >= 10].double()  # bins too small for the test are dropped
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(counts.shape[1] - 1.0, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


MODES = [("greedy", "coupled", False), ("coupled", "coupled", False),
         ("independent", "rejection", False), ("coupled", "rejection", False),
         ("greedy", "rejection", False), ("auto", "rejection", False),
         ("independent", "rejection", True)]


@pytest.mark.parametrize(("draft_sampling", "verification", "lookup"), MODES)
def test_sampled_distribution_matches_without_speculation(draft_sampling: str,
                                                          verification: str,
                                                          lookup: bool) -> None:
    """Temperature 1, small vocabulary: each of the first 3 tokens has the same distribution
    with draft speculation as without, for every way of drafting and verifying, and with
    one-hot lookup drafts beside sampled model drafts in one batch. The draft is the target
    with flatter next-token distributions, so both acceptances and recoveries happen.
    Chi-square at significance 0.001 per position, fixed seeds."""
    cfg = tiny_config("qwen2", vocab_size=24, eos_token_id=None, bos_token_id=None)
    target = random_weights(cfg, seed=11)
    draft = dict(target)
    target["model.embed_tokens.weight"] = target["model.embed_tokens.weight"] * 6
    draft["model.embed_tokens.weight"] = draft["model.embed_tokens.weight"] * 3
    options = {"block_size": 4, "num_kv_blocks": 4096, "max_model_len": 64,
               "max_num_seqs": 512, "max_num_batched_tokens": 4096, "log_stats_interval": 0}
    from braid.config import EngineConfig
    from braid.engine.engine import LLMEngine

    plain = LLMEngine(EngineConfig(model="t", seed=1, **options), model=braid_model(cfg, target))
    spec = LLMEngine(
        EngineConfig(model="t", seed=2, speculative_config={
            "method": "draft_model", "num_speculative_tokens": 2, "model": "d",
            "policy": "fixed", "draft_sampling": draft_sampling, "verification": verification,
            "draft_prompt_lookup": lookup, "prompt_lookup_min": 1}, **options),
        model=braid_model(cfg, target), draft_model=braid_model(cfg, draft))
    prompt = [3, 7, 1, 9, 4]
    a, b = _first_tokens(plain, prompt, 4000), _first_tokens(spec, prompt, 4000)
    assert 0.1 < spec.stats.spec_stats.acceptance_rate < 0.95
    assert (spec.speculator.lookup_windows > 0) is lookup  # type: ignore[union-attr]
    for pos in range(3):
        assert _chi_square_p(a[:, pos], b[:, pos], 24) > 1e-3


class HingeCost(LinearCost):
    """Synthetic step cost: 0.2 s up to 4 query tokens, +0.1 s per token beyond (so with
    many requests decoding, drafts cost more than they return); free drafts."""

    def __init__(self) -> None:
        super().__init__(0.2, 0.1, 0.001)

    def target_time(self, tokens: float, attention: float = 0.0, rows: float | None = None
                    ) -> float:
        return self.base + self.per_token * max(0, tokens - 4)


def test_goodput_switches_off_under_load_and_back_on_losslessly() -> None:
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ps = prompts()

    def drive(engine) -> tuple[dict[str, list[int]], list[int]]:
        engine.add_request("A", ps[0], long)
        done, history = {}, []
        for step in range(200):
            if step == 4:
                for i in range(1, 8):
                    engine.add_request(str(i), ps[i][:6], short)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            if "A" in engine.requests:
                history.append(len(engine.requests["A"].spec_token_ids))
            if not engine.has_unfinished_requests():
                break
        return done, history

    reference, _ = drive(make_engine(max_num_batched_tokens=64))
    engine = spec_engine("draft_model", 3, policy="goodput", max_num_batched_tokens=64)
    engine.speculator.policy.cost = HingeCost()
    draft = engine.speculator.proposer
    forwards: list[int] = []  # query tokens of every draft forward
    plain_propose = draft.propose

    def propose(requests, ks):
        proposal = plain_propose(requests, ks)
        forwards.extend(f.num_tokens for f in proposal.forwards)
        return proposal

    draft.propose = propose
    lags: list[int] = []  # A's draft backlog after each step
    step_forwards: list[list[int]] = []  # the draft forwards of each step
    evidence: list[float] = []  # global acceptance trials after each step
    plain_step = engine.step

    def step():
        before = len(forwards)
        out = plain_step()
        if "A" in engine.requests:
            lags.append(draft.lag(engine.requests["A"]))
            step_forwards.append(forwards[before:])
            evidence.append(engine.speculator.acceptance.global_trials)
        return out

    engine.step = step
    outputs, history = drive(engine)
    assert outputs == reference
    first_off = history.index(0)
    back_on = first_off + next(i for i, k in enumerate(history[first_off:]) if k)
    assert max(history[:first_off]) > 0, history  # on while alone
    assert back_on > first_off, history  # back on once the others finished
    assert engine.speculator.chosen_k[0] > 0 and engine.speculator.chosen_k[3] > 0
    # While off, the draft is left behind (no forwards for A's tokens): its backlog grows,
    # and turning back on first catches up all of it, so the drafts are never stale.
    assert lags[back_on - 1] > lags[first_off] >= 1
    assert step_forwards[back_on][0] >= lags[back_on - 1]
    assert lags[back_on] == 1  # only the token sampled next step is new to the draft
    # Steps in which nobody drafts age the global evidence (so a policy that stopped
    # drafting explores again in time).
    assert evidence[back_on - 1] < evidence[first_off]


def test_a_request_whose_first_windows_failed_drafts_again() -> None:
    """A request whose own estimate fell (its first windows are reported rejected at the
    first draft) goes to k = 0, which verifies nothing. Its evidence ages with every step it
    does not draft, so it drafts again once its estimate is back near the global one (the
    draft is the target: in truth every window is accepted), not never."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    reference = run(make_engine(), {0: [1]}, params)
    engine = spec_engine("draft_model", 3, policy="goodput")
    spec = engine.speculator
    spec.policy.cost = LinearCost(0.1, 0.001, 0.05)  # k = 1 pays from an acceptance of ~0.5
    for _ in range(100):  # other requests' windows were accepted whole
        spec.acceptance.update("other", 3, 3)
    spec.acceptance.forget("other")
    verified, unlucky = spec.on_verified, []

    def reported(req, num_drafted, num_accepted):
        if len(unlucky) < 6:
            unlucky.append(num_drafted)
            num_accepted = 0
        verified(req, num_drafted, num_accepted)

    spec.on_verified = reported
    history: list[int] = []  # drafts proposed for the request after each of its decodes
    plain_step = engine.step

    def step():
        out = plain_step()
        if (req := engine.requests.get("1")) is not None and not req.is_prefilling:
            history.append(len(req.spec_token_ids))
        return out

    engine.step = step
    assert run(engine, {0: [1]}, params) == reference
    assert unlucky
    stopped = history.index(0)
    assert any(history[stopped:]), history  # drafting again before the end
    assert spec.acceptance.alpha("1") > 0.9


def test_itl_target_caps_prefill_chunks_losslessly(reference) -> None:
    """With an ITL target the policy shrinks prefill chunks riding with decodes so the
    (synthetic) predicted step time stays under it; outputs do not change."""
    engine = spec_engine("draft_model", 3, policy="goodput", max_num_batched_tokens=64,
                         target_itl_ms=800)
    engine.speculator.policy.cost = HingeCost()  # 0.2 s up to 4 tokens, +0.1 s per token beyond
    assert run(engine, STAGGERED, GREEDY) == reference
    mixed = [s for s in engine.stats.recent if s.num_decode_tokens and s.num_prefill_tokens]
    assert mixed, "no step mixed decodes and prefill"
    # 0.8 s allows 10 query tokens; the 16-token minimum chunk keeps prompts moving.
    assert all(s.num_prefill_tokens <= 16 for s in mixed)


def run_bounded(engine, arrivals: dict[int, list[int]], max_steps: int = 2000
                ) -> dict[str, list[int]]:
    """`run` that fails instead of hanging when the engine stops scheduling."""
    ps, done, step = prompts(), {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        assert step < max_steps, f"no progress: {engine.num_waiting} waiting, " \
            f"{engine.num_running} running after {step} steps"
        for i in arrivals.get(step, []):
            engine.add_request(f"{i}-{step}", ps[i], GREEDY)
        for out in engine.step():
            if out.finished:
                done[out.request_id.split("-")[0]] = out.outputs[0].token_ids
        step += 1
    return done


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_itl_target_serves_batches_after_idle_and_bursts(reference, method: str) -> None:
    """The prefill cap belongs to the step being scheduled: requests that arrive after the
    engine went idle, in a burst, or while others decode are all served, losslessly."""
    engine = spec_engine(method, 3, policy="goodput", max_num_batched_tokens=64,
                         target_itl_ms=800)
    engine.speculator.policy.cost = HingeCost()
    capped: list[int] = []  # prefill tokens of each step scheduled under the ITL cap
    schedule = engine.scheduler.schedule

    def schedule_and_record(prefill_cap: int | None = None) -> SchedulerOutput:
        out = schedule(prefill_cap)
        if prefill_cap is not None:
            capped.append(out.num_prefill_tokens)
        return out

    engine.scheduler.schedule = schedule_and_record
    first = run_bounded(engine, {0: [2]})  # one short batch, then idle
    assert first == {"2": reference["2"]}
    for _ in range(3):
        assert engine.step() == []  # idle steps in between
    second = run_bounded(engine, {0: [0, 1]})  # two requests after idle
    assert second == {k: reference[k] for k in ("0", "1")}
    burst = run_bounded(engine, {0: list(range(8))})  # a burst of all prompts
    assert burst == reference
    # Arrivals while another request decodes: the cap applies and they still finish.
    joined = run_bounded(engine, {0: [5], 6: [3, 4], 30: [6, 7]})
    assert joined == {k: reference[k] for k in ("5", "3", "4", "6", "7")}
    # (a step's sampled rows are no sign of decodes: a prompt found cached ends in one)
    assert any(capped) and all(n <= 16 for n in capped)


def test_itl_target_needs_goodput_speculation() -> None:
    with pytest.raises(ConfigError, match="--target-itl-ms"):
        make_engine(target_itl_ms=100)


@pytest.mark.parametrize(("key", "value"), [("draft_sampling", "random"),
                                            ("verification", "exact")])
def test_bad_sampling_modes_are_config_errors(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"--speculative-config: {key} must be one of"):
        EngineConfig(model="tiny", speculative_config={
            "method": "draft_model", "num_speculative_tokens": 3, key: value})


def test_each_request_drafts_and_verifies_by_one_rule() -> None:
    spec = EngineConfig(model="tiny", speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3}).spec_config
    assert spec is not None and (spec.verification, spec.draft_sampling) == ("rejection", "auto")
    sampled, seeded = SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, seed=1)
    greedy = SamplingParams(temperature=0)
    assert [spec.verification_for(p) for p in (sampled, seeded, greedy)] == [
        "rejection", "coupled", "coupled"]
    assert [spec.draft_sampling_for(p) for p in (sampled, seeded, greedy)] == [
        "independent", "greedy", "greedy"]
    spec.draft_sampling = "coupled"
    assert [spec.draft_sampling_for(p) for p in (sampled, seeded, greedy)] == [
        "coupled", "coupled", "greedy"]


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "smollm3", "gemma3", "granite",
                                    "mistral", "ministral", "olmo2", "olmo3"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_other_families_speculate_losslessly(method: str, family: str) -> None:
    """Every family but Qwen2's (the other tests' tiny model): Llama, Qwen3 (q and k heads
    normalised before RoPE), Phi-3 (fused weights; as Phi-4-mini, LongRoPE and 3/4 of each
    head turned), SmolLM3 (a layer without RoPE), Gemma 3
    Mistral and Ministral (layers in a window of 8, shorter than the prompts; Mistral's blocks
    before it given back), Granite (its multipliers) and OLMo 2 / 3 (norms after its
    sub-layers; OLMo 3 windowed and global layers) through the whole engine: greedy
    speculation, by
    prompt lookup and by a draft of the same family with other weights, gives the tokens of
    no speculation, with chunked prefill and preemption (40 blocks of 4 tokens; 52 for a
    hybrid model, whose windowed layers keep a table of their own)."""
    from braid.engine.engine import LLMEngine
    from braid.models.kv_layout import kv_layout
    from tests.models.test_qwen2 import long_rope

    cfg = tiny_config(family, **{"mistral": {"sliding_window": 8},
                                 "phi3": {"partial_rotary_factor": 0.75,  # as Phi-4-mini
                                          "rope_scaling": long_rope(0.75)},
                                 "smollm3": {"no_rope_layers": [1, 0]}}.get(family, {}))
    weights = random_weights(cfg, seed=5)

    # 40 blocks, and where windowed layers keep a table of their own (a hybrid model's
    # layer group), the 12 it takes: a window of 8 and a step of 32 tokens
    num_blocks = 40 + (12 if kv_layout(cfg).hybrid else 0)

    def engine(spec: dict | None = None, draft=None) -> LLMEngine:
        config = EngineConfig(model="tiny", block_size=4, num_kv_blocks=num_blocks,
                              max_model_len=160,
                              max_num_batched_tokens=32, log_stats_interval=0,
                              speculative_config=spec)
        return LLMEngine(config, model=braid_model(cfg, weights), draft_model=draft)

    expected = run(engine(), STAGGERED, GREEDY)
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "policy": "fixed"}
    draft = None
    if method == "draft_model":
        spec["model"] = "tiny-draft"
        draft = braid_model(cfg, random_weights(cfg, seed=6))
    speculating = engine(spec, draft)
    assert run(speculating, STAGGERED, GREEDY) == expected
    assert speculating.stats.spec_stats.num_drafts > 0
    # (Mistral's requests give their blocks before the window back, behind the draft's
    # progress where a draft model runs: with prompt lookup they fit the 40 blocks)
    released = family == "mistral" and method == "ngram"
    assert (speculating.stats.num_preemptions == 0) == released
