"""Logits and KV cache of braid's model equal the transformers reference on the same weights."""

from __future__ import annotations

import pytest
import torch

from braid.files import ModelLoadError
from braid.models.attention import build_attention_metadata
from braid.models.qwen2 import can_pack
from tests.tiny import braid_model, hf_model, random_weights, tiny_config

BLOCK = 4
TOL = 1e-4


class PagedRun:
    """Drives braid's model directly: a KV cache, per-request block tables, step inputs."""

    def __init__(self, model, num_blocks: int = 64, kv_dtype: torch.dtype = torch.float32
                 ) -> None:
        cfg = model.config
        self.model = model
        self.kv = torch.zeros(
            cfg.num_hidden_layers, 2, num_blocks * BLOCK, cfg.num_key_value_heads, cfg.head_dim,
            dtype=kv_dtype,
        )
        model.bind_kv_cache(self.kv)
        # Scattered, non-contiguous blocks so paging bugs show up.
        self.free = list(torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)))
        self.tables: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}

    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """Run one flat batch; chunks maps request -> its next query tokens. Returns logits."""
        ids, pos, qlens, ctx, tables = [], [], [], [], []
        for rid, toks in chunks.items():
            c = self.done.get(rid, 0)
            table = self.tables.setdefault(rid, [])
            while len(table) * BLOCK < c + len(toks):
                table.append(int(self.free.pop()))
            ids += toks
            pos += range(c, c + len(toks))
            qlens.append(len(toks))
            ctx.append(c)
            tables.append(table)
            self.done[rid] = c + len(toks)
        meta = build_attention_metadata(qlens, ctx, tables, BLOCK)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), meta)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for rid, n in zip(chunks, qlens, strict=True):
            out[rid] = logits[start : start + n]
            start += n
        return out

    def cached_kv(self, rid: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.done[rid]
        table = torch.tensor(self.tables[rid])
        p = torch.arange(n)
        slots = table[p // BLOCK] * BLOCK + p % BLOCK
        return self.kv[layer, 0, slots], self.kv[layer, 1, slots]  # [n, KVH, D]


def reference(hf, tokens: list[int]):
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), use_cache=True)
    return out.logits[0], out.past_key_values


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


ARCHITECTURES = ["qwen2", "llama", "qwen3", "mistral", "phi3", "smollm3", "gemma3", "granite",
                 "ministral", "olmo2", "olmo3"]


@pytest.fixture(params=[(arch, packed) for packed in (False, True) for arch in ARCHITECTURES],
                ids=[arch + suffix for suffix in ("", "-packed") for arch in ARCHITECTURES])
def models(request):
    arch, packed = request.param
    # SmolLM3: its second layer without RoPE (NoPE)
    cfg = tiny_config(arch, **({"no_rope_layers": [1, 0]} if arch == "smollm3" else {}))
    hf = hf_model(cfg, seed=0)
    return hf, braid_model(cfg, dict(hf.state_dict()), packed=packed)


def test_whole_prompt_prefill(models) -> None:
    hf, model = models
    toks = prompt(37, seed=1)
    ref_logits, ref_cache = reference(hf, toks)
    run = PagedRun(model)
    logits = run.step({"a": toks})["a"]
    torch.testing.assert_close(logits, ref_logits, atol=TOL, rtol=0)
    for layer in range(model.config.num_hidden_layers):
        k, v = run.cached_kv("a", layer)
        ref = ref_cache.layers[layer]
        kept = ref.keys.shape[2]  # (transformers keeps a windowed layer's last positions only)
        torch.testing.assert_close(k[-kept:].transpose(0, 1), ref.keys[0], atol=TOL, rtol=0)
        torch.testing.assert_close(v[-kept:].transpose(0, 1), ref.values[0], atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk_sizes", [[1] * 9, [5, 1, 17, 3, 20], [16, 17, 18]])
def test_chunked_prefill_matches_whole(models, chunk_sizes: list[int]) -> None:
    hf, model = models
    toks = prompt(sum(chunk_sizes), seed=2)
    ref_logits, _ = reference(hf, toks)
    run, start = PagedRun(model), 0
    for n in chunk_sizes:
        logits = run.step({"a": toks[start : start + n]})["a"]
        torch.testing.assert_close(logits, ref_logits[start : start + n], atol=TOL, rtol=0)
        start += n


def test_mixed_flat_batch(models) -> None:
    """One forward holding a prefill chunk, a single decode token and a 5-token window."""
    hf, model = models
    seqs = {"prefill": prompt(40, 3), "decode": prompt(23, 4), "window": prompt(30, 5)}
    run = PagedRun(model)
    # Warm-up steps leave each request with some context cached.
    run.step({"prefill": seqs["prefill"][:12], "decode": seqs["decode"][:22]})
    run.step({"window": seqs["window"][:25]})
    logits = run.step({
        "prefill": seqs["prefill"][12:40],  # a 28-token chunk (long group)
        "decode": seqs["decode"][22:23],  # one token
        "window": seqs["window"][25:30],  # a 5-token verification window
    })
    for rid, (lo, hi) in {"prefill": (12, 40), "decode": (22, 23), "window": (25, 30)}.items():
        ref_logits, ref_cache = reference(hf, seqs[rid])
        torch.testing.assert_close(logits[rid], ref_logits[lo:hi], atol=TOL, rtol=0)
        k, _ = run.cached_kv(rid, layer=1)
        torch.testing.assert_close(k.transpose(0, 1), ref_cache.layers[1].keys[0], atol=TOL, rtol=0)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("arch, scaling", [
    ("llama", {"rope_type": "linear", "factor": 4.0}),
    # with head_dim 16 the frequencies fall in all three of llama3's bands
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ("qwen3", YARN),  # Qwen's long-context configs
    ("llama", YARN | {"beta_fast": 8, "beta_slow": 2, "truncate": False}),
    ("qwen2", YARN | {"mscale": 1.0, "mscale_all_dim": 0.5}),
    ("llama", YARN | {"attention_factor": 1.3}),
], ids=["linear", "llama3", "yarn", "yarn-betas", "yarn-mscales", "yarn-attention-factor"])
def test_rope_scaling_matches_transformers(arch: str, scaling: dict) -> None:
    """Llama 3.x configs scale RoPE (llama3), Qwen's long-context ones by YaRN (the
    frequencies ramped between kept and divided, cos and sin scaled): braid's logits equal
    transformers' on the same weights, positions beyond the original context included (it
    ran plain RoPE, far off)."""
    cfg = tiny_config(arch, rope_scaling=scaling)
    hf = hf_model(cfg, seed=0)
    tokens = prompt(100, seed=3)
    got = PagedRun(braid_model(cfg, dict(hf.state_dict()))).step({"a": tokens})["a"]
    expected, _ = reference(hf, tokens)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=TOL)
    plain = PagedRun(braid_model(tiny_config(arch), dict(hf.state_dict())))
    assert not torch.allclose(plain.step({"a": tokens})["a"], expected, atol=1e-2)


