"""A path no route matches is OpenAI's 404 "Invalid URL" naming it (gateway/api/openai_errors.py),
answered where routing found nothing: a route added by any controller, wherever it is declared,
always wins over it."""

from __future__ import annotations

from litestar import Controller, Litestar, get, post
from litestar.exceptions import NotFoundException
from litestar.params import FromPath
from litestar.testing import TestClient

from gateway.api.openai_errors import EXCEPTION_HANDLERS


class Embeddings(Controller):
    path = "/v1"

    @post("/embeddings", status_code=200)
    async def embeddings(self) -> dict[str, str]:
        return {"object": "list"}

    @get("/models/{model_id:str}")
    async def model(self, model_id: FromPath[str]) -> dict[str, str]:
        raise NotFoundException(f"no model {model_id}")  # a handler's own 404 stays its own


@post("/v1/responses", status_code=200)  # as another package would add it
async def responses() -> dict[str, str]:
    return {"object": "response"}


def _client() -> TestClient[Litestar]:
    return TestClient(Litestar([Embeddings, responses], exception_handlers=EXCEPTION_HANDLERS))


def test_registered_routes_answer_and_only_unmatched_paths_are_invalid_urls() -> None:
    with _client() as client:
        assert client.post("/v1/responses").json() == {"object": "response"}
        assert client.post("/v1/embeddings").json() == {"object": "list"}
        answer = client.post("/v1/responses/abc/cancel")
        assert answer.status_code == 404
        error = answer.json()["error"]
        assert error == {
            "message": "Invalid URL (POST /v1/responses/abc/cancel): this gateway does not "
            "implement /v1/responses/abc/cancel of the OpenAI API; it implements "
            "/v1/embeddings, /v1/responses",
            "type": "invalid_request_error",
            "param": None,
            "code": "unknown_url",
        }
        own = client.get("/v1/models/x").json()["error"]
        assert (own["message"], own["code"]) == ("no model x", None)
        outside = client.get("/nowhere").json()["error"]
        assert outside["message"] == "Invalid URL (GET /nowhere): no such route on this gateway"
