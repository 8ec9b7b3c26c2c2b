"""Sleep mode (vLLM's `sleep` / `wake_up`): the engine frees its KV cache (and, at level 2, its
weights) while idle, keeps requests that arrive meanwhile waiting, and after waking answers
exactly as transformers does -- with the same weights after level 1, with the weights loaded
after level 2 (`update_weights`). On a CUDA machine the same tests run on the GPU too, where
level 1 offloads the weights to host memory and the decode graphs are captured again.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ksana_llm as kt
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.sleep_mode import SleepMode
from tests.family_harness import greedy_trace, hf_reference
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.timeout(300)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NEW_TOKENS = 8
CONFIG = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """Tiny Llamas A (seed 0) and B (seed 1) of one shape, and transformers' greedy tokens."""
    root = tmp_path_factory.mktemp("sleep")
    prompt = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    found = {"prompt": prompt}
    for name, seed in (("a", 0), ("b", 1)):
        hf = build_tiny_model("llama2", root / name, seed=seed)
        found[name] = str(root / name)
        found["tokens_" + name] = greedy_trace(hf_reference(hf), prompt, NEW_TOKENS)[0][21:]
    return found


def engine_on(folder: str, device: str) -> kt.Engine:
    return kt.Engine(folder, device=device, dtype="float32", enable_sleep_mode=True,
                     block_token_num=4, num_device_blocks=64)


def kv_bytes(engine: kt.Engine) -> int:
    return sum(t.untyped_storage().nbytes() for pair in engine._core.runner.kv_caches
               for t in pair)


