"""Continuous batching gives the same greedy tokens as decoding each prompt alone."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from braid.config import ConfigError, EngineConfig
from braid.engine.engine import LLMEngine, RequestError
from braid.sampling_params import SamplingParams
from tests.tiny import braid_model, random_weights, save_tiny_model, tiny_config

CFG = tiny_config("qwen2")
WEIGHTS = random_weights(CFG, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT_LENS = [3, 70, 1, 25, 140, 9, 40, 17]


def make_engine(draft_model=None, tokenizer=None, **options) -> LLMEngine:
    options = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 256,
               "log_stats_interval": 0, **options}
    return LLMEngine(EngineConfig(model="tiny", **options), model=braid_model(CFG, WEIGHTS),
                     tokenizer=tokenizer, draft_model=draft_model)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, CFG.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def run(
    engine: LLMEngine, arrivals: dict[int, list[int]], params: SamplingParams = GREEDY
) -> dict[str, list[int]]:
    """arrivals: step index -> prompt indices added before that step. Returns tokens by id."""
    ps, done, step = prompts(), {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), ps[i], params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.blocks.check_invariants()
        budget = engine.config.max_num_batched_tokens
        assert all(s.num_prefill_tokens + s.num_decode_tokens <= budget
                   for s in engine.stats.recent)
        step += 1
    return done


@pytest.fixture(scope="module")
def alone() -> dict[str, list[int]]:
    out = {}
    for i in range(len(PROMPT_LENS)):
        out.update(run(make_engine(max_num_seqs=1, max_num_batched_tokens=256), {0: [i]}))
    return out


STAGGERED = {0: [0, 1, 2], 2: [3], 3: [4, 5], 9: [6], 10: [7]}


@pytest.mark.parametrize("budget", [8, 32, 1024])
@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_chunked_batching_matches_alone(alone, budget: int, max_num_seqs: int) -> None:
    engine = make_engine(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    assert run(engine, STAGGERED) == alone


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_prefill_first_matches_alone(alone, max_num_seqs: int) -> None:
    engine = make_engine(enable_chunked_prefill=False, max_num_seqs=max_num_seqs)
    assert run(engine, STAGGERED) == alone


@pytest.mark.parametrize("chunked", [True, False])
def test_preemption_keeps_outputs(alone, chunked: bool) -> None:
    # 40 blocks of 4 tokens cannot hold all requests at once: the newest get preempted.
    engine = make_engine(num_kv_blocks=40, max_model_len=160,
                         max_num_batched_tokens=256 if not chunked else 32,
                         enable_chunked_prefill=chunked)
    assert run(engine, STAGGERED) == alone
    assert engine.stats.num_preemptions > 0


def test_admission_leaves_room_so_admitted_requests_are_not_recomputed() -> None:
    """A pool that holds two of four requests, chunked prefill: a request is admitted with
    blocks for its whole prompt and one to spare per running request, so none is preempted
    mid-prefill or just after, and no prompt is computed twice. Admitted on its first
    chunk's blocks alone, requests preempted one another 4 times and recomputed 68 prompt
    tokens here (on the real model, a multi-turn load: 68 preemptions, 1.5x slower)."""
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):  # the same draws as when this case was found
        torch.randint(3, CFG.vocab_size, (1,), generator=gen)
    ps = [torch.randint(3, CFG.vocab_size, (80,), generator=gen).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = make_engine(num_kv_blocks=40, max_model_len=160, max_num_batched_tokens=32)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, params)
    prefill = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        prefill += engine.stats.recent[-1].num_prefill_tokens
        engine.blocks.check_invariants()
        for o in outs:
            if o.finished:
                alone = make_engine()
                alone.add_request("a", ps[int(o.request_id)], params)
                want = [x for x in alone.run_until_done() if x.finished][0]
                assert o.outputs[0].token_ids == want.outputs[0].token_ids
    assert engine.stats.num_preemptions == 0
    assert prefill == 4 * 80


def test_priority_policy_orders_admission_and_preemption(alone) -> None:
    """--scheduling-policy priority (vLLM's): the waiting request with the lowest priority
    value runs first (then arrival), and preemption takes the running request with the
    highest value, not the newest; outputs stay those of each request alone. FCFS refuses a
    priority other than 0."""
    preemptions: dict[str, int] = {}

    def finish_order(engine, priorities: dict[int, int], late: dict[int, int]) -> list[str]:
        order, step = [], 0
        for i, pr in priorities.items():
            engine.add_request(str(i), prompts()[i], GREEDY, priority=pr)
        while engine.has_unfinished_requests() or step == 0:
            for i, pr in late.items() if step == 2 else ():
                engine.add_request(str(i), prompts()[i], GREEDY, priority=pr)
            for out in engine.step():
                if out.finished:
                    order.append(out.request_id)
                    preemptions[out.request_id] = out.metrics.num_preemptions
                    assert out.outputs[0].token_ids == alone[out.request_id]
            step += 1
        return order

    one_at_a_time = {"max_num_seqs": 1, "max_num_batched_tokens": 256}
    assert finish_order(make_engine(**one_at_a_time), {0: 0, 1: 0, 2: 0, 3: 0}, {}) == [
        "0", "1", "2", "3"]
    engine = make_engine(scheduling_policy="priority", **one_at_a_time)
    assert finish_order(engine, {0: 5, 1: 0, 2: 5, 3: -1}, {}) == ["3", "1", "0", "2"]
    # KV for about two requests at a time: the late, urgent one is never preempted, the
    # least urgent one is (FCFS would preempt the newest, the urgent one)
    for policy, first, victim, urgent in (("priority", 3, "0", "5"), ("fcfs", 0, "5", "0")):
        preemptions.clear()
        finish_order(make_engine(scheduling_policy=policy, num_kv_blocks=14, max_model_len=56,
                                 max_num_batched_tokens=32), {0: first, 3: 0}, {5: 0})
        assert preemptions[victim] > 0, (policy, preemptions)
        assert preemptions[urgent] == 0, (policy, preemptions)
    with pytest.raises(RequestError, match="priority 1 needs --scheduling-policy priority"):
        make_engine().add_request("x", [1, 2], GREEDY, priority=1)
    with pytest.raises(ConfigError, match="--scheduling-policy must be fcfs or priority"):
        make_engine(scheduling_policy="lifo")


def test_budget_below_max_model_len_without_chunking_fails() -> None:
    with pytest.raises(ConfigError, match="--max-num-batched-tokens"):
        make_engine(enable_chunked_prefill=False, max_num_batched_tokens=8)


@pytest.mark.parametrize("device, match", [
    ("foo", "--device: "), ("cuda", "--device cuda: this torch build or machine has no CUDA"),
    ("meta", "--device meta: braid runs on cpu or cuda"),  # a traceback at load before
    ("mps", "--device mps: braid runs on cpu or cuda")])
def test_a_bad_device_is_a_config_error_before_loading(device: str, match: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match=match):
        EngineConfig(model="no model is loaded before the check", device=device)


def test_a_draft_model_must_be_a_name_or_path() -> None:
    with pytest.raises(ConfigError, match="'model' must be a model name or path, got 5"):
        EngineConfig(model="tiny", speculative_config={
            "method": "draft_model", "num_speculative_tokens": 3, "model": 5})


@pytest.mark.parametrize("options, match", [
    ({"enable_chunked_prefill": "no"}, "--enable-chunked-prefill must be true or false, got 'no'"),
    ({"max_model_len": "100"}, "--max-model-len must be an integer, got '100'"),
    ({"max_num_seqs": True}, "--max-num-seqs must be an integer, got True"),
    ({"kv_cache_gib": float("nan")}, "--kv-cache-gib must be a finite number, got nan"),
    ({"target_itl_ms": "50"}, "--target-itl-ms must be a finite number, got '50'"),
    ({"model": 5}, "--model must be a string, got 5"),
    ({"speculative_config": 5}, "--speculative-config must be a JSON object, got 5"),
    ({"speculative_config": "{bad"}, "--speculative-config: invalid JSON"),
    ({"speculative_config": "[3]"}, "--speculative-config: expected a JSON object"),
])
def test_engine_options_of_the_wrong_type_are_config_errors(options: dict, match: str) -> None:
    """LLM(...) hands its keywords to EngineConfig unparsed: each is checked against its
    field's type, with a message naming the option (was: accepted, or a TypeError later)."""
    with pytest.raises(ConfigError, match=re.escape(match)):
        EngineConfig(model=options.pop("model", "tiny"), **options)


def test_a_speculative_config_may_be_its_json_text() -> None:
    """As on the command line: LLM(speculative_config='{"method": ...}') works too."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    config = EngineConfig(model="tiny", speculative_config=spec)
    assert config.spec_config is not None and config.spec_config.num_speculative_tokens == 3


@pytest.mark.parametrize("key, value", [("model", "x"), ("draft_dtype", "float32"),
                                        ("quantization", "int8"), ("draft_vocab_size", 64),
                                        ("draft_coarse_head", False),
                                        ("draft_prompt_lookup", False)])
def test_draft_model_keys_in_an_ngram_config_are_refused(key: str, value: object) -> None:
    """They configure a draft model ngram does not have (some were silently ignored)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, key: value}
    with pytest.raises(ConfigError, match=f"'{key}' is only for method draft_model"):
        EngineConfig(model="tiny", speculative_config=spec)


