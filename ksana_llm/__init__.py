"""ksana-llm: a high-performance LLM inference and serving engine in Python.

    import ksana_llm as kt
    engine = kt.Engine()                      # the embedded SmolLM2-135M-Instruct on CPU
    print(engine.generate("What is the capital of France?"))
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it. The names are resolved on first use (PEP 562) so that
# light entry points -- `ksana-llm bench`, `ksana-llm --help`, the YAML checker -- do not pay for
# importing torch and transformers just because they live inside this package.
_EXPORTS = MappingProxyType({
    "ClassificationOutput": "ksana_llm.api.classification",
    "Engine": "ksana_llm.api.engine",
    "EngineDeadError": "ksana_llm.api.engine",
    "ForwardOutput": "ksana_llm.api.forward_outputs",
    "ForwardTarget": "ksana_llm.api.forward_outputs",
    "Model": "ksana_llm.api.model",
    "Request": "ksana_llm.api.outputs",
    "RequestError": "ksana_llm.api.outputs",
    "RequestHandle": "ksana_llm.api.request_handle",
    "RequestOutput": "ksana_llm.api.outputs",
    "SequenceDelta": "ksana_llm.api.outputs",
    "SequenceOutput": "ksana_llm.api.outputs",
    "EngineConfig": "ksana_llm.config",
    "QueueFullError": "ksana_llm.engine.scheduler_records",
    "QueueTimeoutError": "ksana_llm.engine.scheduler_records",
    "RequestInfo": "ksana_llm.engine.scheduling_policy",
    "SchedulingPolicy": "ksana_llm.engine.scheduling_policy",
    "GenerationConfig": "ksana_llm.generation_config",
    "StructuredOutputSpec": "ksana_llm.generation_config",
    "LogitsProcessor": "ksana_llm.logits_processor",
    "LogitsProcessorContext": "ksana_llm.logits_processor",
    "LogitsRow": "ksana_llm.logits_processor",
    "PerRequestLogitsProcessor": "ksana_llm.logits_processor",
    "TransferredKv": "ksana_llm.runner.kv_transfer",
})

__all__ = ["ClassificationOutput", "Engine", "EngineConfig", "EngineDeadError", "ForwardOutput", "ForwardTarget",
           "GenerationConfig", "LogitsProcessor", "LogitsProcessorContext", "LogitsRow", "Model",
           "PerRequestLogitsProcessor", "QueueFullError", "QueueTimeoutError", "Request",
           "RequestError", "RequestHandle", "RequestInfo", "RequestOutput", "SchedulingPolicy",
           "SequenceDelta", "SequenceOutput", "StructuredOutputSpec", "TransferredKv",
           "__version__"]

if TYPE_CHECKING:  # static checkers and IDEs see the eager imports
    from ksana_llm.api.classification import ClassificationOutput
    from ksana_llm.api.engine import Engine, EngineDeadError
    from ksana_llm.api.forward_outputs import ForwardOutput, ForwardTarget
    from ksana_llm.api.model import Model
    from ksana_llm.api.outputs import (Request, RequestError, RequestOutput, SequenceDelta,
                                       SequenceOutput)
    from ksana_llm.api.request_handle import RequestHandle
    from ksana_llm.config import EngineConfig
    from ksana_llm.engine.scheduler_records import QueueFullError, QueueTimeoutError
    from ksana_llm.engine.scheduling_policy import RequestInfo, SchedulingPolicy
    from ksana_llm.generation_config import GenerationConfig, StructuredOutputSpec
    from ksana_llm.logits_processor import (LogitsProcessor, LogitsProcessorContext, LogitsRow,
                                            PerRequestLogitsProcessor)
    from ksana_llm.runner.kv_transfer import TransferredKv


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'ksana_llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
