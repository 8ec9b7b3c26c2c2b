"""GPT-OSS's harmony format: the `openai_gptoss` reasoning parser and the `openai` tool-call
parser (`server/tool_parsers/harmony.py`).

- Each parser on harmony text, non-streamed and streamed in random chunkings (every chunking
  must give the non-streamed answer, and no half special token may be sent as text), and the two
  composed as the server composes them.
- The same text as SmolLM2's real tokenizer (the harmony special tokens added) decodes it token by
  token through our incremental detokenizer with special tokens kept.
- Real servers: a tiny model whose every token's successor is fixed (attention and MLP outputs
  zeroed: each position's logits come from its own token alone) writes a harmony answer or tool
  call; over HTTP the `openai` client gets the final channel as content and the call as a tool
  call, though the requests left skip_special_tokens at its default (true).
"""

from __future__ import annotations

import json
import random

import openai
import pytest
import torch

from ksana_llm.engine.detokenizer import IncrementalDetokenizer
from ksana_llm.server.reasoning_parsers import ReasoningOutput, get_reasoning_parser
from ksana_llm.server.tool_parsers import ToolCall, get_tool_parser
from ksana_llm.server.tool_parsers.base import ParsedOutput, collect
from tests.server_process import ServerProcess

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
            "<|call|>"]
THOUGHT = "The user wants the weather in Paris. Call get_weather."
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking the forecast.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris", "unit": "C"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 18 C and sunny in Paris.<|return|>"

CALL_AS_HARMONY = ('<|channel|>commentary to=functions.get_weather<|message|>'
                   '{"city": "Paris", "unit": "C"}<|call|>')

# (text, calls_read, reasoning, content) for the reasoning parser
REASONING_CASES = [
    (ANALYSIS + FINAL, False, THOUGHT, "It is 18 C and sunny in Paris."),
    (ANALYSIS + FINAL[:-len("<|return|>")], False, THOUGHT,
     "It is 18 C and sunny in Paris."),  # the EOS not in the text
    (ANALYSIS + "\n" + FINAL, False, THOUGHT, "It is 18 C and sunny in Paris."),
    ("Plain text from a model not writing harmony.", False, None,
     "Plain text from a model not writing harmony."),
    (f"<|channel|>analysis<|message|>{THOUGHT}", False, THOUGHT, None),  # cut off while thinking
    (ANALYSIS + "<|start|>assistant<|channel|>fin", False, THOUGHT, None),  # cut off in a header
    (ANALYSIS + '<|start|>assistant to=functions.get_weather<|channel|>commentary json', False,
     THOUGHT, None),
    # A call goes on as harmony when the tool-call parser reads it; else it is no user text.
    (ANALYSIS + PREAMBLE + CALL, True, THOUGHT, "Checking the forecast." + CALL_AS_HARMONY),
    (ANALYSIS + PREAMBLE + CALL, False, THOUGHT, "Checking the forecast."),
    # Off the format, nothing is lost: a header closed with no <|message|> is plain text, ...
    ("<|channel|>final hello world<|end|>and more text", False, None,
     "final hello worldand more text"),
    ("<|start|>assistant hello world", False, None, "assistant hello world"),
    # ... a header inside a body ends that body, terminators in plain text are dropped.
    ("<|channel|>analysis<|message|>a<|channel|>final<|message|>b<|end|>", False, "a", "b"),
    ("hello<|end|> world", False, None, "hello world"),
]

