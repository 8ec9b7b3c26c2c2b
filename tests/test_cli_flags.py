"""Command-line flags and config files reach the engine and server configs (parsed in
process: no model is loaded). The console script run as a process is tests/test_cli.py."""

from __future__ import annotations

import os

import pytest


def test_serve_step_loop_flags_reach_the_engine_config(tmp_path):
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args

    def engine_config(args):
        return configs_from_args(args)[0]

    config = engine_config(parse(["serve"]))
    assert (config.enable_cuda_graphs, config.async_scheduling,
            config.overlap_output_processing) == (True, None, None)  # the device decides
    args = ["serve", "--no-enable-cuda-graphs", "--no-async-scheduling",
            "--overlap-output-processing"]
    config = engine_config(parse(args))
    assert (config.enable_cuda_graphs, config.async_scheduling,
            config.overlap_output_processing) == (False, False, True)
    yaml_file = tmp_path / "ksana.yaml"
    yaml_file.write_text("setting:\n  global:\n    enable_cuda_graph: true\n")
    config = engine_config(parse([*args, "--config_file", str(yaml_file)]))
    assert (config.enable_cuda_graphs, config.async_scheduling) == (False, False)  # flags win
    assert engine_config(parse(["serve"])).num_speculative_tokens == 0
    config = engine_config(parse(["serve", "--num-speculative-tokens", "2"]))
    assert config.num_speculative_tokens == 2
    assert engine_config(parse(["serve"])).kv_cache_dtype == "auto"
    assert engine_config(parse(["serve", "--kv-cache-dtype", "fp8_e5m2"])).kv_cache_dtype == \
        "fp8_e5m2"
    assert parse(["generate", "hi", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert engine_config(parse(["serve"])).quantization is None
    assert engine_config(parse(["serve", "--quantization", "fp8"])).quantization == "fp8"
    assert parse(["generate", "hi", "-q", "fp8"]).quantization == "fp8"
    assert parse(["generate", "hi", "-q", "w8a8_int8"]).quantization == "w8a8_int8"


def test_scheduling_and_memory_flags_reach_the_engine_config():
    """Every EngineConfig scheduling / memory field has a flag (vLLM's names as aliases); the
    defaults are the EngineConfig's own."""
    import ksana_llm as kt
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    names = ("max_step_tokens", "split_fuse_token_num", "block_device_memory_ratio",
             "reserved_device_memory_ratio", "block_host_memory_factor", "enable_prefix_caching",
             "preempt_mode", "waiting_timeout_ms", "enable_cuda_graphs",
             "cuda_graph_max_batch_size", "attention_backend", "scheduler_policy")
    defaults = kt.EngineConfig()
    config = configs_from_args(parse(["serve"]))[0]
    assert [getattr(config, n) for n in names] == [getattr(defaults, n) for n in names]
    config = configs_from_args(parse([
        "serve", "--max-num-batched-tokens", "4096", "--split-fuse-token-num", "256",
        "--gpu-memory-utilization", "0.8", "--reserved-device-memory-ratio", "0.02",
        "--block-host-memory-factor", "2", "--no-enable-prefix-caching", "--preemption-mode",
        "recompute", "--waiting-timeout-ms", "500", "--enforce-eager",
        "--cuda-graph-max-batch-size", "32", "--attention-backend", "torch",
        "--scheduling-policy", "fcfs"]))[0]
    assert [getattr(config, n) for n in names] == [4096, 256, 0.8, 0.02, 2.0, False, 1, 500,
                                                   False, 32, "torch", "fifo"]
    assert parse(["serve", "--block-device-memory-ratio", "0.5"]).block_device_memory_ratio == 0.5
    # vLLM's spellings: --long-prefill-token-threshold is the per-sequence chunk cap;
    # --cuda-graph-sizes with one value the largest batch captured, with several the sizes.
    config = configs_from_args(parse(["serve", "--long-prefill-token-threshold", "128",
                                      "--cuda-graph-sizes", "48"]))[0]
    assert (config.split_fuse_token_num, config.cuda_graph_sizes) == (128, [48])
    config = configs_from_args(parse(["serve", "--cuda-graph-sizes", "1", "4", "16"]))[0]
    assert (config.cuda_graph_max_batch_size, config.cuda_graph_sizes) == (None, [1, 4, 16])
    for both in (["--cuda-graph-sizes", "8"], ["--cuda-graph-sizes", "1", "8"]):
        with pytest.raises(ValueError, match="cuda.graph.sizes or .*cuda.graph.max.batch.size"):
            configs_from_args(parse(["serve", "--cuda-graph-max-batch-size", "8", *both]))
    with pytest.raises(SystemExit):
        parse(["serve", "--cuda-graph-sizes", "0"])
    assert configs_from_args(parse(["serve", "--swap-space", "4"]))[0].swap_space == 4.0
    for value, size in (("7.5GiB", 7.5 * 2**30), ("8e9", 8e9), ("512M", 512e6)):
        config = configs_from_args(parse(["serve", "--kv-cache-memory-bytes", value]))[0]
        assert config.kv_cache_memory_bytes == int(size)
    for bad in ("0", "8X", "lots"):
        with pytest.raises(SystemExit):
            parse(["serve", "--kv-cache-memory-bytes", bad])
    for bad in (["--preemption-mode", "later"], ["--attention-backend", "cuda"]):
        with pytest.raises(SystemExit):
            parse(["serve", *bad])
    # Named by the flag as typed (its vLLM name), not the field.
    with pytest.raises(ValueError, match="--gpu-memory-utilization: .*less than or equal to 1"):
        configs_from_args(parse(["serve", "--gpu-memory-utilization", "1.5"]))
    # A policy of one's own by import path; a bad one is named by its flag.
    config = configs_from_args(parse([
        "serve", "--scheduling-policy", "tests.scheduling_policies:ShortestPromptFirst"]))[0]
    assert config.scheduler_policy == "tests.scheduling_policies:ShortestPromptFirst"
    with pytest.raises(ValueError, match="--scheduling-policy: .*has no 'Nope'"):
        configs_from_args(parse(["serve", "--scheduling-policy", "tests.scheduling_policies:Nope"]))


def test_vllm_command_line_spellings(tmp_path, caplog):
    """`serve MODEL` (positional, as `vllm serve MODEL`), --block-size and --uvicorn-log-level
    are vLLM's spellings of --model, --block-token-num and --log-level; --tokenizer reaches
    the EngineConfig under vLLM's and KsanaLLM's names."""
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    config = configs_from_args(parse(["serve", "/models/m", "--block-size", "32"]))[0]
    assert (config.model, config.block_token_num) == ("/models/m", 32)
    assert configs_from_args(parse(["serve", "--model", "/models/m"]))[0].model == "/models/m"
    assert configs_from_args(parse(["serve", "/models/m", "--model", "/models/m"]))[0].model == \
        "/models/m"
    assert configs_from_args(parse(["serve"]))[0].model is None  # the default model
    with pytest.raises(ValueError, match="given twice.*/models/a.*--model /models/b"):
        configs_from_args(parse(["serve", "/models/a", "--model", "/models/b"]))
    here = os.path.basename(os.getcwd())
    assert configs_from_args(parse(["serve", ".", "--model", f"../{here}"]))[0].model == "."
    # --served-model-name takes every word after it: a model path there is refused, not served
    # under its name while the default model loads.
    with pytest.raises(ValueError, match=f"--served-model-name took {tmp_path} as a name"):
        configs_from_args(parse(["serve", "--served-model-name", "foo", str(tmp_path)]))
    assert parse(["serve", "--uvicorn-log-level", "info"]).log_level == "info"
    for flag in ("--tokenizer", "--tokenizer_path", "--tokenizer-dir"):  # vLLM's, KsanaLLM's
        assert configs_from_args(parse(["serve", flag, "/tok"]))[0].tokenizer == "/tok"
    assert parse(["router", "--uvicorn-log-level", "debug"]).log_level == "debug"
    # Flags vLLM command lines carry that mean nothing here: taken, with a warning saying why,
    # and no trace in the settings.
    with caplog.at_level("WARNING", logger="ksana_llm.cli"):
        args = parse(["serve", "/models/m", "--disable-log-requests",
                      "--enable-chunked-prefill", "--enable-request-id-headers",
                      "--enable-prompt-tokens-details", "--enable-lora"])
    assert configs_from_args(args)[0].model == "/models/m"
    assert not {"disable_log_requests", "enable_chunked_prefill",
                "enable_lora"} & set(vars(args))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "--disable-log-requests changes nothing",
        "--enable-chunked-prefill changes nothing", "--enable-request-id-headers changes nothing",
        "--enable-prompt-tokens-details changes nothing", "--enable-lora changes nothing"]
    # --trust-remote-code runs a hub repository's plugin (tests/test_hub_models.py).
    assert parse(["generate", "hi", "--trust-remote-code"]).trust_remote_code is True
    # vLLM's names of settings that exist here.
    assert configs_from_args(parse(["serve", "--num-gpu-blocks-override", "96"]))[0] \
        .num_device_blocks == 96
    assert parse(["serve", "--access-log", "--disable-uvicorn-access-log"]).access_log is False
    assert parse(["router", "--disable-uvicorn-access-log"]).access_log is False
    assert parse(["serve"]).access_log is False
    # run-batch opens no port: listening flags are refused, not ignored.
    for flag in (["--port", "8000"], ["--ssl-certfile", "cert.pem"], ["--access-log"],
                 ["--disable-log-stats"]):  # (nor the stats line: it has a progress bar)
        with pytest.raises(SystemExit):
            parse(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl", *flag])


def test_speculative_flags_reach_the_engine_config():
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    config = configs_from_args(parse(["serve"]))[0]
    assert (config.num_speculative_tokens, config.speculative_method) == (0, "mtp")
    config = configs_from_args(parse(["serve", "--num-speculative-tokens", "3",
                                      "--speculative-method", "ngram", "--prompt-lookup-min",
                                      "2", "--prompt-lookup-max", "5",
                                      "--speculative-disable-by-batch-size", "6"]))[0]
    assert (config.num_speculative_tokens, config.speculative_method, config.prompt_lookup_min,
            config.prompt_lookup_max, config.speculative_disable_by_batch_size) \
        == (3, "ngram", 2, 5, 6)
    assert parse(["generate", "hi", "--speculative-method", "ngram"]).speculative_method == "ngram"
    with pytest.raises(SystemExit):
        parse(["serve", "--speculative-method", "eagle"])


def test_vllm_speculative_config_json(capsys):
    """vLLM's --speculative-config JSON sets the same fields as the separate flags; what this
    engine cannot do (a draft model, EAGLE, unknown keys) is refused as the flags are read, and
    a flag that disagrees with it is an error naming both."""
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    config = configs_from_args(parse([
        "serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 5, "disable_by_batch_size": 6}']))[0]
    assert (config.num_speculative_tokens, config.speculative_method, config.prompt_lookup_min,
            config.prompt_lookup_max, config.speculative_disable_by_batch_size) \
        == (3, "ngram", 2, 5, 6)
    for spelling in ('{"method": "deepseek_mtp", "num_speculative_tokens": 1}',
                     '{"method": "mtp", "num_speculative_tokens": 1}'):
        config = configs_from_args(parse(["serve", "--speculative-config", spelling]))[0]
        assert (config.speculative_method, config.num_speculative_tokens) == ("mtp", 1)
    old_ngram = '{"model": "[ngram]", "num_speculative_tokens": 2}'  # vLLM's older spelling
    assert configs_from_args(parse(["serve", "--speculative-config", old_ngram]))[0] \
        .speculative_method == "ngram"
    # Agreeing flags are fine; disagreeing ones name both.
    ngram4 = '{"method": "ngram", "num_speculative_tokens": 4}'
    assert configs_from_args(parse(["serve", "--speculative-config", ngram4,
                                    "--num-speculative-tokens", "4"]))[0] \
        .num_speculative_tokens == 4
    with pytest.raises(ValueError, match="--speculative-config sets num_speculative_tokens to 4 "
                                         "and --num-speculative-tokens to 2"):
        configs_from_args(parse(["serve", "--speculative-config", ngram4,
                                 "--num-speculative-tokens", "2"]))
    # Values the engine refuses are named as the JSON's.
    with pytest.raises(ValueError, match="--speculative-config"):
        configs_from_args(parse(["serve", "--speculative-config",
                                 '{"method": "ngram", "num_speculative_tokens": -1}']))
    for bad, needle in (('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                        ('{"model": "/drafts/small", "num_speculative_tokens": 2}', "draft"),
                        ('{"method": "ngram", "num_speculative_tokens": 2, "eagle": 1}',
                         "unsupported key"),
                        ('{"method": "ngram"}', "num_speculative_tokens"),
                        ("[1]", "JSON object"), ("{", "not JSON")):
        with pytest.raises(SystemExit):
            parse(["serve", "--speculative-config", bad])
        assert needle in capsys.readouterr().err, bad


def test_lora_flags_reach_the_engine_config(tmp_path, capsys):
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    config = configs_from_args(parse(["serve"]))[0]
    assert (config.lora_modules, config.num_lora_slots, config.max_lora_rank) == ({}, 0, 16)
    assert config.lora_max_wait_steps == 64
    args = parse(["serve", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "3",
                  "--max-lora-rank", "64", "--allow-runtime-lora-updating",
                  "--lora-max-wait-steps", "0", "--max-cpu-loras", "5"])
    config = configs_from_args(args)[0]
    assert config.lora_modules == {"sql": "/a/sql", "chat": "/a/chat"}
    assert (config.num_lora_slots, config.max_lora_rank, config.lora_max_wait_steps,
            config.max_cpu_loras) == (3, 64, 0, 5)
    assert args.allow_runtime_lora_updating
    with pytest.raises(ValueError, match="each adapter once"):
        configs_from_args(parse(["serve", "--lora-modules", "a=/x", "a=/y"]))
    # Runtime loading alone: one slot (vLLM's max_loras default), so a load can succeed.
    assert configs_from_args(parse(["serve", "--allow-runtime-lora-updating"]))[0] \
        .num_lora_slots == 1
    # More adapters than slots: they take turns.
    assert configs_from_args(parse(["serve", "--lora-modules", "a=/x", "b=/y", "--max-loras",
                                    "1"]))[0].num_lora_slots == 1
    with pytest.raises(SystemExit):
        parse(["serve", "--lora-modules", "no-path"])
    assert "NAME=PATH" in capsys.readouterr().err
    # vLLM's JSON form too, mixed with the other (base_model_name is taken, not needed).
    vllm_form = '{"name": "tone", "path": "/a/tone", "base_model_name": "SmolLM2"}'
    config = configs_from_args(parse(["serve", "--lora-modules", "sql=/a/sql", vllm_form]))[0]
    assert config.lora_modules == {"sql": "/a/sql", "tone": "/a/tone"}
    for bad in ('{"name": "tone"}', '{"name": "t", "path": "/p", "rank": 8}'):
        with pytest.raises(SystemExit):
            parse(["serve", "--lora-modules", bad])
        assert '"name" and "path"' in capsys.readouterr().err


def test_kv_transfer_flags_and_yaml(tmp_path, local_engine):
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import build_app, configs_from_args, kv_transfer_from_args

    parse = build_parser().parse_args
    yaml_file = tmp_path / "ksana.yaml"
    yaml_file.write_text("setting:\n  connector:\n    group_role: decode\n"
                         "    task_expire_sec: 30\n")
    args = parse(["serve", "--config_file", str(yaml_file)])
    assert kv_transfer_from_args(args, configs_from_args(args)[1]) == ("decode", 30.0)
    args = parse(["serve", "--config_file", str(yaml_file), "--kv-role", "prefill",
                  "--kv-transfer-ttl", "5"])
    assert kv_transfer_from_args(args, configs_from_args(args)[1]) == ("prefill", 5.0)
    # none switches the YAML's role off (and with it the YAML's expiry).
    args = parse(["serve", "--config_file", str(yaml_file), "--kv-role", "none"])
    assert kv_transfer_from_args(args, configs_from_args(args)[1]) == (None, None)
    # A flag's bad value is named by the flag, with a YAML file as without one.
    for extra in ([], ["--config_file", str(yaml_file)]):
        with pytest.raises(ValueError, match="^--max-num-seqs: .*greater than or equal to 1"):
            configs_from_args(parse(["serve", *extra, "--max-num-seqs", "0"]))
    assert kv_transfer_from_args(parse(["serve"]), None) == (None, None)
    # vLLM's --kv-transfer-config: its kv_role is ours (over the YAML's), its transport keys
    # are accepted; a bad role, an unknown key or a disagreeing --kv-role is named.
    vllm = '{"kv_connector": "P2pNcclConnector", "kv_role": "%s", "kv_buffer_size": 1e9}'
    for theirs, ours in (("kv_producer", "prefill"), ("kv_consumer", "decode"),
                         ("kv_both", "both")):
        args = parse(["serve", "--config_file", str(yaml_file), "--kv-transfer-config",
                      vllm % theirs])
        assert kv_transfer_from_args(args, configs_from_args(args)[1]) == (ours, 30.0)
    for flags, message in (
            (["--kv-transfer-config", vllm % "kv_middle"], "kv_role must be one of"),
            (["--kv-transfer-config", '{"kv_role": "kv_both", "kv_magic": 1}'],
             "unknown key.* kv_magic"),
            (["--kv-transfer-config", vllm % "kv_producer", "--kv-role", "decode"],
             "disagree")):
        with pytest.raises(ValueError, match="--kv-"):
            kv_transfer_from_args(parse(["serve", *flags]), None)
        with pytest.raises(ValueError, match=message):
            kv_transfer_from_args(parse(["serve", *flags]), None)
    from fastapi.testclient import TestClient

    app = build_app(local_engine, served_model_name="m", kv_role="prefill")
    assert app.state.server.kv_transfer.exports and not app.state.server.kv_transfer.imports
    # (No `with`: the app's shutdown would stop the shared engine.)
    missing = TestClient(app).get("/kv_transfer/abc")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "kv_transfer_not_found"
    plain = build_app(local_engine, served_model_name="m")
    assert plain.state.server.kv_transfer is None
    assert TestClient(plain).get("/kv_transfer/abc").status_code == 404  # no such route
    refused = TestClient(plain).post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert refused.status_code == 400 and "--kv-role" in refused.json()["error"]["message"]
    # --kv-prefill-url: a decode server fetches from those servers only.
    listed = build_app(local_engine, served_model_name="m", kv_role="decode",
                       kv_prefill_urls=["http://127.0.0.1:1/"])
    refused = TestClient(listed).post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 1, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_url": "http://169.254.169.254", "transfer_id": "x"}})
    assert refused.status_code == 400 and "--kv-prefill-url" in refused.json()["error"]["message"]
    # The listed server spelled another way (a router given localhost): fetched from, and as
    # nothing answers on port 1, the prompt is computed here.
    fetched = TestClient(listed).post("/v1/completions", json={
        "prompt": "Hi", "max_tokens": 1, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_url": "HTTP://localhost:1", "transfer_id": "x"}})
    assert fetched.status_code == 200, fetched.text
    assert listed.state.server.kv_transfer.num_fetch_failures == 1
    with pytest.raises(ValueError, match="--kv-transfer-ttl and --kv-prefill-url need --kv-role"):
        build_app(local_engine, served_model_name="m", kv_transfer_ttl_s=5)
    with pytest.raises(ValueError, match="need --kv-role"):
        build_app(local_engine, served_model_name="m", kv_prefill_urls=["http://a:1"])
    with pytest.raises(ValueError, match="--kv-role must be one of"):
        build_app(local_engine, served_model_name="m", kv_role="middle")
    with pytest.raises(ValueError, match="--kv-transfer-ttl must be > 0"):
        build_app(local_engine, served_model_name="m", kv_role="both", kv_transfer_ttl_s=0)
    from ksana_llm.server.app import check_kv_role

    with pytest.raises(ValueError, match="--kv-role needs a single-rank engine"):
        check_kv_role("decode", 2, 1)  # (checked before the model loads)


@pytest.mark.parametrize("flag, module, name", [
    ("--load-format", "ksana_llm.loader.load_format", "LOAD_FORMATS"),
    ("--logprobs-mode", "ksana_llm.runner.logprobs_mode", "LOGPROBS_MODES")])
def test_choices_below_the_config_are_spelled_as_it_spells_them(flag, module, name):
    """The loader and the runner cannot import the config (they sit below it): their tuples
    and the config's Literals, which the CLI's choices come from, must name the same values in
    the same order."""
    import argparse
    import importlib

    from ksana_llm import config
    from ksana_llm.cli_args import add_serve_args

    lower = getattr(importlib.import_module(module), name)
    assert lower == getattr(config, name)
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    action = next(a for a in parser._actions if flag in a.option_strings)
    assert tuple(action.choices) == lower


def test_api_key_from_the_environment_and_an_empty_one(monkeypatch, capsys):
    from ksana_llm.cli import build_parser

    monkeypatch.setenv("KLLM_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "given"]).api_key == "given"
    # An empty $KLLM_API_KEY means no key (vLLM reads an empty $VLLM_API_KEY so).
    monkeypatch.setenv("KLLM_API_KEY", "")
    assert build_parser().parse_args(["serve"]).api_key is None
    # An empty --api-key is a mistake, told at once (before any model loads), on the router too.
    for command in (["serve", "--api-key", ""], ["router", "--decode", "http://a", "--api-key", " "]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(command)
        assert "--api-key: must not be empty" in capsys.readouterr().err


def test_more_vllm_flags_are_taken_or_refused_with_the_reason(caplog, capsys):
    """Flags of vLLM deployment scripts: those that describe what this engine does anyway are
    taken with a warning saying why; values that ask for what it does not do (another
    tokenizer mode, Ray, another grammar backend, grammar over the thinking) stop the command
    line with the reason; --max-cudagraph-capture-size is vLLM's --cuda-graph-max-batch-size."""
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    flags = ["--tokenizer-mode", "auto", "--distributed-executor-backend", "mp",
             "--guided-decoding-backend", "xgrammar", "--max-seq-len-to-capture", "8192",
             "--max-parallel-loading-workers", "2", "--disable-custom-all-reduce",
             "--disable-frontend-multiprocessing", "--disable-cascade-attn",
             "--enable-expert-parallel", "--structured-outputs-config",
             '{"backend": "xgrammar", "disable_any_whitespace": true}']
    with caplog.at_level("WARNING", logger="ksana_llm.cli"):
        args = parse(["serve", "/models/m", *flags, "--max-cudagraph-capture-size", "24"])
    warned = {r.getMessage().split(" changes nothing")[0] for r in caplog.records}
    assert warned == {f for f in flags if f.startswith("--")}
    config = configs_from_args(args)[0]
    assert (config.model, config.cuda_graph_max_batch_size) == ("/models/m", 24)
    for refused, reason in ((["--tokenizer-mode", "mistral"], "accepted: auto, hf"),
                            (["--distributed-executor-backend", "ray"], "accepted: mp, uni"),
                            (["--guided-decoding-backend", "outlines"], "xgrammar"),
                            (["--structured-outputs-config", '{"enable_in_reasoning": true}'],
                             "enable_in_reasoning"),
                            (["--structured-outputs-config", '{"backend": "guidance"}'],
                             "backend"),
                            (["--structured-outputs-config", '{"whitespace": 1}'],
                             "unknown key")):
        with pytest.raises(SystemExit):
            parse(["serve", *refused])
        assert reason in capsys.readouterr().err
