"""KsanaLLM YAML -> EngineConfig: every mapping, strict errors that name the key, CLI overrides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ksana_llm.config import EngineConfig
from ksana_llm.yaml_config import ServerSettings, load_engine_config, parse_engine_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ksana_llm.yaml"

FULL_YAML = """
setting:
  global:
    tensor_para_size: 0
  batch_scheduler:
    max_batch_size: 7
    max_step_tokens: 333
    max_token_len: 1234
    max_waiting_queue_len: 55
    waiting_timeout_in_ms: 4321
    split_fuse_token_num: 32
    enable_auto_prefix_cache: false
    preempt_mode: 1
  block_manager:
    block_token_num: 32
    reserved_device_memory_ratio: 0.05
    block_device_memory_ratio: 0.25
    block_host_memory_factor: 2
model_spec:
  base_model:
    model_dir: /models/some-model
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_example_file_loads_cleanly():
    config, server = load_engine_config(EXAMPLE)
    assert isinstance(config, EngineConfig)
    assert config.max_num_seqs == 128 and config.max_step_tokens == 4096
    assert config.block_device_memory_ratio is None  # -1.0 = "the default"
    assert (config.max_model_len, config.waiting_timeout_ms, config.tensor_parallel_size) == \
        (2048, 600000, 1)
    assert server == ServerSettings(config_file=str(EXAMPLE), kv_role=None, kv_transfer_ttl_s=300.0)


def test_example_documents_every_accepted_key():
    text = EXAMPLE.read_text(encoding="utf-8")
    for leaf in ("tensor_para_size", "max_batch_size", "max_step_tokens", "max_token_len",
                 "max_waiting_queue_len", "waiting_timeout_in_ms", "split_fuse_token_num",
                 "enable_auto_prefix_cache", "preempt_mode", "block_token_num",
                 "reserved_device_memory_ratio", "block_device_memory_ratio",
                 "block_host_memory_factor", "model_dir", "group_role", "task_expire_sec",
                 "dtype", "quant_method"):
        assert f"{leaf}:" in text, leaf


def test_every_key_lands_in_its_field(tmp_path):
    config, server = load_engine_config(write(tmp_path, FULL_YAML))
    assert config.max_num_seqs == 7
    assert config.max_step_tokens == 333
    assert config.max_model_len == 1234
    assert config.max_queue_size == 55
    assert config.waiting_timeout_ms == 4321
    assert config.split_fuse_token_num == 32
    assert config.enable_prefix_caching is False
    assert config.preempt_mode == 1
    assert config.block_token_num == 32
    assert config.reserved_device_memory_ratio == 0.05
    assert config.block_device_memory_ratio == 0.25
    assert config.block_host_memory_factor == 2.0
    assert config.model == "/models/some-model"
    assert config.tensor_parallel_size == 0
    assert server.config_file == str(tmp_path / "cfg.yaml")


def test_tokenizer_keys_land_in_the_tokenizer_field():
    """KsanaLLM names the tokenizer folder under two keys; either sets EngineConfig.tokenizer,
    and the two must agree when both are there."""
    by_dir = {"model_spec": {"base_model": {"tokenizer_dir": "~/tok"}}}
    by_path = {"setting": {"tokenization": {"tokenizer_path": "/models/tok"}}}
    assert parse_engine_config(by_dir)[0].tokenizer == os.path.expanduser("~/tok")
    assert parse_engine_config(by_path)[0].tokenizer == "/models/tok"
    same = {"model_spec": {"base_model": {"tokenizer_dir": "/models/tok"}}, **by_path}
    assert parse_engine_config(same)[0].tokenizer == "/models/tok"
    with pytest.raises(ValueError, match="tokenizer_dir.*tokenizer_path.*differently"):
        parse_engine_config({**by_dir, **by_path})
    # The command line's --tokenizer wins over the file.
    assert parse_engine_config(by_path, {"tokenizer": "/cli/tok"})[0].tokenizer == "/cli/tok"