@pytest.mark.parametrize("options, match", [
    ({"max_model_len": 10**6}, "--max-model-len 1000000 exceeds the model's 512"),
    ({"kv_cache_gib": 10**6}, "--kv-cache-gib: a KV cache of 1000000.0 GiB does not fit"),
    ({"num_kv_blocks": 10**12}, "--num-kv-blocks: a KV cache of"),
    ({"block_size": 100000, "kv_cache_gib": 0.01},
     "blocks of 100000 tokens (--block-size) cannot hold one sequence of --max-model-len (512) "
     "tokens"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8},
     "--max-num-batched-tokens (8) must be >= --max-model-len"),
])
def test_impossible_sizes_are_refused_before_the_weights_load(
        tmp_path, options: dict, match: str) -> None:
    """Checks that need only the model's config.json run before any weight is read: here
    there are no weights at all, so reaching the load would be a different error."""
    save_tiny_model(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=re.escape(match)):
        LLMEngine(EngineConfig(model=str(tmp_path / "m"), **options))


@pytest.mark.parametrize("draft, spec, match", [
    ("other-vocab", {}, "the draft model's vocabulary (300 tokens) differs from the target's"),
    ("same", {"draft_vocab_size": 10**6}, "draft_vocab_size 1000000 exceeds the vocabulary"),
    ("missing", {}, "--speculative-config model: model '"),  # named as the draft's
])
def test_a_draft_that_cannot_draft_is_refused_before_the_weights_load(
        tmp_path, draft: str, spec: dict, match: str) -> None:
    """The draft model's config.json is checked against the target's before either loads
    (a missing draft, or one with another vocabulary, failed after the target loaded)."""
    from braid.files import ModelLoadError

    for name, overrides in (("m", {}), ("same", {}), ("other-vocab", {"vocab_size": 300})):
        save_tiny_model(tmp_path / name, **overrides)
        (tmp_path / name / "model.safetensors").unlink()
    spec = {"method": "draft_model", "num_speculative_tokens": 3,
            "model": str(tmp_path / draft), **spec}
    with pytest.raises((ConfigError, ModelLoadError), match=re.escape(match)):
        LLMEngine(EngineConfig(model=str(tmp_path / "m"), speculative_config=spec))


