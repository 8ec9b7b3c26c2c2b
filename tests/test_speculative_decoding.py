"""Speculative decoding with DeepSeek's MTP layer, against transformers (fp32, CPU).

The model is a tiny random DeepSeek-V3 with one MTP layer (tests/deepseek_checkpoint.py). Random
MTP weights almost never guess the main model's next tokens, so the MTP head is fitted to the
main model's greedy continuations of the test prompts, their first half (`fit_draft_head`):
drafts are then often right and often wrong, and both paths of verification run.

- greedy tokens through the Engine equal transformers' `generate`, with 1 and 3 drafts per step,
  chunked prefill, a prefix-cache hit, preemption (swap and recompute), tensor parallelism (2
  gloo ranks), requests with log-probs (which draft too: their log-probs equal those without
  drafts) and requests that do not draft (penalties, n > 1 with a penalty, beam search) in the
  same batches;
- the engine's drafts after every step equal the MTP layer run by transformers over the whole
  sequence (so the draft layer's paged cache is right after accepted and refused drafts);
- verification keeps the sampling distribution (the speculative sampling rule): sampled
  requests' second tokens (each verified from a draft) against transformers' marginal (on
  synthetic logits: tests/test_draft_verification.py);
- a real `ksana-llm serve --num-speculative-tokens 2` answers the `openai` client with
  transformers' greedy text (plain and streamed) and counts accepted drafts in /metrics;
- bad settings fail with a ValueError naming the field, and KsanaLLM's YAML keys map to it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

import ksana_llm as kt
from ksana_llm import EngineConfig, GenerationConfig, Model
from ksana_llm.api.core_builder import build_core
from ksana_llm.engine.request import Sequence
from ksana_llm.engine.speculative_steps import SpeculativeSteps
from ksana_llm.yaml_config import parse_engine_config
from tests.deepseek_checkpoint import (
    deepseek_config,
    fit_draft_head,
    greedy_continuations,
    hf_drafts,
    hf_mtp_layer,
    mtp_embedding,
    randomize,
    save_with_mtp,
)
from tests.server_process import ServerProcess

VOCAB = 32
NUM_TOKENS = 24


class Setup:
    def __init__(self, root) -> None:
        torch.manual_seed(0)
        self.hf = DeepseekV3ForCausalLM(deepseek_config(vocab_size=VOCAB)).eval()
        randomize(self.hf)
        self.layer = hf_mtp_layer(self.hf.config)
        self.embed = mtp_embedding(self.hf)  # the depth's own, not the main model's
        gen = torch.Generator().manual_seed(1)
        shared = torch.randint(3, VOCAB, (9,), generator=gen).tolist()
        self.prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 13)]
        self.prompts.append(shared + torch.randint(3, VOCAB, (6,), generator=gen).tolist())
        self.prompts.append(shared + torch.randint(3, VOCAB, (3,), generator=gen).tolist())
        self.expected = greedy_continuations(self.hf, self.prompts, NUM_TOKENS)
        # Fitted to the first half of each continuation only: the second half's drafts are
        # often refused.
        self.head = fit_draft_head(self.hf, self.layer, self.embed, [
            p + e[:NUM_TOKENS // 2] for p, e in zip(self.prompts, self.expected)])
        self.folder = save_with_mtp(self.hf, self.layer, self.embed, self.head,
                                    root / "deepseek_mtp")
        self.model = Model.from_pretrained(self.folder, device="cpu", dtype="float32",
                                           progress=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return Setup(tmp_path_factory.mktemp("spec"))


def _generate(setup: Setup, prompts: list[list[int]], configs=None, then=(), **engine_kwargs):
    """Outputs of `prompts` (then of `then`, once those are done) and the engine's stats."""
    config = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    kwargs = {"block_token_num": 4, "num_device_blocks": 128, **engine_kwargs}
    with kt.Engine(setup.model, generation_config=config, **kwargs) as engine:
        outputs = engine.generate_outputs(prompts, configs) if configs else \
            engine.generate_outputs(prompts)
        if then:
            outputs += engine.generate_outputs(list(then))
        return outputs, engine.stats()


