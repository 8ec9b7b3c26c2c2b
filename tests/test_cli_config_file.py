"""vLLM's `serve --config FILE`: a YAML file of the command's own flags (ksana_llm/cli_config.py),
read as the command's defaults under the command line's flags."""

from __future__ import annotations


def test_vllm_config_file_sets_flags_and_the_command_line_wins(tmp_path, capsys, caplog):
    """vLLM's `serve --config FILE`: the YAML's keys are the command's long flag names (dashes
    or underscores); they reach the EngineConfig and the server's settings; a flag on the
    command line wins, as does its model; a key the command does not take, a switch given a
    non-boolean, a key given twice (as in --config_file) or a value its flag refuses (a list
    for a one-value flag) is an error naming --config and the key."""
    from ksana_llm.cli import _with_flags_file, build_parser, main
    from ksana_llm.server.app import configs_from_args

    parser = build_parser()
    flags = tmp_path / "vllm.yaml"
    flags.write_text("model: /models/from-yaml\nport: 8123\nmax-model-len: 512\n"
                     "max_num_seqs: 8\nenable-prefix-caching: false\n"
                     "served-model-name: [a, b]\noverride-generation-config: {temperature: 0.5}\n"
                     "kv-cache-memory-bytes: 2GiB\n")

    def parse(*argv: str):
        args = parser.parse_args(list(argv))
        return _with_flags_file(parser, args, list(argv))

    args = parse("serve", "--config", str(flags), "--max-num-seqs", "4")
    config = configs_from_args(args)[0]
    assert (args.port, args.served_model_name, args.override_generation_config) == (
        8123, ["a", "b"], {"temperature": 0.5})
    assert (config.model, config.max_model_len, config.max_num_seqs) == (
        "/models/from-yaml", 512, 4)
    assert (config.enable_prefix_caching, config.kv_cache_memory_bytes) == (False, 2 * 2**30)
    for argv in (["serve", "/models/typed", "--config", str(flags)],
                 ["serve", "--config", str(flags), "--model", "/models/typed"]):
        assert configs_from_args(parse(*argv))[0].model == "/models/typed"
    # A flag without effect, on the command line and in the file: one warning for each (the
    # command line is read twice, once before the file is known).
    flags.write_text("enable-chunked-prefill: true\n")
    with caplog.at_level("WARNING", logger="ksana_llm.cli"):
        parse("serve", "--config", str(flags), "--disable-log-requests")
    assert sorted(r.getMessage().split(":")[0] for r in caplog.records) == [
        "--disable-log-requests changes nothing", "--enable-chunked-prefill changes nothing"]
    for text, message in (("max-modle-len: 5\n", "'max-modle-len' is not a flag"),
                          ("enable-prefix-caching: maybe\n", "enable-prefix-caching is a switch"),
                          ("- port\n", "must hold a mapping"),
                          ("config: other.yaml\n", "'config' is not a flag"),
                          ("max-model-len: [256, 512]\n", "max-model-len: invalid int value"),
                          ("max-num-seqs: 4\nmax-num-seqs: 8\n", "duplicate key 'max-num-seqs'"),
                          ("load-format: nope\n", "load-format: invalid choice: 'nope'")):
        flags.write_text(text)
        assert main(["serve", "--config", str(flags)]) == 2
        error = capsys.readouterr().err
        assert "--config" in error and message in error, error


def test_config_file_lists_and_optional_values_reach_their_own_flags(tmp_path):
    """A list in the flags file fills a list flag without swallowing the command line's
    positional model; a repeatable flag is given once per item; `hf-token: true` is the bare
    flag (huggingface_hub's own token) and false none."""
    from ksana_llm.cli import _with_flags_file, build_parser
    from ksana_llm.server.app import configs_from_args

    parser = build_parser()
    flags = tmp_path / "vllm.yaml"

    def parse(text: str, *argv: str):
        flags.write_text(text)
        argv = ("serve", *argv, "--config", str(flags))
        return _with_flags_file(parser, parser.parse_args(list(argv)), list(argv))

    args = parse("served-model-name: [a, b]\ncuda-graph-sizes: [1, 2]\n"
                 "kv-prefill-url: [http://p:1, http://q:2]\n", "/models/typed")
    assert configs_from_args(args)[0].model == "/models/typed"
    assert (args.served_model_name, args.cuda_graph_sizes, args.kv_prefill_url) == (
        ["a", "b"], [1, 2], ["http://p:1", "http://q:2"])
    assert parse("served-model-name: [a, b]\n", "/models/typed",
                 "--served-model-name", "c").served_model_name == ["c"]
    assert configs_from_args(parse("hf-token: true\n"))[0].hf_token is True
    assert configs_from_args(parse("hf-token: false\n"))[0].hf_token is None
    assert configs_from_args(parse("hf-token: hf_abc\n"))[0].hf_token == "hf_abc"