def test_a_draft_whose_tokenizer_cannot_be_read_starts_with_a_warning(tmp_path, caplog) -> None:
    """The draft proposes token ids and never decodes: a tokenizer file it cannot read only
    means its ids cannot be compared with the target's (test_a_draft_with_another_tokenizer
    _is_refused), which the log says."""
    save_tiny_model(tmp_path / "m")
    save_tiny_model(tmp_path / "d")
    (tmp_path / "d" / "tokenizer.json").write_text("not a tokenizer")
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(tmp_path / "d")}
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "m"), speculative_config=spec,
                                    log_stats_interval=0))
    assert engine.tokenizer is not None and engine.speculator.draft_runner is not None
    assert "the draft's vocabulary is taken to be the target's" in caplog.text


@pytest.mark.parametrize("change", ["swapped", "extra"])
def test_a_draft_with_another_tokenizer_is_refused(tmp_path, change: str) -> None:
    """A draft whose tokenizer gives ids to other tokens (two swapped), or has more tokens,
    is refused at start naming what differs (its drafts would be another model's text);
    the same draft with the target's tokenizer starts."""
    import json

    save_tiny_model(tmp_path / "m")
    save_tiny_model(tmp_path / "d", seed=1)
    file = tmp_path / "d" / "tokenizer.json"
    tok = json.loads(file.read_text())
    vocab = tok["model"]["vocab"]
    if change == "swapped":
        a, b = (t for t, i in vocab.items() if i in (65, 66))
        vocab[a], vocab[b] = vocab[b], vocab[a]
        match = "token id 65 is"
    else:
        tok["added_tokens"].append({"id": max(vocab.values()) + 10, "content": "<|extra|>",
                                    "special": True, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False})
        match = "the draft model's tokenizer has"
    file.write_text(json.dumps(tok))
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(tmp_path / "d")}
    config = EngineConfig(model=str(tmp_path / "m"), speculative_config=spec,
                          log_stats_interval=0)
    with pytest.raises(ConfigError, match=match):
        LLMEngine(config)
    file.write_text((tmp_path / "m" / "tokenizer.json").read_text())
    assert LLMEngine(config).speculator.draft_runner is not None


def test_server_port_is_checked_by_the_parser(capsys) -> None:
    from braid.cli import main

    for port in ("-1", "99999"):
        with pytest.raises(SystemExit):
            main(["serve", "--port", port])
        assert f"--port: must be in [0, 65535], got {port}" in capsys.readouterr().err
    for timeout in ("-1", "nan"):
        with pytest.raises(SystemExit):
            main(["serve", "--shutdown-timeout", timeout])
        assert f"--shutdown-timeout: must be >= 0 seconds, got {timeout}" in \
            capsys.readouterr().err
    assert main(["bench", "sweep", "--modes", " , "]) == 2
    assert "--modes: name at least one mode" in capsys.readouterr().err
    for flag in ("--max-request-bytes", "--max-waiting-requests"):  # refused before the load
        with pytest.raises(SystemExit):
            main(["serve", flag, "0"])
        assert f"{flag}: must be >= 1, got 0" in capsys.readouterr().err


def test_serve_binds_its_address_before_loading(capsys) -> None:
    """A taken port or a host that does not resolve fails at once, naming the flags (it
    failed after the weights loaded): here the model does not even exist."""
    import socket

    from braid.cli import main

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "/no/such/model"]) == 2
    assert (f"braid: error: --host 127.0.0.1 --port {port}: cannot listen there (Address "
            "already in use)") in capsys.readouterr().err
    # an address of no interface here (TEST-NET-1: numeric, so no name lookup)
    assert main(["serve", "--host", "192.0.2.1", "--model", "/no/such/model"]) == 2
    assert "--host 192.0.2.1 --port 8000: cannot listen there" in capsys.readouterr().err


