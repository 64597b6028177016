"""Quantized models: QuantLinear is the product with its dequantized weight, quantized models
stay close to float, speculation over a quantized model is lossless, and without the kernels a
quantized GGUF loads as float."""

from __future__ import annotations

import gc
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from torch import nn

from braid.config import ConfigError, EngineConfig
from braid.engine.engine import LLMEngine
from braid.files import ModelLoadError
from braid.kernels import kernel_isa, quant_ops
from braid.models.build import FAMILIES, load_model
from braid.models.quant import (
    HUGE_PAGE,
    QuantEmbedding,
    QuantLinear,
    QuantWeight,
    as_kernel_format,
    huge_page_zeros,
    quantize_float,
    weights_to_huge_pages,
)
from braid.models.qwen2 import Qwen2ForCausalLM
from braid.sampling_params import SamplingParams
from tests.conftest import write_gguf
from tests.engine.test_engine import STAGGERED, run
from tests.kernels.test_quant import GEMM_RTOL, random_weight
from tests.models.test_qwen2 import PagedRun
from tests.tiny import VOCAB, braid_model, random_weights, save_tiny_model, tiny_config

CFG = tiny_config("qwen2")
WEIGHTS = random_weights(CFG, seed=0)
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 256, 4, 2, 2  # FFN: one K-quant super-block
HEAD_DIM = HIDDEN // HEADS
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
# Tolerances on the logits' relative (Frobenius) error against float, 2.5-3.5x what these seeded
# tiny models show: int8 activations alone (the GGUF's blocks run as they are) 3.5%, Q8_0
# weights and int8 activations 1.4%, Q4_0 weights (16 levels per block of 32) 16%.
ACTIVATIONS_RTOL, INT8_RTOL, INT4_RTOL = 0.1, 5e-2, 0.4
# Keys and values rounded to 16 bits (float16 keeps 11 significant bits, bfloat16 8), which
# int8-quantized activations downstream can amplify.
KV16_RTOL = 0.05


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    if quant_ops() is None:
        pytest.skip("quantized kernels unavailable (no compiler, or BRAID_NO_KERNELS=1)")


def rel_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def logits(model: Qwen2ForCausalLM, tokens: list[int] = PROMPT) -> torch.Tensor:
    """[len(tokens), vocab]: one prefill of `tokens`."""
    return PagedRun(model).step({"p": tokens})["p"]


def quant_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, QuantLinear | QuantEmbedding)]


