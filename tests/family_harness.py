"""Shared parity checks for a model family against a reference (transformers, or an explicit torch
model): logits through the paged KV cache at prefill (whole and chunked) and at each of 16 decode
steps, a prefix-cache hit inside a mixed batch, and greedy tokens through the real `Engine` with
chunked prefill and a prefix-cache hit.

A reference is any callable `ids -> logits [len(ids), vocab]` (float32), so families without a
transformers class can pass a hand-written torch forward.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.engine.kv_cache import BlockManager
from ksana_llm.engine.request import Sequence
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.model_runner import ModelRunner, SeqSlice, StepInput


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run transformers' references single-threaded: generate launches thousands of small ops,
    and on a busy 2-core machine two torch threads wait for each other at every one of them (10x
    slower, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


ATOL = 2e-4
RTOL = 1e-4
NUM_DECODE = 16

Reference = Callable[[list[int]], torch.Tensor]


def hf_reference(hf_model: torch.nn.Module) -> Reference:
    """Full-sequence logits of a transformers causal LM (no cache: the plainest possible path)."""
    def logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf_model(torch.tensor([ids])).logits[0].float()
    return logits


def spread_weights(model: torch.nn.Module, *, norm_std: float = 0.5, bias_std: float = 0.1,
                   qk_std: float | None = None) -> torch.nn.Module:
    """Move a random model's norm weights (about 1) and biases (about 0) off their initial
    values, and with `qk_std` widen its q/k projections (scores big enough for positions to
    matter), so that a lost norm, bias or rotation moves the logits. Returns it in eval mode."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, bias_std)
            elif "norm" in name:
                param.normal_(1.0, norm_std)
            elif qk_std is not None and name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0, qk_std)
    return model.eval()


def save_each(tmp_path_factory: Any, builders: Mapping[str, Callable[[], torch.nn.Module]],
              **spread: float) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Each builder's transformers model (seed 0, weights moved off their init by
    `spread_weights(**spread)`), saved in a folder of its own: name -> (model, folder)."""
    out = {}
    for name, build in builders.items():
        torch.manual_seed(0)
        model = spread_weights(build(), **spread)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (model, folder)
    return out


def write_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor], fmt: str) -> Path:
    """A checkpoint folder written by hand (families transformers has no class for): config.json
    plus the tensors as model.safetensors or pytorch_model.bin."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        safetensors.torch.save_file(tensors, str(folder / "model.safetensors"))
    else:
        torch.save(tensors, folder / "pytorch_model.bin")
    return folder


def save_both_formats(hf_model: torch.nn.Module, root: Path) -> dict[str, Path]:
    """The same weights as a safetensors folder and as a pytorch_model.bin folder.

    transformers 5 writes safetensors even when asked for .bin, so the .bin folder is made by
    re-saving the tensors with torch.save, as old checkpoints were."""
    folders = {"safetensors": root / "safetensors", "bin": root / "bin"}
    for folder in folders.values():
        hf_model.save_pretrained(folder)
    bin_folder = folders["bin"]
    state = safetensors.torch.load_file(bin_folder / "model.safetensors")
    torch.save(state, bin_folder / "pytorch_model.bin")
    (bin_folder / "model.safetensors").unlink()
    assert not list(bin_folder.glob("*.safetensors*"))
    return folders


def load_ours(folder: Path, dtype: str = "float32") -> torch.nn.Module:
    return Model.from_pretrained(folder, device="cpu", dtype=dtype, progress=False).module


