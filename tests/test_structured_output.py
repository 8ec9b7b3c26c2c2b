"""`ksana_llm.structured` on the real SmolLM2 tokenizer: matchers driven with the tokens of valid
and invalid texts, bitmasks against a reference computed from the token strings, masking of
logits against a torch reference, and errors for invalid specs."""

from __future__ import annotations

import json

import pytest
import torch

from ksana_llm.generation_config import StructuredOutputSpec
from ksana_llm.structured import GrammarCompiler, allocate_bitmask, apply_bitmask

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                                  "maxItems": 2}},
          "required": ["name", "age", "tags"]}


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def vocab_size(default_model_dir):
    return json.loads((default_model_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def compiler(tokenizer, vocab_size):
    return GrammarCompiler(tokenizer, vocab_size)


def _allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    """Bool [vocab] from the packed int32 row (bit j of word i = token 32 i + j)."""
    words = bitmask[row].to(torch.int64) & 0xFFFFFFFF
    bits = (words[:, None] >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].bool()


def _drive(compiler: GrammarCompiler, spec: StructuredOutputSpec, ids: list[int]):
    """Accept tokens up to the first rejected one: (accepted flags, matcher)."""
    matcher = compiler.matcher(spec)
    accepted = []
    for t in ids:
        accepted.append(matcher.accept_token(t))
        if not accepted[-1]:
            break
    return accepted, matcher


def test_json_schema_accepts_valid_json_then_eos(compiler, tokenizer):
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))
    text = json.dumps({"name": "Ada", "age": 36, "tags": ["a", "b"]})  # ", " and ": " layout
    accepted, matcher = _drive(compiler, spec, tokenizer.encode(text))
    assert all(accepted)
    assert matcher.is_completed() and not matcher.is_terminated()
    # Complete: only EOS may follow, and accepting it terminates the matcher.
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    assert _allowed(bitmask, 0, compiler.vocab_size).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()
    assert not matcher.accept_token(tokenizer.encode("x")[0])


@pytest.mark.parametrize("bad", [
    {"name": "Ada", "age": "36", "tags": []},  # wrong type
    {"name": "Ada", "tags": []},  # missing required
    {"name": "Ada", "age": 1, "tags": ["c"]},  # not in the enum
    {"name": "Ada", "age": 1, "tags": ["a", "b", "a"]},  # too many items
    {"name": "A" * 13, "age": 1, "tags": []},  # too long
])
def test_json_schema_rejects_invalid_json(compiler, tokenizer, bad):
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))
    ids = tokenizer.encode(json.dumps(bad))
    accepted, matcher = _drive(compiler, spec, ids)
    assert not all(accepted)
    assert not matcher.is_completed()


def test_bitmask_matches_token_strings(compiler, tokenizer, vocab_size):
    """At the start of `(yes|no)`, exactly the tokens whose text is a non-empty prefix of "yes"
    or "no" are allowed (no EOS); after "ye" only tokens spelling a prefix of "s"."""
    spec = StructuredOutputSpec("regex", "(yes|no)")
    texts = [tokenizer.decode([t]) for t in range(len(tokenizer))]

    def reference(done: str) -> set[int]:
        return {t for t, s in enumerate(texts) if s and any(
            w.startswith(done + s) for w in ("yes", "no")) and t not in tokenizer.all_special_ids}

    matcher = compiler.matcher(spec)
    bitmask = allocate_bitmask(2, vocab_size)
    matcher.fill_bitmask(bitmask, 1)
    allowed = set(_allowed(bitmask, 1, vocab_size).nonzero().flatten().tolist())
    assert allowed == reference("") and len(allowed) >= 3
    for t in tokenizer.encode("ye"):
        assert matcher.accept_token(t)
    matcher.fill_bitmask(bitmask, 0)
    assert set(_allowed(bitmask, 0, vocab_size).nonzero().flatten().tolist()) == reference("ye")
    assert not matcher.accept_token(tokenizer.encode("no")[0])  # rejected: state unchanged
    assert matcher.accept_token(tokenizer.encode("s")[0]) and matcher.is_completed()