def quantized_gguf(path: Path, seed: int = 0, down_types: tuple[Q, ...] = (Q.Q4_K, Q.Q6_K)
                   ) -> Path:
    """A tiny Qwen2 GGUF whose embedding and projections are Q8_0 / Q4_0 / Q5_0 blocks, and
    each layer's down projection (the only one with rows of 256) `down_types[layer]` (norms and
    biases float32), with weights of std 0.2 like tests.tiny's."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    def blocks(array: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
        return quantize(array, qtype), qtype

    tensors = {"token_embd.weight": blocks(rand(VOCAB, HIDDEN), Q.Q8_0),
               "output_norm.weight": (1 + rand(HIDDEN), None)}
    for i in range(LAYERS):
        down_type = down_types[i]
        down = random_weight(down_type, HIDDEN, FFN, seed=seed + i, std=0.2).numpy()
        tensors.update({
            f"blk.{i}.attn_norm.weight": (1 + rand(HIDDEN), None),
            f"blk.{i}.attn_q.weight": blocks(rand(HEADS * HEAD_DIM, HIDDEN), Q.Q8_0),
            f"blk.{i}.attn_k.weight": blocks(rand(KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_0),
            f"blk.{i}.attn_v.weight": blocks(rand(KV_HEADS * HEAD_DIM, HIDDEN), Q.Q5_0),
            f"blk.{i}.attn_q.bias": (rand(HEADS * HEAD_DIM), None),
            f"blk.{i}.attn_k.bias": (rand(KV_HEADS * HEAD_DIM), None),
            f"blk.{i}.attn_v.bias": (rand(KV_HEADS * HEAD_DIM), None),
            f"blk.{i}.attn_output.weight": blocks(rand(HIDDEN, HIDDEN), Q.Q8_0),
            f"blk.{i}.ffn_norm.weight": (1 + rand(HIDDEN), None),
            f"blk.{i}.ffn_gate.weight": blocks(rand(FFN, HIDDEN), Q.Q4_0),
            f"blk.{i}.ffn_up.weight": blocks(rand(FFN, HIDDEN), Q.Q8_0),
            f"blk.{i}.ffn_down.weight": (down, down_type),
        })
    hparams = dict(context_length=512, embedding_length=HIDDEN, feed_forward_length=FFN,
                   block_count=LAYERS, head_count=HEADS, head_count_kv=KV_HEADS,
                   layer_norm_rms_eps=1e-6, rope_freq_base=1e4)
    return write_gguf(path, "qwen2", tensors, hparams)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantized_gguf(tmp_path_factory.mktemp("quant") / "tiny-q.gguf")


@pytest.fixture(scope="module")
def float_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("float") / "tiny")


def engine(target: Qwen2ForCausalLM | None = None, draft: Qwen2ForCausalLM | None = None,
           **options: object) -> LLMEngine:
    """An engine over `target` (None: loaded from options["model"])."""
    options = {"model": "tiny-q", "block_size": 4, "num_kv_blocks": 256, "max_model_len": 256,
               "log_stats_interval": 0, **options}
    return LLMEngine(EngineConfig(**options), model=target,  # type: ignore[arg-type]
                     draft_model=draft)


def spec_config(method: str, k: int = 3, **extra: object) -> dict[str, object]:
    spec = {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "policy": "fixed", **extra}
    if method == "draft_model":
        spec.setdefault("model", "tiny-q-draft")
    return spec


# ---- QuantLinear -------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q5_0], ids=lambda t: t.name)
def test_quant_linear_is_the_product_with_its_dequantized_weight(qtype: Q) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    layer = QuantLinear(64, 48, bias=True)
    with torch.no_grad():
        layer.bias.copy_(bias)  # type: ignore[union-attr]
    layer.set_rows(0, quantize_float(weight, qtype))
    x = torch.randn(2, 3, 64, generator=gen)
    got = layer(x)
    assert got.shape == (2, 3, 48) and got.dtype == torch.float32
    expected = F.linear(x, layer.segments[0][1].dequantize(), bias)
    assert rel_error(got, expected) < GEMM_RTOL
    assert rel_error(layer.segments[0][1].dequantize(), weight) < (0.2 if qtype == Q.Q4_0
                                                                   else 0.1)


def test_segments_of_different_formats_fill_their_rows() -> None:
    """A fused projection whose parts differ in format (K-quant and 32-value activations)."""
    k_rows = random_weight(Q.Q4_K, 16, 256, seed=1)
    q8_rows = quantize_float(torch.randn(32, 256, generator=torch.Generator().manual_seed(2)),
                             Q.Q8_0)
    layer = QuantLinear(256, 48)
    layer.set_rows(16, q8_rows)  # in any order
    layer.set_rows(0, QuantWeight(k_rows, Q.Q4_K, 256))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    got = layer(x)
    weight = torch.cat([torch.from_numpy(dequantize(k_rows.numpy(), Q.Q4_K)),
                        q8_rows.dequantize()])
    assert rel_error(got, F.linear(x, weight)) < GEMM_RTOL
    ops = quant_ops()
    assert ops is not None
    k_part = layer.segments[0][1]
    isa = kernel_isa()
    alone = ops.qgemm(ops.quantize_activations(x, int(Q.Q4_K), isa), k_part.data, k_part.layout,
                      256, isa)
    assert torch.equal(got[:, :16], alone)
    # Q4_K runs with its scales as bytes (unpacked or in panels): 148 bytes a block, not 144.
    assert layer.weight_bytes() == k_rows.numel() // 144 * 148 + q8_rows.data.numel()


def test_adjacent_segments_of_one_format_act_as_one_matrix() -> None:
    """q and k of one format are stored as one segment; rows come out as from one matrix."""
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(4))
    parts = QuantLinear(64, 48)
    parts.set_rows(16, quantize_float(weight[16:], Q.Q8_0))
    parts.set_rows(0, quantize_float(weight[:16], Q.Q8_0))
    whole = QuantLinear(64, 48)
    whole.set_rows(0, quantize_float(weight, Q.Q8_0))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    assert torch.equal(parts(x), whole(x))
    assert parts.weight_bytes() == whole.weight_bytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("nbytes", [HUGE_PAGE // 2, 3 * HUGE_PAGE + 4096])
@pytest.mark.parametrize("huge_pages", ["1", "0"])
def test_huge_page_zeros_are_zeros_that_outlive_their_mapping(
        dtype: torch.dtype, nbytes: int, huge_pages: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BRAID_HUGE_PAGES", huge_pages)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    t = huge_page_zeros((nbytes // itemsize // 4, 4), dtype)
    # torch's own allocation (resizable storage) unless asked for and large enough; a mapping
    # (a fixed-size buffer) otherwise, on systems that have madvise
    if huge_pages == "0" or nbytes < HUGE_PAGE:
        assert t.untyped_storage().resizable()
    elif hasattr(mmap, "MADV_HUGEPAGE"):
        assert not t.untyped_storage().resizable()
    assert t.dtype == dtype and t.shape == (nbytes // itemsize // 4, 4)
    assert t.is_contiguous() and not t.any()
    gc.collect()  # the mapping is owned by the tensor, not by a name here
    t.fill_(3)
    assert bool((t == 3).all())


@pytest.mark.parametrize("huge_pages", ["1", "0"])
def test_weights_move_to_huge_pages_unchanged_and_still_shared(
        huge_pages: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed weights are copied once each (a QuantWeight two modules share stays shared)
    and compute exactly what they did; with huge pages off they are not copied at all."""
    monkeypatch.setenv("BRAID_HUGE_PAGES", huge_pages)
    weight = torch.randn(2048, 1024, generator=torch.Generator().manual_seed(6))
    first = QuantLinear(1024, 2048)
    first.set_rows(0, quantize_float(weight, Q.Q8_0))
    assert first.weight_bytes() > HUGE_PAGE
    second = QuantLinear(1024, 2048)
    second.segments = first.segments
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(7))
    before, pointer = first(x), first.segments[0][1].data.data_ptr()
    weights_to_huge_pages([first, second])
    moved = huge_pages == "1" and hasattr(mmap, "MADV_HUGEPAGE")
    assert (first.segments[0][1].data.data_ptr() != pointer) == moved
    assert second.segments[0][1] is first.segments[0][1]
    assert torch.equal(first(x), before)


