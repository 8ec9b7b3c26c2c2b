"""A real server under a mixed load, through the official `openai` async client: greedy chats and
completions (streamed and not), seeded n = 2 samples sent twice, streams the client drops
halfway, and requests the server must refuse, all at once, against a KV pool small enough that
running requests are preempted (recompute).

Every greedy answer must be the one the Python API gives alone, each seeded pair must agree,
every refusal must be a 400 naming its parameter, and afterwards nothing may be left running
and the server must still answer. tests/test_engine_soak.py does the same to the engine alone.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

import ksana_llm as kt
from tests.server_process import ServerProcess

pytestmark = pytest.mark.timeout(600)

PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived a cat named",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "Translate to French: The weather is nice today.",
    "长城是",
    "A short list of prime numbers: 2, 3, 5,",
]
QUESTIONS = ["What is the capital of France?", "Name a fruit that is yellow.",
             "How many legs does a spider have?"]
MAX_TOKENS = 24
# 4-token blocks: 40 of them hold 160 tokens, the context cap too, while six sequences of up to
# ~60 tokens each run at once (and dropped streams grow to 100): the pool runs out, and
# running requests are preempted and recomputed.
SERVER_ARGS = ["--dtype", "float32", "--block-size", "4", "--num-device-blocks", "40",
               "--max-num-seqs", "6", "--preemption-mode", "recompute"]


@pytest.fixture(scope="module")
def server(default_model_dir):
    proc = ServerProcess(SERVER_ARGS)
    yield proc
    proc.stop()


def _chat_prompt(engine: kt.Engine, question: str) -> str:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                add_generation_prompt=True, tokenize=False)


def _expected(local_engine: kt.Engine, prompts: list[str]) -> list[str]:
    config = kt.GenerationConfig(max_new_tokens=MAX_TOKENS)
    return [o.text for o in local_engine.generate_outputs(prompts, config, use_tqdm=False)]


def _preemptions(server: ServerProcess) -> float:
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("ksana_llm:num_preemptions_total"))


def test_a_mixed_load_keeps_every_answer(server, local_engine):
    expected_completions = _expected(local_engine, PROMPTS)
    expected_chats = _expected(local_engine, [_chat_prompt(local_engine, q) for q in QUESTIONS])
    preempted_before = _preemptions(server)

    async def main() -> dict[str, list]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                                    timeout=300)
        model = (await client.models.list()).data[0].id
        greedy = dict(model=model, temperature=0, max_tokens=MAX_TOKENS)

        async def completion(prompt: str, stream: bool) -> str:
            if not stream:
                return (await client.completions.create(prompt=prompt, **greedy)).choices[0].text
            chunks = await client.completions.create(prompt=prompt, stream=True, **greedy)
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        async def chat(question: str, stream: bool) -> str:
            messages = [{"role": "user", "content": question}]
            if not stream:
                reply = await client.chat.completions.create(messages=messages, **greedy)
                return reply.choices[0].message.content
            chunks = await client.chat.completions.create(messages=messages, stream=True,
                                                          **greedy)
            return "".join([c.choices[0].delta.content or "" async for c in chunks
                            if c.choices])

        async def seeded(seed: int) -> list[str]:
            reply = await client.completions.create(
                model=model, prompt=PROMPTS[seed % len(PROMPTS)], n=2, seed=seed,
                temperature=1.0, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
            return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

        async def dropped(prompt: str) -> int:
            """A stream the client leaves after a dozen chunks (the server must abort it)."""
            chunks = await client.completions.create(
                model=model, prompt=prompt, stream=True, max_tokens=100, temperature=0,
                extra_body={"ignore_eos": True})
            seen = 0
            async for _ in chunks:
                seen += 1
                if seen == 12:
                    await chunks.close()
                    break
            return seen

        async def refused(field: str, value: object) -> str | None:
            try:
                await client.completions.create(prompt=PROMPTS[0], **{**greedy, field: value})
            except openai.BadRequestError as error:
                return error.body.get("param") if isinstance(error.body, dict) else None
            return "accepted"

        tasks = {
            "completions": [completion(p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)],
            "chats": [chat(q, stream=i % 2 == 0) for i, q in enumerate(QUESTIONS)],
            "seeded": [seeded(s) for s in (3, 4, 3, 4)],
            "dropped": [dropped(p) for p in PROMPTS[:4]],
            "refused": [refused("max_tokens", -3), refused("temperature", -1.0),
                        refused("top_p", 7.0)],
        }
        names = [name for name, group in tasks.items() for _ in group]
        flat = await asyncio.gather(*(c for group in tasks.values() for c in group))
        await client.close()
        results: dict[str, list] = {name: [] for name in tasks}
        for name, value in zip(names, flat):
            results[name].append(value)
        return results

    results = asyncio.run(main())
    assert results["completions"] == expected_completions
    assert results["chats"] == expected_chats
    first, second, again_first, again_second = results["seeded"]
    assert first == again_first and second == again_second
    assert first[0] != first[1]
    assert results["dropped"] == [12] * 4
    assert results["refused"] == ["max_tokens", "temperature", "top_p"]
    assert _preemptions(server) > preempted_before  # the pool really ran out

    deadline = time.monotonic() + 30
    while (health := httpx.get(server.url + "/health", timeout=10).json()) and \
            (health["num_running"], health["num_waiting"]) != (0, 0):
        assert time.monotonic() < deadline, f"requests still live: {health}"
        time.sleep(0.1)
    # Still serving, and every block back: the next answer is the one it gives alone.
    again = httpx.post(server.base_url + "/completions", timeout=60,
                       json={"prompt": PROMPTS[2], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == \
        expected_completions[2]