def test_empty_file_and_untouched_keys_keep_defaults(tmp_path):
    config, server = load_engine_config(write(tmp_path, "# nothing\n"))
    assert config == EngineConfig()
    assert (server.kv_role, server.kv_transfer_ttl_s) == (None, None)


def test_max_token_len_zero_means_model_context():
    config, _ = parse_engine_config({"setting": {"batch_scheduler": {"max_token_len": 0}}})
    assert config.max_model_len is None


@pytest.mark.parametrize("text, message", [
    ("setting:\n  batch_scheduler:\n    max_step_tokenz: 4\n",
     "setting.batch_scheduler.max_step_tokenz: unknown key"),
    ("setting:\n  block_managr:\n    block_token_num: 16\n", "setting.block_managr: unknown key"),
    ("model_spec:\n  base_model:\n    model_dirr: x\n", "model_spec.base_model.model_dirr: unknown key"),
    ("extra: 1\n", "extra: unknown key"),
    ("setting:\n  global:\n    enable_lora_adapter: true\n",
     "setting.global.enable_lora_adapter: a KsanaLLM key that ksana_llm does not support yet"),
    ("setting:\n  kernel_config:\n    x: 5\n",
     "setting.kernel_config: a KsanaLLM key that ksana_llm does not support yet"),
    # KsanaLLM keys accepted at values that change nothing here, refused at others.
    ("setting:\n  global:\n    expert_para_size: 2\n",
     "setting.global.expert_para_size: a KsanaLLM key that ksana_llm does not support yet at 2"),
    ("setting:\n  endpoint_type: trpc\n", "setting.endpoint_type: a KsanaLLM key"),
    ("setting:\n  tokenization:\n    skip_special_tokens: false\n",
     "setting.tokenization.skip_special_tokens: a KsanaLLM key"),
    ("setting:\n  batch_scheduler:\n    min_flexible_cache_num: 64\n",
     "setting.batch_scheduler.min_flexible_cache_num: a KsanaLLM key"),
    ("setting:\n  batch_scheduler:\n    schedule_strategy: true\n",  # true is no 0
     "setting.batch_scheduler.schedule_strategy: a KsanaLLM key"),
    ("setting:\n  tokenization:\n    skip_special_tokenz: true\n",
     "setting.tokenization.skip_special_tokenz: unknown key"),
    ("setting:\n  batch_scheduler:\n    attention_dp_lb_config:\n      enable_balance: true\n",
     "setting.batch_scheduler.attention_dp_lb_config.enable_balance: a KsanaLLM key"),
    ("setting:\n  batch_scheduler: 5\n", "setting.batch_scheduler: expected a mapping"),
])
def test_unknown_keys_are_named(tmp_path, text, message):
    with pytest.raises(ValueError) as info:
        load_engine_config(write(tmp_path, text))
    assert message in str(info.value)


def test_every_bad_key_is_named_at_once(tmp_path):
    """One run names everything to mend, each on a line of its own, not just the first."""
    text = ("setting:\n  batch_scheduler:\n    max_step_tokenz: 4\n    max_batch_size: many\n"
            "  block_managr:\n    block_token_num: 16\nextra: 1\n")
    with pytest.raises(ValueError) as info:
        load_engine_config(write(tmp_path, text))
    assert str(info.value).splitlines() == [
        "setting.batch_scheduler.max_step_tokenz: unknown key",
        "setting.block_managr: unknown key",
        "extra: unknown key",
        "setting.batch_scheduler.max_batch_size: expected an integer, got 'many'"]


@pytest.mark.parametrize("section, key, value, message", [
    ("block_manager", "block_token_num", "abc",
     "setting.block_manager.block_token_num: expected an integer, got 'abc'"),
    ("block_manager", "block_token_num", "16.5", "expected an integer, got 16.5"),
    ("batch_scheduler", "max_batch_size", "true", "expected an integer, got True"),
    ("batch_scheduler", "enable_auto_prefix_cache", "1",
     "setting.batch_scheduler.enable_auto_prefix_cache: expected true or false, got 1"),
    ("block_manager", "reserved_device_memory_ratio", "lots",
     "setting.block_manager.reserved_device_memory_ratio: expected a number, got 'lots'"),
])
def test_wrong_types_are_named(tmp_path, section, key, value, message):
    text = f"setting:\n  {section}:\n    {key}: {value}\n"
    with pytest.raises(ValueError) as info:
        load_engine_config(write(tmp_path, text))
    assert message in str(info.value)