def test_rows_that_do_not_fit_raise() -> None:
    layer = QuantLinear(64, 48)
    with pytest.raises(ValueError, match="do not fit"):
        layer.set_rows(32, quantize_float(torch.randn(32, 64), Q.Q8_0))
    with pytest.raises(ValueError, match="do not fit"):
        layer.set_rows(0, quantize_float(torch.randn(32, 96), Q.Q8_0))
    embedding = QuantEmbedding(VOCAB, 64)
    with pytest.raises(ValueError, match="does not fit"):
        embedding.set_rows(0, quantize_float(torch.randn(VOCAB - 1, 64), Q.Q8_0))


def test_formats_without_a_kernel_are_requantized_to_q8_0() -> None:
    weight = torch.randn(32, 256, generator=torch.Generator().manual_seed(0))
    tq2_0 = QuantWeight(torch.from_numpy(quantize(weight.numpy(), Q.TQ2_0)), Q.TQ2_0, 256)
    layer = QuantLinear(256, 32)
    layer.set_rows(0, tq2_0)
    assert layer.segments[0][1].qtype == Q.Q8_0
    x = torch.randn(3, 256)
    expected = F.linear(x, torch.from_numpy(dequantize(tq2_0.data.numpy(), Q.TQ2_0)))
    assert rel_error(layer(x), expected) < GEMM_RTOL


# ---- models ------------------------------------------------------------------------------------


def test_q8_0_model_from_float_weights_is_close_to_float() -> None:
    model = Qwen2ForCausalLM(CFG, quant_type=Q.Q8_0)
    model.load_weights(WEIGHTS.items())
    model.eval()
    for name in ("lm_head", "layers.0.self_attn.qkv_proj", "layers.0.self_attn.o_proj",
                 "layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"):
        assert isinstance(model.get_submodule(name), QuantLinear)
    lm_head, embedding = model.get_submodule("lm_head"), model.embed_tokens
    assert isinstance(lm_head, QuantLinear) and isinstance(embedding, QuantEmbedding)
    assert lm_head.segments[0][1] is embedding.quant  # the tied LM head runs the embedding's
    got, expected = logits(model), logits(braid_model(CFG, WEIGHTS))
    assert torch.isfinite(got).all()
    assert rel_error(got, expected) < INT8_RTOL