# (text, content, calls) for the tool-call parser on its own: the analysis channel and calls to
# other recipients are not content.
TOOL_CASES = [
    (ANALYSIS + PREAMBLE + CALL, "Checking the forecast.",
     [ToolCall("get_weather", '{"city": "Paris", "unit": "C"}')]),
    (ANALYSIS + CALL + CALL.replace("get_weather", "get_time").replace("Paris", "Rome"), None,
     [ToolCall("get_weather", '{"city": "Paris", "unit": "C"}'),
      ToolCall("get_time", '{"city": "Rome", "unit": "C"}')]),
    (ANALYSIS + FINAL, "It is 18 C and sunny in Paris.", []),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary to=browser.search<|message|>"
     '{"query": "Paris"}<|call|>', None, []),
    # the recipient before the channel, as harmony also allows
    ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": '
     '"Oslo"}<|call|>', None, [ToolCall("get_weather", '{"city": "Oslo"}')]),
    # a preamble as plain text (what the reasoning parser hands on), then a call
    ("Checking.<|channel|>commentary to=functions.get_weather<|message|>{}<|call|>", "Checking.",
     [ToolCall("get_weather", "{}")]),
]


def _chunkings(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    out = [list(text), [text]]
    for _ in range(60):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            pieces.append(text[i:i + n])
            i += n
        out.append(pieces)
    return out


def _no_half_special(piece: str) -> None:
    for special in SPECIALS:
        for n in range(1, len(special)):
            assert not piece.endswith(special[:n]) or piece.endswith(special), piece


@pytest.mark.parametrize("text,calls_read,reasoning,content", REASONING_CASES)
def test_reasoning_parser_streamed_and_not(text, calls_read, reasoning, content):
    parser = get_reasoning_parser("openai_gptoss")
    assert parser.extract(text, calls_read=calls_read) == ReasoningOutput(reasoning, content)
    for pieces in _chunkings(text):
        stream = parser.stream(calls_read=calls_read)
        deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        for delta in deltas[:-1]:
            _no_half_special(delta.reasoning)
        assert ReasoningOutput("".join(d.reasoning for d in deltas) or None,
                               "".join(d.content for d in deltas) or None) \
            == ReasoningOutput(reasoning, content)


@pytest.mark.parametrize("text,content,calls", TOOL_CASES)
def test_tool_parser_streamed_and_not(text, content, calls):
    parser = get_tool_parser("openai")
    assert parser.extract(text) == ParsedOutput(content, calls)
    for pieces in _chunkings(text):
        stream = parser.stream()
        deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        for delta in deltas[:-1]:
            _no_half_special(delta.content)
        assert collect(deltas) == ParsedOutput(content, calls)


def test_parsers_composed_as_the_server_composes_them():
    """The reasoning parser's content goes on to the tool-call parser."""
    split = get_reasoning_parser("openai_gptoss").extract(ANALYSIS + PREAMBLE + CALL,
                                                          calls_read=True)
    assert split.reasoning == THOUGHT
    assert get_tool_parser("openai").extract(split.content) == ParsedOutput(
        "Checking the forecast.", [ToolCall("get_weather", '{"city": "Paris", "unit": "C"}')])


@pytest.fixture(scope="module")
def harmony_tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}"
                         "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant"
                         "{% endif %}")
    return tok


def test_token_by_token_through_the_detokenizer(harmony_tokenizer):
    """The output as the engine decodes it (special tokens kept), one token at a time."""
    text = ANALYSIS + PREAMBLE + CALL
    ids = harmony_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(harmony_tokenizer, [], skip_special_tokens=False)
    reasoning = get_reasoning_parser("openai_gptoss").stream(calls_read=True)
    deltas = [reasoning.feed(detok.update([token]).delta) for token in ids]
    deltas += [reasoning.feed(detok.flush()), reasoning.finish()]
    content = "".join(d.content for d in deltas)
    assert "".join(d.reasoning for d in deltas) == THOUGHT
    assert get_tool_parser("openai").extract(content) == ParsedOutput(
        "Checking the forecast.", [ToolCall("get_weather", '{"city": "Paris", "unit": "C"}')])


# ---- real servers ------------------------------------------------------------------------------

ANSWER_SCRIPT = "<|channel|>final<|message|>Hello world<|return|>"
CALL_SCRIPT = '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>'
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}


