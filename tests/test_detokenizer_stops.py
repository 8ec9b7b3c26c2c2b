"""Stop strings in ksana_llm.engine.detokenizer, with the real SmolLM2 tokenizer.

Every expected text is computed with ``tokenizer.decode``; only the input strings and the stop
strings are literals. The rest of the detokenizer's tests are in tests/test_detokenizer.py.
"""

from __future__ import annotations

import pytest

from ksana_llm.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer
from tests.detokenizer_harness import (CHINESE, EMOJI, REPLACEMENT_CHAR, decode, encode, joined,
                                       stream)
from tests.detokenizer_harness import tok_fixture  # noqa: F401  (the `tok` fixture)

# --------------------------------------------------------------------------- stop strings


def run_with_stop(tok, text: str, stop: list[str], include: bool = False, chunk: int = 1):
    """Stream ``text`` with stop strings; return (detokenizer, updates, flush output, full decode)."""
    ids = encode(tok, text)
    det = IncrementalDetokenizer(tok, encode(tok, "Q:"), stop=stop, include_stop_str_in_output=include)
    updates, flushed = stream(det, ids, chunk)
    return det, updates, flushed, decode(tok, ids)


def assert_stopped(det: IncrementalDetokenizer, updates, flushed: str, stop_str: str, expected: str) -> None:
    """Stopped exactly once, at ``stop_str``, with ``expected`` as the whole output."""
    first = next(i for i, u in enumerate(updates) if u.stop_str is not None)
    assert updates[first].stop_str == stop_str
    # After the stop: the stop stays reported, and no more text, not even from flush.
    assert all(u == DetokenizerUpdate("", stop_str) for u in updates[first + 1 :])
    assert flushed == ""
    assert det.stop_str == stop_str and det.finished
    assert joined(updates) == det.output_text == expected


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_inside_one_token(tok, include: bool) -> None:
    text, stop = "Hello world. Goodbye world.", "ood"
    det, updates, flushed, full = run_with_stop(tok, text, [stop], include)
    assert any(stop in decode(tok, [t]) for t in encode(tok, text))  # precondition
    cut = full.index(stop) + (len(stop) if include else 0)
    assert_stopped(det, updates, flushed, stop, full[:cut])


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_split_across_tokens(tok, include: bool, chunk: int) -> None:
    text, stop = "Hello world. Goodbye world.", "d. Goodb"
    det, updates, flushed, full = run_with_stop(tok, text, [stop], include, chunk)
    assert not any(stop in decode(tok, [t]) for t in encode(tok, text))  # precondition
    cut = full.index(stop) + (len(stop) if include else 0)
    assert_stopped(det, updates, flushed, stop, full[:cut])


@pytest.mark.parametrize("include", [False, True])
def test_chinese_stop_string_split_across_byte_tokens(tok, include: bool) -> None:
    stop = "世界"
    det, updates, flushed, full = run_with_stop(tok, CHINESE, [stop], include)
    cut = full.index(stop) + (len(stop) if include else 0)
    assert_stopped(det, updates, flushed, stop, full[:cut])
    assert all(REPLACEMENT_CHAR not in u.delta for u in updates)


@pytest.mark.parametrize("text, stop, min_tokens", [
    ("1, 2, 3, 4, 5, 6", ",", 4),  # two commas in the first 4 tokens' text
    ("Hello world. Goodbye world.", "d. Goodb", 3),  # starts before the boundary, ends after
    ("Hello world. Goodbye world.", "world", 99),  # never: the output stays short of min_tokens
])
def test_stop_strings_wait_for_min_tokens(tok, text: str, stop: str, min_tokens: int) -> None:
    """vLLM's min_tokens: only a stop string that ends in the text of token min_tokens + 1 or
    later stops the output."""
    ids = encode(tok, text)
    det = IncrementalDetokenizer(tok, encode(tok, "Q:"), stop=[stop], min_tokens=min_tokens)
    updates, flushed = stream(det, ids)
    full, before = decode(tok, ids), decode(tok, ids[:min_tokens])
    assert full.startswith(before) and 0 <= full.find(stop) < len(before)  # starts in it
    end = full.find(stop, max(0, len(before) - len(stop) + 1))
    if end < 0:
        assert det.stop_str is None and joined(updates) + flushed == full
    else:
        assert_stopped(det, updates, flushed, stop, full[:end])


