"""`Engine.start_profile` / `stop_profile` and the server's /start_profile, /stop_profile
(vLLM's): a real torch.profiler trace of the engine's steps, read back from the file."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import httpx
import pytest

import ksana_llm as kt


def trace_names(path: str) -> set[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return {event.get("name", "") for event in json.load(f)["traceEvents"]}


@pytest.fixture(scope="module")
def profiled(default_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("traces")
    engine = kt.Engine(default_model, num_device_blocks=64,
                       profiler_config={"torch_profiler_dir": str(directory)})
    yield engine, directory
    engine.shutdown()


def test_a_profile_holds_the_steps_it_ran_over(profiled):
    engine, directory = profiled
    engine.start_profile(profile_prefix="run")
    assert engine.is_profiling
    assert engine.generate("Hello", kt.GenerationConfig(max_new_tokens=3))
    path = engine.stop_profile()
    assert not engine.is_profiling
    assert Path(path).parent == directory and Path(path).name.startswith("run-")
    assert path.endswith(".pt.trace.json.gz")
    names = trace_names(path)
    # The model's forward ran inside: its embedding lookup and its matrix products.
    assert "aten::embedding" in names and names & {"aten::mm", "aten::addmm", "aten::linear"}
    # A profile stopped is not running: a second stop is refused; the engine goes on.
    with pytest.raises(ValueError, match="^stop_profile: no profile is running"):
        engine.stop_profile()
    engine.start_profile()
    with pytest.raises(ValueError, match="^start_profile: a profile is already running"):
        engine.start_profile()
    assert trace_names(engine.stop_profile())  # an idle profile still writes a trace
    with pytest.raises(ValueError, match="profile_prefix"):
        engine.start_profile(profile_prefix="a/b")
    assert engine.generate("Hello", kt.GenerationConfig(max_new_tokens=2))


def test_settings_and_shutdown(default_model, tmp_path):
    plain = kt.Engine(default_model, num_device_blocks=32)
    try:
        with pytest.raises(ValueError, match="^profiler_config: profiling is off"):
            plain.start_profile()
        assert plain.get_tokenizer() is plain.tokenizer is not None
    finally:
        plain.shutdown()
    with pytest.raises(ValueError, match="profiler_config"):
        kt.EngineConfig(profiler_config={"profiler": "cuda", "torch_profiler_dir": "x"})
    engine = kt.Engine(default_model, num_device_blocks=32, profiler_config={
        "torch_profiler_dir": str(tmp_path), "torch_profiler_use_gzip": False,
        "torch_profiler_with_stack": False})
    engine.start_profile()
    engine.generate("Hi", kt.GenerationConfig(max_new_tokens=2))
    engine.shutdown()  # a running profile's trace is written, not lost
    traces = list(tmp_path.glob("ksana_llm-*.pt.trace.json"))
    assert len(traces) == 1 and "aten::embedding" in trace_names(str(traces[0]))


def test_profile_routes(profiled, default_model):
    from ksana_llm.server.app import build_app

    engine, directory = profiled
    plain = kt.Engine(default_model, num_device_blocks=32)

    async def check():
        transport = httpx.ASGITransport(app=build_app(engine, served_model_name="m"))
        async with httpx.AsyncClient(transport=transport, base_url="http://m") as http:
            assert (await http.post("/start_profile")).status_code == 200
            r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200
            r = await http.post("/stop_profile")
            assert r.status_code == 200 and Path(r.json()["trace"]).parent == directory
            assert "aten::embedding" in trace_names(r.json()["trace"])
            r = await http.post("/stop_profile")  # nothing running: a 400 with the reason
            assert r.status_code == 400 and "no profile is running" in r.json()["error"]["message"]
        transport = httpx.ASGITransport(app=build_app(plain, served_model_name="m"))
        async with httpx.AsyncClient(transport=transport, base_url="http://m") as http:
            assert (await http.post("/start_profile")).status_code == 404  # not mounted

    try:
        asyncio.run(check())
    finally:
        plain.shutdown()


def test_profiler_flags(monkeypatch):
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    def config(*flags):
        return configs_from_args(build_parser().parse_args(["serve", *flags]))[0].profiler_config

    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    assert config() is None
    given = config("--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/t", '
                                        '"torch_profiler_record_shapes": true}')
    assert (given.torch_profiler_dir, given.torch_profiler_record_shapes) == ("/t", True)
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "/traces")  # older vLLM's way
    assert config().torch_profiler_dir == "/traces"
    with pytest.raises(ValueError, match="--profiler-config"):
        config("--profiler-config", '{"torch_profiler_dir": "/t", "torch_profiler_sample": 1}')
