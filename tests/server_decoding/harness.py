"""What the decoding server tests share: the prompts, the tools, the chat template the server
is started with, and helpers to talk to the in-process deepseek_r1 app and read fields the openai
client does not model. The servers themselves are fixtures in conftest.py."""

from __future__ import annotations

import asyncio

import httpx
import openai

KV_ARGS = ["--num-device-blocks", "256"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"

# SmolLM2's own template, plus what Qwen3's does with tools and enable_thinking=False, and a
# line for reasoning_effort (as gpt-oss's template writes one), so that the tests can see each
# reach the template.
TEMPLATE = (
    "{% if reasoning_effort is defined %}{{ 'Reasoning: ' + reasoning_effort + '\n' }}{% endif %}"
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | map(attribute='function') "
    "| map(attribute='name') | join(', ')) + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    # Qwen3-Thinking-2507-style: the template opens the thinking block for the output.
    "{% if open_thinking is defined and open_thinking %}{{ '<think>\n' }}{% endif %}{% endif %}")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}, "required": ["timezone"]}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


def run_r1(app, fn):
    """`await fn(client)` with an AsyncOpenAI client talking to `app` in-process."""
    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r1/v1",
                                 timeout=120)
        aclient = openai.AsyncOpenAI(base_url="http://r1/v1", api_key="x", max_retries=0, http_client=http)
        try:
            return await fn(aclient, http)
        finally:
            await http.aclose()

    return asyncio.run(main())


def extra_field(obj, name: str):
    """A field the openai client does not model (vLLM's reasoning_content)."""
    return getattr(obj, name, None) if getattr(obj, name, None) is not None else (obj.model_extra or {}).get(name)


def client_tokens(client, text: str) -> list[int]:
    r = httpx.post(str(client.base_url).removesuffix("/v1/").removesuffix("/v1") + "/tokenize",
                   json={"prompt": text, "add_special_tokens": False}, timeout=30)
    return r.json()["tokens"]
