"""FP8 KV cache (`kv_cache_dtype`): the engine against transformers with the same rounding.

The reference is transformers' own model with a cache that rounds K/V the way ours stores them (a
`DynamicCache` whose `update` passes the new states through `kv_quant.through_cache`): attention
then reads the same numbers on both sides, so greedy tokens and logits must agree, while plain
transformers (no rounding) disagrees. DeepSeek's MLA caches its compressed latent through the
same `update` in transformers, so the same reference covers it.

The models are tiny (2-3 layers) on purpose. FP8 rounding is discontinuous: an fp32 difference of
1e-6 now and then lands a value on the other side of a rounding step (up to 25% of it with E5M2),
and in a deep model the change grows layer by layer. On SmolLM2's 30 layers even transformers in
fp32 and in fp64, under the same rounding, differ by ~0.3 in mean log-prob with E5M2, so no
reference can pin a deep model's tokens; two layers cannot amplify a rare flip that far.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3ForCausalLM, DynamicCache

import ksana_llm as kt
from ksana_llm.api.kv_calibration import write_kv_cache_scales
from ksana_llm.kernels.kv_quant import cache_dtype_for, from_cache, through_cache, to_cache
from ksana_llm.loader.kv_scales import KV_SCALES_FILENAME, load_kv_cache_scales
from ksana_llm.runner.model_runner import kv_bytes_per_block
from tests.deepseek_checkpoint import (deepseek_config, hf_mtp_layer, mtp_embedding, randomize,
                                       save_with_mtp)
from tests.tiny_models import build_tiny_model

NUM_TOKENS = 20
KV_DTYPES = {"fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
# The tiny Llama's K/V stay under ~10: with these scales they span most of E4M3's range (up to
# 448), and a scale that were ignored would change the rounding.
E4M3_SCALES = [0.02, 0.03]
# Weights this wide give the tiny model varied greedy tokens (std 0.02 repeats one token, which
# no rounding changes).
WEIGHT_STD = 0.2


class RoundingCache(DynamicCache):
    """transformers' cache, keeping K/V as an FP8 cache would give them back."""

    def __init__(self, kv_dtype: torch.dtype, scales: list[float], **kwargs) -> None:
        super().__init__(**kwargs)
        self.kv_dtype, self.scales = kv_dtype, scales

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        scale = self.scales[layer_idx]
        return super().update(through_cache(key_states, self.kv_dtype, scale),
                              through_cache(value_states, self.kv_dtype, scale), layer_idx,
                              *args, **kwargs)


def _cache(hf, kv_dtype: torch.dtype | None, scales: list[float] | None) -> DynamicCache:
    if kv_dtype is None:
        return DynamicCache(config=hf.config)
    return RoundingCache(kv_dtype, scales or [1.0] * hf.config.num_hidden_layers, config=hf.config)


def hf_greedy(hf, prompt: list[int], kv_dtype: torch.dtype | None,
              scales: list[float] | None = None, num_tokens: int = NUM_TOKENS) -> list[int]:
    """transformers' greedy tokens, one forward per token through the (rounding) cache."""
    cache, tokens, x = _cache(hf, kv_dtype, scales), [], torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(num_tokens):
            token = int(hf(x, cache=cache).logits[0, -1].argmax())
            tokens.append(token)
            x = torch.tensor([[token]])
    return tokens


def hf_logits(hf, ids: list[int], kv_dtype: torch.dtype | None,
              scales: list[float] | None = None) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids]), cache=_cache(hf, kv_dtype, scales)).logits[0]


def _scales_for(kv_dtype: str) -> list[float] | None:
    return E4M3_SCALES if kv_dtype == "fp8_e4m3" else None  # E5M2 reads no scales