def greedy_trace(reference: Reference, prompt: list[int], steps: int
                 ) -> tuple[list[int], torch.Tensor]:
    """Prompt + greedy continuation, and the reference logits at every position."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(reference(ids)[-1].argmax()))
    return ids, reference(ids)


class PagedDriver:
    """Feeds sequences through ModelRunner by hand, so a test controls every chunk."""

    attention_backend = "auto"  # the torch backend on CPU

    def __init__(self, module: torch.nn.Module, block_size: int = 4, num_blocks: int = 128,
                 dtype: torch.dtype = torch.float32) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.runner = ModelRunner(module, device=torch.device("cpu"), dtype=dtype,
                                  num_blocks=num_blocks, block_size=block_size,
                                  attention_backend=self.attention_backend)

    def new_seq(self, tokens: list[int], name: str = "s") -> Sequence:
        return Sequence(name, list(tokens), GenerationConfig())

    def step(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """Compute `n` more tokens of each sequence in one batch; logits of the last ones."""
        slices = []
        for seq, n in work:
            if not seq.block_table:
                prefix = self.bm.match_prefix(seq)
                assert self.bm.allocate(seq, n, prefix)
                seq.num_computed_tokens = prefix.num_tokens
            else:
                assert self.bm.allocate(seq, n)
            start = seq.num_computed_tokens
            slices.append(SeqSlice(seq.tokens_slice(start, start + n), start, seq.block_table, True))
        result = self.runner.execute(StepInput(slices, [], []))
        for seq, n in work:
            seq.num_computed_tokens += n
            self.bm.cache_full_blocks(seq)
        return result.logits


class TritonDriver(PagedDriver):
    """The same, through the Triton kernels (in their interpreter on CPU)."""

    attention_backend = "triton"


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def check_prefill_and_decode(module: torch.nn.Module, reference: Reference, *, vocab: int,
                             chunks: list[int] = (40,), seed: int = 1, atol: float = ATOL,
                             driver_class: type[PagedDriver] = PagedDriver) -> None:
    """Prefill a 40-token prompt in `chunks`, then 16 decode steps; logits equal the reference's."""
    torch.manual_seed(seed)
    prompt = torch.randint(3, vocab, (sum(chunks),)).tolist()
    ids, ref = greedy_trace(reference, prompt, NUM_DECODE)
    driver = driver_class(module)
    seq = driver.new_seq(prompt)
    for n in chunks:
        logits = driver.step([(seq, n)])
    _close(logits[0], ref[len(prompt) - 1], f"prefill {list(chunks)}", atol)
    for i in range(NUM_DECODE):
        seq.output_token_ids.append(ids[len(prompt) + i])
        logits = driver.step([(seq, 1)])
        _close(logits[0], ref[len(prompt) + i], f"decode step {i}", atol)


def check_prefix_hit_mixed_batch(module: torch.nn.Module, reference: Reference, *, vocab: int,
                                 seed: int = 2, atol: float = ATOL,
                                 driver_class: type[PagedDriver] = PagedDriver) -> None:
    """One decode, one prefix-cache-hit prefill and one chunked prefill in one batch, then all
    three decode together at different context lengths."""
    torch.manual_seed(seed)
    shared = torch.randint(3, vocab, (24,)).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,)).tolist() for n in (5, 13, 30)]
    traces = [greedy_trace(reference, p, 6) for p in prompts]
    driver = driver_class(module)
    first = driver.new_seq(prompts[0], "a")
    driver.step([(first, len(prompts[0]))])
    seqs = [first] + [driver.new_seq(p, f"s{i}") for i, p in enumerate(prompts[1:])]
    prefix = driver.bm.match_prefix(seqs[1])
    assert prefix.num_tokens == 24 and prefix.block_ids == first.block_table[:6]
    seqs[0].output_token_ids.append(traces[0][0][len(prompts[0])])
    logits = driver.step([(seqs[0], 1), (seqs[1], len(prompts[1]) - 24), (seqs[2], 20)])
    assert seqs[1].num_computed_tokens == len(prompts[1])
    _close(logits[0], traces[0][1][len(prompts[0])], "decode beside prefills", atol)
    _close(logits[1], traces[1][1][len(prompts[1]) - 1], "prefix-hit prefill", atol)
    logits = driver.step([(seqs[2], len(prompts[2]) - seqs[2].num_computed_tokens)])
    _close(logits[0], traces[2][1][len(prompts[2]) - 1], "second prefill chunk", atol)
    for step in range(1, 6):
        for seq, (ids, _) in zip(seqs, traces):
            seq.output_token_ids.append(ids[seq.num_prompt_tokens + len(seq.output_token_ids)])
        logits = driver.step([(s, 1) for s in seqs])
        for row, (seq, (_, ref)) in enumerate(zip(seqs, traces)):
            _close(logits[row], ref[seq.num_tokens - 1], f"batched decode {step}, seq {row}", atol)


