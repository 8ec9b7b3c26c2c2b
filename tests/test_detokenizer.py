"""Tests for ksana_llm.engine.detokenizer with the real SmolLM2 tokenizer (byte-level BPE).

Every expected text is computed with ``tokenizer.decode``; only the input strings are literals.
Stop strings are tested in tests/test_detokenizer_stops.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from ksana_llm.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from tests.detokenizer_harness import (CHINESE, CODE, EMOJI, ENGLISH, REPLACEMENT_CHAR, DecodeSpy,
                                       decode, encode, joined, stream)
from tests.detokenizer_harness import tok_fixture  # noqa: F401  (the `tok` fixture)

# --------------------------------------------------------------------------- UTF-8 safety


@pytest.mark.parametrize("text", [ENGLISH, CHINESE, EMOJI, CODE], ids=["english", "chinese", "emoji", "code"])
@pytest.mark.parametrize("prompt", ["", "User: hi\nAssistant:"], ids=["no-prompt", "prompt"])
def test_one_token_at_a_time_matches_full_decode(tok, text: str, prompt: str) -> None:
    ids = encode(tok, text)
    det = IncrementalDetokenizer(tok, encode(tok, prompt))
    updates, flushed = stream(det, ids)

    assert all(REPLACEMENT_CHAR not in u.delta for u in updates)
    assert all(u.stop_str is None for u in updates)
    # Complete text ends on a character boundary: nothing is left for flush.
    assert flushed == ""
    assert joined(updates) == decode(tok, ids)
    assert det.output_text == decode(tok, ids)


def test_multibyte_characters_are_never_split(tok) -> None:
    ids = encode(tok, EMOJI)
    # Precondition: the tokenizer really splits some characters over several tokens.
    assert any(REPLACEMENT_CHAR in decode(tok, [t]) for t in ids)
    det = IncrementalDetokenizer(tok, [])
    deltas = [det.update([t]).delta for t in ids]
    # Some tokens only carry partial bytes and must yield no text yet.
    assert "" in deltas
    for delta in filter(None, deltas):
        # Each delta is valid text that survives a UTF-8 round trip unchanged.
        assert delta.encode("utf-8").decode("utf-8") == delta
        assert REPLACEMENT_CHAR not in delta


@pytest.mark.parametrize("chunk", [2, 3, 7, 1000])
def test_chunked_updates_give_the_same_text(tok, chunk: int) -> None:
    ids = encode(tok, EMOJI + " " + ENGLISH)
    updates, flushed = stream(IncrementalDetokenizer(tok, encode(tok, "Hi")), ids, chunk)
    assert joined(updates) + flushed == decode(tok, ids)
    assert all(REPLACEMENT_CHAR not in u.delta for u in updates)


def test_empty_update_emits_nothing(tok) -> None:
    det = IncrementalDetokenizer(tok, encode(tok, "Hi"))
    assert det.update([]) == DetokenizerUpdate("", None)
    assert det.flush() == ""
    assert det.output_text == ""


def test_incomplete_tail_is_left_out_on_flush(tok) -> None:
    """vLLM's rule: an output cut inside a character never ends in the U+FFFD its bytes decode
    to; the complete text before it all comes out."""
    ids = encode(tok, CHINESE)
    cut = next(i for i in range(2, len(ids)) if decode(tok, ids[:i]).endswith(REPLACEMENT_CHAR)
               and len(decode(tok, ids[:i]).rstrip(REPLACEMENT_CHAR)) > 0)
    truncated = ids[:cut]  # e.g. a length limit hit in the middle of a character
    updates, flushed = stream(IncrementalDetokenizer(tok, []), truncated)

    assert all(REPLACEMENT_CHAR not in u.delta for u in updates)
    assert REPLACEMENT_CHAR not in flushed
    assert joined(updates) + flushed == decode(tok, truncated).rstrip(REPLACEMENT_CHAR)
    assert joined(updates) + flushed  # the characters before the cut one are there


def test_invalid_bytes_do_not_stall_the_stream(tok) -> None:
    # A token that is a lone UTF-8 continuation byte: repeated, it never forms a
    # character, so the text would otherwise be held back forever.
    lone = next(t for t in encode(tok, CHINESE) if decode(tok, [t]) == REPLACEMENT_CHAR)
    ids = encode(tok, "ok ") + [lone] * 60 + encode(tok, " done")
    spy = DecodeSpy(tok)
    det = IncrementalDetokenizer(spy, [])
    updates, flushed = stream(det, ids)

    assert joined(updates) + flushed == decode(tok, ids)
    assert joined(updates[:40]) != ""  # text came out before the garbage ended
    assert max(spy.lengths) <= 40  # the decode window stayed bounded


# --------------------------------------------------------------------------- prompt context


def test_leading_space_of_first_output_token_after_prompt(tok) -> None:
    prompt_ids = encode(tok, "Hello")
    output_ids = encode(tok, " world, and a café.")
    updates, flushed = stream(IncrementalDetokenizer(tok, prompt_ids), output_ids)

    full = decode(tok, prompt_ids + output_ids)
    expected = full[len(decode(tok, prompt_ids)) :]
    assert expected[0].isspace()  # precondition: the first output token starts with a space
    assert updates[0].delta == expected[: len(updates[0].delta)] != ""
    assert joined(updates) + flushed == expected == decode(tok, output_ids)


def test_leading_space_with_sentencepiece_style_decoder() -> None:
    """Metaspace decoders drop the first token's leading space; prompt context prevents that.

    SmolLM2 (byte-level BPE) decodes a leading space the same with or without
    context, so this builds a tiny in-memory tokenizer with SentencePiece-style
    decoding (no download) to show why the context is needed.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "\u2581how": 3, "\u2581are": 4, "\u2581you": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    sp_tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")

    ids = encode(sp_tok, "Hello world how are you")
    assert vocab["<unk>"] not in ids
    prompt_ids, output_ids = ids[:1], ids[1:]
    updates, flushed = stream(IncrementalDetokenizer(sp_tok, prompt_ids), output_ids)

    expected = decode(sp_tok, ids)[len(decode(sp_tok, prompt_ids)) :]
    assert joined(updates) + flushed == expected
    # The documented difference: a standalone decode loses the leading space.
    assert decode(sp_tok, output_ids) == expected.lstrip()
    assert expected != expected.lstrip()


