"""How message content reaches a chat template (vLLM's --chat-template-content-format), the
role a chat answer has (--response-role), and vLLM's chat request extras `documents` and
`echo`: the template reading, rendering against transformers' own `apply_chat_template` on the
same messages, and all of it on a real server process."""

from __future__ import annotations

import json

import httpx
import pytest

import ksana_llm as kt
from ksana_llm.server.chat import ChatTemplate, loops_over_content, render_chat
from ksana_llm.server.errors import APIError
from ksana_llm.server.openai_protocol import ChatMessage
from tests.server_process import ServerProcess

# ChatML whose turns loop over content parts, as multimodal models' templates do: given a
# plain string, the loop would walk its characters (which have no 'text').
PARTS_TEMPLATE = (
    "{%- for d in documents or [] %}{{ '[' + d['title'] + '] ' + d['text'] + '\n' }}{%- endfor %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- for part in m['content'] %}{%- if part['type'] == 'text' %}{{ part['text'] }}"
    "{%- endif %}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
STRING_TEMPLATE = ("{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                   "{%- endfor %}")
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                         {"type": "text", "text": "of France?"}]}]
# The same conversation as transformers gets it in the OpenAI format: every content a part list.
AS_PARTS = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
            MESSAGES[1]]


@pytest.mark.parametrize("template, loops", [
    (PARTS_TEMPLATE, True),
    ("{% for c in message.content %}{{ c.text }}{% endfor %}", True),
    # Llama 3.2 Vision's shape: a filter between the loop and the content.
    ("{% for m in messages %}{% for c in m['content'] | selectattr('type', 'equalto', 'text') %}"
     "{{ c['text'] }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% set parts = m['content'] %}{% for p in parts %}{{ p.text }}"
     "{% endfor %}{% endfor %}", True),
    (STRING_TEMPLATE, False),
    ("{% for m in messages %}{% for t in m['tool_calls'] %}{{ t }}{% endfor %}{% endfor %}", False),
    ("{% for x in %}", False),  # not Jinja: rendering reports it
])
def test_loops_over_content(template, loops):
    assert loops_over_content(template) is loops


def test_auto_reads_the_template_or_the_tokenizers(model):
    tokenizer = model.tokenizer
    assert ChatTemplate.resolve(None, "auto", tokenizer).content_format == "string"
    assert ChatTemplate.resolve(PARTS_TEMPLATE, "auto", tokenizer).content_format == "openai"
    assert ChatTemplate.resolve(PARTS_TEMPLATE, "string", tokenizer).content_format == "string"
    assert ChatTemplate.resolve(STRING_TEMPLATE, "openai", tokenizer).content_format == "openai"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        ChatTemplate.resolve(None, "parts", tokenizer)


def test_rendering_matches_transformers_in_both_formats(model):
    tokenizer = model.tokenizer
    messages = [ChatMessage.model_validate(m) for m in MESSAGES]
    as_parts = render_chat(tokenizer, messages, ChatTemplate(PARTS_TEMPLATE, "openai"))
    assert as_parts == tokenizer.apply_chat_template(AS_PARTS, chat_template=PARTS_TEMPLATE,
                                                     tokenize=False, add_generation_prompt=True)
    assert "What is the capital of France?" in as_parts
    flattened = [{"role": "system", "content": "You are terse."},
                 {"role": "user", "content": "What is the capital of France?"}]
    as_string = render_chat(tokenizer, messages, ChatTemplate(STRING_TEMPLATE, "string"))
    assert as_string == tokenizer.apply_chat_template(flattened, chat_template=STRING_TEMPLATE,
                                                      tokenize=False)
    # The format is what makes the difference: the part loop over a flattened string has no text.
    assert "France" not in render_chat(tokenizer, messages, ChatTemplate(PARTS_TEMPLATE, "string"))
    # A template that concatenates strings, handed parts: a 400 naming the messages, not a 500.
    with pytest.raises(APIError) as info:
        render_chat(tokenizer, messages, ChatTemplate(STRING_TEMPLATE, "openai"))
    assert info.value.status == 400 and info.value.param == "messages"
    assert "chat template rejected them (TypeError" in str(info.value)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "parts.jinja"
    template.write_text(PARTS_TEMPLATE)
    # No --chat-template-content-format: "auto" must find the loop over content.
    proc = ServerProcess(["--num-gpu-blocks-override", "128", "--chat-template", str(template),
                          "--response-role", "narrator"])
    yield proc
    proc.stop()