def check_engine_greedy(folder: Path, reference: Reference, *, vocab: int, num_tokens: int = 32,
                        seed: int = 3, attention_backend: str = "auto",
                        tensor_parallel_size: int = 1) -> None:
    """32 greedy tokens through the real Engine equal the reference's, for a prompt prefilled in
    chunks and for a second prompt that hits the first one's cached prefix."""
    torch.manual_seed(seed)
    shared = torch.randint(3, vocab, (32,)).tolist()
    prompts = [shared + torch.randint(3, vocab, (8,)).tolist(),
               shared + torch.randint(3, vocab, (11,)).tolist()]
    expected = [greedy_trace(reference, p, num_tokens)[0][len(p):] for p in prompts]
    config = GenerationConfig(max_new_tokens=num_tokens, ignore_eos=True)
    model = Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                  tensor_parallel_size=tensor_parallel_size)
    with kt.Engine(model, generation_config=config, block_token_num=4, num_device_blocks=128,
                   split_fuse_token_num=16, attention_backend=attention_backend) as engine:
        first = engine.generate_outputs([prompts[0]])[0]
        second = engine.generate_outputs([prompts[1]])[0]
        assert engine.stats().prefix_cache_hit_rate > 0, "the second prompt should hit the cache"
    assert first.token_ids == expected[0], "chunked prefill: greedy tokens differ"
    assert second.token_ids == expected[1], "prefix-cache hit: greedy tokens differ"


def check_triton_backend(module: torch.nn.Module, folder: Path, reference: Reference, *,
                         vocab: int, atol: float = ATOL) -> None:
    """The Triton path (its kernels in the interpreter on CPU: attention, and MoE experts
    grouped): logits over a chunked prefill and decode, and greedy tokens through the Engine.
    Run it last on a module: the runner leaves the module's layers on their Triton path."""
    check_prefill_and_decode(module, reference, vocab=vocab, chunks=[16, 16, 8], atol=atol,
                             driver_class=TritonDriver)
    check_engine_greedy(folder, reference, vocab=vocab, attention_backend="triton")


def write_bin_twin(folder: Path, target: Path) -> Path:
    """`folder` (a transformers save: model.safetensors) again as a lone pytorch_model.bin
    (transformers 5 writes no .bin itself), with the same config and other files."""
    shutil.copytree(folder, target, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(safetensors.torch.load_file(folder / "model.safetensors"),
               target / "pytorch_model.bin")
    return target


def check_other_format(first: torch.nn.Module, folder: Path, reference: Reference, *,
                       vocab: int) -> None:
    """The same weights saved in the other format load into exactly the same parameters (so
    every check run on the first load holds for this one), and its logits match too."""
    second = load_ours(folder)
    a, b = dict(first.named_parameters()), dict(second.named_parameters())
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name
    check_prefill_and_decode(second, reference, vocab=vocab, chunks=[16, 16, 8])


def memoized(reference: Reference) -> Reference:
    """The checks replay the same traces (one per chunking); run each reference forward once."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in cache:
            cache[key] = reference(list(ids))
        return cache[key]
    return logits


def check_family(module: torch.nn.Module, folder: Path, reference: Reference, *, vocab: int,
                 atol: float = ATOL) -> None:
    """Every check above, for one loaded model."""
    reference = memoized(reference)
    for chunks in ([40], [16, 16, 8], [1, 39]):
        check_prefill_and_decode(module, reference, vocab=vocab, chunks=chunks, atol=atol)
    check_prefix_hit_mixed_batch(module, reference, vocab=vocab, atol=atol)
    check_engine_greedy(folder, reference, vocab=vocab)