def test_tokenizer_flag_takes_another_tokenizer(tmp_path, capsys) -> None:
    """--tokenizer, as vLLM's: the tokenizer and chat template of a folder that holds only
    tokenizer files; one that does not exist, or has more tokens than the model's
    vocabulary, is refused naming the flag before any weight loads. The model's own
    tokenizer is then not read at all (here it could not be)."""
    import json

    from braid.cli import main
    from tests.tiny import byte_tokenizer

    save_tiny_model(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text("not a tokenizer")
    tok = tmp_path / "tok"
    tok.mkdir()
    byte_tokenizer().save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "chat_template": "{{ messages[0].content }}!"}))
    engine = LLMEngine(EngineConfig(model=str(tmp_path / "m"), tokenizer=str(tok),
                                    log_stats_interval=0))
    assert engine.tokenizer is not None
    assert engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    big = byte_tokenizer()
    big.add_tokens([f"<extra_{i}>" for i in range(100)])
    big.save(str(tok / "tokenizer.json"))
    count = big.get_vocab_size(with_added_tokens=True)
    for tokenizer, message in ((str(tok), f"--tokenizer {tok}: its {count} tokens are more "
                                          "than the model's vocabulary (272)"),
                               ("/no/such", "--tokenizer /no/such: model '/no/such' not found")):
        assert main(["serve", str(tmp_path / "m"), "--port", "0", "--tokenizer", tokenizer]) == 2
        assert message in capsys.readouterr().err


def test_serve_names_a_bad_kv_cache_dtype(capsys) -> None:
    from braid.cli import main

    assert main(["serve", "--kv-cache-dtype", "int8", "--model", "/no/such/model"]) == 2
    assert ("braid: error: --kv-cache-dtype must be one of auto, float32, bfloat16, float16, "
            "got 'int8'") in capsys.readouterr().err
    assert main(["serve", "--kv-cache-dtype", "fp8", "--model", "/no/such/model"]) == 2
    assert ("braid: error: --kv-cache-dtype fp8: braid has no 8-bit KV cache; with no scale "
            "per block, fp8 raised the default model's perplexity by a third"
            ) in capsys.readouterr().err


def test_memory_limit_is_the_container_s_where_lower(tmp_path, caplog) -> None:
    """A cgroup's memory limit below the machine's memory is the one KV caches are checked
    against (v2 memory.max, v1 memory.limit_in_bytes; "max" or a huge v1 value: none); KV
    caches beyond the memory available now are a warning."""
    from braid.worker.memory import (
        available_memory,
        memory_limit,
        warn_beyond_available,
    )

    physical, whose = memory_limit(tmp_path)
    assert whose == "this machine's" and physical > 2**30
    (tmp_path / "memory.max").write_text("max\n")
    assert memory_limit(tmp_path) == (physical, "this machine's")
    (tmp_path / "memory.max").write_text(f"{2**30}\n")
    assert memory_limit(tmp_path) == (2**30, "this container's (cgroup limit)")
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_limit(tmp_path) == (physical, "this machine's")
    available = available_memory()
    assert available is not None and 0 < available <= physical
    assert not warn_beyond_available(2**30, "--kv-cache-gib", 2 * 2**30)
    assert warn_beyond_available(3 * 2**30, "--kv-cache-gib", 2 * 2**30)
    assert "--kv-cache-gib: the KV caches take 3.0 GiB, and only 2.0 GiB" in caplog.text


def test_serve_takes_vllm_s_command_line(capsys, caplog) -> None:
    """`braid serve MODEL` as `vllm serve MODEL` (the positional wins over --model, with a
    warning as in vLLM), and vLLM's names --uvicorn-log-level and --disable-log-stats."""
    from braid.cli import build_parser, main
    from braid.config import DEFAULT_TARGET, config_from_args

    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve"])).model == DEFAULT_TARGET
    assert config_from_args(parser.parse_args(["serve", "some/model", "--port", "1"])
                            ).model == "some/model"
    assert config_from_args(parser.parse_args(["serve", "--model", "b", "b"])).model == "b"
    assert "given twice" not in caplog.text
    assert config_from_args(parser.parse_args(["serve", "--model", "a", "b"])).model == "b"
    assert "the model is given twice: serving b (MODEL), not --model a" in caplog.text
    human = config_from_args(parser.parse_args(["serve", "--max-model-len", "25.6k",
                                                "--max-num-batched-tokens", "2K"]))
    assert (human.max_model_len, human.max_num_batched_tokens) == (25600, 2048)
    with pytest.raises(SystemExit):
        main(["serve", "--max-model-len", "1.5k7"])
    assert ("argument --max-model-len: expected an integer such as 4096, 32k (32000) or 32K "
            "(32768), got '1.5k7'") in capsys.readouterr().err
    vllm_names = parser.parse_args(["serve", "--uvicorn-log-level", "warning",
                                    "--disable-log-stats"])
    assert vllm_names.log_level == "warning"
    assert config_from_args(vllm_names).log_stats_interval == 0
    assert main(["serve", "/no/such/model", "--port", "0"]) == 2
    assert "braid: error: model '/no/such/model' not found" in capsys.readouterr().err


def test_serve_names_a_bad_cors_flag_root_path_or_tool_parser(capsys) -> None:
    """vLLM's flags braid takes: a value they cannot take is refused naming the flag."""
    from braid.cli import build_parser, main
    from braid.config import config_from_args

    with pytest.raises(SystemExit):
        main(["serve", "--allowed-origins", "*", "--model", "/no/such/model"])
    assert "argument --allowed-origins: expected a JSON list of strings" in \
        capsys.readouterr().err
    assert main(["serve", "--enable-log-requests", "--disable-log-requests", "--port", "0"]) == 2
    assert "--enable-log-requests and --disable-log-requests contradict" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--root-path", "llm"])
    assert "argument --root-path: must start with /, got 'llm'" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--root-path", "/a/b/"]).root_path == "/a/b"
    # vLLM's --served-model-name takes several names after one flag; repeated works too
    for argv in (["m", "--served-model-name", "a", "b"],
                 ["--model", "m", "--served-model-name", "a", "--served-model-name", "b"]):
        args = build_parser().parse_args(["serve", *argv])
        assert args.served_model_name == ["a", "b"] and config_from_args(args).model == "m"
    for flag in ("--served-model-name", "--response-role"):
        with pytest.raises(SystemExit):
            main(["serve", flag, " "])
        assert f"{flag}: must not be blank" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--tool-call-parser", "granite"])
    assert "argument --tool-call-parser: invalid choice: 'granite'" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice",
                                      "--tool-call-parser", "hermes", "--trust-remote-code",
                                      "--enforce-eager", "--disable-log-requests"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"