def test_earliest_stop_string_wins(tok) -> None:
    stops = ["world", "Hello", "absent"]
    det, updates, flushed, full = run_with_stop(tok, "Say Hello to the world", stops)
    first = min((s for s in stops if s in full), key=full.index)
    assert first == "Hello"  # not the first one in the list
    assert_stopped(det, updates, flushed, first, full[: full.index(first)])


@pytest.mark.parametrize("chunk", [1, 1000])
def test_stop_completed_first_wins_regardless_of_chunking(tok, chunk: int) -> None:
    # "two three" starts earlier, but "two" is complete first in the stream.
    stops = ["two three", "two"]
    det, updates, flushed, full = run_with_stop(tok, "one two three four", stops, chunk=chunk)
    assert_stopped(det, updates, flushed, "two", full[: full.index("two")])


def test_first_occurrence_of_repeated_stop_string(tok) -> None:
    det, updates, flushed, full = run_with_stop(tok, "a. b. c.", [". "], include=True, chunk=1000)
    assert_stopped(det, updates, flushed, ". ", full[: full.index(". ") + 2])


def test_possible_stop_prefix_is_held_back_and_released_by_flush(tok) -> None:
    stop = "The ending"
    text = "The answer is 42. The end"
    ids = encode(tok, text)
    det = IncrementalDetokenizer(tok, [], stop=[stop])
    updates = [det.update([t]) for t in ids]
    full = decode(tok, ids)
    held = stop[: len("The end")]
    assert full.endswith(held)  # precondition: the output ends with a stop-string prefix

    assert all(u.stop_str is None for u in updates)
    assert joined(updates) == det.output_text == full[: -len(held)]
    flushed = det.flush()
    assert flushed == held
    assert joined(updates) + flushed == det.output_text == full
    assert det.stop_str is None and det.finished


def test_held_back_prefix_is_released_when_it_stops_matching(tok) -> None:
    stop = "The ending"
    det, updates, flushed, full = run_with_stop(tok, "The end is near. The final", [stop])
    assert det.stop_str is None
    assert flushed == ""
    assert joined(updates) == full


def test_holdback_never_emits_text_that_is_cut_later(tok) -> None:
    # Every prefix of the stop string appears before the stop string completes;
    # any of it leaking into a delta would make the output longer than expected.
    stop = "<END>"
    text = "a <E b <EN c <END d <END> e"
    det, updates, flushed, full = run_with_stop(tok, text, [stop])
    assert_stopped(det, updates, flushed, stop, full[: full.index(stop)])


def test_include_stop_str_streams_without_holdback(tok) -> None:
    stop = "The ending"
    det, updates, flushed, full = run_with_stop(tok, "The answer is 42. The end", [stop], include=True)
    # Nothing before a stop string's end is ever cut when it is included, so no delay.
    assert joined(updates) == full
    assert flushed == ""


def test_stop_string_not_found_when_absent(tok) -> None:
    det, updates, flushed, full = run_with_stop(tok, EMOJI, ["xyz", "🙂👍🙂"])
    assert det.stop_str is None
    assert joined(updates) + flushed == full


def test_incomplete_tail_at_flush_completes_no_stop_string(tok) -> None:
    # Truncating inside a character leaves the last tokens unread until flush,
    # which leaves the incomplete character out (vLLM's rule), so a stop string
    # ending in the U+FFFD its bytes would decode to never matches; the text
    # held back as a possible stop prefix still comes out.
    ids = encode(tok, CHINESE)
    cut = next(i for i in range(2, len(ids)) if decode(tok, ids[:i]).endswith(REPLACEMENT_CHAR))
    text = decode(tok, ids[:cut])
    stop = text.rstrip(REPLACEMENT_CHAR)[-1:] + REPLACEMENT_CHAR
    det = IncrementalDetokenizer(tok, [], stop=[stop])
    updates = [det.update([t]) for t in ids[:cut]]
    assert all(u.stop_str is None for u in updates)
    flushed = det.flush()
    assert det.stop_str is None
    assert joined(updates) + flushed == det.output_text == text.rstrip(REPLACEMENT_CHAR)