def test_apply_bitmask_matches_torch_reference(compiler, vocab_size):
    spec = StructuredOutputSpec("regex", "[0-9]{2}")
    bitmask = allocate_bitmask(3, vocab_size)
    compiler.matcher(spec).fill_bitmask(bitmask, 0)
    compiler.matcher(StructuredOutputSpec("json_object")).fill_bitmask(bitmask, 2)
    logits = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    for row in (0, 2):
        expected[row][~_allowed(bitmask, row, vocab_size)] = float("-inf")
    apply_bitmask(logits, bitmask, indices=[0, 2])  # row 1 is an unconstrained request
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[1]).all()
    # Every row, no indices: row 1 of a fresh bitmask allows everything.
    again = torch.randn(3, vocab_size, generator=torch.Generator().manual_seed(1))
    reference = again.clone()
    for row in (0, 2):
        reference[row][~_allowed(bitmask, row, vocab_size)] = float("-inf")
    apply_bitmask(again, bitmask)
    assert torch.equal(again, reference)


def test_padded_vocab_never_allows_ids_past_the_tokenizer(tokenizer, vocab_size):
    padded = vocab_size + 64  # logits wider than the tokenizer, as padded embeddings are
    compiler = GrammarCompiler(tokenizer, padded)
    matcher = compiler.matcher(StructuredOutputSpec("json_object"))
    bitmask = allocate_bitmask(1, padded)
    matcher.fill_bitmask(bitmask, 0)
    allowed = _allowed(bitmask, 0, padded)
    assert allowed[:vocab_size].any() and not allowed[vocab_size:].any()
    assert not matcher.accept_token(vocab_size + 3)


def test_json_object_regex_grammar_kinds(compiler, tokenizer):
    cases = [
        (StructuredOutputSpec("json_object"), '{"anything": [1, {"x": null}]}', "[1, 2]"),
        (StructuredOutputSpec("regex", r"\d{3}-[a-z]+"), "123-abc", "12-abc"),
        (StructuredOutputSpec("grammar", 'root ::= "left" | "right"'), "right", "up"),
    ]
    for spec, good, bad in cases:
        accepted, matcher = _drive(compiler, spec, tokenizer.encode(good))
        assert all(accepted) and matcher.is_completed(), spec
        accepted, matcher = _drive(compiler, spec, tokenizer.encode(bad))
        assert not (all(accepted) and matcher.is_completed()), spec


def test_fork_and_rollback(compiler, tokenizer):
    spec = StructuredOutputSpec("regex", "(abc|abd)")
    matcher = compiler.matcher(spec)
    for t in tokenizer.encode("ab"):
        assert matcher.accept_token(t)
    other = matcher.fork()
    assert matcher.accept_token(tokenizer.encode("c")[0]) and matcher.is_completed()
    assert not other.is_completed() and other.accept_token(tokenizer.encode("d")[0])
    matcher.rollback(1)
    assert not matcher.is_completed() and matcher.accept_token(tokenizer.encode("d")[0])


def test_compile_is_cached(compiler):
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))
    assert compiler.compile(spec) is compiler.compile(StructuredOutputSpec("json_schema", json.dumps(SCHEMA)))


@pytest.mark.parametrize("spec,reason", [
    (StructuredOutputSpec("json_schema", '{"type": "nope"}'), "invalid JSON schema: Unsupported type"),
    (StructuredOutputSpec("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'),
     "minLength 5 is greater than maxLength 2"),
    (StructuredOutputSpec("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutputSpec("json_schema", "[1, 2]"), "must be an object"),
    (StructuredOutputSpec("regex", "[a-"), "invalid regex"),
    (StructuredOutputSpec("grammar", "root ::= undefined_rule"), "invalid EBNF grammar"),
])
def test_invalid_specs_raise_value_error(compiler, spec, reason):
    with pytest.raises(ValueError, match="structured_output") as info:
        compiler.compile(spec)
    assert reason in str(info.value)
    assert "/project/" not in str(info.value)  # xgrammar's source location is stripped
