"""ksana-llm: a high-performance LLM inference and serving engine in Python.

    import ksana_llm as kt
    engine = kt.Engine()                      # the embedded SmolLM2-135M-Instruct on CPU
    print(engine.generate("What is the capital of France?"))
"""

from ksana_llm.api.engine import Engine, EngineDeadError
from ksana_llm.api.forward_outputs import ForwardOutput, ForwardTarget
from ksana_llm.api.model import Model
from ksana_llm.api.outputs import (Request, RequestError, RequestHandle, RequestOutput,
                                   SequenceDelta, SequenceOutput)
from ksana_llm.config import EngineConfig
from ksana_llm.engine.scheduler import QueueFullError, QueueTimeoutError
from ksana_llm.engine.scheduling_policy import RequestInfo, SchedulingPolicy
from ksana_llm.generation_config import GenerationConfig, StructuredOutputSpec
from ksana_llm.runner.kv_transfer import TransferredKv

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig", "EngineDeadError", "ForwardOutput", "ForwardTarget",
           "GenerationConfig", "Model", "QueueFullError", "QueueTimeoutError", "Request",
           "RequestError", "RequestHandle", "RequestInfo", "RequestOutput", "SchedulingPolicy",
           "SequenceDelta", "SequenceOutput", "StructuredOutputSpec", "TransferredKv",
           "__version__"]