@pytest.mark.parametrize("num_drafts, overlap", [(1, False), (3, False), (2, True)])
def test_greedy_tokens_equal_transformers(setup, num_drafts, overlap):
    """Chunked prefill (split_fuse 8); the last prompt hits the cached prefix of the one before;
    with overlapped output processing too (outputs of accepted drafts deferred a step)."""
    outputs, stats = _generate(setup, setup.prompts[:3], then=setup.prompts[3:],
                               num_speculative_tokens=num_drafts, split_fuse_token_num=8,
                               overlap_output_processing=overlap)
    assert [o.token_ids for o in outputs] == setup.expected
    # Both verification paths ran: drafts accepted and drafts refused.
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.prefix_cache_hit_rate > 0
    assert stats.draft_acceptance_rate == stats.num_accepted_draft_tokens / stats.num_draft_tokens
    # Per position: a draft stands only if those before it did, so the counts never rise; they
    # add up to the accepted drafts; each verifying step had at most num_drafts drafts.
    per_position = stats.num_accepted_draft_tokens_per_position
    assert 1 <= len(per_position) <= num_drafts
    assert sum(per_position) == stats.num_accepted_draft_tokens
    assert list(per_position) == sorted(per_position, reverse=True)
    assert per_position[0] <= stats.num_drafts <= stats.num_draft_tokens <= num_drafts * stats.num_drafts
    assert stats.mean_acceptance_length == 1 + stats.num_accepted_draft_tokens / stats.num_drafts


def test_greedy_tokens_equal_transformers_on_the_triton_backend(setup):
    """Drafting and verification with MLA on the Triton attention kernels and the MoE experts
    grouped (in the interpreter on CPU): transformers' tokens. A model of its own: the runner
    leaves a model's layers on their Triton path."""
    model = Model.from_pretrained(setup.folder, device="cpu", dtype="float32", progress=False)
    config = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    with kt.Engine(model, generation_config=config, block_token_num=4, num_device_blocks=128,
                   num_speculative_tokens=2, split_fuse_token_num=8,
                   attention_backend="triton") as engine:
        outputs = engine.generate_outputs(setup.prompts)
        stats = engine.stats()
    assert [o.token_ids for o in outputs] == setup.expected
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens


def test_nan_left_in_the_latent_and_draft_caches_reaches_no_request(setup):
    """MLA's torch attention reads whole blocks of latents too, and so does the draft layer:
    blocks full of NaN (what an overflowing request could leave) are cleared as they are handed
    out, in every cache (tests/test_stale_kv.py: the plain attention's). Stale draft KV would
    not change the tokens (verification refuses bad drafts), only the drafts: so the drafts
    accepted equal a clean engine's."""
    def run(poisoned: bool):
        config = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
        with kt.Engine(setup.model, generation_config=config, block_token_num=4,
                       num_device_blocks=128, num_speculative_tokens=2,
                       attention_backend="torch") as engine:
            runner = engine._core.runner
            assert runner.draft_kv_caches
            for pair in runner.kv_caches + runner.draft_kv_caches if poisoned else ():
                for cache in pair:
                    cache.fill_(float("nan"))
            outputs = engine.generate_outputs(setup.prompts)
            return [o.token_ids for o in outputs], engine.stats().num_accepted_draft_tokens

    tokens, accepted = run(poisoned=True)
    assert tokens == setup.expected
    assert accepted == run(poisoned=False)[1] > 0


