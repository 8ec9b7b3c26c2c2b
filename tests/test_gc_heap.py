"""The engine's start-up heap is frozen out of the garbage collector's full passes while it
serves (`EngineConfig.freeze_gc_heap`, `api/gc_heap.py`), and given back when it stops."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import ksana_llm as kt

GREEDY = kt.GenerationConfig(max_new_tokens=4)


@pytest.fixture(autouse=True)
def thawed():
    """Each test starts from a process with nothing frozen (another module's engine may be
    running, and its start froze the heap)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def _is_walked(obj: object) -> bool:
    """Whether a full collection walks `obj`: frozen objects are in no generation."""
    return any(o is obj for o in gc.get_objects())


def test_serving_engine_keeps_its_startup_objects_out_of_full_passes(default_model,
                                                                     hf_default_model):
    engine = kt.Engine(default_model, num_device_blocks=64)
    try:
        assert engine.config.freeze_gc_heap  # the default
        frozen = gc.get_freeze_count()
        # Everything alive at start-up, the model's modules and the step loop's core among it,
        # is out of the passes, and what is left to walk is a small part of the heap.
        assert frozen > 0
        assert not _is_walked(engine._core)
        assert not _is_walked(default_model.module)
        assert len(gc.get_objects()) < frozen / 4
        ids = [1, 504, 3458, 314, 4649, 282]
        [out] = engine.generate_outputs([ids], GREEDY, use_tqdm=False)
        reference = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=4,
                                              do_sample=False)
        assert out.token_ids == reference[0, len(ids):].tolist()
        # A full pass while serving still leaves them out.
        gc.collect()
        assert not _is_walked(engine._core)
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0  # thawed when the engine stopped


def test_stopped_engine_is_freed(default_model):
    """Freezing pins nothing: a stopped engine's core (and with it the KV cache) goes once the
    last reference to the engine does."""
    engine = kt.Engine(default_model, num_device_blocks=64)
    engine.generate_outputs([[1, 504, 3458]], GREEDY, use_tqdm=False)
    core = weakref.ref(engine._core)
    engine.shutdown()
    del engine
    gc.collect()
    assert core() is None


def test_freeze_off_leaves_the_collector_as_it_was(default_model):
    with kt.Engine(default_model, num_device_blocks=64, freeze_gc_heap=False) as engine:
        engine.generate_outputs([[1, 504, 3458]], GREEDY, use_tqdm=False)
        assert gc.get_freeze_count() == 0
        assert _is_walked(engine._core)


def test_batch_generation_queues_no_per_token_deltas(default_model, monkeypatch):
    """`generate_outputs` waits on its handles in turn: the ones waited on later must not pile
    up a `SequenceDelta` per token meanwhile (garbage for the collector's passes on the engine
    thread), while a handle read as a stream still gets every delta."""
    pushed: list[type] = []
    push = kt.RequestHandle._push

    def recording_push(self, item, batch=None):
        pushed.append(type(item))
        return push(self, item, batch)

    monkeypatch.setattr(kt.RequestHandle, "_push", recording_push)
    configs = [kt.GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in (12, 3, 3, 3)]
    with kt.Engine(default_model, num_device_blocks=64) as engine:
        outputs = engine.generate_outputs([[1, 504, 3458 + i] for i in range(4)], configs,
                                          use_tqdm=False)
        assert [len(o.token_ids) for o in outputs] == [12, 3, 3, 3]
        from ksana_llm.api.outputs import SequenceDelta

        assert SequenceDelta not in pushed
        pushed.clear()
        handle = engine.submit(kt.Request([1, 504, 3458], configs[1]))
        deltas = list(handle.deltas())
        assert [t for d in deltas for t in d.token_ids] == handle.output.token_ids
        assert pushed.count(SequenceDelta) == len(deltas) == 3