class Tiny:
    """A tiny random Llama (GQA, biases) saved with a kv_cache_scales.json, and prompts: two
    share a 12-token prefix, one is long enough for several chunks."""

    def __init__(self, root: Path) -> None:
        self.folder = root / "tiny"
        self.hf = build_tiny_model("yi-gqa4-bias", self.folder)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in self.hf.parameters():
                if param.dim() == 2:
                    param.copy_(torch.randn(param.shape, generator=gen) * WEIGHT_STD)
        self.hf.save_pretrained(self.folder)
        (self.folder / KV_SCALES_FILENAME).write_text(json.dumps({
            "model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {
                "0": {str(i): s for i, s in enumerate(E4M3_SCALES)}}}}))
        self.model = kt.Model.from_pretrained(self.folder, device="cpu", dtype="float32",
                                              progress=False)
        gen = torch.Generator().manual_seed(1)
        shared = torch.randint(3, 256, (12,), generator=gen).tolist()
        self.prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 61)]
        self.prompts += [shared + torch.randint(3, 256, (n,), generator=gen).tolist()
                         for n in (4, 9)]
        self._expected: dict[str, list[list[int]]] = {}

    def expected(self, kv_dtype: str) -> list[list[int]]:
        if kv_dtype not in self._expected:
            self._expected[kv_dtype] = [hf_greedy(self.hf, p, KV_DTYPES.get(kv_dtype),
                                                  _scales_for(kv_dtype)) for p in self.prompts]
        return self._expected[kv_dtype]

    def engine(self, kv_dtype: str, **kwargs) -> kt.Engine:
        kwargs = {"num_device_blocks": 64, "block_token_num": 8, **kwargs}
        return kt.Engine(self.model, kv_cache_dtype=kv_dtype, generation_config=kt.GenerationConfig(
            max_new_tokens=NUM_TOKENS, ignore_eos=True), **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("fp8"))