def _scripted_model(tok, script: str, folder) -> None:
    """A one-layer Llama that, after the chat template's generation prompt, writes `script`:
    attention and MLP outputs zeroed, token t's embedding a basis vector, the LM head mapping it
    to t's successor in the script."""
    from transformers import LlamaConfig, LlamaForCausalLM

    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    chain = [tok.encode(prompt, add_special_tokens=False)[-1]] + \
        tok.encode(script, add_special_tokens=False)
    assert len(set(chain)) == len(chain), "each token of the script must have one successor"
    stops = [tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=stops, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "lm_head.weight")):
                param.zero_()
        model.model.embed_tokens.weight.normal_(0, 0.01)
        for dim, (token, successor) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token, dim] = 1.0
            model.lm_head.weight[successor, dim] = 5.0
    model.generation_config.eos_token_id = stops
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def servers(harmony_tokenizer, tmp_path_factory):
    procs = {}
    try:
        for name, script in (("answer", ANSWER_SCRIPT), ("call", CALL_SCRIPT)):
            folder = tmp_path_factory.mktemp(f"harmony-{name}")
            _scripted_model(harmony_tokenizer, script, folder)
            procs[name] = ServerProcess(["--model", str(folder), "--dtype", "float32",
                                         "--reasoning-parser", "openai_gptoss",
                                         "--tool-call-parser", "openai",
                                         "--enable-auto-tool-choice"])
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_server_reads_the_final_channel(servers):
    client = _client(servers["answer"])
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=20,
                                           temperature=0)
    message = reply.choices[0].message
    assert message.content == "Hello world" and reply.choices[0].finish_reason == "stop"
    # Streamed: the same answer, no header or special token in any chunk.
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=20,
                                                 temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world"
    # The completions route has no parser: the request's skip_special_tokens decides.
    plain = client.completions.create(model=model, prompt="<|start|>user<|message|>hi<|end|>"
                                      "<|start|>assistant", max_tokens=20, temperature=0)
    assert plain.choices[0].text == "finalHello world"


def test_server_reads_a_tool_call(servers):
    client = _client(servers["call"])
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, max_tokens=40, temperature=0,
                                           messages=[{"role": "user", "content": "hi"}],
                                           tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # Without tools no parser reads the call: no markup reaches the content either.
    reply = client.chat.completions.create(model=model, max_tokens=40, temperature=0,
                                           messages=[{"role": "user", "content": "hi"}])
    assert not reply.choices[0].message.content and not reply.choices[0].message.tool_calls


# GPT-OSS's template's handling of an earlier assistant turn, in short: its reasoning as
# `thinking` on the analysis channel, and no harmony tags allowed in the content.
HISTORY_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}"
    "{%- if '<|channel|>' in m.content %}{{ raise_exception('harmony tags in content') }}"
    "{%- endif %}{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>"
    "{{ m.thinking }}<|end|>{%- endif %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
    "{%- endif %}{%- endfor %}<|start|>assistant")


def test_an_earlier_turns_reasoning_reaches_the_template_as_thinking(harmony_tokenizer):
    """A client sends back the reasoning_content it got: GPT-OSS's template reads it as
    `thinking`, rendered as transformers renders the same turn."""
    from ksana_llm.server.chat import ChatTemplate, render_chat
    from ksana_llm.server.openai_protocol import ChatMessage

    turns = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "Sunny.", "reasoning_content": THOUGHT},
             {"role": "user", "content": "And tomorrow?"}]
    rendered = render_chat(harmony_tokenizer, [ChatMessage.model_validate(t) for t in turns],
                           ChatTemplate(HISTORY_TEMPLATE, "string"))
    expected = harmony_tokenizer.apply_chat_template(
        [turns[0], {"role": "assistant", "content": "Sunny.", "thinking": THOUGHT}, turns[2]],
        chat_template=HISTORY_TEMPLATE, tokenize=False)
    assert rendered == expected and f"analysis<|message|>{THOUGHT}<|end|>" in rendered
