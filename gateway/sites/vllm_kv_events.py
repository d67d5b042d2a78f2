"""Subscribes to a vLLM engine's KV cache events (ZMQ, `--kv-events-config`), so an `openai` site
of vLLM gets a precise prefix index.

vLLM's publisher sends multipart messages (topic, 8-byte big-endian sequence, msgpack payload) on
a PUB socket, and keeps its last batches (10,000 by default) behind an optional ROUTER socket that
replays from a given sequence. This subscriber:
- subscribes first, then asks the replay socket for everything from sequence 0 up to the first
  live message: a gateway that (re)starts rebuilds what the buffer still holds (whatever it does
  not hold, blocks stored earlier, stays unknown: the index under-claims);
- on a gap in the sequence asks for the missing batches, and when the replay cannot bring them
  all, starts the index over from the next batch (no replay socket: the same);
- takes a sequence going back to 0 for a restarted publisher (its cache started empty).
The translated batches go to the site's prefix index (gateway/routing/prefix/vllm_events.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from gateway.routing.prefix.site_prefix import SitePrefix
from gateway.routing.prefix.vllm_events import MalformedEvents, VllmEventTranslator
from gateway.sites.registry import SiteState

log = logging.getLogger(__name__)
END_OF_REPLAY = -1
_REPLAY_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class KvEventsEndpoints:
    publisher: str  # e.g. tcp://10.0.0.9:5557
    replay: str | None = None  # e.g. tcp://10.0.0.9:5558
    topic: str = ""


class VllmKvEventSubscriber:
    def __init__(
        self,
        site: str,
        prefix: SitePrefix,
        translator: VllmEventTranslator,
        endpoints: KvEventsEndpoints,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self._site = site
        self._prefix = prefix
        self._translator = translator
        self._endpoints = endpoints
        self._context = context or zmq.asyncio.Context.instance()
        self.last_sequence: int | None = None
        self.restarts = 0

    async def run(self) -> None:
        """Follows the publisher until cancelled (ZMQ reconnects by itself)."""
        self._prefix.follow_events()
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._endpoints.topic.encode())
        sub.connect(self._endpoints.publisher)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("site %s: a KV event message of %d parts", self._site, len(frames))
                    continue
                await self.receive(int.from_bytes(frames[1], "big", signed=True), frames[2])
        finally:
            sub.close()

    async def receive(self, sequence: int, payload: bytes) -> None:
        """One live message: replays what came before it when needed, then applies it."""
        last = self.last_sequence
        if last is None:
            self._start_over()
            if not await self._replay(0, sequence):
                self._start_over()
        elif sequence <= last:
            if sequence != 0:
                return  # already applied
            self._start_over()  # the publisher restarted: its cache started empty
        elif sequence > last + 1 and not await self._replay(last + 1, sequence):
            self._start_over()
        self._apply(sequence, payload)

    def _start_over(self) -> None:
        self.restarts += 1
        self._translator.restart()

    def _apply(self, sequence: int, payload: bytes) -> None:
        try:
            batch = self._translator.translate(payload)
        except MalformedEvents as exc:
            log.warning("site %s: KV event batch %d unreadable: %s", self._site, sequence, exc)
            self._start_over()
            return
        self._prefix.apply(batch)
        self.last_sequence = sequence

    async def _replay(self, start: int, until: int) -> bool:
        """Applies batches start..until-1 from the replay socket; False when it cannot bring
        them all (no socket, no answer, or its buffer no longer reaches back to `start`)."""
        if self._endpoints.replay is None or start >= until:
            return start >= until
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._endpoints.replay)
        expected = start
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while expected < until:
                if not await dealer.poll(int(_REPLAY_WAIT_S * 1000)):
                    break
                frames = await dealer.recv_multipart()
                sequence = int.from_bytes(frames[-2], "big", signed=True)
                if sequence == END_OF_REPLAY:
                    break
                if sequence < expected:
                    continue
                if sequence > expected:
                    if expected == 0 and self.last_sequence is None:
                        expected = sequence  # at start-up: what the buffer holds is all there is
                    else:
                        break
                self._apply(sequence, frames[-1])
                expected += 1
        finally:
            dealer.close()
        return expected >= until


async def follow_vllm_events(subscriber: VllmKvEventSubscriber, retry_s: float = 1.0) -> None:
    """Runs the subscriber, starting it over after an error (logged), until cancelled."""
    while True:
        try:
            await subscriber.run()
        except (zmq.ZMQError, OSError) as exc:
            log.warning("KV events: %s; subscribing again", exc)
        await asyncio.sleep(retry_s)


def kv_event_followers(sites: Iterable[SiteState]) -> dict[str, Coroutine[Any, Any, None]]:
    """A background task per `openai` site whose federation entry names vLLM's KV events."""
    followers: dict[str, Coroutine[Any, Any, None]] = {}
    for site in sites:
        config = site.config.openai
        if config is None or config.kv_events_endpoint is None:
            continue
        translator = VllmEventTranslator(
            site.config.model, config.kv_block_size, site.prefix.max_blocks
        )
        endpoints = KvEventsEndpoints(
            config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_topic
        )
        subscriber = VllmKvEventSubscriber(site.name, site.prefix, translator, endpoints)
        followers[f"kv-events-{site.name}"] = follow_vllm_events(subscriber)
    return followers