LONG_ROPE = {"rope_type": "longrope", "original_max_position_embeddings": 32,
             "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 9.0],
             "short_factor": [1.0, 1.1, 1.2, 1.1, 1.3, 1.0, 1.5, 2.0]}


def long_rope(partial: float, head_dim: int = 16) -> dict:
    """LONG_ROPE's factors for the frequencies `partial` of a head turns."""
    n = int(head_dim * partial) // 2
    return LONG_ROPE | {key: LONG_ROPE[key][:n] for key in ("long_factor", "short_factor")}


@pytest.mark.parametrize("partial", [1.0, 0.75, 0.5])
@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("packed", [False, True], ids=["float", "packed"])
def test_phi3_long_rope_and_partial_rotary_match_transformers(partial: float, long: bool,
                                                              packed: bool) -> None:
    """Phi-3.5 / Phi-4-mini: LongRoPE (each frequency divided by its own factor, cos and sin
    scaled) with its short factors where the served context (context_length: --max-model-len)
    stays within the original one, its long ones past it, as transformers runs a sequence that
    short or that long; and a partial rotary embedding (Phi-4-mini turns 3/4 of each head).
    Logits equal transformers' over a whole prompt and in chunks; plain RoPE's are far off."""
    ntok = 100 if long else 30
    cfg = tiny_config("phi3", partial_rotary_factor=partial, rope_scaling=long_rope(partial),
                      context_length=512 if long else 32)
    assert cfg.long_rope == long and cfg.rotary_dim == int(16 * partial)
    hf = hf_model(cfg, seed=0)
    tokens = prompt(ntok, seed=3)
    expected, _ = reference(hf, tokens)
    run = PagedRun(braid_model(cfg, dict(hf.state_dict()), packed=packed))
    torch.testing.assert_close(run.step({"a": tokens[:ntok // 3]})["a"],
                               expected[:ntok // 3], atol=TOL, rtol=TOL)
    torch.testing.assert_close(run.step({"a": tokens[ntok // 3:]})["a"],
                               expected[ntok // 3:], atol=TOL, rtol=TOL)
    plain = PagedRun(braid_model(tiny_config("phi3"), dict(hf.state_dict())))
    assert not torch.allclose(plain.step({"a": tokens})["a"], expected, atol=1e-2)


def test_rope_that_is_not_run_is_refused() -> None:
    """A partial rotary factor where braid does not rotate part of a head, LongRoPE factors
    of the wrong count: errors naming the key."""
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported for llama"):
        tiny_config("llama", partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="long_factor needs 6 factors"):
        tiny_config("phi3", partial_rotary_factor=0.75, rope_scaling=long_rope(1.0))
    with pytest.raises(ValueError, match="short_factor must be a list of numbers > 0"):
        tiny_config("phi3", rope_scaling=LONG_ROPE | {"short_factor": [0.0] * 8})


def test_untied_lm_head_and_no_bias() -> None:
    cfg = tiny_config("qwen2", tie_word_embeddings=False)
    hf = hf_model(cfg, seed=3)
    model = braid_model(cfg, dict(hf.state_dict()))
    toks = prompt(10, 6)
    torch.testing.assert_close(
        PagedRun(model).step({"a": toks})["a"], reference(hf, toks)[0], atol=TOL, rtol=0
    )


@pytest.mark.parametrize("tied", [True, False])
def test_logits_of_the_first_ids_only(tied: bool) -> None:
    cfg = tiny_config("qwen2", tie_word_embeddings=tied)
    model = braid_model(cfg, dict(hf_model(cfg, seed=3).state_dict()))
    hidden = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    full = model.compute_logits(hidden)
    some = model.compute_logits(hidden, 50)
    torch.testing.assert_close(some[:, :50], full[:, :50], atol=1e-5, rtol=1e-5)
    assert torch.isneginf(some[:, 50:]).all()
    assert torch.equal(model.compute_logits(hidden, 10**6), full)


def test_missing_weight_is_reported() -> None:
    cfg = tiny_config("llama")
    weights = dict(hf_model(cfg).state_dict())
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match="up_proj"):
        braid_model(cfg, weights)


@pytest.mark.parametrize("override, match", [
    ({"num_key_value_heads": 4}, r"'model.layers.0.self_attn.k_proj.weight' is \[32, 64\] "
                                 r"where the config makes it \[64, 64\]"),
    ({"intermediate_size": 100}, r"mlp.gate_proj.weight' is \[128, 64\] where the config "
                                 r"makes it \[100, 64\]"),
    ({"vocab_size": 300}, r"embed_tokens.weight' is \[272, 64\]"),
    ({"num_hidden_layers": 1}, r"unexpected weight 'model\.layers\.1\.[a-z_.]+' for this config "
                               r"\(qwen2, 1 layers\)"),
    ({"num_hidden_layers": 3}, r"missing weights: \['model.layers.2"),
])
def test_a_config_that_does_not_match_its_weights_is_a_load_error(
        override: dict, match: str) -> None:
    """A config.json that disagrees with its checkpoint (another KV head count, sizes or
    layer count) is refused naming the weight; a KV head count that fit fewer rows than the
    fused QKV holds loaded silently and generated garbage."""
    weights = random_weights(tiny_config("qwen2"), seed=0)
    with pytest.raises(ModelLoadError, match=match):
        braid_model(tiny_config("qwen2", **override), weights)


@pytest.mark.skipif(not can_pack("cpu", torch.bfloat16), reason="CPU without native bf16")
def test_packed_bfloat16_matches_reference() -> None:
    """A bf16 model (how the draft runs on CPUs with native bf16) through the packed kernels,
    including 1-2 row forwards (padded), stays within bf16 rounding of the fp32 reference."""
    cfg = tiny_config("qwen2")
    hf = hf_model(cfg, seed=0)
    model = braid_model(cfg, dict(hf.state_dict())).to(torch.bfloat16)
    model.pack_linear_weights()
    toks = prompt(12, seed=7)
    ref_logits, _ = reference(hf, toks)
    run = PagedRun(model)
    run.kv = run.kv.to(torch.bfloat16)
    model.bind_kv_cache(run.kv)
    logits = torch.cat([run.step({"a": toks[s:e]})["a"] for s, e in ((0, 8), (8, 9), (9, 11),
                                                                       (11, 12))])
    assert (logits - ref_logits).abs().max() < 0.03 * ref_logits.abs().max()
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("arch", ["mistral", "phi3", "gemma3", "ministral", "olmo3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["row-kernel", "sdpa"])
def test_sliding_window_layers_attend_inside_their_window(arch: str, dtype: torch.dtype
                                                          ) -> None:
    """A window of 8 over 40 tokens: every position has transformers' logits, whole,
    chunked (chunks across the window's edge) and beside another request, on the compiled
    row-by-row attention (float32) and on SDPA (float64); the same weights attending to
    every position give other logits, so the window is what is checked."""
    cfg = tiny_config(arch, sliding_window=8)
    hf = hf_model(cfg, seed=2)
    toks = prompt(40, seed=9)
    expected = reference(hf, toks)[0]  # (compute_logits gives float32)
    model = braid_model(cfg, dict(hf.state_dict())).to(dtype)
    run = PagedRun(model, kv_dtype=dtype)
    torch.testing.assert_close(run.step({"a": toks})["a"], expected, atol=TOL, rtol=0)
    run, start = PagedRun(model, kv_dtype=dtype), 0
    for n in (5, 1, 17, 3, 14):
        got = run.step({"a": toks[start:start + n], f"b{n}": prompt(n + 10, seed=n)})["a"]
        torch.testing.assert_close(got, expected[start:start + n], atol=TOL, rtol=0)
        start += n
    unwindowed = braid_model(tiny_config(arch, sliding_window=None, layer_types=None),
                             dict(hf.state_dict())).to(dtype)
    full = PagedRun(unwindowed, kv_dtype=dtype).step({"a": toks})["a"]
    assert not torch.allclose(full[8:], expected[8:], atol=1e-2)
    torch.testing.assert_close(full[:8], expected[:8], atol=TOL, rtol=0)
