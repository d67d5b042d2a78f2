"""Driving an engine by hand in tests: add requests, step until nothing is left, collect tokens."""

from __future__ import annotations

from site_engine.engine.core.api import Engine, EngineRequest


def generate_all(engine: Engine, requests: list[EngineRequest]) -> dict[str, list[int]]:
    """Every request's generated token ids, by request id, once the engine has finished them."""
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    return tokens