def test_gguf_blocks_run_as_they_are_close_to_dequantized(gguf_path: Path) -> None:
    quantized, tokenizer = load_model(str(gguf_path), quantization="auto")
    dequantized, _ = load_model(str(gguf_path), quantization="none")
    assert tokenizer is not None
    assert len(quant_modules(quantized)) == 2 + LAYERS * 4  # embedding, LM head, projections
    formats = {w.qtype for m in quantized.modules() if isinstance(m, QuantLinear)
               for _, w in m.segments}
    assert formats == {Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K}
    assert not quant_modules(dequantized)
    assert quantized.weight_bytes() < dequantized.weight_bytes() / 2
    # Same weight values: only the int8 activations differ.
    assert rel_error(logits(quantized), logits(dequantized)) < ACTIVATIONS_RTOL


MORE_FORMATS = [Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.Q4_1, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS]


@pytest.mark.parametrize("qtype", MORE_FORMATS, ids=[t.name for t in MORE_FORMATS])
def test_more_gguf_formats_run_as_they_are(tmp_path: Path, qtype: Q) -> None:
    """Q5_K (Q5_K_M files' main format), Q3_K (Q3_K_S/M/L's), Q2_K, IQ4_XS, and Q4_1 / Q5_1 /
    IQ4_NL (what llama.cpp stores in K-quant files for rows not a multiple of 256) have their own
    kernels: they are not re-quantized to Q8_0, and the logits are the dequantized model's up
    to the int8 activations."""
    path = quantized_gguf(tmp_path / "k.gguf", down_types=(qtype, qtype))
    quantized, _ = load_model(str(path), quantization="auto")
    dequantized, _ = load_model(str(path), quantization="none")
    for layer in quantized.layers:
        assert [w.qtype for _, w in layer.mlp.down_proj.segments] == [qtype]
    assert rel_error(logits(quantized), logits(dequantized)) < ACTIVATIONS_RTOL


def test_formats_without_a_kernel_run_as_q8_0_or_are_load_errors(tmp_path: Path) -> None:
    """IQ2_XXS, which gguf-py reads and the kernels do not, runs as Q8_0 blocks of its values;
    Q1_0, which neither reads, is a ModelLoadError naming the tensor under every quantization
    (under `auto` it was gguf-py's NotImplementedError)."""
    path = quantized_gguf(tmp_path / "iq2.gguf", down_types=(Q.IQ2_XXS, Q.IQ2_XXS))
    quantized, _ = load_model(str(path), quantization="auto")
    dequantized, _ = load_model(str(path), quantization="none")
    for layer in quantized.layers:
        assert [w.qtype for _, w in layer.mlp.down_proj.segments] == [Q.Q8_0]
    assert rel_error(logits(quantized), logits(dequantized)) < INT8_RTOL
    path = quantized_gguf(tmp_path / "q1.gguf", down_types=(Q.Q4_K, Q.Q1_0))
    for quantization in ("auto", "none", "int4"):
        with pytest.raises(ModelLoadError, match="tensor blk.1.ffn_down.weight: unsupported "
                                                 "GGUF tensor type Q1_0"):
            load_model(str(path), quantization=quantization)


@pytest.mark.parametrize("quantization, rtol", [("int8", INT8_RTOL), ("int4", INT4_RTOL)])
def test_float_checkpoint_quantized_at_load(float_folder: Path, quantization: str,
                                            rtol: float) -> None:
    model, _ = load_model(str(float_folder), quantization=quantization)
    reference, _ = load_model(str(float_folder), quantization="auto")
    assert not quant_modules(reference)  # float checkpoints stay float unless asked
    assert len(quant_modules(model)) == 2 + LAYERS * 4  # embedding, LM head and projections
    expected = Q.Q8_0 if quantization == "int8" else Q.Q4_0
    assert {w.qtype for m in model.modules() if isinstance(m, QuantLinear)
            for _, w in m.segments} == {expected}
    error = rel_error(logits(model), logits(reference))
    assert 0 < error < rtol


def test_int4_requantizes_a_gguf_s_wider_projections(gguf_path: Path) -> None:
    """int4 on a GGUF: layers stored in Q5_0 / Q6_K / Q8_0 become Q4_0, Q4_0 and Q4_K ones
    stay as they are, and the embedding and the LM head keep the file's format."""
    auto, _ = load_model(str(gguf_path))
    model, _ = load_model(str(gguf_path), quantization="int4")
    layers = {w.qtype for layer in model.layers for m in quant_modules(layer)
              if isinstance(m, QuantLinear) for _, w in m.segments}
    assert layers == {Q.Q4_0, Q.Q4_K}
    assert model.embed_tokens.quant is not None and model.embed_tokens.quant.qtype == Q.Q8_0
    assert model.lm_head is not None
    assert [w.qtype for _, w in model.lm_head.segments] == [Q.Q8_0]
    assert model.weight_bytes() < auto.weight_bytes()
    assert 0 < rel_error(logits(model), logits(auto)) < INT4_RTOL