def test_out_of_range_values_name_the_yaml_key():
    with pytest.raises(ValueError, match=r"setting\.batch_scheduler\.preempt_mode: .*\(got 2\)"):
        parse_engine_config({"setting": {"batch_scheduler": {"preempt_mode": 2}}})
    with pytest.raises(ValueError, match=r"setting\.block_manager\.block_token_num: .*\(got 0\)"):
        parse_engine_config({"setting": {"block_manager": {"block_token_num": 0}}})


def test_cuda_graph_switch_reaches_the_engine_config():
    config, _ = parse_engine_config({"setting": {"global": {"enable_cuda_graph": False}}})
    assert config.enable_cuda_graphs is False


def test_parallel_sizes_reach_the_engine_config():
    config, _ = parse_engine_config({"setting": {"global": {"tensor_para_size": 2,
                                                            "pipeline_para_size": 3}}})
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 3)


@pytest.mark.parametrize("key, size", [("tensor_para_size", -1), ("pipeline_para_size", 0)])
def test_invalid_parallel_sizes_name_the_yaml_key(key, size):
    with pytest.raises(ValueError) as info:
        parse_engine_config({"setting": {"global": {key: size}}})
    assert f"setting.global.{key}" in str(info.value)


def test_overrides_win_over_yaml(tmp_path):
    path = write(tmp_path, FULL_YAML)
    config, _ = load_engine_config(path, {"max_num_seqs": 9, "model": "/other", "device": "cpu",
                                               "max_step_tokens": None})
    assert config.max_num_seqs == 9
    assert config.model == "/other"
    assert config.device == "cpu"
    assert config.max_step_tokens == 333  # None = flag not given


def test_bad_override_is_named():
    with pytest.raises(ValueError, match=r"max_num_seqs \(override\)"):
        parse_engine_config({}, {"max_num_seqs": 0})
    with pytest.raises(ValueError, match=r"no_such_field \(override\)"):
        parse_engine_config({}, {"no_such_field": 1})


def test_cross_field_check_is_reported():
    data = {"setting": {"batch_scheduler": {"max_step_tokens": 64, "split_fuse_token_num": 128}}}
    with pytest.raises(ValueError, match="split_fuse_token_num must be <= max_step_tokens"):
        parse_engine_config(data)


def test_duplicate_keys_and_bad_yaml_are_errors(tmp_path):
    dup = "setting:\n  block_manager:\n    block_token_num: 16\n    block_token_num: 32\n"
    with pytest.raises(ValueError, match="duplicate key 'block_token_num'"):
        load_engine_config(write(tmp_path, dup))
    with pytest.raises(ValueError, match="invalid YAML"):
        load_engine_config(write(tmp_path, "setting: [unclosed\n"))
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_engine_config(write(tmp_path, "- a\n- b\n"))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"setting: \xff\xfe\n")
    with pytest.raises(ValueError, match=f"{binary}: not UTF-8 text"):
        load_engine_config(binary)


def test_connector_role_reaches_the_server_settings():
    """KsanaLLM's PD-disaggregation keys: the role and the TTL of kept KV (the server's
    --kv-role / --kv-transfer-ttl); its transport and cluster keys are named as unsupported."""
    _, server = parse_engine_config({"setting": {"connector": {
        "group_role": "decode", "task_expire_sec": 60}}})
    assert (server.kv_role, server.kv_transfer_ttl_s) == ("decode", 60.0)
    _, server = parse_engine_config({"setting": {"connector": {"group_role": "none"}}})
    assert server.kv_role is None
    with pytest.raises(ValueError, match="setting.connector.group_role must be none, prefill"):
        parse_engine_config({"setting": {"connector": {"group_role": "decoder"}}})
    with pytest.raises(ValueError, match="setting.connector.metadata_addr: a KsanaLLM key"):
        parse_engine_config({"setting": {"connector": {"metadata_addr": "redis://x"}}})
    # Refused as the file is read, not once the model has loaded.
    with pytest.raises(ValueError, match="setting.connector.task_expire_sec must be > 0"):
        parse_engine_config({"setting": {"connector": {"task_expire_sec": -5}}})


