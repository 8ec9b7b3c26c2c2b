"""`POST /pooling` (vLLM's pooling API): one pooled output per input, in one call for either
kind of model. Its `task` picks the output, else the model's own: a sequence-classification
model's class probabilities (as `/classify` gives them), any other model's embedding (as
`/v1/embeddings` gives it). The per-token tasks give one row per prompt token: "token_embed"
every position's embedding, "token_classify" every position's class probabilities. The
classify tasks on a language model are a 400, as on /classify.
"""

from __future__ import annotations

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ksana_llm.server.classification import checked_classifier, classify_prompts, classify_tokens
from ksana_llm.server.classification_protocol import ClassificationUsage
from ksana_llm.server.embeddings import (check_dimensions, embed_prompts, embed_tokens,
                                        encode_vector, pooling_inputs)
from ksana_llm.server.errors import bad_request
from ksana_llm.server.pooling_protocol import PoolingData, PoolingRequest, PoolingResponse
from ksana_llm.server.state import server_state
from ksana_llm.server.submission import CLIENT_CLOSED_REQUEST, parse_body

router = APIRouter()


@router.post("/pooling")
async def create_pooling(request: Request) -> JSONResponse:
    state = server_state(request)
    req = await parse_body(request, PoolingRequest)
    lora = state.check_model(req.model)
    task = req.task or ("classify" if state.engine.model.classifier is not None else "embed")
    if task in ("classify", "token_classify"):
        checked_classifier(state, "classification")
        for field in ("dimensions", "normalize"):
            if field in req.model_fields_set:
                raise bad_request(f"`{field}` applies to the embed tasks, not {task}.",
                                  param=field)
    else:
        check_dimensions(req.dimensions, state)
    prompts = pooling_inputs(req, state)
    if task == "classify":
        outputs = await classify_prompts(state, prompts, request, lora, priority=req.priority)
        pooled = None if outputs is None else [torch.tensor(out.probs) for out in outputs]
    elif task == "token_classify":
        pooled = await classify_tokens(state, prompts, request, lora, priority=req.priority)
    elif task == "token_embed":
        pooled = await embed_tokens(state, prompts, request, lora, priority=req.priority,
                                    normalize=req.normalize)
    else:
        pooled = await embed_prompts(state, prompts, request, lora, priority=req.priority,
                                     normalize=req.normalize)
    if pooled is None:  # the client left; its requests were aborted
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
    data = [PoolingData(index=i, data=encode_vector(vector, req.encoding_format))
            for i, vector in enumerate(pooled)]
    tokens = sum(map(len, prompts))
    response = PoolingResponse(model=state.response_model(req.model), data=data,
                               usage=ClassificationUsage(prompt_tokens=tokens,
                                                         total_tokens=tokens))
    return JSONResponse(response.model_dump())