def weight_bytes(engine: kt.Engine) -> int:
    return sum(p.untyped_storage().nbytes() for p in engine.model.module.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_level_1_frees_the_kv_cache_and_requests_wait_for_waking(pair, device):
    with engine_on(pair["a"], device) as engine:
        run = lambda: engine.generate_outputs([pair["prompt"]], generation_config=CONFIG)[0]
        assert run().token_ids == pair["tokens_a"]
        assert run().num_cached_tokens == 20  # cached, until the sleep empties the cache
        weights = weight_bytes(engine)
        engine.sleep(level=1)
        assert engine.is_sleeping() and kv_bytes(engine) == 0
        assert weight_bytes(engine) == (weights if device == "cpu" else 0)  # offloaded on GPU
        waiting = engine.submit(kt.Request(pair["prompt"], generation_config=CONFIG))
        with pytest.raises(TimeoutError):
            waiting.result(timeout=1.0)  # queued, not run, while asleep
        engine.wake_up()
        assert not engine.is_sleeping() and kv_bytes(engine) > 0
        assert weight_bytes(engine) == weights
        answer = waiting.result(timeout=60)
        assert answer.token_ids == pair["tokens_a"] and answer.num_cached_tokens == 0


@pytest.mark.parametrize("device", DEVICES)
def test_level_2_then_new_weights_before_the_kv_cache(pair, device):
    """The RL trainer's order: sleep(2), wake the weights, load new ones, wake the KV cache."""
    with engine_on(pair["a"], device) as engine:
        engine.sleep(level=2)
        assert weight_bytes(engine) == 0 and kv_bytes(engine) == 0
        with pytest.raises(ValueError, match="weights are asleep"):
            engine.update_weights(pair["b"])
        engine.wake_up(tags=["weights"])
        assert weight_bytes(engine) > 0 and kv_bytes(engine) == 0 and engine.is_sleeping()
        engine.update_weights(pair["b"])
        engine.wake_up(tags=["kv_cache"])
        assert not engine.is_sleeping()
        answer = engine.generate_outputs([pair["prompt"]], generation_config=CONFIG)[0]
        assert answer.token_ids == pair["tokens_b"]


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_sleep_while_asleep_changes_nothing(pair, device):
    """vLLM's rule: a retried sleep is a no-op. A level 2 after a level 1 once dropped the
    weights on CPU (where level 1 leaves them in place) and not on CUDA; after waking the
    engine then waited forever for weights nobody was going to send."""
    with engine_on(pair["a"], device) as engine:
        engine.sleep(level=1)
        engine.sleep(level=2)
        engine.wake_up()
        assert not engine.is_sleeping()
        answer = engine.generate_outputs([pair["prompt"]], generation_config=CONFIG)[0]
        assert answer.token_ids == pair["tokens_a"]


def test_after_level_2_nothing_runs_until_every_weight_is_loaded(pair):
    """Memory back, values not: the engine must not answer from them, nor from half of them
    (a trainer sends its weights in parts)."""
    weights = load_file(f"{pair['a']}/model.safetensors")
    names = sorted(weights)
    with engine_on(pair["a"], "cpu") as engine:
        engine.sleep(level=2)
        engine.wake_up()
        assert engine.is_sleeping()
        waiting = engine.submit(kt.Request(pair["prompt"], generation_config=CONFIG))
        engine.update_weights({name: weights[name] for name in names[:5]})
        assert engine.is_sleeping()
        with pytest.raises(TimeoutError):
            waiting.result(timeout=1.0)
        engine.update_weights({name: weights[name] for name in names[5:]})
        assert not engine.is_sleeping()
        assert waiting.result(timeout=60).token_ids == pair["tokens_a"]


def test_queued_requests_time_out_while_asleep(pair):
    with kt.Engine(pair["a"], device="cpu", dtype="float32", enable_sleep_mode=True,
                   waiting_timeout_ms=300, num_device_blocks=64) as engine:
        engine.sleep()
        waiting = engine.submit(kt.Request(pair["prompt"], generation_config=CONFIG))
        with pytest.raises(kt.api.outputs.RequestError) as info:
            waiting.result(timeout=10)
        assert isinstance(info.value.__cause__, kt.QueueTimeoutError)
        engine.wake_up()
        answer = engine.generate_outputs([pair["prompt"]], generation_config=CONFIG)[0]
        assert answer.token_ids == pair["tokens_a"]


def test_the_queue_limit_holds_while_asleep(pair):
    """Asleep, no free sequence slot is about to take a request: every one counts as queued,
    and the one past max_queue_size is refused (429 over HTTP) rather than kept."""
    with kt.Engine(pair["a"], device="cpu", dtype="float32", enable_sleep_mode=True,
                   max_queue_size=2, num_device_blocks=64) as engine:
        engine.sleep()
        queued = [engine.submit(kt.Request(pair["prompt"], generation_config=CONFIG))
                  for _ in range(2)]
        with pytest.raises(kt.QueueFullError):
            engine.submit(kt.Request(pair["prompt"], generation_config=CONFIG))
        engine.wake_up()
        assert [h.result(timeout=60).token_ids for h in queued] == [pair["tokens_a"]] * 2


def test_engines_sharing_a_model_may_not_sleep_or_update_under_each_other(pair):
    """Two engines on one loaded Model share its weights: one may neither sleep (the other's
    weights would vanish) nor load new weights (the other would step on half-copied ones)
    while the other runs; once it is shut down, both work, and the engine answers as B."""
    model = kt.Model.from_pretrained(pair["a"], device="cpu", dtype="float32", progress=False)
    settings = dict(enable_sleep_mode=True, block_token_num=4, num_device_blocks=64)
    b_weights = kt.Model.from_pretrained(pair["b"], device="cpu", dtype="float32",
                                         progress=False).module.state_dict()
    with kt.Engine(model, **settings) as engine:
        other = kt.Engine(model, **settings)
        try:
            with pytest.raises(ValueError, match="sleep: 1 other running engine"):
                engine.sleep()
            with pytest.raises(ValueError, match="update_weights: 1 other running engine"):
                engine.update_weights(pair["b"])
            assert not engine.is_sleeping()
            for either in (engine, other):
                answer = either.generate_outputs([pair["prompt"]], generation_config=CONFIG)[0]
                assert answer.token_ids == pair["tokens_a"]
        finally:
            other.shutdown()
        engine.sleep(level=2)
        engine.wake_up()
        engine.update_weights(b_weights)
        answer = engine.generate_outputs([pair["prompt"]], generation_config=CONFIG)[0]
        assert answer.token_ids == pair["tokens_b"]


def test_sleep_mode_misuse_is_a_clear_error(pair):
    with kt.Engine(pair["a"], device="cpu", dtype="float32", num_device_blocks=64) as engine:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            engine.sleep()
    with engine_on(pair["a"], "cpu") as engine:
        for level in (0, 3, "1", True):
            with pytest.raises(ValueError, match="level must be 1"):
                engine.sleep(level=level)
        for tags in (["weight"], [], ["kv_cache", "gpu"]):
            with pytest.raises(ValueError, match="tags must name"):
                engine.wake_up(tags=tags)
        long = GenerationConfig(max_new_tokens=200, ignore_eos=True)
        running = engine.submit(kt.Request(pair["prompt"], generation_config=long))
        next(running.deltas())
        with pytest.raises(ValueError, match="requests are running"):
            engine.sleep()
        assert len(running.result(timeout=120).token_ids) == 200  # undisturbed
        assert not engine.is_sleeping()
        engine.sleep()
        engine.sleep()  # asleep already: nothing more to free
        engine.wake_up()
        engine.wake_up()  # awake already: nothing to take back
        answer = engine.generate_outputs([pair["prompt"]], generation_config=CONFIG)[0]
        assert answer.token_ids == pair["tokens_a"]


class _OffloadingRunner(SleepMode):
    """The GPU rule (level 1 copies the weights to host memory and frees them) on CPU
    tensors: `device` claims a GPU so the copy-and-restore path runs on this CPU-only
    machine (the storages are real, only the device name is borrowed)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.device = model, torch.device("cuda")
        self.kv_caches, self.draft_kv_caches, self.decode_graphs = [], [], None
        self.host_caches = []


def test_a_failed_offload_loses_no_weight(monkeypatch):
    """Host copies are made before any weight is freed: when one cannot be allocated (pinned
    memory runs out), every weight is still there and the runner is awake."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    before = [p.detach().clone() for p in model.parameters()]
    runner = _OffloadingRunner(model)
    real_empty, calls = torch.empty, []

    def failing_empty(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("out of pinned memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", failing_empty)
    with pytest.raises(RuntimeError, match="pinned"):
        runner.sleep(1)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert "weights" not in runner.asleep
    for p, value in zip(model.parameters(), before):
        assert torch.equal(p, value)


def test_level_1_offload_restores_every_value_tied_ones_included():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    model[1].weight = model[0].weight  # tied, as an LM head: one storage, freed once
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    runner = _OffloadingRunner(model)
    runner.sleep(1)
    assert runner.asleep == ("weights", "kv_cache")
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    runner.wake_up(["weights"])
    assert runner.asleep == ("kv_cache",) and not runner.weights_discarded
    assert model[1].weight is model[0].weight
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_shutdown_while_asleep_gives_the_model_its_weights_back():
    """An engine shut down while its weights sleep on the host (level 1 on a GPU): the weights
    are the Model's, which another engine may serve next, so they come back before the KV
    cache goes for good."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    before = [p.detach().clone() for p in model.parameters()]
    runner = _OffloadingRunner(model)
    runner.kv_caches = [(torch.zeros(4, 8), torch.zeros(4, 8))]
    runner.sleep(1)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    runner.release_kv_memory()
    assert "weights" not in runner.asleep
    for p, value in zip(model.parameters(), before):
        assert torch.equal(p, value)
    assert all(t.untyped_storage().nbytes() == 0 for t in runner.kv_caches[0])


def test_tensor_parallel_ranks_sleep_and_wake_together(pair):
    """TP 2 (gloo): every rank frees its slices at level 2 and loads the new ones; a worker
    that kept A's weights, or never took its memory back, would change the tokens."""
    with kt.Engine(pair["a"], device="cpu", dtype="float32", enable_sleep_mode=True,
                   tensor_parallel_size=2, block_token_num=4, num_device_blocks=64) as engine:
        engine.sleep(level=2)
        engine.wake_up(tags=["weights"])
        engine.update_weights(pair["b"])
        engine.wake_up(tags=["kv_cache"])
        answer = engine.generate_outputs([pair["prompt"]], generation_config=CONFIG)[0]
        assert answer.token_ids == pair["tokens_b"]
