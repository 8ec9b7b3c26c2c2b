"""Request parameters that constrain the output's shape -> one `StructuredOutputSpec`.

Sources, at most one per request: OpenAI `response_format` (json_object / json_schema), vLLM's
`structured_outputs` ({json | regex | grammar | choice | json_object}) and its older `guided_*`
spellings, KsanaLLM's `structured_output_regex` / `json_schema`, and the tool-call schema that
`tool_choice` "required" or a named function implies. The spec is compiled (off the event loop)
before anything is submitted, so an invalid schema, regex or grammar is a 400 naming the
parameter it came from.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ksana_llm.generation_config import GenerationConfig, StructuredOutputSpec
from ksana_llm.server.errors import bad_request


@dataclass(frozen=True)
class StructuredRequest:
    """A spec's kind and value, and the request parameter it came from (for errors)."""

    kind: str
    value: str | None
    param: str


def engine_supports_structured_output() -> bool:
    return "structured_output" in {f.name for f in dataclasses.fields(GenerationConfig)}


def make_spec(req: StructuredRequest) -> Any:
    """The engine's StructuredOutputSpec for `req` (400 while the engine has none)."""
    if not engine_supports_structured_output():
        raise bad_request("Structured output is not supported by this engine build.",
                          param=req.param, code="unsupported_parameter")
    return StructuredOutputSpec(req.kind, req.value)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"`{param}` is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"`{param}` must be a JSON schema object.", param=param)
    return json.dumps(schema)


def from_response_format(value: Any) -> StructuredRequest | None:
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("`response_format` must be an object with a `type`.", param=param)
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise bad_request(f"Unknown field(s) in `response_format`: {', '.join(sorted(extra))}.",
                          param=param)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredRequest("json_object", None, param)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("`response_format.json_schema` is required for type 'json_schema' "
                              "(an object with `name` and `schema`).", param=f"{param}.json_schema")
        if "schema" not in spec:
            raise bad_request("`response_format.json_schema.schema` is required.",
                              param=f"{param}.json_schema.schema")
        name = spec.get("name")
        if not isinstance(name, str) or not name:  # required by OpenAI and vLLM alike
            raise bad_request("`response_format.json_schema.name` is required (a non-empty "
                              "string).", param=f"{param}.json_schema.name")
        schema_param = f"{param}.json_schema.schema"
        return StructuredRequest("json_schema", _schema_text(spec["schema"], schema_param),
                                 schema_param)
    raise bad_request(f"`response_format.type` must be 'text', 'json_object' or 'json_schema', "
                      f"got {kind!r}.", param=f"{param}.type")


def _choice_grammar(choices: Any, param: str) -> str:
    try:
        return StructuredOutputSpec.choice(choices).value
    except ValueError:
        raise bad_request(f"`{param}` must be a non-empty list of non-empty strings.",
                          param=param) from None


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"`{param}` must be a non-empty string.", param=param)
    return value


def from_vllm_extras(req: Any) -> list[StructuredRequest]:
    """`structured_outputs` and `guided_*` (vLLM's extra parameters), each one found."""
    found = []
    so = req.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("`structured_outputs` must be an object.", param="structured_outputs")
        keys = [k for k, v in so.items() if v is not None and v is not False]
        unknown = set(so) - {"json", "regex", "grammar", "choice", "json_object"}
        if unknown:
            raise bad_request(f"Unknown field(s) in `structured_outputs`: {', '.join(sorted(unknown))}.",
                              param="structured_outputs")
        if len(keys) != 1:
            raise bad_request("`structured_outputs` takes exactly one of json, regex, grammar, "
                              "choice, json_object.", param="structured_outputs")
        key = keys[0]
        param = f"structured_outputs.{key}"
        if key == "json":
            found.append(StructuredRequest("json_schema", _schema_text(so[key], param), param))
        elif key == "json_object":
            found.append(StructuredRequest("json_object", None, param))
        elif key == "choice":
            found.append(StructuredRequest("grammar", _choice_grammar(so[key], param), param))
        else:
            found.append(StructuredRequest(key, _text(so[key], param), param))
    if req.guided_json is not None:
        found.append(StructuredRequest("json_schema", _schema_text(req.guided_json, "guided_json"),
                                       "guided_json"))
    if req.guided_regex is not None:
        found.append(StructuredRequest("regex", _text(req.guided_regex, "guided_regex"), "guided_regex"))
    if req.guided_grammar is not None:
        found.append(StructuredRequest("grammar", _text(req.guided_grammar, "guided_grammar"),
                                       "guided_grammar"))
    if req.guided_choice is not None:
        found.append(StructuredRequest("grammar", _choice_grammar(req.guided_choice, "guided_choice"),
                                       "guided_choice"))
    return found


def refuse_with_beam_search(request: StructuredRequest | None, beam_search: bool) -> None:
    """Beam search keeps several hypotheses per step; the engine constrains sampled sequences
    only. A 400 naming the parameter the client set (not the engine's field)."""
    if request is not None and beam_search:
        raise bad_request(f"`{request.param}` cannot be combined with beam search: output "
                          "constraints apply to sampled or greedy sequences only.",
                          param=request.param)


def single(requests: list[StructuredRequest | None]) -> StructuredRequest | None:
    """The one constraint of a request; 400 naming both when two parameters each set one."""
    present = [r for r in requests if r is not None]
    if len(present) > 1:
        raise bad_request(f"Only one output constraint per request: `{present[0].param}` and "
                          f"`{present[1].param}` both set one.", param=present[1].param)
    return present[0] if present else None


async def compile_spec(state: Any, req: StructuredRequest) -> Any:
    """Build and compile the spec in a worker thread (a regex can take a second to compile);
    400 naming `req.param` if xgrammar rejects it. Returns the engine's StructuredOutputSpec."""
    spec = make_spec(req)
    compiler = state.grammar_compiler()
    try:
        await asyncio.to_thread(compiler.compile, spec)
    except ValueError as exc:
        message = str(exc)
        prefix = "structured_output: "
        message = message.removeprefix(prefix)
        raise bad_request(f"Invalid `{req.param}`: {message}", param=req.param) from exc
    return spec