# ---- engine: speculation over a quantized model is lossless ------------------------------------


@pytest.fixture(scope="module")
def target(gguf_path: Path) -> Qwen2ForCausalLM:
    return load_model(str(gguf_path))[0]


@pytest.fixture(scope="module")
def reference(target: Qwen2ForCausalLM) -> dict[str, list[int]]:
    return run(engine(target, max_num_batched_tokens=256), STAGGERED, GREEDY)


def test_quantized_batches_match_requests_alone(target: Qwen2ForCausalLM,
                                                reference: dict[str, list[int]]) -> None:
    for i in (0, 1, 4):  # prompts of 3, 70 and 140 tokens
        alone = run(engine(target, max_num_seqs=1, max_num_batched_tokens=256), {0: [i]},
                    GREEDY)
        assert alone == {str(i): reference[str(i)]}


def tiny_q8_0(family: str) -> Qwen2ForCausalLM:
    """A tiny model of the family on Q8_0 weights (Gemma 3: a windowed layer of 4 positions
    and a global one; Qwen3: per-head norms)."""
    cfg = tiny_config(family, **({"sliding_window": 4} if family == "gemma3" else {}))
    model = FAMILIES[family](cfg, quant_type=Q.Q8_0)
    model.load_weights(random_weights(cfg, seed=4).items())
    return model.eval()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3", "granite"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
def test_fused_layers_are_the_modules_bit_for_bit(request: pytest.FixtureRequest, family: str,
                                                  kv_dtype: torch.dtype) -> None:
    """Prefill chunks, decodes and a verification-sized window in mixed flat batches give
    the same logits and KV cache whether the layers run as compiled calls (ops.FusedLayer,
    with Qwen3's head norms or Granite's multipliers; ops.GemmaLayer) or as modules, with each
    KV cache type."""
    target = request.getfixturevalue("target") if family == "qwen2" else tiny_q8_0(family)
    steps = [{"a": PROMPT[:17], "b": PROMPT[5:9]}, {"a": PROMPT[17:], "b": [7]},
             {"a": [11, 12, 13, 14], "b": [8]}, {"a": [15], "c": PROMPT[:3]}]
    runs = []
    for fuse in (False, True):
        target.fuse_layers = fuse
        paged = PagedRun(target, kv_dtype=kv_dtype)
        runs.append(([paged.step(chunks) for chunks in steps], paged.kv.clone()))
    target.fuse_layers = True
    assert target._fused is not None  # the compiled path ran
    (logits_modules, kv_modules), (logits_fused, kv_fused) = runs
    assert torch.equal(kv_fused, kv_modules)
    for modules, fused in zip(logits_modules, logits_fused, strict=True):
        assert modules.keys() == fused.keys()
        assert all(torch.equal(fused[r], modules[r]) for r in modules)


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_a_16_bit_kv_cache(gguf_path: Path, target: Qwen2ForCausalLM, kv_cache_dtype: str
                           ) -> None:
    """--kv-cache-dtype: the cache holds twice the blocks in the same bytes as a float32
    one; batches equal requests alone; greedy speculation with a draft (whose cache is 16-bit
    too) equals greedy without it; and the tokens stay close to the float32 cache's (logits
    move by the 16-bit rounding of keys and values only)."""
    wide = engine(target, num_kv_blocks=None, kv_cache_gib=1 / 64, kv_cache_dtype="float32")
    narrow = engine(target, num_kv_blocks=None, kv_cache_gib=1 / 64, kv_cache_dtype=kv_cache_dtype)
    assert narrow.blocks.num_blocks == 2 * wide.blocks.num_blocks
    assert narrow.runner.kv_cache.nbytes == wide.runner.kv_cache.nbytes
    assert narrow.runner.kv_cache.dtype == getattr(torch, kv_cache_dtype)
    options = {"kv_cache_dtype": kv_cache_dtype, "max_num_batched_tokens": 256}
    batched = run(engine(target, **options), STAGGERED, GREEDY)
    for i in (0, 1, 4):
        alone = run(engine(target, max_num_seqs=1, **options), {0: [i]}, GREEDY)
        assert alone == {str(i): batched[str(i)]}
    draft = load_model(str(gguf_path))[0]
    e = engine(target, draft, **{**options, "max_num_batched_tokens": 16},
               speculative_config=spec_config("draft_model", 3, draft_prompt_lookup=False))
    assert e.speculator.draft_runner is not None
    assert e.speculator.draft_runner.kv_cache.dtype == getattr(torch, kv_cache_dtype)
    assert run(e, STAGGERED, GREEDY) == batched
    assert e.stats.spec_stats.num_drafts > 0 and e.stats.spec_stats.acceptance_rate == 1.0
    steps = [{"a": PROMPT[:39]}, {"a": PROMPT[39:]}]  # a prefill, then a decode over it
    runs = []
    for dtype in (torch.float32, getattr(torch, kv_cache_dtype)):
        paged = PagedRun(target, kv_dtype=dtype)  # binds the model to its cache
        runs.append([paged.step(chunks)["a"] for chunks in steps])
    for f, r in zip(*runs, strict=True):
        assert 0 < rel_error(r, f) < KV16_RTOL