def test_generate_names_the_sampling_seed_flag(capsys) -> None:
    """`generate --sampling-seed` (the request's seed; --seed is the engine's) is named as
    such when it is out of range."""
    from braid.cli import main

    assert main(["generate", "--sampling-seed", str(2**64), "x"]) == 2
    assert "braid: error: --sampling-seed: seed must be in" in capsys.readouterr().err
    assert main(["generate", "--raw", "--system", "be brief", "x"]) == 2  # was ignored
    assert "--system goes into the chat template, which --raw leaves out" in \
        capsys.readouterr().err


def test_generate_names_a_model_without_a_tokenizer(tmp_path, capsys) -> None:
    """It failed on a bare AssertionError."""
    from braid.cli import main

    (save_tiny_model(tmp_path / "m") / "tokenizer.json").unlink()
    assert main(["generate", "--model", str(tmp_path / "m"), "--num-kv-blocks", "64", "hi"]) == 2
    assert (f"braid: error: --model {tmp_path / 'm'}: it has no tokenizer.json; give one with "
            "--tokenizer") in capsys.readouterr().err


def test_generate_refuses_an_empty_stdin(monkeypatch, capsys) -> None:
    """A prompt piped in empty is an error before any weight loads (it ran the demo prompt,
    which only a terminal's stdin gets)."""
    import io

    from braid.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(" \n"))
    assert main(["generate", "--model", "/no/such/model"]) == 2
    assert "braid: error: stdin is empty: give the prompt as an argument or pipe it in" in \
        capsys.readouterr().err


def test_more_threads_than_cores_is_a_warning(caplog) -> None:
    import os

    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        make_engine(num_threads=cores + 1)
    finally:
        torch.set_num_threads(before)
    assert f"--num-threads {cores + 1} is more than the {cores} cores" in caplog.text


def test_stats_lines_report_their_own_interval(caplog) -> None:
    """Each stats line gives the prefix cache hit rate and the speculation figures of its
    interval, as vLLM's do (not the totals since start); an idle engine writes one line
    after its last busy one, and no more while nothing runs."""
    from braid.core.stats import EngineStats, StepStats

    def step(queries: int, hits: int) -> StepStats:
        return StepStats(1, 0, 1, 0, 0, 0.0, 0.01, 0.5, 0, 0, num_cache_queries=queries,
                         num_cache_hits=hits)

    caplog.set_level("INFO", logger="braid")
    stats = EngineStats(num_kv_blocks=4)
    stats.record(step(10, 0))
    stats.spec_stats.record(4, 4)
    stats.add_update(5)
    stats.maybe_log(1e-9)
    stats.record(step(10, 10))
    stats.spec_stats.record(4, 0)
    stats.add_update(1)
    stats.maybe_log(1e-9)
    first, second = [r.getMessage() for r in caplog.records]
    assert "hit rate 0.0%" in first and "spec acceptance 1.00 mean length 5.00" in first
    assert "hit rate 100.0%" in second and "spec acceptance 0.00 mean length 1.00" in second
    stats.maybe_log(1e-9, idle_kv_usage=0.25)
    assert len(caplog.records) == 2  # nothing ran since the last line
    stats.add_update(3)
    stats.maybe_log(1e-9, idle_kv_usage=0.25)
    idle = caplog.records[-1].getMessage()
    assert idle.startswith("idle: 0 running, 0 waiting, gen ") and "KV 25%" in idle
    stats.maybe_log(1e-9, idle_kv_usage=0.25)
    assert len(caplog.records) == 3
    stats.record(step(8, 0))  # steps that generated nothing (a prefill chunk, then an abort)
    stats.maybe_log(1e-9, idle_kv_usage=0.0)
    assert len(caplog.records) == 4 and caplog.records[-1].getMessage().startswith("idle: ")


def test_step_mixes_prefill_chunk_and_decodes() -> None:
    engine = make_engine(max_num_batched_tokens=16)
    ps = prompts()
    engine.add_request("a", ps[0], GREEDY)
    engine.step()  # "a" prefilled whole (3 tokens), now decoding
    engine.add_request("b", ps[4], GREEDY)  # 140 tokens: needs many chunks
    engine.step()
    last = engine.stats.recent[-1]
    assert last.num_decode_tokens == 1 and last.num_prefill_tokens == 15


def test_abort_frees_blocks() -> None:
    engine = make_engine(max_num_batched_tokens=16)
    engine.add_request("a", prompts()[4], GREEDY)
    engine.step()
    assert engine.blocks.num_used_blocks > 0
    engine.abort("a")
    engine.blocks.check_invariants()
    assert engine.blocks.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_max_tokens_and_stop_token() -> None:
    engine = make_engine()
    ref = run(make_engine(), {0: [1]})["1"]
    stop = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ref[4]])
    engine.add_request("s", prompts()[1], stop)
    outs = [o for o in engine.run_until_done() if o.finished]
    first = ref.index(ref[4])
    assert outs[0].outputs[0].token_ids == ref[: first + 1]
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].stop_reason == ref[4]
    assert len(run(make_engine(), {0: [1]})["1"]) == 12