def test_kv_cache_dtype_key():
    """KsanaLLM's quantization_config.kv_cache.dtype, and a CLI flag wins."""
    key = {"setting": {"quantization_config": {"kv_cache": {"dtype": "fp8_e5m2"}}}}
    assert parse_engine_config(key)[0].kv_cache_dtype == "fp8_e5m2"
    assert parse_engine_config(key, {"kv_cache_dtype": "fp8_e4m3"})[0].kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="setting.quantization_config.kv_cache.dtype: Input"):
        parse_engine_config({"setting": {"quantization_config": {"kv_cache": {"dtype": "int8"}}}})


def test_weight_quant_method_key():
    """KsanaLLM's quantization_config.weight.quant_method: fp8_e4m3 = online FP8 weights, auto =
    the checkpoint's weights as they are; GPTQ's backend key takes KsanaLLM's two values."""
    def weight(method: str) -> dict:
        return {"setting": {"quantization_config": {"weight": {"quant_method": method}}}}

    assert parse_engine_config(weight("fp8_e4m3"))[0].quantization == "fp8"
    assert parse_engine_config(weight("w8a8_int8"))[0].quantization == "w8a8_int8"
    assert parse_engine_config(weight("auto"))[0].quantization is None
    assert parse_engine_config(weight("auto"), {"quantization": "fp8"})[0].quantization == "fp8"
    with pytest.raises(ValueError, match="quantization_config.weight.quant_method must be auto"):
        parse_engine_config(weight("int4"))
    def backend(name: str) -> dict:
        return {"setting": {"quantization_config": {"gptq_backend": name}}}

    for name in ("cutlass", "marlin"):
        assert parse_engine_config(backend(name))[0] == parse_engine_config({})[0]
    with pytest.raises(ValueError, match="gptq_backend must be cutlass or marlin, got 'exllama'"):
        parse_engine_config(backend("exllama"))


# What KsanaLLM's own examples/ksana_llm.yaml sets (its keys at its values, written out here).
KSANA_EXAMPLE = """
setting:
  global:
    tensor_para_size: 1
    pipeline_para_size: 1
    attn_data_para_size: 1
    expert_world_size: 1
    expert_para_size: 1
    embed_tokens_use_cpu: false
    enable_cuda_graph: false
    enable_full_shared_expert: false
    pipeline_para_comm_type: "default"
  batch_scheduler:
    schedule_strategy: 0
    waiting_timeout_in_ms: 3600000
    max_waiting_queue_len: 1200
    max_step_tokens: 4096
    max_batch_size: 128
    max_token_len: 2048
    swapout_block_threshold: 1.0
    swapin_block_threshold: 2.0
    launch_block_threshold: 2.0
    enable_auto_prefix_cache: true
    split_fuse_token_num: 256
    swap_threadpool_size: 8
    preempt_mode: 0
    min_flexible_cache_num: 0
    enable_speculative_decoding: false
    enable_mtp_module: false
    enable_xgrammar: false
  block_manager:
    block_token_num: 16
    reserved_device_memory_ratio: 0.05
    block_device_memory_ratio: -1.0
    block_host_memory_factor: 0.0
    dynamic_reusable_memory_ratio: 0.5
    lora_deivce_memory_ratio: 0.1  # pcg's [sic]
    lora_host_memory_factor: 1.0
  attn_backend:
    enable_blocked_multi_token_forwarding_kv: false
    flash_attn_impl: auto
    use_flashinfer_for_decode: false
  quantization_config:
    gptq_backend: cutlass
    kv_cache:
      dtype: auto
    weight:
      quant_method: auto
  profiler:
    export_interval_millis: 30000
    export_timeout_millis: 1000
    attributes:
      instance: "1.1.1.1"
  endpoint_type: python
  tokenization:
    add_special_tokens: true
    skip_special_tokens: true
model_spec:
  base_model:
    model_dir: /models/qwen
  plugin_model:
    enable_tensorrt: true
    plugin_thread_pool_size: 1
"""


