"""Tiny Llama / Qwen2 / Qwen3 GGUF files written with gguf.GGUFWriter (quantized with gguf-py), and a
reference transformers model built from gguf-py's own dequantize of the same tensors, independent of
transformers' GGUF reader (tests/test_gguf_files.py)."""
from __future__ import annotations
import numpy as np, torch, gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize, dequantize

HIDDEN, HEADS, KV, HD, INTER, LAYERS = 256, 4, 2, 64, 512, 2
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b); cs.append(256 + n); n += 1
    return dict(zip(bs, [chr(c) for c in cs]))

def vocab():
    b2u = bytes_to_unicode()
    toks = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [b2u[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n"]
    for m in merges:
        toks.append(m.replace(" ", ""))
    types = [3, 3, 3] + [1] * (len(toks) - 3)
    return toks, merges, types

# Byte offsets of the f16 super-block scales (d, dmin) in each K-quant block.
K_LAYOUT = {T.Q2_K: (84, [80, 82]), T.Q3_K: (110, [108]), T.Q4_K: (144, [0, 2]),
            T.Q5_K: (176, [0, 2]), T.Q6_K: (210, [208])}

def make_raw(shape, qtype, rng, target=0.08):
    """Quantized bytes for a float matrix `shape` (rows, cols)."""
    rows, cols = shape
    if qtype in K_LAYOUT:
        bsz, offs = K_LAYOUT[qtype]
        nblk = rows * cols // 256
        raw = rng.integers(0, 256, size=(nblk, bsz), dtype=np.uint8)
        def set_scale(v):
            for o in offs:
                raw[:, o:o + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)
        set_scale(1.0)
        m = np.abs(dequantize(raw.reshape(rows, -1), qtype)).max()
        set_scale(target / m)
        return raw.reshape(rows, -1)
    x = (rng.standard_normal(shape) * target / 3).astype(np.float32)
    if qtype == T.F32:
        return x
    if qtype == T.F16:
        return x.astype(np.float16)
    return quantize(x, qtype)

def build(path, arch="llama", qtype=T.Q4_0, tied=True, rope_theta=50000.0, eps=1e-5, seed=0,
          embd_qtype=None, ctx=512, extra=None, head_dim=HD, skip=(), eos_token_id=2):
    """`head_dim`: the attention heads' size (stated as key_length where it is not hidden /
    heads, as llama.cpp writes it); `skip`: tensor names left out of the file;
    `eos_token_id`: one past the vocabulary makes a tokenizer transformers cannot build."""
    rng = np.random.default_rng(seed)
    toks, merges, types = vocab()
    V = len(toks)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-" + arch)
    w.add_context_length(ctx); w.add_embedding_length(HIDDEN); w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER); w.add_head_count(HEADS); w.add_head_count_kv(KV)
    w.add_rope_dimension_count(head_dim); w.add_rope_freq_base(rope_theta)
    # Qwen3's reader takes head_dim from here (and transformers' did not)
    if arch == "qwen3" or head_dim != HIDDEN // HEADS:
        w.add_key_length(head_dim); w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(eps); w.add_vocab_size(V); w.add_file_type(1)
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default")
    w.add_token_list(toks); w.add_token_types(types); w.add_token_merges(merges)
    w.add_bos_token_id(1); w.add_eos_token_id(eos_token_id); w.add_unk_token_id(0); w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    stored = {}
    def add(name, shape, q):
        if name in skip:
            return
        raw = make_raw(shape, q, rng) if len(shape) == 2 else (rng.standard_normal(shape) * 0.05 + (1.0 if name.endswith("norm.weight") else 0.0)).astype(np.float32)
        if len(shape) == 2 and q not in (T.F32, T.F16):
            w.add_tensor(name, raw, raw_dtype=q)
        else:
            w.add_tensor(name, raw)
        deq = dequantize(raw, q if len(shape) == 2 else T.F32).astype(np.float32).reshape(shape)
        stored[name] = deq
    add("token_embd.weight", (V, HIDDEN), embd_qtype or qtype)
    for i in range(LAYERS):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (HIDDEN,), T.F32)
        add(p + "attn_q.weight", (HEADS * head_dim, HIDDEN), qtype)
        add(p + "attn_k.weight", (KV * head_dim, HIDDEN), qtype)
        add(p + "attn_v.weight", (KV * head_dim, HIDDEN), qtype)
        if arch == "qwen2":
            add(p + "attn_q.bias", (HEADS * head_dim,), T.F32)
            add(p + "attn_k.bias", (KV * head_dim,), T.F32)
            add(p + "attn_v.bias", (KV * head_dim,), T.F32)
        if arch == "qwen3":
            add(p + "attn_q_norm.weight", (head_dim,), T.F32)
            add(p + "attn_k_norm.weight", (head_dim,), T.F32)
        add(p + "attn_output.weight", (HIDDEN, HEADS * head_dim), qtype)
        add(p + "ffn_norm.weight", (HIDDEN,), T.F32)
        add(p + "ffn_gate.weight", (INTER, HIDDEN), qtype)
        add(p + "ffn_up.weight", (INTER, HIDDEN), qtype)
        add(p + "ffn_down.weight", (HIDDEN, INTER), qtype)
    add("output_norm.weight", (HIDDEN,), T.F32)
    if not tied:
        add("output.weight", (V, HIDDEN), qtype)
    if extra is not None:
        extra(w)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return stored, V

def unpermute(wt, n_head):
    return wt.reshape(n_head, wt.shape[0] // n_head // 2, 2, *wt.shape[1:]).swapaxes(1, 2).reshape(wt.shape)

SUB = {'attn_norm': 'input_layernorm', 'ffn_norm': 'post_attention_layernorm', 'attn_q': 'self_attn.q_proj',
       'attn_k': 'self_attn.k_proj', 'attn_v': 'self_attn.v_proj', 'attn_output': 'self_attn.o_proj',
       'ffn_gate': 'mlp.gate_proj', 'ffn_up': 'mlp.up_proj', 'ffn_down': 'mlp.down_proj',
       'attn_q_norm': 'self_attn.q_norm', 'attn_k_norm': 'self_attn.k_norm'}

def reference_model(stored, V, arch, tied, rope_theta, eps, ctx=512, head_dim=HD):
    """A transformers model built from gguf-py's dequantized tensors (the llama.cpp q/k
    permutation undone for llama), config stated by hand."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)
    kw = dict(vocab_size=V, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV, rms_norm_eps=eps,
              max_position_embeddings=ctx, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
              rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    cfg = config_class(**kw) if arch == "qwen2" else config_class(head_dim=head_dim, **kw)
    cfg.head_dim = head_dim  # (Qwen2's config has no such argument; its model reads it)
    model = model_class(cfg).float().eval()
    sd = {}
    for name, t in stored.items():
        base, suf = name.rsplit(".", 1)
        if arch == "llama" and ".attn_q." in name: t = unpermute(t, HEADS)
        if arch == "llama" and ".attn_k." in name: t = unpermute(t, KV)
        if base == "token_embd": hf = "model.embed_tokens"
        elif base == "output_norm": hf = "model.norm"
        elif base == "output": hf = "lm_head"
        else:
            _, i, s = base.split(".", 2); hf = f"model.layers.{i}.{SUB[s]}"
        sd[hf + "." + suf] = torch.from_numpy(np.ascontiguousarray(t))
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"}, missing
    model.tie_weights() if tied else None
    return model