@pytest.mark.parametrize("prompt, match", [([], "empty"), (list(range(300)), "maximum"),
                                           ([5, 99999], "token ids")])
def test_bad_prompts_are_rejected(prompt, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        make_engine().add_request("x", prompt, GREEDY)


def test_a_failing_request_fails_alone(monkeypatch) -> None:
    engine = make_engine()
    ps = prompts()
    for i in range(3):
        engine.add_request(str(i), ps[i], GREEDY)
    original = engine.outputs._stop_reason

    def stop_reason(req, *args):
        if req.request_id == "1":
            raise RuntimeError("boom")
        return original(req, *args)

    monkeypatch.setattr(engine.outputs, "_stop_reason", stop_reason)
    finished = {o.request_id: o.outputs[0] for o in engine.run_until_done() if o.finished}
    assert finished["1"].finish_reason == "error"
    assert finished["0"].finish_reason == finished["2"].finish_reason == "length"
    assert len(finished["0"].token_ids) == 12
    engine.blocks.check_invariants()
    assert engine.blocks.num_used_blocks == 0


def test_generate_on_a_pipe_and_a_terminal(tmp_path, capsys, monkeypatch) -> None:
    """The answer ends its line; --raw keeps a piped prompt as it is (indentation and
    newlines are part of a completion's prompt), a chat prompt is stripped; a reader that
    goes away (`| head`) ends the command quietly with 128 + SIGPIPE, no traceback."""
    import io
    import subprocess
    import sys

    from braid.cli import _stdin_or, main

    model = str(save_tiny_model(tmp_path))
    flags = ["generate", "--model", model, "--num-kv-blocks", "256", "--block-size", "4",
             "--max-model-len", "512", "--raw", "--ignore-eos"]
    assert main([*flags, "--max-tokens", "4", "hi"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    for strip, want in ((False, "    ab\n\n\n"), (True, "ab")):
        monkeypatch.setattr("sys.stdin", io.StringIO("    ab\n\n\n"))
        assert _stdin_or("demo", strip=strip) == want
    assert main([*flags[:2], "/no/such/model", *flags[3:], " "]) == 2  # before the load
    assert "braid: error: the prompt is empty" in capsys.readouterr().err
    command = [sys.executable, "-m", "braid.cli", *flags, "--max-tokens", "400", "hi"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.read(5)
    proc.stdout.close()  # as `head -c 5` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err
    # `2>&1 | head`: the reader goes while the model loads (the progress bar writes then)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    proc.stdout.read(5)
    proc.stdout.close()
    assert proc.wait(timeout=60) == 141


def test_vllm_command_lines_run_as_they_are(capsys) -> None:
    """Flag names with underscores (vLLM's parser takes them), vLLM's parallel sizes of 1
    and gpu_memory_utilization (nothing to do on one CPU); a size above 1 is refused."""
    from braid.cli import _dashed, main
    from braid.config import SpecConfig

    # only a flag's name: values (after "=", or a whole --server-args text) stay
    for arg in ('--speculative-config {"method": "draft_model"}', "--stop=a_b", "a_b"):
        assert _dashed(arg) == arg
    assert _dashed("--max_num_seqs=8_1") == "--max-num-seqs=8_1"
    with pytest.raises(SystemExit):
        main(["serve", "--max_model_len", "abc"])
    assert "argument --max-model-len: expected an integer" in capsys.readouterr().err
    assert main(["serve", "--tensor_parallel_size", "1", "--pipeline-parallel-size=1",
                 "--gpu-memory-utilization", "0.9", "--model", "/no/such/model"]) == 2
    assert "/no/such/model" in capsys.readouterr().err  # the flags passed; the model did not
    with pytest.raises(SystemExit):
        main(["serve", "--tensor-parallel-size", "2"])
    assert ("argument --tensor-parallel-size: braid runs one model on one machine: must be 1, "
            "got 2") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--port", "abc"])
    assert "argument --port: invalid port value: 'abc'" in capsys.readouterr().err
    assert main(["serve", "--ssl-cert-reqs", "2", "--model", "/no/such/model"]) == 2
    assert "--ssl-cert-reqs 2 asks clients for certificates, which needs TLS" in \
        capsys.readouterr().err
    # an unknown flag with its subcommand's usage (it printed the top level's)
    for argv, command in ((["serve", "--bogus"], "serve"),
                          (["bench", "sweep", "--bogus", "1"], "bench sweep")):
        with pytest.raises(SystemExit):
            main(argv)
        err, flags = capsys.readouterr().err, " ".join(argv[len(command.split()):])
        assert f"braid {command}: error: unrecognized arguments: {flags}" in err
        assert f"usage: braid {command}" in err
    # vLLM's draft-model config names the model, not the method
    spec = SpecConfig.from_dict({"model": "tiny-draft", "num_speculative_tokens": 3})
    assert (spec.method, spec.model) == ("draft_model", "tiny-draft")


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
@pytest.mark.parametrize("degenerate", [
    {"temperature": 1e-300}, {"temperature": 1e-45}, {"top_p": 1e-300},
    {"repetition_penalty": 1e-300}], ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_degenerate_sampling_parameters_hurt_no_other_request(degenerate: dict,
                                                              spec: dict | None) -> None:
    """One request whose parameters are 0 or inf in float32 (a temperature or top_p of
    1e-300, a repetition penalty of 1e-300) batched with a greedy and a seeded random one:
    the other two give what they give alone, and it completes as its safe bound does (a tiny
    temperature or top_p greedily). They used to fail the whole step (top_p: an index of -1)
    or draw a garbage id from NaN probabilities (an id past the vocabulary on the real one)."""
    from braid.sampling_params import REPETITION_PENALTY_BOUNDS

    ps = prompts()
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)
    odd = SamplingParams(seed=5, max_tokens=12, ignore_eos=True, **degenerate)

    def outputs(requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple]:
        engine = make_engine(speculative_config=spec)
        for rid, (prompt, params) in requests.items():
            engine.add_request(rid, prompt, params)
        return {o.request_id: (o.outputs[0].token_ids, o.outputs[0].finish_reason)
                for o in engine.run_until_done() if o.finished}

    requests = {"greedy": (ps[0], GREEDY), "seeded": (ps[1], seeded), "odd": (ps[2], odd)}
    together = outputs(requests)
    for rid in ("greedy", "seeded"):
        assert together[rid] == outputs({rid: requests[rid]})[rid]
    if "repetition_penalty" in degenerate:
        bound = dataclasses.replace(odd, repetition_penalty=REPETITION_PENALTY_BOUNDS[0])
        assert together["odd"] == outputs({"odd": (ps[2], bound)})["odd"]
    else:
        assert together["odd"] == outputs({"odd": (ps[2], GREEDY)})["odd"]
    assert together["odd"][1] == "length"


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_a_sliding_window_model_generates_past_its_window(tmp_path, arch: str) -> None:
    """Windowed layers (all of Mistral's, Gemma 3's local ones) attend to their last 8
    positions: greedy output of a 27-token prompt and 30 new tokens is transformers' own,
    in prefill chunks of 5 with two requests at once, with prompt-lookup speculation on and
    off, and again after the engine went idle."""
    import transformers

    folder = save_tiny_model(tmp_path / "m", arch=arch, sliding_window=8)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = [[3 + (i * 7 + j) % 40 for i in range(27)] for j in range(2)]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3,
                        "prompt_lookup_min": 1}):
        engine = LLMEngine(EngineConfig(model=str(folder), log_stats_interval=0,
                                        max_num_batched_tokens=5, speculative_config=spec))
        assert engine.config.max_model_len == 512
        for _ in range(2):  # the second time after the engine went idle
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, params)
            done = {o.request_id: o.outputs[0].token_ids
                    for o in engine.run_until_done() if o.finished}
            assert [done["0"], done["1"]] == expected


@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_a_sliding_window_model_s_kv_blocks_stay_within_its_window(tmp_path, proposer: str
                                                                   ) -> None:
    """Every layer in a window of 8 (Mistral), blocks of 4: blocks that only hold positions
    before a request's window (and before a draft model's own progress) go back to the pool
    after each step, so two requests of 20 prompt and 60 new tokens hold at most 6 blocks each
    (the window's, the drafts', a draft model's lag) while the same run keeping every block
    holds 20 each; the tokens are the same, with
    prefix caching on, a third request on the same prompt after the engine went idle, and
    prompt lookup or a Mistral draft model speculating."""
    folder = save_tiny_model(tmp_path / "m", arch="mistral", sliding_window=8)
    spec: dict = {"method": proposer, "num_speculative_tokens": 3, "policy": "fixed"}
    if proposer == "ngram":
        spec["prompt_lookup_min"] = 1
    else:
        spec["model"] = str(save_tiny_model(tmp_path / "d", arch="mistral", sliding_window=8,
                                            seed=1))
    prompts = [[3 + (i * 5 + j) % 30 for i in range(20)] for j in range(2)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    results = []
    for release in (True, False):
        engine = LLMEngine(EngineConfig(model=str(folder), log_stats_interval=0, block_size=4,
                                        num_kv_blocks=256, enable_prefix_caching=True,
                                        speculative_config=spec))
        assert engine.scheduler.sliding_window == 8
        if not release:
            engine.scheduler.sliding_window = None
        most, outputs = 0, {}
        for rids, batch in ((["a", "b"], prompts), (["c"], prompts[:1])):
            for rid, p in zip(rids, batch, strict=True):
                engine.add_request(rid, p, params)
            while engine.has_unfinished_requests():
                outputs |= {o.request_id: o.outputs[0].token_ids for o in engine.step()
                            if o.finished}
                engine.scheduler.check_invariants()
                held = {r: len([b for b in engine.blocks.block_table(r) if b >= 0])
                        for r in engine.scheduler.requests}
                most = max(most, *held.values(), 0)
        results.append((most, outputs))
    (most_released, released), (most_kept, kept) = results
    assert released == kept and released["c"] == released["a"]
    assert most_released <= 6 < 20 <= most_kept


@pytest.mark.parametrize("proposer, num_kv_blocks", [
    (None, 512), ("ngram", 512), ("draft_model", 512), (None, 40), ("ngram", 40)])
def test_a_gemma3_model_s_windowed_layers_hold_kv_for_their_window_only(
        tmp_path, proposer: str | None, num_kv_blocks: int) -> None:
    """Gemma 3 with two global layers among six (a window of 8, blocks of 4): the global
    layers' block table holds every position, the windowed groups' only about a window and a
    step, through chunked prefills of 6 tokens, two requests at once and 50 new tokens each;
    greedy tokens and their logprobs are transformers' own, with speculation (prompt lookup,
    a Gemma 3 draft model) and without, and again for a third request on the first prompt
    after the engine went idle, which takes its prefix from the cache. With 40 blocks the two
    requests do not fit at once: preempted and resumed, their tokens are the same."""
    import transformers

    from braid.models.config import gemma3_layer_types

    shape = dict(arch="gemma3", num_hidden_layers=6, layer_types=gemma3_layer_types(6, 3))
    folder = save_tiny_model(tmp_path / "m", **shape)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompts = [[3 + (i * 5 + j) % 30 for i in range(30)] for j in range(2)]
    expected, expected_logprobs = [], []
    for p in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=50, do_sample=False,
                              eos_token_id=None, pad_token_id=0, output_scores=True,
                              return_dict_in_generate=True)
        expected.append(out.sequences[0, len(p):].tolist())
        expected_logprobs.append([float(torch.log_softmax(s[0], -1)[t])
                                  for s, t in zip(out.scores, expected[-1], strict=True)])
    spec: dict | None = None
    if proposer is not None:
        spec = {"method": proposer, "num_speculative_tokens": 3, "policy": "fixed",
                "prompt_lookup_min": 1}
        if proposer == "draft_model":
            spec = {k: v for k, v in spec.items() if k != "prompt_lookup_min"}
            spec["model"] = str(save_tiny_model(tmp_path / "d", seed=1, **shape))
    engine = LLMEngine(EngineConfig(model=str(folder), log_stats_interval=0, block_size=4,
                                    num_kv_blocks=num_kv_blocks, max_num_batched_tokens=6,
                                    max_model_len=96, enable_prefix_caching=True,
                                    speculative_config=spec))
    assert engine.blocks.windows == (None, 8, 8)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, logprobs=0)
    global_most, windowed_most, outputs = 0, 0, {}
    for rids, batch in ((["a", "b"], prompts), (["c"], prompts[:1])):
        for rid, p in zip(rids, batch, strict=True):
            engine.add_request(rid, p, params)
        while engine.has_unfinished_requests():
            outputs |= {o.request_id: o for o in engine.step() if o.finished}
            engine.scheduler.check_invariants()
            for rid in engine.scheduler.requests:
                tables = engine.blocks.block_tables(rid)
                global_most = max(global_most, len(tables[0]))
                windowed_most = max(windowed_most, *(sum(b >= 0 for b in t) for t in tables[1:]))
    assert [outputs[r].outputs[0].token_ids for r in "abc"] == expected + expected[:1]
    for r, want in zip("abc", expected_logprobs + expected_logprobs[:1], strict=True):
        out = outputs[r].outputs[0]  # (the tiny model soon repeats a token: its logprobs
        got = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        assert got == pytest.approx(want, abs=1e-4)  # tell a wrong window apart)
    assert global_most == 20 and windowed_most <= 6  # (8 + 6 positions, a block's rounding)
    if num_kv_blocks < 60:  # two requests of 20 global and 2 x 5 windowed blocks
        assert engine.stats.num_preemptions > 0
    else:  # all but the last of its prompt's blocks
        assert engine.stats.num_preemptions == 0 and outputs["c"].num_cached_tokens == 28