@pytest.mark.parametrize("budget", [8, 32])
def test_ngram_over_a_quantized_model_is_lossless(target: Qwen2ForCausalLM,
                                                  reference: dict[str, list[int]],
                                                  budget: int) -> None:
    e = engine(target, speculative_config=spec_config("ngram"), max_num_batched_tokens=budget)
    assert run(e, STAGGERED, GREEDY) == reference
    assert e.stats.spec_stats.num_drafts > 0


@pytest.mark.parametrize("k, budget", [(1, 8), (3, 16), (7, 32)])
def test_quantized_draft_equal_to_target_accepts_everything(
        gguf_path: Path, target: Qwen2ForCausalLM, reference: dict[str, list[int]], k: int,
        budget: int) -> None:
    draft = load_model(str(gguf_path))[0]
    e = engine(target, draft, max_num_batched_tokens=budget, speculative_config=spec_config(
        "draft_model", k, draft_prompt_lookup=False))
    assert run(e, STAGGERED, GREEDY) == reference
    assert e.stats.spec_stats.num_drafts > 0 and e.stats.spec_stats.acceptance_rate == 1.0


@pytest.mark.parametrize("num_ids", [1, 16, 100, 272])
def test_logits_of_the_first_ids_only(target: Qwen2ForCausalLM, num_ids: int) -> None:
    """The LM head's first rows (whole panels and a part of one): the same logits as the
    full head, -inf for the rest."""
    hidden = torch.randn(3, target.config.hidden_size, generator=torch.Generator().manual_seed(4))
    full = target.compute_logits(hidden)
    some = target.compute_logits(hidden, num_ids)
    assert some.shape == full.shape
    assert torch.equal(some[:, :num_ids], full[:, :num_ids])
    assert torch.isneginf(some[:, num_ids:]).all()


@pytest.mark.parametrize("qtype, rows", [(Q.Q8_0, 48), (Q.Q5_0, 40), (Q.Q6_K, 32)])
def test_rows_taken_from_a_weight_give_those_rows_products(qtype: Q, rows: int) -> None:
    """take_rows (whole panels, or rows where the layout has none; ids repeated and out of
    order): bit-identical to the same rows of the full product."""
    w = as_kernel_format(QuantWeight(random_weight(qtype, rows, 256, seed=5), qtype, 256))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    ids = torch.tensor([rows - 1, 3, 17, 3, 0])
    part, where = w.take_rows(ids)
    assert part.layout == w.layout and part.rows < rows + 16
    assert torch.equal(part.matmul(x)[:, where], w.matmul(x)[:, ids])


@pytest.fixture(scope="module")
def coarse_model(gguf_path: Path) -> Qwen2ForCausalLM:
    model = load_model(str(gguf_path))[0]
    assert model.add_coarse_head()
    return model


def test_coarse_head_is_a_q4_0_copy_of_the_head(coarse_model: Qwen2ForCausalLM,
                                                target: Qwen2ForCausalLM) -> None:
    """The tied Q8_0 head gets a Q4_0 copy (close to it, about half its bytes); the bytes a
    forward streams do not count it; a second call builds nothing new."""
    coarse = coarse_model.coarse_head
    assert coarse is not None and [w.qtype for _, w in coarse.segments] == [Q.Q4_0]
    head = coarse_model.lm_head
    assert isinstance(head, QuantLinear)
    assert coarse.weight_bytes() < 0.55 * head.weight_bytes()
    hidden = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(7))
    x = coarse_model.norm(hidden)
    assert rel_error(coarse(x), head(x)) < INT4_RTOL
    assert coarse_model.weight_bytes() == target.weight_bytes()
    assert coarse_model.add_coarse_head() and coarse_model.coarse_head is coarse