@pytest.mark.parametrize("prompt", ["a", "one two three four five six seven eight nine ten", "你好，世界！🙂"])
def test_no_prompt_text_is_emitted(tok, prompt: str) -> None:
    output_ids = encode(tok, " Sure, here it is.")
    updates, flushed = stream(IncrementalDetokenizer(tok, encode(tok, prompt)), output_ids)
    assert joined(updates) + flushed == decode(tok, output_ids)


def test_prompt_ending_inside_a_character(tok) -> None:
    ids = encode(tok, CHINESE)
    cut = next(i for i in range(1, len(ids)) if decode(tok, ids[:i]).endswith(REPLACEMENT_CHAR))
    prompt_ids, output_ids = ids[:cut], ids[cut:]
    updates, flushed = stream(IncrementalDetokenizer(tok, prompt_ids), output_ids)
    # The orphaned continuation bytes come out like in a standalone decode.
    assert joined(updates) + flushed == decode(tok, output_ids)


def test_chat_template_prompt_with_special_tokens(tok) -> None:
    prompt_ids = encode(tok, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    output_ids = encode(tok, "Hello! 🙂")
    for skip in (True, False):
        updates, flushed = stream(IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip), output_ids)
        assert joined(updates) + flushed == decode(tok, output_ids, skip)


# --------------------------------------------------------------------------- special tokens


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_with_eos(tok, skip: bool) -> None:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert eos in tok.all_special_ids
    ids = encode(tok, "Hi there! 你好") + [eos]
    updates, flushed = stream(IncrementalDetokenizer(tok, encode(tok, "Hey"), skip_special_tokens=skip), ids)

    assert joined(updates) + flushed == decode(tok, ids, skip)
    assert (tok.decode([eos], skip_special_tokens=False) in joined(updates)) is not skip
    if skip:
        assert updates[-1].delta == ""  # the skipped EOS adds no text


def test_special_token_text_as_stop_string(tok) -> None:
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = encode(tok, "Answer: yes") + [eos] + encode(tok, " trailing")
    det = IncrementalDetokenizer(tok, [], skip_special_tokens=False, stop=["<|im_end|>"])
    updates, _ = stream(det, ids)
    assert det.stop_str == "<|im_end|>"
    assert det.output_text == decode(tok, ids[: ids.index(eos)], False)


# --------------------------------------------------------------------------- lifecycle and cost


def test_update_after_flush_raises(tok) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["hi there"])
    ids = encode(tok, "oh hi")
    update = det.update(ids)
    assert update.delta + det.flush() == decode(tok, ids)
    assert det.flush() == ""  # idempotent
    assert det.output_text == decode(tok, ids)
    with pytest.raises(RuntimeError):
        det.update(encode(tok, "more"))


def test_invalid_stop_strings_are_rejected(tok) -> None:
    with pytest.raises(ValueError):
        IncrementalDetokenizer(tok, [], stop=[""])
    with pytest.raises(TypeError):
        IncrementalDetokenizer(tok, [], stop="abc")  # type: ignore[arg-type]


def test_update_is_frozen(tok) -> None:
    update = IncrementalDetokenizer(tok, []).update(encode(tok, "hi"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.delta = "x"  # type: ignore[misc]


def test_decode_window_stays_short(tok) -> None:
    ids = encode(tok, (ENGLISH + " " + CHINESE + " " + EMOJI + "\n") * 20)
    spy = DecodeSpy(tok)
    det = IncrementalDetokenizer(spy, encode(tok, "Tell me a story."), stop=["never appears"])
    updates, flushed = stream(det, ids)

    assert len(ids) > 500
    assert joined(updates) + flushed == decode(tok, ids)
    # Never re-decodes the whole output: each decode sees only a few tokens,
    # and there are at most two decodes per token.
    assert max(spy.lengths) <= 12
    assert len(spy.lengths) <= 2 * len(ids) + 2




def test_rust_decode_is_used_only_when_it_equals_the_tokenizers_decode(tok) -> None:
    from ksana_llm.engine.detokenizer import _backend_decode

    ids = encode(tok, EMOJI + " " + CODE)
    fast = _backend_decode(tok, skip_special_tokens=True)
    assert fast is not None, "SmolLM2's fast tokenizer should be decoded by its Rust backend"
    for end in range(1, len(ids) + 1):
        assert fast(ids[:end]) == decode(tok, ids[:end])

    # A class that changes decoding keeps its own decode.
    calls: list[list[int]] = []

    def own_decode(self, token_ids, **kwargs):
        calls.append(list(token_ids))
        return type(tok)._decode(self, token_ids, **kwargs)

    marked = type("OwnDecodeTokenizer", (type(tok),), {"_decode": own_decode})
    custom = marked.__new__(marked)
    custom.__dict__.update(tok.__dict__)
    assert _backend_decode(custom, skip_special_tokens=True) is None
    det = IncrementalDetokenizer(custom, [])
    assert joined([det.update(ids)]) + det.flush() == decode(tok, ids)
    assert calls and calls[-1][-1] == ids[-1]
