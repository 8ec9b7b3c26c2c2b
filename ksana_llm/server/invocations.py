"""`POST /invocations`: SageMaker's one inference route (vLLM serves it too), picking the API
from the body's shape: `messages` is a chat completion, `prompt` (or `prompt_embeds`) a
completion, `input` an embedding (a classification, `/classify`, with a classification model),
`text_1` a score (`/score`) and `documents` a rerank. The chosen route answers as it would on its own path (streams, errors, metrics and
all); a body with none of those keys, or more than one, is a 400 naming them.
"""

from __future__ import annotations


from fastapi import APIRouter, Request
from fastapi.responses import Response

from ksana_llm.server.classification import create_classifications
from ksana_llm.server.embeddings import create_embeddings
from ksana_llm.server.errors import bad_request, malformed_json
from ksana_llm.server.json_body import load_json
from ksana_llm.server.openai_routes import create_chat_completion, create_completion
from ksana_llm.server.scores import create_scores, rerank
from ksana_llm.server.state import server_state

router = APIRouter()

# Each API by the keys only its requests carry.
_ROUTES = {"messages": create_chat_completion, "prompt": create_completion,
           "prompt_embeds": create_completion, "input": create_embeddings,
           "text_1": create_scores, "documents": rerank}


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    try:
        # The route parses the body again: Starlette keeps it, so it is read from the client once.
        body = load_json(await request.body())
    except (ValueError, RecursionError) as exc:  # the same 400 as every route's
        raise malformed_json(exc) from exc
    keys = [key for key in _ROUTES if isinstance(body, dict) and key in body]
    routes = {_ROUTES[key] for key in keys}
    if len(routes) != 1:
        raise bad_request("An /invocations body needs exactly one of `messages` (a chat "
                          "completion), `prompt` or `prompt_embeds` (a completion), `input` "
                          "(embeddings), `text_1` (scores) or `documents` (a rerank).",
                          param=keys[-1] if keys else "messages")
    route = routes.pop()
    if route is create_embeddings and server_state(request).engine.model.classifier is not None:
        route = create_classifications  # vLLM: `input` goes to the task the model serves
    return await route(request)