def test_ksana_llms_own_example_file_loads(tmp_path, caplog):
    """Every key of KsanaLLM's shipped example: the ones we read take effect, the ones that change
    nothing here at these values are accepted and logged."""
    import logging

    with caplog.at_level(logging.INFO, logger="ksana_llm.config"):
        config, server = load_engine_config(write(tmp_path, KSANA_EXAMPLE))
    assert (config.max_num_seqs, config.max_step_tokens, config.max_model_len,
            config.split_fuse_token_num, config.max_queue_size) == (128, 4096, 2048, 256, 1200)
    assert config.num_speculative_tokens == 0 and config.model == "/models/qwen"
    logged = caplog.text
    assert "setting.profiler" in logged and "setting.global.expert_para_size" in logged
    assert "model_spec.plugin_model" in logged
    assert "use_flashinfer_for_decode" in logged and "lora_deivce_memory_ratio" in logged
    # At a value that would change something, an inert key is refused by name.
    with pytest.raises(ValueError, match="use_flashinfer_for_decode"):
        load_engine_config(write(tmp_path, KSANA_EXAMPLE.replace(
            "use_flashinfer_for_decode: false", "use_flashinfer_for_decode: true")))
    # KsanaLLM's Global Cache keys (its README): accepted while the connector is off (an empty
    # service_endpoint, the default scheduler), refused by name when they would turn it on.
    off = KSANA_EXAMPLE.replace("    schedule_strategy: 0\n", "    schedule_strategy: 0\n"
                                "    scheduler_type: 0\n")
    off = off.replace("  endpoint_type: python\n", '  endpoint_type: python\n'
                      '  global_cache_connector:\n    service_endpoint: ""\n'
                      '    master_server_addr: "127.0.0.1:50051"\n    backend_type: mooncake\n'
                      '    protocol: tcp\n')
    assert load_engine_config(write(tmp_path, off))[0] == config
    for before, after, key in (
            ("scheduler_type: 0", "scheduler_type: 1", "scheduler_type"),
            ('service_endpoint: ""', 'service_endpoint: "http://127.0.0.1:8080/metadata"',
             "service_endpoint")):
        with pytest.raises(ValueError, match=f"setting.*{key}: a KsanaLLM key that ksana_llm "
                                             "does not support yet"):
            load_engine_config(write(tmp_path, off.replace(before, after)))


@pytest.mark.parametrize("switch", ["enable_mtp_module", "enable_speculative_decoding"])
def test_mtp_and_async_keys(switch):
    """KsanaLLM's MTP switch (enable_mtp_module, with mtp_step_num drafts) and enable_async
    (async scheduling)."""
    config, _ = parse_engine_config({"setting": {"batch_scheduler": {switch: True,
                                                                     "mtp_step_num": 2}}})
    assert config.num_speculative_tokens == 2
    config, _ = parse_engine_config({"setting": {"batch_scheduler": {"enable_async": True}}})
    assert config.async_scheduling is True
    # KsanaLLM's example file carries both switches: turning either one on drafts.
    for mtp, speculative, drafts in ((False, True, 1), (True, False, 1), (False, False, 0)):
        config, _ = parse_engine_config({"setting": {"batch_scheduler": {
            "enable_mtp_module": mtp, "enable_speculative_decoding": speculative}}})
        assert config.num_speculative_tokens == drafts, (mtp, speculative)
    # An error about the drafts names the key the file gave: the switch without a step count.
    with pytest.raises(ValueError, match=f"enable_async, setting.batch_scheduler.{switch}: "):
        parse_engine_config({"setting": {"batch_scheduler": {switch: True, "enable_async": True}}})