def test_large_batches_pause_drafting(setup):
    """speculative_disable_by_batch_size=3: while three sequences run nobody drafts, yet the
    draft layer keeps its KV cache up, so once two are done the third's drafts are again
    transformers' MTP drafts over its whole sequence; every token is transformers'."""
    config = EngineConfig(device="cpu", dtype="float32", block_token_num=4, num_device_blocks=64,
                          num_speculative_tokens=2, speculative_disable_by_batch_size=3)
    core = build_core(setup.model, config, setup.model.tokenizer, lambda message: None)
    seqs = [Sequence(str(i), list(p), GenerationConfig(max_new_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(setup.prompts, (12, 12, 20)))]
    for seq in seqs:
        core.add(seq)
    checked = 0
    while core.has_work():
        core.step()
        if len(core.scheduler.running) >= 3:
            assert not any(seq.draft_token_ids for seq in seqs)
        elif seqs[2].draft_token_ids:
            assert seqs[2].draft_token_ids == hf_drafts(setup.hf, setup.layer, setup.embed,
                                                        setup.head, seqs[2].token_ids,
                                                        len(seqs[2].draft_token_ids))
            checked += 1
    assert [s.output_token_ids for s in seqs] == [e[:n] for e, n in
                                                  zip(setup.expected, (12, 12, 20))]
    assert checked >= 2 and core.num_accepted_draft_tokens > 0


@pytest.mark.parametrize("preempt_mode", [0, 1])
def test_greedy_tokens_survive_preemption(setup, preempt_mode):
    """A KV pool too small for every sequence at once: sequences are swapped out or recomputed
    (the draft cache is swapped too); a greedy request with two sequences forks and shares its
    prompt's last block while drafting. Outputs stay transformers'."""
    plain = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    twice = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True, num_return_sequences=2)
    outputs, stats = _generate(setup, setup.prompts, [twice, plain, plain, plain],
                               num_speculative_tokens=3, num_device_blocks=20,
                               preempt_mode=preempt_mode)
    assert stats.num_preemptions > 0
    assert [o.token_ids for o in outputs] == setup.expected
    assert [s.token_ids for s in outputs[0].sequences] == [setup.expected[0]] * 2
    assert stats.num_accepted_draft_tokens > 0


def test_drafting_engine_decodes_from_imported_kv(setup):
    """Prefill/decode disaggregation with drafts: the exported KV carries the MTP layer's cache
    too, so the decode engine (another block size) drafts exactly as if it had computed the
    prompt itself: same tokens as transformers, same drafts accepted as a local run."""
    config = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    local, local_stats = _generate(setup, setup.prompts[:2], num_speculative_tokens=1)
    with kt.Engine(setup.model, num_speculative_tokens=1, block_token_num=4,
                   num_device_blocks=64) as prefill, \
            kt.Engine(setup.model, num_speculative_tokens=1, block_token_num=8,
                      num_device_blocks=64) as decode:
        outputs = []
        for prompt in setup.prompts[:2]:
            kv = prefill.submit(kt.Request(prompt, generation_config=config.replace(
                max_new_tokens=1), export_kv=True)).result().exported_kv
            assert len(kv.tensors) == 2 * (setup.model.module.num_layers + 1)  # + the MTP layer
            outputs.append(decode.submit(kt.Request(prompt, generation_config=config,
                                                    imported_kv=kv)).result())
            # The decode engine's cache holds the imported rows, the MTP layer's included, and
            # computes the last prompt row of the main layers as the prefill engine did (the MTP
            # layer's last row needs the token after the prompt: neither engine has it yet).
            again = decode.submit(kt.Request(prompt, generation_config=config.replace(
                max_new_tokens=1), imported_kv=kv, export_kv=True)).result().exported_kv
            for mine, theirs in zip(again.tensors, kv.tensors):
                assert torch.equal(mine[:-1], theirs[:-1])
            num_main = 2 * setup.model.module.num_layers
            for mine, theirs in zip(again.tensors[:num_main], kv.tensors[:num_main]):
                torch.testing.assert_close(mine[-1], theirs[-1], rtol=1e-4, atol=1e-5)
        stats = decode.stats()
    assert [o.token_ids for o in outputs] == setup.expected[:2] == [o.token_ids for o in local]
    assert stats.num_imported_kv_tokens == 2 * sum(len(p) - 1 for p in setup.prompts[:2])
    assert (stats.num_draft_tokens, stats.num_accepted_draft_tokens) == (
        local_stats.num_draft_tokens, local_stats.num_accepted_draft_tokens)


def test_stops_among_accepted_drafts(setup, monkeypatch):
    """A stop token can be one of a step's accepted drafts: the tokens after it are dropped, as
    without drafts. (Several requests, each stopping at a different token of the same greedy
    continuation; a spy checks that some stop fell before a step's last token.)"""
    cut_short = []
    verify = SpeculativeSteps._verify

    def spy(self, seqs, slices, *args, **kwargs):
        before = [len(seq.output_token_ids) for seq in seqs]
        outputs, accepted = verify(self, seqs, slices, *args, **kwargs)
        cut_short.extend(seq.finish_reason is not None
                         and len(seq.output_token_ids) - n < accepted[seq] + 1
                         for seq, n in zip(seqs, before))
        return outputs, accepted

    monkeypatch.setattr(SpeculativeSteps, "_verify", spy)
    continuation = setup.expected[0]
    stops = list(dict.fromkeys(continuation[2:12]))
    configs = [GenerationConfig(max_new_tokens=NUM_TOKENS, stop_token_ids=[stop])
               for stop in stops]
    outputs, _ = _generate(setup, [setup.prompts[0]] * len(stops), configs,
                           num_speculative_tokens=3)
    for stop, output in zip(stops, outputs):
        assert output.token_ids == continuation[:continuation.index(stop) + 1]
        assert (output.finish_reason, output.stop_reason) == ("stop", stop)
    assert any(cut_short)