def test_rounding_scaling_and_saturation():
    x = torch.tensor([0.3, -1.7, 1.0e6, -1.0e9, 0.0])
    for dtype in KV_DTYPES.values():
        stored = to_cache(x, dtype, 0.5)
        assert stored.dtype == dtype
        assert torch.equal(stored[:2].float(), (x[:2] / 0.5).to(dtype).float())
        limit = torch.finfo(dtype).max  # saturated, never inf or NaN
        assert stored[2].float() == limit and stored[3].float() == -limit
        assert torch.equal(from_cache(stored, torch.float32, 0.5), stored.float() * 0.5)
        assert torch.equal(through_cache(x, dtype, 0.5), stored.float() * 0.5)
    plain = torch.randn(4)
    assert through_cache(plain, torch.float32) is plain  # a cache of the model's dtype: as is
    assert cache_dtype_for("auto", torch.bfloat16) == torch.bfloat16
    assert cache_dtype_for("fp8", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        cache_dtype_for("int4", torch.float32)


def test_every_e4m3_entry_reads_back_as_torch_casts_it():
    """On a CPU E4M3 entries widen through float16's fields (torch's own E4M3 cast is ~6x
    slower there): every finite entry, subnormals and both zeros included, times a scale,
    equals torch's cast times that scale, in fp32, bf16 and fp16."""
    entries = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~entries.float().isnan()  # to_cache never writes E4M3's two NaN bytes
    entries = entries[finite]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for scale in (1.0, 0.37, 8.0):
            expected = entries.to(dtype) * scale if scale != 1.0 else entries.to(dtype)
            ours = from_cache(entries, dtype, scale)
            assert ours.dtype == dtype
            assert torch.equal(ours, expected), (dtype, scale)
            assert torch.equal(ours.signbit(), expected.signbit())


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_greedy_tokens_equal_transformers_with_the_same_rounding(tiny, kv_dtype):
    """A batch with chunked prefill (chunks of 16), then the prompts again (prefix-cache hits)."""
    expected = tiny.expected(kv_dtype)
    # The rounding is visible: without it, transformers picks other tokens.
    assert expected != [hf_greedy(tiny.hf, p, None) for p in tiny.prompts]
    with tiny.engine(kv_dtype, split_fuse_token_num=16) as engine:
        first = engine.generate_outputs(tiny.prompts, use_tqdm=False)
        again = engine.generate_outputs(tiny.prompts, use_tqdm=False)
        stats = engine.stats()
        cache = engine.kv_layout.dtype
    assert cache == KV_DTYPES[kv_dtype]
    assert stats.prefix_cache_hit_rate > 0
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_logits_equal_transformers_with_the_same_rounding(tiny, kv_dtype):
    """With another engine on the same model and another format alive at the same time (scales
    are per engine, not on the shared modules)."""
    ids = tiny.prompts[1]
    other = "fp8_e4m3" if kv_dtype == "fp8_e5m2" else "fp8_e5m2"
    with tiny.engine(kv_dtype) as engine, tiny.engine(other):
        out = engine.forward(ids, [kt.ForwardTarget("logits", [[0, len(ids) - 1]])])
    ours = out.targets[0].tensor
    rounded = hf_logits(tiny.hf, ids, KV_DTYPES[kv_dtype], _scales_for(kv_dtype))
    torch.testing.assert_close(ours, rounded, atol=2e-5, rtol=1e-4)
    assert (ours - hf_logits(tiny.hf, ids, None)).abs().max() > 1e-3
    if kv_dtype == "fp8_e4m3":  # the file's scales are the ones applied
        unscaled = hf_logits(tiny.hf, ids, KV_DTYPES[kv_dtype], [1.0, 1.0])
        assert (ours - unscaled).abs().max() > 1e-3


def test_triton_kernels_equal_transformers_with_the_same_rounding(tiny):
    """The Triton backend (in the interpreter here) over an E4M3 cache with the file's scales:
    chunked prefill, then the last prompt again (a prefix-cache hit)."""
    with tiny.engine("fp8_e4m3", attention_backend="triton", split_fuse_token_num=16) as engine:
        outputs = engine.generate_outputs(tiny.prompts, use_tqdm=False)
        again = engine.generate_outputs(tiny.prompts[-1:], use_tqdm=False)
        assert engine.stats().prefix_cache_hit_rate > 0
    expected = tiny.expected("fp8_e4m3")
    assert [o.token_ids for o in outputs] == expected
    assert again[0].token_ids == expected[-1]


@pytest.mark.parametrize("preempt_mode", [0, 1], ids=["swap", "recompute"])
def test_preemption_keeps_fp8_blocks(tiny, preempt_mode):
    with tiny.engine("fp8_e5m2", num_device_blocks=12, preempt_mode=preempt_mode) as engine:
        outputs = engine.generate_outputs(tiny.prompts, use_tqdm=False)
        assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == tiny.expected("fp8_e5m2")


def _without_scales_file(tiny: Tiny, folder: Path) -> kt.Model:
    """The tiny model from a folder of links to its files, less kv_cache_scales.json."""
    folder.mkdir()
    for item in tiny.folder.iterdir():
        if item.name != KV_SCALES_FILENAME:
            (folder / item.name).symlink_to(item)
    return kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_kv_transfer_between_fp8_engines(tiny, kv_dtype, tmp_path):
    """The payload keeps FP8 and the scales; an engine that would read the bytes otherwise (no
    FP8, or other scales) refuses it."""
    prompt = tiny.prompts[1]
    greedy = kt.GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    with tiny.engine(kv_dtype) as prefill, tiny.engine(kv_dtype, block_token_num=4) as decode, \
            tiny.engine("auto") as plain:
        kv = prefill.submit(kt.Request(prompt, generation_config=greedy.replace(max_new_tokens=1),
                                       export_kv=True)).result().exported_kv
        assert {t.dtype for t in kv.tensors} == {KV_DTYPES[kv_dtype]}
        kv = type(kv).from_bytes(kv.to_bytes())  # the wire format
        assert kv.kv_scales == (tuple(E4M3_SCALES) if kv_dtype == "fp8_e4m3" else ())
        out = decode.submit(kt.Request(prompt, generation_config=greedy, imported_kv=kv)).result()
        assert decode.stats().num_imported_kv_tokens == len(prompt) - 1
        with pytest.raises(ValueError, match="imported_kv: its dtype"):
            plain.submit(kt.Request(prompt, generation_config=greedy, imported_kv=kv))
    assert out.token_ids == tiny.expected(kv_dtype)[1]
    if kv_dtype == "fp8_e4m3":
        unscaled = _without_scales_file(tiny, tmp_path / "unscaled")
        with kt.Engine(unscaled, kv_cache_dtype=kv_dtype, num_device_blocks=16) as other:
            with pytest.raises(ValueError, match="FP8 cache scales differ"):
                other.submit(kt.Request(prompt, generation_config=greedy, imported_kv=kv))


def test_cache_holds_more_tokens(default_model):
    """One byte per number: a quarter of fp32's block size, half of a 16-bit one."""
    module = default_model.module
    fp32 = kv_bytes_per_block(module, 16, torch.float32)
    assert kv_bytes_per_block(module, 16, torch.float8_e5m2) * 4 == fp32
    with kt.Engine(default_model, kv_cache_dtype="fp8", num_device_blocks=8) as engine:
        assert engine.kv_layout.bytes_per_token * 4 == fp32 // 16


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_mla_and_speculative_decoding_with_fp8_latents(tmp_path, kv_dtype):
    """DeepSeek: the compressed latents (and the MTP layer's) in an FP8 cache (E4M3 with
    per-layer scales); drafting on and off; on the Triton backend too (its store and attention
    kernels over FP8 latents; a model of its own, as the runner leaves its layers on the
    Triton path)."""
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(deepseek_config()).eval()
    randomize(hf)
    layer = hf_mtp_layer(hf.config)
    folder = save_with_mtp(hf, layer, mtp_embedding(hf), hf.lm_head.weight.detach(),
                           tmp_path / "deepseek")
    scales = [0.01, 0.02, 0.015] if kv_dtype == "fp8_e4m3" else None  # latents stay under ~4
    if scales:
        write_kv_cache_scales(folder, scales)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (6, 40)]
    expected = [hf_greedy(hf, p, KV_DTYPES[kv_dtype], scales) for p in prompts]
    assert expected != [hf_greedy(hf, p, None) for p in prompts]
    model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)
    config = kt.GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    for drafts, backend in ((0, "torch"), (2, "torch"), (2, "triton")):
        if backend == "triton":
            model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32",
                                             progress=False)
        with kt.Engine(model, kv_cache_dtype=kv_dtype, num_device_blocks=64, block_token_num=4,
                       num_speculative_tokens=drafts, generation_config=config,
                       attention_backend=backend) as engine:
            outputs = engine.generate_outputs(prompts, use_tqdm=False)
            assert engine.kv_layout.dtype == KV_DTYPES[kv_dtype]
            assert (engine.stats().num_draft_tokens > 0) == (drafts > 0)
        assert [o.token_ids for o in outputs] == expected, f"{drafts} drafts, {backend}"