def test_a_hybrid_request_admitted_onto_blocks_its_step_publishes_is_requeued(tmp_path
                                                                              ) -> None:
    """Gemma 3's global group still caches a finished prompt but its windowed groups do not:
    C recomputes the prompt and publishes only windowed blocks (its global ones are already
    published), and B, admitted after C in the same step, shares the old global blocks and
    C's new windowed ones. Before that step runs again in parts, B goes back to waiting:
    its windowed blocks are written by C's part, not by B's."""
    from braid.models.config import gemma3_layer_types

    folder = save_tiny_model(tmp_path / "m", arch="gemma3", num_hidden_layers=6,
                             layer_types=gemma3_layer_types(6, 3))
    engine = LLMEngine(EngineConfig(model=str(folder), log_stats_interval=0, block_size=4,
                                    num_kv_blocks=256, max_num_batched_tokens=64,
                                    enable_prefix_caching=True))
    prompt = [3 + i for i in range(24)]
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=2))
    list(engine.run_until_done())
    blocks = engine.blocks
    for g in range(1, blocks.num_tables):  # the windowed groups' published blocks go
        hashes = blocks._chain(("probe", g), lambda s, e: prompt[s:e], 6)
        blocks.unpublish([blocks._cached[h] for h in hashes if h in blocks._cached])
    blocks.free("probe")
    for rid in ("c", "b"):
        engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=2))
    sched = engine.scheduler.schedule()
    b = engine.requests["b"]
    assert [s.request.request_id for s in sched.scheduled] == ["c", "b"]
    assert b.num_computed_tokens == 20  # five blocks shared
    global_blocks, *windowed = blocks.block_tables("b")
    assert not set(global_blocks) & set(sched.published)
    assert set(sched.published) & {x for t in windowed for x in t}
    engine.scheduler.requeue_dependents(sched)
    assert b in engine.scheduler.waiting and b.num_computed_tokens == 0
