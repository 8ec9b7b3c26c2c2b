"""How close our float32 numbers on SmolLM2 must come to a reference on the same weights.

Measured on SmolLM2-135M-Instruct (30 layers, float32, a 2-core Xeon VM): transformers against
itself, the prompt cut at 1 to 20 tokens, differs by up to 7e-5 on the logits (MKL's GEMM rounds
a row differently at another row count); our prepacked oneDNN weights against transformers' MKL
matmuls by 1.2e-4; a row of ours moves the same way with the rows it shares a step with. Which of
those a test meets changes from run to run (how concurrent requests fall into steps), so a
tighter bound fails at random. A real error -- a wrong position, mask, cache block or weight --
moves the logits by more than 1e-2.
"""

# Logits and log-probs (absolute).
LOGIT_ATOL = 5e-4
# Pooled, L2-normalised embedding vectors (components ~0.04): the same rounding, normalised.
EMBEDDING_ATOL = 2e-5