def test_scales_file(tmp_path, tiny):
    assert load_kv_cache_scales(tmp_path, 2) is None
    path = tmp_path / KV_SCALES_FILENAME
    path.write_text(json.dumps({"kv_cache": {"scaling_factor": {"0": {"1": 0.5}}}}))
    assert load_kv_cache_scales(tmp_path, 2) == [1.0, 0.5]  # a layer left out keeps 1.0
    for bad, message in [
        ("{", "is not valid JSON"),
        ("[0.5]", "must hold a JSON object"),
        ({"kv_cache": {"scaling_factor": {"1": {"0": 0.5}}}}, 'rank "0"'),
        ({"kv_cache": {"scaling_factor": {"0": {"0": -1}}}}, "positive number"),
        ({"kv_cache": {"scaling_factor": {"0": {"0": "big"}}}}, "positive number"),
        ({"kv_cache": {"scaling_factor": {"0": {"7": 0.5}}}}, "layer 7 is not one"),
        ({"kv_cache": {"dtype": "float8_e5m2", "scaling_factor": {"0": {}}}}, "float8_e4m3fn"),
    ]:
        path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
        with pytest.raises(ValueError, match=KV_SCALES_FILENAME) as err:
            load_kv_cache_scales(tmp_path, 2)
        assert message in str(err.value)
    # An engine refuses a broken file before it serves anything.
    model = _without_scales_file(tiny, tmp_path / "model")
    (model.path / KV_SCALES_FILENAME).write_text("[1, 2]")
    with pytest.raises(ValueError, match=KV_SCALES_FILENAME):
        kt.Engine(model, kv_cache_dtype="fp8_e4m3", num_device_blocks=8)


