"""One SiteClient per site of the federation file, of the site's kind."""

from __future__ import annotations

from gateway.federation import FederationConfigError, ModelTask, SiteConfig
from gateway.sites.grpc_client import GrpcSiteClient
from gateway.sites.grpc_generate_stream import ChunkPacer
from gateway.sites.interface import SiteClient
from gateway.sites.openai_client import OpenAISiteClient
from gateway.sites.tls import SiteTls
from gateway.tokenizers import ModelTokenizers


def site_client(
    site: SiteConfig,
    connect_timeout_s: float,
    site_tls: SiteTls | None,
    tokenizers: ModelTokenizers,
    task: ModelTask = "generate",
    pacer: ChunkPacer | None = None,
) -> SiteClient:
    """A client for the site (`task`: its model's); an unreadable API key file stops the start,
    naming the site. `pacer`: the chunk budget this gateway's answers from this project's sites
    share (GATEWAY_STREAM_CHUNKS_PER_S)."""
    if site.kind == "grpc":
        return GrpcSiteClient(
            site.name,
            site.endpoint,
            connect_timeout_s,
            site_tls,
            site.tls_server_name,
            pacer,
        )
    assert site.openai is not None  # the federation file gives every openai site its fields
    try:
        return OpenAISiteClient(
            site.name, site.model, site.openai, tokenizers, connect_timeout_s, task=task
        )
    except ValueError as exc:
        raise FederationConfigError(f"site {site.name!r}: {exc}") from exc