def test_requests_that_do_not_draft_share_the_batch(setup):
    """Penalties, parallel samples with a penalty and beam search decode one token per step next
    to drafting requests (greedy, and greedy with log-probs): the greedy ones still equal
    transformers, the others equal the same requests without speculative decoding, and the
    log-probs of drafted tokens equal those computed one token at a time."""
    plain = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    configs = [plain, GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2),
               GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True,
                                repetition_penalty=1.3),
               GenerationConfig(max_new_tokens=8, ignore_eos=True, num_beams=2),
               GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True, do_sample=True,
                                seed=3, num_return_sequences=2, presence_penalty=0.5)]
    prompts = setup.prompts[:2] + setup.prompts[:3]
    with_drafts, stats = _generate(setup, prompts, configs, num_speculative_tokens=2)
    without, _ = _generate(setup, prompts, configs)
    assert [o.token_ids for o in with_drafts[:2]] == setup.expected[:2]
    assert stats.num_accepted_draft_tokens > 0
    for ours, reference in zip(with_drafts[2:], without[2:]):
        assert [s.token_ids for s in ours.sequences] == [s.token_ids for s in reference.sequences]
    # The log-prob request drafts as well (alone, it has drafts accepted).
    _, alone = _generate(setup, prompts[1:2], configs[1:2], num_speculative_tokens=2)
    assert alone.num_accepted_draft_tokens > 0
    ours, reference = with_drafts[1].logprobs, without[1].logprobs
    assert len(ours) == len(reference) == NUM_TOKENS
    for entry, expected in zip(ours, reference):
        assert entry["token_id"] == expected["token_id"]
        assert entry["logprob"] == pytest.approx(expected["logprob"], abs=1e-4)
        assert list(entry["top_logprobs"]) == list(expected["top_logprobs"])
        assert list(entry["top_logprobs"].values()) == pytest.approx(
            list(expected["top_logprobs"].values()), abs=1e-4)


def test_tensor_parallel_drafts(setup):
    """Two gloo ranks: the draft layer (MLA heads and experts split like the main layers) runs
    on both, and greedy outputs stay transformers'."""
    model = Model.from_pretrained(setup.folder, device="cpu", dtype="float32", progress=False,
                                  tensor_parallel_size=2)
    config = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    with kt.Engine(model, generation_config=config, block_token_num=4, num_device_blocks=128,
                   num_speculative_tokens=2) as engine:
        outputs = engine.generate_outputs(setup.prompts)
        stats = engine.stats()
    assert [o.token_ids for o in outputs] == setup.expected
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_drafts_equal_transformers_mtp(setup, num_drafts):
    """After every step, the sequence's drafts are what transformers' MTP layer gives over the
    whole sequence so far (main hidden states, shifted tokens; chained drafts one row on)."""
    config = EngineConfig(device="cpu", dtype="float32", block_token_num=4, num_device_blocks=64,
                          num_speculative_tokens=num_drafts, max_step_tokens=8)
    core = build_core(setup.model, config, setup.model.tokenizer, lambda message: None)
    prompt = setup.prompts[1]
    seq = Sequence("s", list(prompt), GenerationConfig(max_new_tokens=16, ignore_eos=True))
    core.add(seq)
    checked = 0
    while core.has_work():
        core.step()
        if seq.draft_token_ids:
            assert seq.draft_token_ids == hf_drafts(setup.hf, setup.layer, setup.embed,
                                                    setup.head, seq.token_ids,
                                                    len(seq.draft_token_ids))
            checked += 1
    assert seq.output_token_ids == setup.expected[1][:16]
    assert checked >= 3 and core.num_accepted_draft_tokens > 0


