"""A model plugin behind the server: every route tokenizes before the engine sees the request,
yet the plugin's `preprocess` still gets what the ids were made from (KsanaLLM's kwargs
`prompt` and `messages`): the completions prompt, the chat messages and their rendered text,
`/generate`'s prompt. The plugin here refuses a marked prompt, naming what it saw: a 400 whose
message the test reads."""

from __future__ import annotations

import json
import textwrap

import httpx
import pytest

from tests.server_process import ServerProcess
from tests.tiny_models import build_tiny_chat_model

SHOWING_PLUGIN = '''
import json


class KsanaPlugin:
    def preprocess(self, **kwargs):
        prompt = kwargs["prompt"] or ""
        if "SHOW" in prompt:
            raise ValueError("saw " + json.dumps({"prompt": prompt,
                                                  "messages": kwargs["messages"]}))
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("plugin_server") / "model"
    build_tiny_chat_model(folder, default_model_dir, num_hidden_layers=1)
    (folder / "ksana_plugin.py").write_text(textwrap.dedent(SHOWING_PLUGIN))
    proc = ServerProcess(["--model", str(folder), "--num-device-blocks", "64"])
    yield proc
    proc.stop()


def _seen(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    return json.loads(message[message.index("saw ") + 4:])


def test_completions_prompts_reach_the_plugin(server):
    seen = _seen(httpx.post(server.base_url + "/completions", timeout=60, json={
        "prompt": "SHOW me", "max_tokens": 2}))
    assert seen == {"prompt": "SHOW me", "messages": None}
    # Several prompts: each request gets its own text; unmarked ones are answered.
    seen = _seen(httpx.post(server.base_url + "/completions", timeout=60, json={
        "prompt": ["plain", "SHOW the second"], "max_tokens": 2}))
    assert seen["prompt"] == "SHOW the second"
    plain = httpx.post(server.base_url + "/completions", timeout=60, json={
        "prompt": "plain", "max_tokens": 2})
    assert plain.status_code == 200


def test_chat_messages_and_their_rendered_text_reach_the_plugin(server):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "SHOW this"}]
    seen = _seen(httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        "messages": messages, "max_tokens": 2}))
    assert seen["messages"] == messages
    assert "SHOW this" in seen["prompt"] and "Be brief." in seen["prompt"]  # the template's


def test_native_generate_prompt_reaches_the_plugin(server):
    seen = _seen(httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": "SHOW native", "sampling_config": {"max_new_tokens": 2}}))
    assert seen["prompt"] == "SHOW native"
    assert httpx.get(server.url + "/health").status_code == 200  # still serving