def test_bad_setting_names_the_field(default_model):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kt.Engine(default_model, kv_cache_dtype="int8", num_device_blocks=8)


class RecordingCache(DynamicCache):
    """transformers' cache, noting the largest |K| or |V| each layer stores."""

    def __init__(self, amax: list[float], **kwargs) -> None:
        super().__init__(**kwargs)
        self.amax = amax

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.amax[layer_idx] = max(self.amax[layer_idx], float(key_states.abs().max()),
                                   float(value_states.abs().max()))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def test_calibrated_scales_rescue_values_beyond_e4m3(tmp_path):
    """V up to ~3,000 (E4M3 stops at 448): the calibrated scales equal transformers' max |K, V|
    / 224, and with them the engine equals transformers with the same rounding and stays far
    closer to the unrounded model than without them (where values clip)."""
    from ksana_llm.api.kv_calibration import (CALIBRATION_TARGET, calibrate_kv_scales,
                                              write_kv_cache_scales)

    folder = tmp_path / "loud"
    hf = build_tiny_model("llama2", folder)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * WEIGHT_STD)
            if "v_proj" in name:  # (K this large would make attention one-hot)
                param.mul_(500.0)
    hf.save_pretrained(folder)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (30, 45)]
    amax = [0.0] * hf.config.num_hidden_layers
    with torch.no_grad():
        for prompt in prompts:
            hf(torch.tensor([prompt]), cache=RecordingCache(amax, config=hf.config))
    assert max(amax) > 448

    model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)
    with pytest.raises(ValueError, match="texts"):
        calibrate_kv_scales(model, [])
    with kt.Engine(model, kv_cache_dtype="fp8_e5m2", num_device_blocks=16) as rounded:
        with pytest.raises(ValueError, match="kv_cache_dtype='auto'"):
            calibrate_kv_scales(rounded, prompts)  # its values are rounded already
    scales = calibrate_kv_scales(model, prompts)
    assert scales == pytest.approx([a / CALIBRATION_TARGET for a in amax], rel=1e-5)
    ids = prompts[1]
    plain = hf_logits(hf, ids, None)

    def engine_logits() -> torch.Tensor:
        with kt.Engine(model, kv_cache_dtype="fp8_e4m3", num_device_blocks=16) as engine:
            out = engine.forward(ids, [kt.ForwardTarget("logits", [[0, len(ids) - 1]])])
        return out.targets[0].tensor

    unscaled = engine_logits()  # no file yet: every scale 1.0, values beyond 448 clipped
    written = write_kv_cache_scales(folder, scales, model_type="llama")
    assert written == folder / KV_SCALES_FILENAME
    assert load_kv_cache_scales(folder, len(scales)) == pytest.approx(scales)
    calibrated = engine_logits()
    torch.testing.assert_close(calibrated, hf_logits(hf, ids, torch.float8_e4m3fn, scales),
                               atol=2e-5, rtol=1e-4)
    assert (unscaled - plain).abs().mean() > 3 * (calibrated - plain).abs().mean()


def test_calibrate_command(default_model_dir, tmp_path):
    import subprocess
    import sys

    out = tmp_path / "scales.json"
    command = [sys.executable, "-m", "ksana_llm.cli", "calibrate-kv-scales", "--device", "cpu",
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}: 30 layers" in done.stdout
    scales = load_kv_cache_scales(tmp_path, 30) if out.name == KV_SCALES_FILENAME else \
        json.loads(out.read_text())["kv_cache"]["scaling_factor"]["0"]
    assert len(scales) == 30 and all(float(s) > 0 for s in scales.values())
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "--force" in again.stderr