def test_sampled_tokens_keep_their_distribution(setup):
    """2,048 sampled requests for one prompt through the engine: each one's second token comes
    from verifying a draft, and their histogram matches transformers' marginal
    sum_t1 p(t1) p(t2 | t1). Temperature 0.05 makes the tiny model's flat distributions peaky
    enough that drafts are accepted about two times in three and a wrong rule shows: measured
    total variation 0.02 here (0.03 without drafts, sampling noise); 0.28 when every draft is
    accepted, 0.12 when a refusal resamples from p instead of p without the draft."""
    prompt, num, temperature = setup.prompts[1], 2048, 0.05
    with torch.no_grad():
        first = (setup.hf(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)
        batch = torch.tensor([prompt + [t] for t in range(VOCAB)])
        second = (setup.hf(batch).logits[:, -1] / temperature).softmax(-1)
    marginal = first @ second
    # max_new_tokens 3: after the first token there is room for a draft of the second.
    config = GenerationConfig(max_new_tokens=3, ignore_eos=True, do_sample=True,
                              temperature=temperature)
    outputs, stats = _generate(setup, [prompt] * num, [config] * num, num_speculative_tokens=1,
                               num_device_blocks=4096, seed=0)
    assert stats.num_draft_tokens >= num and stats.num_accepted_draft_tokens > num // 3
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outputs]), minlength=VOCAB)
    assert (counts / num - marginal).abs().sum() / 2 < 0.06


def test_server_serves_drafted_tokens(default_model_dir, tmp_path):
    """`ksana-llm serve --num-speculative-tokens 2` on a tiny DeepSeek with SmolLM2's tokenizer,
    driven by the `openai` client: plain and streamed greedy completions are transformers' text,
    and /metrics counts the accepted drafts."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(deepseek_config(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)).eval()
    randomize(hf)
    layer, embed = hf_mtp_layer(hf.config), mtp_embedding(hf)
    prompt = tokenizer("The capital of France is")["input_ids"]
    expected = greedy_continuations(hf, [prompt], NUM_TOKENS)[0]
    head = fit_draft_head(hf, layer, embed, [prompt + expected])
    folder = save_with_mtp(hf, layer, embed, head, tmp_path / "deepseek-chat")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_dir) / name, folder / name)
    server = ServerProcess(["--model", str(folder), "--served-model-name", "tiny",
                            "--dtype", "float32", "--num-speculative-tokens", "2"])
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                               timeout=120)
        request = {"model": "tiny", "prompt": "The capital of France is",
                   "max_tokens": NUM_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
        text = client.completions.create(**request).choices[0].text
        streamed = "".join(chunk.choices[0].text for chunk in
                           client.completions.create(**request, stream=True))
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
    finally:
        server.stop()
    assert text == streamed == tokenizer.decode(expected)
    accepted = [line for line in metrics.splitlines()
                if line.startswith("ksana_llm:spec_decode_num_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) > 0


# ---- configuration ----------------------------------------------------------------------------

def test_bad_settings_name_the_field():
    smol = Model.from_pretrained(None, device="cpu", dtype="float32", progress=False)
    with pytest.raises(ValueError, match="num_speculative_tokens.*no draft"):
        kt.Engine(smol, num_speculative_tokens=1, num_device_blocks=16)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(num_speculative_tokens=1, async_scheduling=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig(num_speculative_tokens=1, pipeline_parallel_size=2)


def test_yaml_keys():
    section = {"setting": {"batch_scheduler": {"enable_speculative_decoding": True,
                                               "mtp_step_num": 2}}}
    assert parse_engine_config(section)[0].num_speculative_tokens == 2
    section["setting"]["batch_scheduler"]["enable_speculative_decoding"] = False
    assert parse_engine_config(section)[0].num_speculative_tokens == 0
    del section["setting"]["batch_scheduler"]["mtp_step_num"]
    section["setting"]["batch_scheduler"]["enable_speculative_decoding"] = True
    assert parse_engine_config(section)[0].num_speculative_tokens == 1
    section["setting"]["batch_scheduler"]["mtp_step_num"] = "two"
    with pytest.raises(ValueError, match="mtp_step_num"):
        parse_engine_config(section)