def test_no_coarse_head_for_a_float_or_narrow_head(float_folder: Path, gguf_path: Path) -> None:
    assert not load_model(str(float_folder), quantization="none")[0].add_coarse_head()
    int4 = load_model(str(float_folder), quantization="int4")[0]  # its own head is Q4_0
    assert not int4.add_coarse_head() and int4.coarse_head is None


@pytest.mark.parametrize("num_ids", [None, 16, 100])
def test_greedy_tokens_through_the_coarse_head_are_the_argmax(
        coarse_model: Qwen2ForCausalLM, monkeypatch: pytest.MonkeyPatch,
        num_ids: int | None) -> None:
    """Candidates from the coarse head, scored by the exact one: each row's argmax of the
    full logits (the first of equal ones), also where too many candidates make the exact
    head run whole, and for a draft vocabulary limit."""
    import braid.models.qwen2 as qwen2

    gen = torch.Generator().manual_seed(8)
    hidden = torch.cat([torch.randn(64, HIDDEN, generator=gen),
                        torch.zeros(1, HIDDEN)])  # all logits equal: the lowest id wins
    expected = coarse_model.compute_logits(hidden, num_ids).argmax(dim=-1)
    assert torch.equal(coarse_model.greedy_tokens(hidden, num_ids), expected)
    monkeypatch.setattr(qwen2, "MAX_RESCORED", 0)
    assert torch.equal(coarse_model.greedy_tokens(hidden, num_ids), expected)


def test_a_draft_with_a_coarse_head_stays_lossless(
        gguf_path: Path, target: Qwen2ForCausalLM, reference: dict[str, list[int]]) -> None:
    """The same model drafting through its coarse head proposes the target's own tokens;
    with speculative_config "draft_coarse_head": false the draft's head runs whole."""
    for coarse in (True, False):
        draft = load_model(str(gguf_path))[0]
        e = engine(target, draft, max_num_batched_tokens=16, speculative_config=spec_config(
            "draft_model", 3, draft_coarse_head=coarse, draft_prompt_lookup=False))
        proposer = e.speculator.proposer  # type: ignore[union-attr]
        assert proposer.coarse_head is coarse and (draft.coarse_head is not None) is coarse
        assert run(e, STAGGERED, GREEDY) == reference
        assert e.stats.spec_stats.num_drafts > 0 and e.stats.spec_stats.acceptance_rate == 1.0
    with pytest.raises(ConfigError, match="draft_coarse_head must be true or false"):
        engine(target, speculative_config=spec_config("draft_model", draft_coarse_head="yes"))


def test_engine_loads_a_quantized_target_and_a_float_draft(
        gguf_path: Path, reference: dict[str, list[int]]) -> None:
    """--quantization applies to the target; the draft's own "quantization" overrides it."""
    spec = spec_config("draft_model", model=str(gguf_path), quantization="none",
                       draft_dtype="float32")
    e = engine(model=str(gguf_path), quantization="auto", speculative_config=spec,
               max_num_batched_tokens=16)
    assert quant_modules(e.runner.model)
    assert not quant_modules(e.speculator.proposer.runner.model)  # type: ignore[union-attr]
    assert run(e, STAGGERED, GREEDY) == reference
    assert e.stats.spec_stats.num_drafts > 0 and e.stats.spec_stats.acceptance_rate > 0.5


def test_a_draft_requantized_to_int4_stays_lossless(
        gguf_path: Path, reference: dict[str, list[int]]) -> None:
    """speculative_config's "quantization": "int4" re-quantizes the draft's wider layers (a
    cheaper draft, not a different output)."""
    spec = spec_config("draft_model", model=str(gguf_path), quantization="int4")
    e = engine(model=str(gguf_path), speculative_config=spec, max_num_batched_tokens=16)
    draft = e.speculator.proposer.runner.model  # type: ignore[union-attr]
    assert {w.qtype for _, w in draft.layers[1].mlp.down_proj.segments} == {Q.Q4_0}
    assert {w.qtype for _, w in e.runner.model.layers[1].mlp.down_proj.segments} == {Q.Q6_K}
    assert run(e, STAGGERED, GREEDY) == reference
    # The same model at 4 bits: on random weights (flat logits) its argmax often differs,
    # but it is accepted far more often than a guess (1 in 272) would be.
    assert e.stats.spec_stats.num_drafts > 0 and e.stats.spec_stats.acceptance_rate > 0.2


