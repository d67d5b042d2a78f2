"""LoRA adapters loaded and unloaded at run time on an OpenAI-compatible engine, vLLM's way:
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter
{"lora_name"} (vLLM serves both when started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).

vLLM answers a refusal with 400 or 404 and an OpenAI error body whose message says why; the
message is all that tells "already loaded" from "cannot be found" from a bad path, so the
reason (AdapterChangeRefused's) is read from it. Anything else (a 5xx, no answer) is the site
being unavailable.
"""

from __future__ import annotations

import httpx

from gateway.sites.interface import AdapterChangeRefused, SiteUnavailable

_TIMEOUT_S = 120.0  # a load reads the adapter's files at the engine


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)[:300]
    return str(error)[:300]


def _reason(status: int, message: str) -> str:
    lowered = message.lower()
    if "already" in lowered:
        return "exists"
    if status == 404 or "not found" in lowered or "cannot be found" in lowered:
        return "not_found"
    return "invalid"


async def change_adapter(
    http: httpx.AsyncClient, site: str, base_url: str, action: str, body: dict[str, str]
) -> None:
    """Calls /v1/{action}_lora_adapter (action: "load" or "unload"); AdapterChangeRefused when
    the engine refuses (400/404), SiteUnavailable when it cannot be reached or fails."""
    try:
        response = await http.post(
            f"{base_url}/{action}_lora_adapter", json=body, timeout=_TIMEOUT_S
        )
    except httpx.HTTPError as exc:
        raise SiteUnavailable(site, f"{action}_lora_adapter: {exc!r}") from exc
    if response.status_code in (400, 404, 409, 422):
        message = _message(response)
        raise AdapterChangeRefused(site, message, _reason(response.status_code, message))
    if response.status_code != 200:
        raise SiteUnavailable(
            site, f"{action}_lora_adapter answered {response.status_code}: {_message(response)}"
        )


def not_enabled(site: str) -> AdapterChangeRefused:
    return AdapterChangeRefused(
        site,
        "run-time LoRA loading is not enabled for this site (the federation file's dynamic_lora)",
        "unsupported",
    )