def test_server_renders_parts_and_answers_in_its_role(server, local_engine):
    tokenizer = local_engine.tokenizer
    expected = tokenizer.encode(
        tokenizer.apply_chat_template(AS_PARTS, chat_template=PARTS_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True), add_special_tokens=False)
    tokens = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert tokens == expected
    answer = httpx.post(server.base_url + "/chat/completions", timeout=120, json={
        "messages": MESSAGES, "max_tokens": 8, "temperature": 0}).json()
    assert answer["usage"]["prompt_tokens"] == len(expected)
    message = answer["choices"][0]["message"]
    assert message["role"] == "narrator"
    assert message["content"] == local_engine.generate_outputs(
        expected, kt.GenerationConfig(max_new_tokens=8), use_tqdm=False)[0].text

    streamed = httpx.post(server.base_url + "/chat/completions", timeout=120, json={
        "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True})
    first = json.loads(streamed.text.split("data: ", 2)[1].strip())
    assert first["choices"][0]["delta"]["role"] == "narrator"


def test_without_a_generation_prompt_the_role_is_the_last_messages(server, local_engine):
    # Continuing the assistant's own turn: the answer is that assistant message, whatever
    # --response-role says; with echo it starts with that message's text, as vLLM's does.
    conversation = MESSAGES + [{"role": "assistant", "content": "The capital"}]
    body = {"messages": conversation, "max_tokens": 4, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    plain = httpx.post(server.base_url + "/chat/completions", timeout=120, json=body).json()
    message = plain["choices"][0]["message"]
    assert message["role"] == "assistant"
    tokenizer = local_engine.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template(
        [*AS_PARTS, {"role": "assistant", "content": [{"type": "text", "text": "The capital"}]}],
        chat_template=PARTS_TEMPLATE, tokenize=False, continue_final_message=True),
        add_special_tokens=False)
    assert message["content"] == local_engine.generate_outputs(
        ids, kt.GenerationConfig(max_new_tokens=4), use_tqdm=False)[0].text
    assert httpx.post(server.url + "/tokenize", json={
        "messages": conversation, "add_generation_prompt": False,
        "continue_final_message": True}).json()["tokens"] == ids
    # The same flags as chat_template_kwargs win over the fields' defaults, as in vLLM.
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    as_kwargs = {"messages": conversation, "chat_template_kwargs": flags}
    assert httpx.post(server.url + "/tokenize", json=as_kwargs).json()["tokens"] == ids
    via_kwargs = httpx.post(server.base_url + "/chat/completions", timeout=120, json={
        **as_kwargs, "max_tokens": 4, "temperature": 0}).json()["choices"][0]["message"]
    assert (via_kwargs["role"], via_kwargs["content"]) == ("assistant", message["content"])
    refused = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        **body, "chat_template_kwargs": {"add_generation_prompt": "no"}})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"
    echoed = httpx.post(server.base_url + "/chat/completions", timeout=120,
                        json={**body, "echo": True}).json()["choices"][0]["message"]
    assert echoed["content"] == "The capital" + message["content"]
    streamed = httpx.post(server.base_url + "/chat/completions", timeout=120,
                          json={**body, "echo": True, "stream": True})
    deltas = [json.loads(line[len("data: "):])["choices"] for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c[0]["delta"].get("content") or "" for c in deltas if c) == echoed["content"]
    # A generation prompt answers as the narrator: the user's message is not echoed.
    asked = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    answers = [httpx.post(server.base_url + "/chat/completions", timeout=120,
                          json={**asked, "echo": echo}).json()["choices"][0]["message"]["content"]
               for echo in (False, True)]
    assert answers[0] == answers[1] and not answers[0].startswith("What is")


def test_documents_reach_the_template(server, local_engine):
    documents = [{"title": "Atlas", "text": "Paris is the capital of France."},
                 {"title": "Notes", "text": "Berlin is the capital of Germany."}]
    tokenizer = local_engine.tokenizer
    rendered = tokenizer.apply_chat_template(AS_PARTS, chat_template=PARTS_TEMPLATE,
                                             tokenize=False, add_generation_prompt=True,
                                             documents=documents)
    assert "[Atlas] Paris" in rendered
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    assert httpx.post(server.url + "/tokenize", json={
        "messages": MESSAGES, "documents": documents}).json()["tokens"] == expected
    answer = httpx.post(server.base_url + "/chat/completions", timeout=120, json={
        "messages": MESSAGES, "documents": documents, "max_tokens": 6, "temperature": 0}).json()
    assert answer["usage"]["prompt_tokens"] == len(expected)
    assert answer["choices"][0]["message"]["content"] == local_engine.generate_outputs(
        expected, kt.GenerationConfig(max_new_tokens=6), use_tqdm=False)[0].text
    # The Python API takes them too.
    assert local_engine.render_chat(AS_PARTS, chat_template=PARTS_TEMPLATE,
                                    documents=documents) == expected
    bad = httpx.post(server.base_url + "/chat/completions", timeout=120, json={
        "messages": MESSAGES, "documents": [{"title": 1}]})
    assert bad.status_code == 400 and "documents" in bad.json()["error"]["param"]
    with pytest.raises(ValueError, match="documents"):
        local_engine.render_chat(AS_PARTS, chat_template=PARTS_TEMPLATE, documents=[{"n": 1}])