def test_kv_cache_gib_holds_for_a_quantized_model_at_any_dtype(
        gguf_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Quantized weights take float32 activations and a float16 KV cache (auto) whatever
    --dtype says (the load says so); the cache is sized in the KV's own dtype, so it takes
    --kv-cache-gib, not twice or half that."""
    gib = 0.01
    for dtype in ("float32", "bfloat16"):
        caplog.clear()
        with caplog.at_level("INFO", logger="braid"):
            e = engine(model=str(gguf_path), dtype=dtype, num_kv_blocks=None, kv_cache_gib=gib)
        kv = e.runner.kv_cache
        assert kv.dtype == torch.float16
        assert gib * 2**30 * 0.9 < kv.numel() * kv.element_size() <= gib * 2**30
        said = "its quantized weights run with float32 activations" in caplog.text
        assert said == (dtype == "bfloat16")


def test_a_quantized_draft_at_its_default_dtype_says_nothing(
        gguf_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The float32 note is for a dtype asked for by hand: a default start with a quantized
    draft (whose draft_dtype auto is bfloat16 on CPUs that have it) logged it every time."""
    for draft_dtype, said in (("auto", False), ("bfloat16", True)):
        caplog.clear()
        with caplog.at_level("INFO", logger="braid"):
            engine(model=str(gguf_path), speculative_config={
                "method": "draft_model", "model": str(gguf_path), "num_speculative_tokens": 2,
                "draft_dtype": draft_dtype})
        assert ("its quantized weights run with float32 activations" in caplog.text) == said


# ---- configuration and fallback ----------------------------------------------------------------


def test_bad_quantization_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--quantization must be one of auto, none, int8, "
                       "int4, got 'bogus'"):
        EngineConfig(model="tiny", quantization="bogus")
    with pytest.raises(ConfigError, match="--speculative-config: quantization must be one of"):
        EngineConfig(model="tiny", speculative_config=spec_config("draft_model",
                                                                  quantization="bogus"))


def test_dtype_takes_vllm_s_names() -> None:
    assert EngineConfig(model="tiny", dtype="half").dtype == "float16"
    assert EngineConfig(model="tiny", dtype="float").torch_dtype == torch.float32
    with pytest.raises(ConfigError, match="--dtype must be auto, float32 \\(float\\), "
                       "bfloat16 or float16 \\(half\\), got 'double'"):
        EngineConfig(model="tiny", dtype="double")


def test_bad_kv_cache_dtype_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, float32, "
                       "bfloat16, float16, got 'int8'"):
        EngineConfig(model="tiny", kv_cache_dtype="int8")
    for fp8 in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # vLLM's names: why braid has none
        with pytest.raises(ConfigError, match=f"--kv-cache-dtype {fp8}: braid has no 8-bit"):
            EngineConfig(model="tiny", kv_cache_dtype=fp8)


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("BRAID_NO_KERNELS", "1")
    quant_ops.cache_clear()
    try:
        assert quant_ops() is None
        yield
    finally:
        quant_ops.cache_clear()  # the next call, with the variable gone, loads the kernels


def test_without_kernels_a_quantized_gguf_loads_as_float(
        gguf_path: Path, request: pytest.FixtureRequest) -> None:
    dequantized, _ = load_model(str(gguf_path), quantization="none")
    expected = run(engine(dequantized, max_num_batched_tokens=32), STAGGERED, GREEDY)
    request.getfixturevalue("no_kernels")
    fallback, _ = load_model(str(gguf_path), quantization="auto")
    assert not quant_modules(fallback)
    assert run(engine(fallback, max_num_batched_tokens=32), STAGGERED, GREEDY) == expected


def test_without_kernels_a_16_bit_kv_cache_is_read_by_torch(
        gguf_path: Path, request: pytest.FixtureRequest) -> None:
    """The torch path writes keys and values rounded to the cache's type and attends over
    them widened back: the tokens of the kernels' path over the same 16-bit cache."""
    dequantized, _ = load_model(str(gguf_path), quantization="none")
    options = {"max_num_batched_tokens": 32, "kv_cache_dtype": "float16"}
    expected = run(engine(dequantized, **options), STAGGERED, GREEDY)
    request.getfixturevalue("no_kernels")
    e = engine(load_model(str(gguf_path), quantization="auto")[0], **options)
    assert e.runner.kv_cache.dtype == torch.float16
    assert run(e, STAGGERED, GREEDY) == expected
