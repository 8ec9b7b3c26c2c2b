"""vLLM's `--compilation-config` / `-O` on `serve`: its CUDA-graph keys set the engine's graph
settings (as --enforce-eager, --cuda-graph-sizes and --cuda-graph-max-batch-size do), its
torch.compile keys and optimization level are taken with a warning that they change nothing,
and anything else is refused as the flags are read."""

from __future__ import annotations

import logging

import pytest

from ksana_llm.cli import build_parser
from ksana_llm.server.app import configs_from_args


def _graph_settings(*argv: str) -> tuple:
    config = configs_from_args(build_parser().parse_args(["serve", *argv]))[0]
    return config.enable_cuda_graphs, config.cuda_graph_sizes, config.cuda_graph_max_batch_size


def test_cuda_graph_keys_set_the_engine_config():
    default = _graph_settings()
    assert _graph_settings("--compilation-config", '{"cudagraph_mode": "NONE"}')[0] is False
    assert _graph_settings("-O", '{"use_cudagraph": false}')[0] is False
    assert _graph_settings("-O", '{"cudagraph_mode": "full_decode_only"}') == (True, None, None)
    assert _graph_settings("-O", '{"cudagraph_capture_sizes": [8, 1, 2, 4]}')[1:] == \
        ([1, 2, 4, 8], None)
    assert _graph_settings("-O", '{"max_cudagraph_capture_size": 64}')[1:] == (None, 64)
    # Both: vLLM caps the list by the largest size.
    assert _graph_settings("-O", '{"cudagraph_capture_sizes": [1, 2, 4, 8, 16], '
                                 '"max_cudagraph_capture_size": 4}')[1:] == ([1, 2, 4], None)
    # Agreeing with the separate flags is fine.
    assert _graph_settings("--enforce-eager", "-O", '{"cudagraph_mode": "NONE"}')[0] is False
    assert _graph_settings("-O3") == default


def test_compile_keys_and_levels_change_nothing_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="ksana_llm.server"):
        settings = _graph_settings("--compilation-config",
                                   '{"level": 3, "use_inductor": true, "custom_ops": ["none"], '
                                   '"cudagraph_capture_sizes": [1, 2]}')
    assert settings[1] == [1, 2]
    assert "--compilation-config level, use_inductor, custom_ops changes nothing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ksana_llm.server"):
        _graph_settings("-O0")
    assert "--compilation-config level changes nothing" in caplog.text


@pytest.mark.parametrize("value, needle", [
    ('{"nope": 1}', "unknown key 'nope'"),
    ("7", "level must be 0, 1, 2 or 3"),
    ('{"cudagraph_mode": "SOMETIMES"}', "cudagraph_mode must be one of NONE"),
    ('{"cudagraph_capture_sizes": [0, 2]}', "cudagraph_capture_sizes must be a list of positive"),
    ('{"max_cudagraph_capture_size": "8"}', "max_cudagraph_capture_size must be a positive"),
    ('{"cudagraph_mode": "NONE", "use_cudagraph": true}', "disagree"),
    ("[1]", "JSON object"),
])
def test_bad_values_are_refused_as_the_flags_are_read(value, needle, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--compilation-config", value])
    assert needle in capsys.readouterr().err


def test_a_separate_flag_that_disagrees_names_both():
    with pytest.raises(ValueError, match="--compilation-config sets enable_cuda_graphs to True "
                                         "and --enable-cuda-graphs to False"):
        _graph_settings("--enforce-eager", "-O", '{"cudagraph_mode": "FULL"}')
    with pytest.raises(ValueError, match="--compilation-config sets cuda_graph_sizes"):
        _graph_settings("--cuda-graph-sizes", "8", "-O", '{"cudagraph_capture_sizes": [4]}')
