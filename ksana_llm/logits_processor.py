"""Engine-wide logits processors (vLLM's `--logits-processors`): user classes loaded once per
engine that see every step's logits, batched, for the requests they apply to.

    class OnlyToken(ksana_llm.LogitsProcessor):
        '''Requests with extra_args={"target_token": id} can only produce that token.'''

        @classmethod
        def validate_params(cls, config):
            token = config.extra_args.get("target_token")
            if token is not None and not isinstance(token, int):
                raise ValueError("extra_args.target_token must be a token id")

        def applies_to(self, config):
            return "target_token" in config.extra_args

        def apply(self, logits, rows):
            targets = torch.tensor([r.extra_args["target_token"] for r in rows],
                                   device=logits.device)
            kept = logits.gather(1, targets[:, None])
            return logits.fill_(float("-inf")).scatter_(1, targets[:, None], kept)

    engine = ksana_llm.Engine(logits_processors=[OnlyToken])   # or "my_module:OnlyToken"
    # ksana-llm serve --logits-processors my_module:OnlyToken; clients send
    # {"vllm_xargs": {"target_token": 42}} with a completion or chat request.

A request reaches a processor's `apply` only if `applies_to` its config said so when the request
was submitted (default: every request), and, for a processor that `is_argmax_invariant`, only
while it samples or searches beams (a greedy row would pick the same token anyway).
`validate_params` and `applies_to` run in the thread that submits the request; `apply` and
`release` in the engine's thread. Whatever a processor's code raises fails only the requests
concerned (a 500 over HTTP); the engine goes on serving the others. Processors run after the
built-in ones (penalties, bans, logit bias) and before the request's own `logits_processors`,
in the order given. Like per-request processors, they read each row's tokens on the host: a
request they apply to is not drafted for by speculative decoding, and its steps do not overlap
the previous step's read-back.

`PerRequestLogitsProcessor` adapts the per-request form (vLLM's `AdapterLogitsProcessor`): it
makes one callable per request and runs it row by row.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ksana_llm.generation_config import GenerationConfig, processor_arity
from ksana_llm.import_path import import_by_path

if TYPE_CHECKING:
    import torch

__all__ = ["LogitsProcessor", "LogitsProcessorContext", "LogitsProcessorError", "LogitsRow", "PerRequestLogitsProcessor",
           "build_logits_processors", "logits_processor_class", "processors_for_request"]


class LogitsProcessorError(RuntimeError):
    """An engine-wide processor failed on a step's logits: the requests it was given fail with
    it (the server's fault, not theirs: a 500 over HTTP); the others go on."""


@dataclass(frozen=True)
class LogitsProcessorContext:
    """What a processor is built with, once per engine."""

    device: torch.device  # where the logits are
    vocab_size: int  # the logits' width (the model's vocabulary, padding included)
    engine_config: Any  # the engine's EngineConfig
    hf_config: Any  # the model's transformers config
    tokenizer: Any  # the engine's tokenizer; None for an engine without one


@dataclass(frozen=True, eq=False)
class LogitsRow:
    """One row of the logits a processor is given: which request and sample it belongs to, and
    its tokens so far. The token lists are the engine's own (read, never change them); they
    grow by one token after each step."""

    request_id: str
    index: int  # the sample's index within its request (parallel sampling, beams); 0 for one
    config: GenerationConfig
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Why `apply` failed this row alone (`fail`); the engine takes it after each apply.
    _failures: list[BaseException] = field(default_factory=list, init=False, repr=False)

    @property
    def extra_args(self) -> dict[str, Any]:
        """The request's `GenerationConfig.extra_args` (vLLM's; `vllm_xargs` over HTTP)."""
        return self.config.extra_args

    def fail(self, reason: BaseException) -> None:
        """From `apply`: fail this row's request alone, for `reason` (its logits are then
        ignored); the other rows of the call go on with what `apply` returns."""
        self._failures.append(reason)

    def take_failure(self) -> BaseException | None:
        """The first reason `fail` was given since the last call, if any (the engine's side)."""
        failure = self._failures[0] if self._failures else None
        self._failures.clear()
        return failure


class LogitsProcessor(ABC):
    """An engine-wide logits processor; see the module docstring. Subclasses implement `apply`
    and may override the other methods. The engine builds one instance, with the context, and
    calls it from its engine thread only."""

    def __init__(self, context: LogitsProcessorContext) -> None:
        self.context = context

    @classmethod
    def validate_params(cls, config: GenerationConfig) -> None:
        """Raise ValueError for a request whose settings (its `extra_args` above all) this
        processor cannot take: the request is refused (a 400 over HTTP) before it is queued."""

    def applies_to(self, config: GenerationConfig) -> bool:
        """Whether a request with `config` goes through `apply` (asked once, at submission)."""
        return True

    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes which token has the largest logit (e.g. it only
        removes unlikely tokens): greedy rows then skip it (beam search rows do not: they rank
        more than the best token). Asked once, when the engine is built."""
        return False

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        """The processed logits: `logits` is float32 [len(rows), vocab_size], one row per entry
        of `rows` (only the rows it applies to), on the engine's device. Change it in place and
        return it, or return a new tensor of the same shape. Raising fails these rows' requests
        (the others go on); `row.fail(reason)` fails one row's alone."""

    def release(self, row: LogitsRow) -> None:
        """`row`'s sample is done (finished or aborted): drop what was kept for it."""


class PerRequestLogitsProcessor(LogitsProcessor):
    """A processor made of per-request callables (vLLM's `AdapterLogitsProcessor`):
    `new_request_processor` returns, for one sample, a callable taking (output_token_ids,
    logits) or (prompt_token_ids, output_token_ids, logits) with the row's [vocab] logits, as
    `GenerationConfig.logits_processors` take, or None to leave that sample alone. It is called
    once per sample, at its first step; rows then run one at a time, and a callable that raises
    or returns anything but a [vocab] tensor fails its own request alone."""

    def __init__(self, context: LogitsProcessorContext) -> None:
        super().__init__(context)
        # (request id, sample index) -> (callable or None, whether it takes the prompt ids)
        self._callables: dict[tuple[str, int], tuple[Callable[..., Any] | None, bool]] = {}

    @abstractmethod
    def new_request_processor(self, config: GenerationConfig) -> Callable[..., Any] | None:
        """A fresh callable for one sample of a request with `config`, or None."""

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            values = logits[i]
            try:
                fn, takes_prompt = self._callable_for(row)
                if fn is None:
                    continue
                # Copies: a callable may keep what it is given without seeing it change later.
                args = ((list(row.prompt_token_ids),) if takes_prompt else ()) + (
                    list(row.output_token_ids), values)
                result = fn(*args)
                problem = result_problem(result, tuple(values.shape))
                if problem is not None:
                    raise ValueError(f"the request's processor {problem}")
                if result is not values:
                    values.copy_(result)
            # User code: this request's failure alone, whatever it raises (the engine lives on).
            except BaseException as exc:  # noqa: BLE001
                row.fail(exc)
        return logits

    def _callable_for(self, row: LogitsRow) -> tuple[Callable[..., Any] | None, bool]:
        """The row's callable, made at its first step, and whether it takes the prompt ids."""
        key = (row.request_id, row.index)
        entry = self._callables.get(key)
        if entry is None:
            fn = self.new_request_processor(row.config)
            entry = self._callables[key] = (fn, fn is not None and processor_arity(fn) == 3)
        return entry

    def release(self, row: LogitsRow) -> None:
        self._callables.pop((row.request_id, row.index), None)


def result_problem(result: Any, shape: tuple[int, ...]) -> str | None:
    """What is wrong with `result` as processed logits of `shape` ("must return ..."), or None
    if it is a dense floating-point tensor of that shape."""
    import torch  # here: this module is imported by configs that need no torch

    is_tensor = isinstance(result, torch.Tensor)
    if is_tensor and tuple(result.shape) == shape and result.layout == torch.strided \
            and result.dtype.is_floating_point:
        return None
    got = (f"a {result.layout} {result.dtype} tensor of shape {tuple(result.shape)}"
           if is_tensor else type(result).__name__)
    return f"must return a dense floating-point tensor of shape {shape}, got {got}"


def logits_processor_class(spec: Any) -> type[LogitsProcessor]:
    """The `LogitsProcessor` subclass `spec` names (an import path, "module:Class" or
    "module.Class") or is. ValueError saying what is wrong."""
    found = import_by_path(spec, "the logits processor") if isinstance(spec, str) else spec
    if not (isinstance(found, type) and issubclass(found, LogitsProcessor)):
        shown = spec if isinstance(spec, str) else getattr(spec, "__name__", type(spec).__name__)
        raise ValueError(f"{shown!s} is not a ksana_llm.LogitsProcessor subclass (a class "
                         "implementing apply(logits, rows), or an import path to one)")
    if inspect.isabstract(found):
        missing = ", ".join(sorted(found.__abstractmethods__))
        raise ValueError(f"{found.__name__} is abstract: it must implement {missing}")
    return found


def build_logits_processors(specs: Sequence[Any], context: LogitsProcessorContext
                            ) -> tuple[LogitsProcessor, ...]:
    """One instance of each class `specs` names (see `logits_processor_class`), in order. A
    class whose constructor fails is a ValueError naming its place in `logits_processors`."""
    made = []
    for i, spec in enumerate(specs):
        cls = logits_processor_class(spec)
        step = f"{cls.__name__}(context)"
        try:
            processor = cls(context)
            step = f"{cls.__name__}.is_argmax_invariant()"
            processor.is_argmax_invariant()  # asked now so that a broken one fails here
        except Exception as exc:  # noqa: BLE001 - user code: say which entry, and why
            raise ValueError(f"logits_processors[{i}]: {step} failed: "
                             f"{type(exc).__name__}: {exc}") from exc
        made.append(processor)
    return tuple(made)


def processors_for_request(processors: Sequence[LogitsProcessor], config: GenerationConfig
                           ) -> tuple[LogitsProcessor, ...]:
    """The processors that apply to a request with `config`, once each has validated it. A
    refusal is the processor's ValueError; any other failure of its code a ValueError naming it
    (the request is refused, the engine goes on)."""
    applying = []
    for processor in processors:
        name = type(processor).__name__
        try:
            type(processor).validate_params(config)
            if processor.applies_to(config):
                applying.append(processor)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - user code: refuse this request, say why
            raise ValueError(f"logits processor {name} could not check the request: "
                             f"{type(exc).__name__}: {exc}") from exc
    return tuple(applying)
