"""`POST /classify` (vLLM's classification API; also `/v1/classify`): a `*ForSequenceClassification`
model's class probabilities for each input, `Engine.classify`'s (`api.classification`): the
`score` head on the input's last-token state, computed as an embedding is. A language model has
no classes to give: a 400, as vLLM answers a model that does not classify.
"""

from __future__ import annotations

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ksana_llm.api.classification import ClassificationOutput, classification_from_hidden
from ksana_llm.models.sequence_classification import ClassifierHead
from ksana_llm.server.classification_protocol import (ClassificationData, ClassificationRequest,
                                                      ClassificationResponse,
                                                      ClassificationUsage)
from ksana_llm.server.embeddings import final_hidden_states, pooling_inputs
from ksana_llm.server.errors import bad_request
from ksana_llm.server.state import ServerState, server_state
from ksana_llm.server.submission import CLIENT_CLOSED_REQUEST, parse_body

router = APIRouter()


def checked_classifier(state: ServerState, api: str) -> ClassifierHead:
    """The served model's classification head; a 400 for a language model."""
    head = state.engine.model.classifier
    if head is None:
        raise bad_request(f"This model is a language model and does not support the {api} "
                          "API; serve a *ForSequenceClassification model.", param="model",
                          code="model_not_supported")
    return head


async def classify_prompts(state: ServerState, prompts: list[list[int]], request: Request,
                           lora: str | None, fields: list[str] | None = None,
                           priority: int = 0) -> list[ClassificationOutput] | None:
    """Each prompt's classification, in order; None when the client left first. As
    `final_hidden_states` (errors naming `fields[i]`)."""
    head = checked_classifier(state, "classification")
    states = await final_hidden_states(state, prompts, request, lora, fields, priority)
    if states is None:
        return None
    return [classification_from_hidden(head, hidden, len(prompt))
            for hidden, prompt in zip(states, prompts)]


async def classify_tokens(state: ServerState, prompts: list[list[int]], request: Request,
                          lora: str | None, priority: int = 0) -> list[torch.Tensor] | None:
    """Each prompt's per-token class probabilities [tokens, classes] (vLLM's token_classify:
    the head and its activation at every position), in order; None when the client left."""
    head = checked_classifier(state, "token classification")
    states = await final_hidden_states(state, prompts, request, lora, priority=priority,
                                       every_token=True)
    if states is None:
        return None
    return [head.probabilities(head.logits(rows)) for rows in states]


@router.post("/classify")
@router.post("/v1/classify")
async def create_classifications(request: Request) -> JSONResponse:
    state = server_state(request)
    req = await parse_body(request, ClassificationRequest)
    lora = state.check_model(req.model)
    checked_classifier(state, "classification")
    prompts = pooling_inputs(req, state)
    outputs = await classify_prompts(state, prompts, request, lora, priority=req.priority)
    if outputs is None:  # the client left; its requests were aborted
        return JSONResponse({}, status_code=CLIENT_CLOSED_REQUEST)
    data = [ClassificationData(index=i, label=out.label, probs=out.probs,
                               num_classes=out.num_classes) for i, out in enumerate(outputs)]
    tokens = sum(map(len, prompts))
    response = ClassificationResponse(
        model=state.response_model(req.model), data=data,
        usage=ClassificationUsage(prompt_tokens=tokens, total_tokens=tokens))
    return JSONResponse(response.model_dump())
