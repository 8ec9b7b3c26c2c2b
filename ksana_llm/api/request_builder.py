"""Turning what callers submit into validated `Sequence`s, on the caller's thread.

Everything here raises `ValueError` naming the bad field before anything reaches the engine
thread, so a bad request never costs another request anything.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from typing import Any

from ksana_llm.api.forward_targets import resolve_target
from ksana_llm.api.lora_registry import LoraRegistry
from ksana_llm.api.model import Model
from ksana_llm.api.forward_outputs import ForwardTarget
from ksana_llm.api.outputs import Prompt, Request, as_token_ids
from ksana_llm.api.prompt_rows import input_embedding_rows, prompt_embeds_rows, truncate_prompt
from ksana_llm.engine.request import ForwardSpec, Sequence
from ksana_llm.generation_config import MAX_LOGPROBS, GenerationConfig, check_truncate_prompt_tokens
from ksana_llm.logits_processor import LogitsProcessor, processors_for_request
from ksana_llm.runner.kv_transfer import KvLayout, TransferredKv


def _as_config(value: GenerationConfig | dict[str, Any] | None,
               default: GenerationConfig) -> GenerationConfig:
    """The request's own copy (transformers and vLLM copy too): a caller changing its config
    after submitting, or reusing it for the next request, must not reach requests in flight."""
    if value is None:
        value = default
    if isinstance(value, GenerationConfig):
        value.validate()  # as set now: a copy would normalise some wrong types away
        return value.replace()
    if isinstance(value, dict):
        return default.replace(**value)
    raise ValueError(f"generation_config must be a GenerationConfig or a dict, got {type(value).__name__}")


class RequestBuilder:
    """Validates prompts and settings against one model and engine and builds their sequences.

    `max_model_len`: the context a request may use; `max_num_seqs`: the most sequences one
    request may ask for (samples or beams). Thread-safe: callers submit from any thread.
    """

    def __init__(self, model: Model, tokenizer: Any, *, max_model_len: int,
                 max_num_seqs: int, kv_layout: KvLayout | None = None,
                 lora: LoraRegistry | None = None, priority_scheduling: bool = True,
                 logits_processors: tuple[LogitsProcessor, ...] = (),
                 logprobs_mode: str = "raw_logprobs", max_logprobs: int = MAX_LOGPROBS) -> None:
        self.model = model
        # The most alternatives a request may ask for (EngineConfig.max_logprobs; -1: all).
        self.max_logprobs = max_logprobs
        # What sample log-probs report: best_of ranks by their sum, which logits cannot give.
        self.logprobs_mode = logprobs_mode
        # The engine's own processors: each checks a request's settings, and says whether it
        # applies to it, here (in the caller's thread, so a refusal is the caller's ValueError).
        self.logits_processors = logits_processors
        # False under the FIFO scheduler, which would ignore a request's priority: refused, as
        # vLLM refuses it, rather than silently dropped.
        self.priority_scheduling = priority_scheduling
        self.lora = lora or LoraRegistry(0)
        # The engine's KV rows, which imported KV must match; None: a parallel engine, whose
        # cache is split over ranks (no KV transfer).
        self.kv_layout = kv_layout
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self._ids = itertools.count()
        self._grammar_compiler: Any = None  # built on the first structured-output request
        # The thinking block's text as this tokenizer spells it (structured.ThinkingMarkers),
        # from the engine's reasoning_config; None: requests cannot cap their thinking.
        self.thinking: Any = None
        self._grammar_lock = threading.Lock()

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string or list of token ids")
            if self.tokenizer is None:
                raise ValueError("prompt: this engine has no tokenizer (none usable in the model "
                                 "folder), so it takes token ids only; or pass Engine(tokenizer=...)")
            return list(self.tokenizer.encode(prompt))
        ids = as_token_ids(prompt)
        if ids is not None:
            return ids
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids "
                         "(a 1-D integer numpy array or torch tensor too)")

    def _check_token_ids(self, token_ids: list[int], prompt: Prompt) -> None:
        """Every id the model will embed must be in its vocabulary: an id past the embedding
        table would fail the whole step, and with it every request in the batch."""
        if not token_ids:
            # (A text prompt can get here: a whitespace-dropping tokenizer, a plugin.) An empty
            # prompt has no position to sample from and would fail the whole step.
            raise ValueError("prompt: it is no tokens (the tokenizer made none of the text); a "
                             "prompt needs at least one token")
        vocab = self.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if not bad:
            return
        if isinstance(prompt, str):
            raise ValueError(f"prompt: the tokenizer gave token ids outside the model's vocabulary "
                             f"[0, {vocab}): {bad[:5]} (does the tokenizer match the model?)")
        raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")

    def sequence(self, request: Request, default_config: GenerationConfig) -> tuple[Sequence, Any]:
        """Validate and build the request's first sequence; also returns what the model's plugin
        preprocess gave (for its postprocess), or None."""
        if self.model.classifier is not None:
            raise ValueError("model: a sequence-classification model does not generate; "
                             "classify, score or embed with it")
        config = _as_config(request.generation_config, default_config)
        if request.additional_params is not None and not isinstance(request.additional_params,
                                                                    dict):
            raise ValueError("additional_params must be a dict (values for the model's plugin), "
                             f"got {type(request.additional_params).__name__}")
        # What the plugin would read, checked with or without one (same input, same answer).
        source_text, source_messages = _source_text(request), _source_messages(request)
        keep = config.truncate_prompt_tokens
        if request.prompt_embeds is not None:
            token_ids, embeddings = prompt_embeds_rows(request, keep, self.model,
                                                       self.max_model_len)
        else:
            token_ids = self.tokenize(request.prompt)
            if keep is not None and request.input_embeddings is not None:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with "
                                 "input_embeddings (their positions would move)")
            token_ids = truncate_prompt(token_ids, keep, self.max_model_len)
            embeddings = input_embedding_rows(request.input_embeddings, len(token_ids),
                                              self.model)
        plugin_info = None
        plugin = getattr(self.model, "plugin", None)
        if plugin is not None and request.prompt_embeds is None:
            plugin_info = plugin.run_preprocess(
                token_ids, generation_config=config, prompt=source_text,
                messages=source_messages, input_embeddings=embeddings,
                additional_params=request.additional_params)
            token_ids, config = plugin_info.token_ids, plugin_info.generation_config
            embeddings = plugin_info.input_embeddings
        self._check_token_ids(token_ids, request.prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens; max_model_len (the model's context, "
                             f"bounded by the KV cache) is {self.max_model_len}, leaving no room "
                             "to generate")
        self._check_priority(request.priority)
        self._check_config(config)
        config = self._resolve_logprobs(config)
        request_id = self._request_id(request.request_id, "req")
        eos = () if config.ignore_eos else self.model.eos_token_ids
        if config.ignore_eos and any(len(w) == 1 and w[0] in self.model.eos_token_ids
                                     for w in config.bad_words_ids):
            # A lone EOS bad word bans nothing (transformers' rule); the logits processors know
            # EOS by the sequence's eos ids, which a request ignoring EOS does not carry.
            config = config.replace(bad_words_ids=[
                w for w in config.bad_words_ids
                if not (len(w) == 1 and w[0] in self.model.eos_token_ids)])
        seq = Sequence(request_id, token_ids, config, eos_token_ids=eos, priority=request.priority)
        seq.engine_processors = processors_for_request(self.logits_processors, config)
        self._use_lora(seq, request.lora)
        self._salt(seq, request.cache_salt)
        seq.prediction = self._prediction(request.prediction)
        if embeddings is not None:
            seq.embeddings = (tuple(embeddings[0]), embeddings[1])
            seq.prompt_is_embeddings = request.prompt_embeds is not None
        if config.prompt_logprobs is not None:
            if seq.prompt_is_embeddings:
                raise ValueError("prompt_logprobs needs prompt token ids to score; this prompt "
                                 "is prompt_embeds")
            seq.prompt_logprobs = {}
        if config.structured_output is not None:
            # Compiled here, so an invalid schema is a ValueError in the caller's thread.
            seq.matcher = self.grammar().matcher(config.structured_output)
        if config.thinking_token_budget is not None or (seq.matcher is not None
                                                        and self.thinking is not None):
            seq.matcher = self._thinking_gate(seq, config.thinking_token_budget)
        self._kv_transfer(request, seq)
        return seq, plugin_info

    def _check_priority(self, priority: Any) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority and not self.priority_scheduling:
            raise ValueError(f"priority {priority} needs an engine with "
                             "scheduler='priority' (or a policy that ranks by it); this engine's "
                             "scheduling policy ignores it")

    def _use_lora(self, seq: Sequence, name: str | None) -> None:
        """Point the sequence at adapter `name`'s slot, with its prefix-cache salt."""
        if name is None:
            return
        if not isinstance(name, str):
            raise ValueError(f"lora must be an adapter name (a string), got {type(name).__name__}")
        info = self.lora.resolve(name)
        seq.lora_id, seq.cache_salt = info.lora_id, info.cache_salt

    def _prediction(self, prediction: str | list[int] | None) -> list[int] | None:
        """The predicted output's token ids (text without special tokens); None for none."""
        if prediction is None:
            return None
        if isinstance(prediction, str):
            if self.tokenizer is None:
                raise ValueError("prediction: text needs a tokenizer; give token ids")
            ids = list(self.tokenizer.encode(prediction, add_special_tokens=False))
        elif isinstance(prediction, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in prediction):
            ids = list(prediction)
        else:
            raise ValueError("prediction must be a string or a list of token ids")
        bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
        if bad:
            raise ValueError(f"prediction token ids must be in [0, {self.model.vocab_size}); "
                             f"got {bad[:5]}")
        return ids or None

    @staticmethod
    def _salt(seq: Sequence, cache_salt: str | None) -> None:
        """Fold the request's own salt into its prefix-cache chain (after the adapter's)."""
        if cache_salt is None:
            return
        if not isinstance(cache_salt, str) or not cache_salt:
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        seq.cache_salt = hash((seq.cache_salt, "cache_salt", cache_salt))

    def _kv_transfer(self, request: Request, seq: Sequence) -> None:
        """Check `export_kv` / `imported_kv` and set them on the sequence."""
        if not isinstance(request.export_kv, bool):
            raise ValueError(f"export_kv must be True or False, got {request.export_kv!r}")
        wanted = "export_kv" if request.export_kv else (
            "imported_kv" if request.imported_kv is not None else None)
        if wanted is None:
            return
        if seq.lora_id:
            # The transferred KV does not say which adapter computed it.
            raise ValueError(f"{wanted} does not work with a LoRA adapter (lora)")
        if self.kv_layout is None:
            raise ValueError(f"{wanted} needs a single-rank engine (tensor_parallel_size=1 and "
                             "pipeline_parallel_size=1)")
        if seq.embeddings is not None:
            given = "prompt_embeds" if seq.prompt_is_embeddings else "input_embeddings"
            raise ValueError(f"{wanted} does not work with {given} (their KV depends on "
                             "more than the token ids)")
        if request.export_kv:
            if seq.config.num_sequences != 1:
                raise ValueError("export_kv needs a single sequence (n=1, no best_of, no beam "
                                 "search)")
            seq.export_kv = True
        kv = request.imported_kv
        if kv is None:
            return
        if not isinstance(kv, TransferredKv):
            raise ValueError(f"imported_kv must be a TransferredKv, got {type(kv).__name__}")
        if seq.prompt_logprobs is not None:
            raise ValueError("imported_kv does not work with prompt_logprobs (the imported rows "
                             "are not computed here)")
        self.kv_layout.check(kv)
        usable = kv.usable_prefix(seq.prompt_token_ids)
        if usable:
            seq.imported_kv = kv.truncated(usable)

    def _request_id(self, given: Any, kind: str) -> str:
        """The caller's id, or a fresh one when none was given. An id is what `abort` and the
        outputs name, so it must be a non-empty string (not silently replaced or coerced)."""
        if given is None:
            return self._new_id(kind)
        if not isinstance(given, str) or not given:
            raise ValueError(f"request_id must be None or a non-empty string, got {given!r}")
        return given

    def _resolve_logprobs(self, config: GenerationConfig) -> GenerationConfig:
        """`logprobs` / `prompt_logprobs` checked against the engine's max_logprobs (vLLM's
        rule), -1 made the vocabulary size: the sampler and the prompt scorer take a count."""
        vocab = self.model.vocab_size
        cap = vocab if self.max_logprobs == -1 else self.max_logprobs
        resolved: dict[str, int] = {}
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(config, name)
            if asked is None:
                continue
            if asked > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size ({vocab}), or -1 "
                                 f"for all of it, got {asked}")
            if (vocab if asked == -1 else asked) > cap:
                what = f"-1 (the whole vocabulary, {vocab} tokens)" if asked == -1 else str(asked)
                raise ValueError(f"{name}: {what} is more than this engine's max_logprobs "
                                 f"({self.max_logprobs}); start it with a larger max_logprobs "
                                 "(-1: no cap)")
            if asked == -1:
                resolved[name] = vocab
        return config.replace(**resolved) if resolved else config

    def _check_config(self, config: GenerationConfig) -> None:
        """The config as it is now (a field may have been set since it was built, or by a
        plugin), then what GenerationConfig cannot check alone: this model's and engine's
        limits."""
        if not isinstance(config, GenerationConfig):
            raise ValueError(f"generation_config must be a GenerationConfig, got {type(config).__name__}")
        config.validate()
        if config.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings are matched in the output's text, and this "
                             "engine has no tokenizer (skip_tokenizer_init, or a model folder "
                             "without one): use stop_token_ids")
        vocab = self.model.vocab_size
        for name, ids in (("logit_bias", list(config.logit_bias)),
                          ("bad_words_ids", [t for w in config.bad_words_ids for t in w]),
                          ("allowed_token_ids", config.allowed_token_ids or []),
                          # never sampled: most likely ids of another tokenizer
                          ("stop_token_ids", config.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab}); got {bad[:5]}")
        if config.allowed_token_ids is not None and config.min_new_tokens > 0:
            held_back = {*config.stop_token_ids, *(() if config.ignore_eos
                                                   else self.model.eos_token_ids)}
            banned = {w[0] for w in config.bad_words_ids
                      if len(w) == 1 and w[0] not in self.model.eos_token_ids}
            if set(config.allowed_token_ids) <= held_back | banned:
                raise ValueError(
                    f"allowed_token_ids {config.allowed_token_ids[:5]} are all stop tokens that "
                    f"min_new_tokens ({config.min_new_tokens}) holds back, or banned: nothing "
                    "could be generated")
        if config.ranks_sequences and not config.use_beam_search \
                and self.logprobs_mode.endswith("_logits"):
            raise ValueError(f"best_of ({config.best_of}) ranks samples by their summed "
                             f"log-probs, but this engine's logprobs_mode "
                             f"({self.logprobs_mode}) reports logits; use best_of = n")
        if config.num_sequences > self.max_num_seqs:
            what = "num_beams" if config.use_beam_search else (
                "best_of" if config.best_of else "num_return_sequences")
            raise ValueError(f"{what} must be <= max_num_seqs ({self.max_num_seqs}), "
                             f"got {config.num_sequences}")

    def watch_thinking(self, start: str, end: str, end_tag: str | None = None) -> None:
        """Requests from now on follow the thinking block these texts open and end."""
        if self.tokenizer is None:
            raise ValueError("reasoning_config: the thinking block is found by its text, and "
                             "this engine has no tokenizer")
        from ksana_llm.structured.thinking import ThinkingMarkers

        self.thinking = ThinkingMarkers.from_tokenizer(self.tokenizer, start, end, end_tag)

    def _thinking_gate(self, seq: Sequence, budget: int | None) -> Any:
        """The sequence's grammar (if any) behind a gate that lets it think first."""
        if self.thinking is None:
            raise ValueError("thinking_token_budget: this engine does not know the model's "
                             "thinking block; give it a reasoning_config (serve: "
                             "--reasoning-parser or --reasoning-config)")
        from ksana_llm.structured.thinking import thinking_gate

        return thinking_gate(self.thinking, seq.context_token_ids, grammar=seq.matcher,
                             budget=budget)

    def grammar(self) -> Any:
        """The structured-output compiler, built on first use (it needs xgrammar and a scan of
        the tokenizer's vocabulary)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured_output needs a tokenizer; this model has none")
                from ksana_llm.structured import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model.vocab_size,
                    stop_token_ids=list(self.model.eos_token_ids) or None)
            return self._grammar_compiler

    def forward_sequence(self, prompt: Prompt, targets: list[ForwardTarget | dict[str, Any]],
                         request_id: str | None, default_config: GenerationConfig,
                         lora: str | None = None, truncate_prompt_tokens: int | None = None,
                         priority: int = 0
                         ) -> tuple[Sequence, list[ForwardTarget], list[list[int]]]:
        """A forward-only request's sequence, its resolved targets and each target's positions
        (after `truncate_prompt_tokens` cut the prompt, when given)."""
        check_truncate_prompt_tokens(truncate_prompt_tokens)
        self._check_priority(priority)
        token_ids = truncate_prompt(self.tokenize(prompt), truncate_prompt_tokens,
                                    self.max_model_len)
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens; max_model_len (the model's "
                             f"context, bounded by the KV cache) is {self.max_model_len}")
        if not isinstance(targets, (list, tuple)) or not targets:
            raise ValueError("targets must be a non-empty list of ForwardTarget")
        resolved = [resolve_target(j, t, token_ids, self.model.vocab_size)
                    for j, t in enumerate(targets)]
        targets = [t for t, _ in resolved]
        positions = [ps for _, ps in resolved]
        if self.model.classifier is not None:
            for j, target in enumerate(targets):
                if target.target_name == "logits":  # its LM head is a stand-in (the embeddings)
                    raise ValueError(f"targets[{j}]: a sequence-classification model has no "
                                     "language-model logits; ask for layernorm (or classify)")
        spec = ForwardSpec(tuple(sorted({p for ps in positions for p in ps})),
                           logits=any(t.target_name == "logits" for t in targets),
                           hidden=any(t.target_name == "layernorm" for t in targets))
        seq = Sequence(self._request_id(request_id, "fwd"), token_ids, default_config, forward=spec,
                       priority=priority)
        self._use_lora(seq, lora)
        return seq, targets, positions


def _source_text(request: Request) -> str | None:
    """The prompt's text for a plugin: the prompt itself, or the text token ids came from."""
    if request.prompt_text is not None and not isinstance(request.prompt_text, str):
        raise ValueError(f"prompt_text must be a string, got {type(request.prompt_text).__name__}")
    return request.prompt if isinstance(request.prompt, str) else request.prompt_text


def _source_messages(request: Request) -> list[dict[str, Any]] | None:
    messages = request.messages
    if messages is not None and not (isinstance(messages, list)
                                     and all(isinstance(m, dict) for m in messages)):
        raise ValueError("messages must be a list of dicts (chat messages)")
    return messages
