"""Broken model folders, side files and settings: each is a clear error naming the file, tensor,
key or flag (a ValueError in Python, `ksana-llm: error: ...` and exit 2 on the command line),
never a bare library traceback, a silent wrong load, or a machine run out of memory. The
checkpoints are a tiny random Llama saved by transformers, then broken the way real downloads
and hand edits break them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import ksana_llm as kt
from ksana_llm.loader.gptq_awq import PackedIntFormat
from ksana_llm.loader.lora import load_lora_adapter
from tests.tiny_models import build_tiny_model

VOCAB = 256


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture
def broken(tiny_folder, tmp_path) -> Path:
    """A fresh copy of the tiny model to break."""
    return Path(shutil.copytree(tiny_folder, tmp_path / "broken"))


def _load(folder: Path) -> kt.Model:
    return kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ksana_llm.cli", *args], capture_output=True,
                          text=True, timeout=300)


def _rewrite_tensor(folder: Path, name: str, change) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def test_a_truncated_safetensors_file_is_named(broken):
    path = broken / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*(corrupt|truncated)"):
        _load(broken)
    proc = _cli("generate", "hi", "--model", str(broken), "--device", "cpu")
    assert proc.returncode == 2 and "model.safetensors" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_garbage_pytorch_bin_is_named(broken):
    (broken / "model.safetensors").unlink()
    (broken / "pytorch_model.bin").write_bytes(b"not a checkpoint at all" * 100)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin is not a readable PyTorch checkpoint"):
        _load(broken)


@pytest.mark.parametrize("file, text, match", [
    ("model.safetensors.index.json", '{"weight_map": [1, 2]}', "weight_map"),
    ("generation_config.json", "[]", r"generation_config\.json must hold a JSON object"),
    ("generation_config.json", "{bad", r"generation_config\.json is not valid JSON"),
])
def test_malformed_side_files_are_named(broken, file, text, match):
    (broken / file).write_text(text)
    with pytest.raises(ValueError, match=match):
        _load(broken)


@pytest.mark.parametrize("name, change, match", [
    # [vocab, 1] used to broadcast into every column of the embedding without complaint.
    ("model.embed_tokens.weight", lambda w: w[:, :1], "embed_tokens"),
    ("lm_head.weight", lambda w: w[:, :1], "lm_head"),
    ("model.layers.0.self_attn.q_proj.weight", lambda w: w[:, :32],
     r"model\.layers\.0\.self_attn\.q_proj\.weight"),
    ("model.layers.1.self_attn.o_proj.weight", lambda w: w[:, :1],
     r"model\.layers\.1\.self_attn\.o_proj\.weight"),
])
def test_a_tensor_of_the_wrong_shape_is_named(broken, name, change, match):
    _rewrite_tensor(broken, name, change)
    with pytest.raises(ValueError, match=match):
        _load(broken)


@pytest.mark.parametrize("name", [
    "model.layers.0.self_attn.q_proj.weight",  # a fused (QKV) part
    "model.layers.0.mlp.gate_proj.weight",  # a fused (gate/up) part
    "model.layers.0.self_attn.o_proj.weight",  # row-parallel
    "model.norm.weight",
])
@pytest.mark.parametrize("bad", [torch.tensor(1.0), torch.ones(2, 2, 2)], ids=["scalar", "3-d"])
def test_a_tensor_of_the_wrong_rank_is_named(broken, name, bad):
    """A scalar once reached an IndexError (`shape[0]` of no shape) in the fused loaders."""
    _rewrite_tensor(broken, name, lambda w: bad)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _load(broken)


@pytest.mark.parametrize("arch, name", [
    ("yi-gqa4-bias", "model.layers.0.self_attn.o_proj.bias"),  # a scalar used to broadcast
    ("qwen3-moe", "model.layers.0.mlp.experts.3.up_proj.weight"),
])
def test_a_scalar_bias_or_expert_weight_is_named(tmp_path, arch, name):
    build_tiny_model(arch, tmp_path)
    _rewrite_tensor(tmp_path, name, lambda w: torch.tensor(1.0))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        _load(tmp_path)


def test_two_copies_of_the_checkpoint_are_refused(broken):
    """Loose safetensors files (no index) are all read: a second full copy used to overwrite the
    first silently."""
    shutil.copy(broken / "model.safetensors", broken / "consolidated.safetensors")
    (broken / "model.safetensors").rename(broken / "model-00001-of-00001.safetensors")
    with pytest.raises(ValueError, match="is in both .*two copies of the checkpoint"):
        _load(broken)


def test_two_tensors_for_one_weight_are_refused(broken):
    """A stray fused qkv_proj beside q/k/v_proj used to overwrite q and k silently (the last
    tensor read won); transformers would have kept the parts and reported the extra key."""
    path = broken / "model.safetensors"
    tensors = load_file(path)
    attention = "model.layers.0.self_attn."
    tensors[attention + "qkv_proj.weight"] = torch.cat(
        [tensors[attention + p + "_proj.weight"] for p in "qkv"]).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint tensors '.*' and '.*' both hold "
                                         r"model\.layers\.0\.self_attn\.qkv_proj"):
        _load(broken)


def test_a_stored_head_that_differs_from_the_tied_embedding_is_reported(broken, caplog):
    """tie_word_embeddings with a checkpoint that stores its own, different, lm_head.weight:
    transformers serves that head untied (tests/test_model_parity.py compares the logits), and
    the log says so."""
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with caplog.at_level("WARNING", logger="ksana_llm.model"):
        model = _load(broken)
    assert "using the stored LM head, untied" in caplog.text
    assert model.module._lm_head_weight() is model.module.lm_head.weight


def test_non_integer_quantization_bits_are_named():
    with pytest.raises(ValueError, match="quantization_config.bits"):
        PackedIntFormat.from_quantization({"quant_method": "gptq", "bits": "four", "group_size": 128})
    with pytest.raises(ValueError, match="quantization_config.group_size"):
        PackedIntFormat.from_quantization({"quant_method": "gptq", "bits": 4, "group_size": "x"})


def test_a_corrupt_lora_adapter_file_is_named(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors cannot be read"):
        load_lora_adapter(str(tmp_path))


def test_a_truncated_gguf_is_named(tmp_path):
    from ksana_llm.loader import convert_gguf_to_hf, default_model_gguf

    cut = tmp_path / "cut.gguf"
    with open(default_model_gguf(), "rb") as source:
        cut.write_bytes(source.read(2_000_000))
    with pytest.raises(ValueError, match=r"cut\.gguf cannot be loaded as a GGUF model"):
        convert_gguf_to_hf(cut, cache_dir=tmp_path / "cache")


def test_a_model_without_a_tokenizer_takes_token_ids_and_says_so_for_text(tiny_folder):
    model = _load(tiny_folder)  # transformers saved no tokenizer beside it
    assert model.tokenizer is None
    with kt.Engine(model, num_device_blocks=16) as engine:
        with pytest.raises(ValueError, match="no tokenizer"):
            engine.generate("hello")
        with pytest.raises(ValueError, match="no tokenizer"):
            engine.chat([{"role": "user", "content": "hello"}])
        out = engine.generate_outputs([1, 2, 3], kt.GenerationConfig(max_new_tokens=3,
                                                                     ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 3


def test_an_empty_tokenizer_transformers_builds_is_no_tokenizer(tmp_path):
    """transformers builds an empty tokenizer (one special token, no vocabulary) for a Qwen2
    folder without tokenizer files, where it fails for Llama's: every text would be zero
    tokens, and a zero-token prompt once failed the step and killed the engine."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    folder = tmp_path / "qwen2"
    Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=VOCAB)).save_pretrained(folder)
    empty = AutoTokenizer.from_pretrained(folder)
    assert empty.encode("hello", add_special_tokens=False) == []  # what made it dangerous
    model = _load(folder)
    assert model.tokenizer is None  # text prompts get the "no tokenizer" ValueError
    with pytest.raises(ValueError, match="tokenizer: .* no usable tokenizer"):
        kt.Engine(model, num_device_blocks=16, tokenizer=str(folder))
    # Given as an object, it is taken as it is: a text it makes nothing of fails alone.
    with kt.Engine(model, num_device_blocks=16, tokenizer=empty) as engine:
        with pytest.raises(ValueError, match="prompt: it is no tokens"):
            engine.generate("hello")
        out = engine.generate_outputs([1, 2, 3], kt.GenerationConfig(max_new_tokens=3,
                                                                     ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 3 and engine.is_running


def test_load_settings_given_with_a_loaded_model_must_match_it(tiny_folder):
    model = _load(tiny_folder)
    for setting in ({"dtype": "bfloat16"}, {"quantization": "fp8"}, {"tensor_parallel_size": 2},
                    {"device": "gpu"}):
        with pytest.raises(ValueError, match=next(iter(setting))):
            kt.Engine(model, num_device_blocks=16, **setting)
    # Matching ones are fine, and the engine's config says what runs.
    with kt.Engine(model, num_device_blocks=16, device="cpu", dtype="fp32") as engine:
        assert (engine.config.device, engine.config.dtype) == ("cpu", "float32")


def test_an_impossible_block_count_is_refused_before_allocating(tiny_folder):
    model = _load(tiny_folder)
    with pytest.raises(ValueError, match=r"num_device_blocks=1000000000000 needs .* GiB"):
        kt.Engine(model, num_device_blocks=10**12)
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1000000000000000 needs .* GiB"):
        kt.Engine(model, kv_cache_memory_bytes=10**15)


def test_kv_cache_memory_bytes_sizes_the_cache(tiny_folder):
    """vLLM's kv_cache_memory_bytes: as many blocks as the bytes hold (the cache's own bytes
    per block, from its tensors); too few for 2 blocks, or given with num_device_blocks, is a
    ValueError naming it."""
    model = _load(tiny_folder)
    with kt.Engine(model, num_device_blocks=2) as engine:
        per_block = sum(t.nbytes for pair in engine._core.runner.kv_caches for t in pair) // 2
    with kt.Engine(model, kv_cache_memory_bytes=per_block * 37 + per_block // 2) as engine:
        assert engine.stats().num_free_kv_blocks == 37
        out = engine.generate_outputs([[5, 6, 7]], kt.GenerationConfig(max_new_tokens=3,
                                                                       ignore_eos=True))
        assert len(out[0].token_ids) == 3
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=.* holds 1 KV blocks"):
        kt.Engine(model, kv_cache_memory_bytes=per_block + 1)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes or num_device_blocks"):
        kt.EngineConfig(kv_cache_memory_bytes=10**9, num_device_blocks=16)


def test_engine_config_takes_what_from_pretrained_takes_and_refuses_infinities(tmp_path):
    config = kt.EngineConfig(model=tmp_path, device=torch.device("cpu"), dtype=torch.float16)
    assert (config.model, config.device, config.dtype) == (str(tmp_path), "cpu", "float16")
    assert kt.EngineConfig(dtype="bf16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="block_host_memory_factor"):
        kt.EngineConfig(block_host_memory_factor=float("inf"))
    for name in ("max_num_seqs", "block_token_num", "preempt_mode", "num_device_blocks"):
        with pytest.raises(ValueError, match=f"{name} must be a number, got True"):
            kt.EngineConfig(**{name: True})
    assert kt.EngineConfig(enable_prefix_caching=False, async_scheduling=True).async_scheduling


@pytest.mark.parametrize("args, needle", [
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-model-len", "0"], "--max-model-len"),
    (["serve", "--gpu-memory-utilization", "2"], "--gpu-memory-utilization"),
    (["serve", "--block-host-memory-factor", "inf"], "--block-host-memory-factor"),
    (["serve", "--max-stored-responses", "-1"], "--max-stored-responses"),
])
def test_bad_serve_flags_fail_before_the_model_loads(args, needle):
    proc = _cli(*args)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "pydantic.dev" not in proc.stderr


def test_a_folder_given_as_a_file_is_a_clear_error(tmp_path):
    proc = _cli("serve", "--config_file", str(tmp_path))
    assert proc.returncode == 2 and str(tmp_path) in proc.stderr and "Traceback" not in proc.stderr


def test_the_guides_pad_token_id_is_taken_and_checked(default_model_dir):
    """The KTransformers guide loads with pad_token_id=tokenizer.pad_token_id."""
    from ksana_llm.api.model import Model

    model = Model.from_pretrained(default_model_dir, device="cpu", progress=False,
                                  pad_token_id=2)
    assert model.tokenizer.pad_token_id is not None
    with pytest.raises(ValueError, match="pad_token_id"):
        Model.from_pretrained(default_model_dir, device="cpu", progress=False, pad_token_id=-1)


@pytest.mark.parametrize("path", [5, ["model"], b"folder"])
def test_a_path_of_the_wrong_type_is_named(path):
    from ksana_llm.api.model import Model

    with pytest.raises(ValueError, match="path must be a folder, a .gguf file or a hub id"):
        Model.from_pretrained(path, device="cpu", progress=False)


@pytest.mark.parametrize("edit, message", [
    ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of "
                                 r"num_key_value_heads \(3\)"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be at least 1, got 0"),
])
def test_a_config_no_model_can_have_is_named(broken, edit, message):
    """Not a shard's row count or a pipeline split nobody asked for."""
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=message):
        _load(broken)


def test_a_folders_tokenizer_code_runs_only_with_trust_remote_code(broken, default_model_dir,
                                                                   tmp_path):
    """A tokenizer_config.json `auto_map` (Baichuan's, Qwen v1's) names Python code of the
    folder's: without trust_remote_code transformers asked on stdin whether to run it (a server
    stalled; "y" ran it). Now it is not run, the folder having no tokenizer, unless trusted."""
    marker = tmp_path / "ran"
    shutil.copy(default_model_dir / "tokenizer.json", broken / "tokenizer.json")
    (broken / "tokenization_marked.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class MarkedTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    (broken / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "MarkedTokenizer",
        "auto_map": {"AutoTokenizer": [None, "tokenization_marked.MarkedTokenizer"]}}))
    assert _load(broken).tokenizer is None
    # Someone at a terminal answering transformers' question: nothing is asked any more.
    load = (f"import ksana_llm as kt; m = kt.Model.from_pretrained({str(broken)!r}, "
            "device='cpu', progress=False); print(m.tokenizer)")
    proc = subprocess.run([sys.executable, "-c", load], input="y\ny\n", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr
    with pytest.raises(ValueError, match="(?s)tokenizer: cannot load .*trust_remote_code"):
        kt.Model.from_pretrained(broken, device="cpu", progress=False, tokenizer=str(broken))
    assert not marker.exists()
    trusted = kt.Model.from_pretrained(broken, device="cpu", progress=False,
                                       trust_remote_code=True)
    assert marker.exists() and type(trusted.tokenizer).__name__ == "MarkedTokenizer"
