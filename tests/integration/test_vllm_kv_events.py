"""The vLLM KV event subscriber over real ZMQ sockets: a publisher built as vLLM's
ZmqEventPublisher is (PUB socket: topic, 8-byte sequence, msgpack; ROUTER socket replaying its
buffer from a requested sequence, then an end marker), the site's prefix index on our side.

Proves: a gateway that starts late rebuilds the index from the replay buffer; a lost message is
replayed; a buffer that no longer reaches back makes the index start over (it forgets, it never
claims a removed block); a restarted publisher (sequence back to 0) empties the index."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from gateway.routing.prefix.site_prefix import SitePrefix
from gateway.routing.prefix.vllm_events import VllmEventTranslator
from gateway.routing.types import PrefixMatch, RoutingRequest
from gateway.sites.vllm_kv_events import KvEventsEndpoints, VllmKvEventSubscriber
from tests.unit.routing.vllm_wire import VllmEngine, encode

TOPIC = "kv-events"
Subscriber = VllmKvEventSubscriber
END = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    """vLLM's ZmqEventPublisher in miniature: numbered batches on PUB, the last `buffer` of them
    replayed on request by a ROUTER."""

    def __init__(self, context: zmq.asyncio.Context, buffer: int = 1000) -> None:
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.sequence = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.serving = asyncio.get_running_loop().create_task(self._serve_replays())

    @property
    def endpoints(self) -> KvEventsEndpoints:
        return KvEventsEndpoints(
            f"tcp://127.0.0.1:{self.pub_port}", f"tcp://127.0.0.1:{self.replay_port}", TOPIC
        )

    async def publish(self, events: Sequence[Any], send: bool = True) -> int:
        """Numbers and buffers the batch; `send=False` loses it on the way (still replayable)."""
        sequence, payload = self.sequence, encode(events)
        self.sequence += 1
        self.buffer.append((sequence, payload))
        if send:
            await self.pub.send_multipart([TOPIC.encode(), sequence.to_bytes(8, "big"), payload])
        return sequence

    async def _serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for sequence, payload in list(self.buffer):
                if sequence >= first:
                    await self.router.send_multipart(
                        [client, b"", sequence.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart([client, b"", END, b""])

    async def close(self) -> None:
        self.serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.serving
        self.pub.close()
        self.router.close()


PROMPTS = [list(range(100 * i, 100 * i + 40)) for i in range(1, 6)]  # 2 full blocks of 16 each


def req(tokens: list[int]) -> RoutingRequest:
    return RoutingRequest("m", len(tokens), 10, prompt_token_ids=tuple(tokens))


MATCHED = PrefixMatch(32, 32)
UNKNOWN = PrefixMatch()


@contextlib.asynccontextmanager
async def listening(
    publisher: Publisher, context: zmq.asyncio.Context
) -> AsyncIterator[tuple[SitePrefix, VllmKvEventSubscriber]]:
    prefix = SitePrefix(max_blocks=1000)
    subscriber = VllmKvEventSubscriber(
        "vllm-a", prefix, VllmEventTranslator("m", 16, 1000), publisher.endpoints, context
    )
    task = asyncio.create_task(subscriber.run())
    try:
        yield prefix, subscriber
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(condition: Callable[[], bool], publisher: Publisher | None = None) -> None:
    """Waits (at most 20 s) for `condition`; a SUB socket joins a few ms after it connects, so
    an idle publisher keeps sending empty batches meanwhile."""
    for _ in range(2000):
        if condition():
            return
        if publisher is not None:
            await publisher.publish([])
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in 20 s")


Body = Callable[[VllmEngine, Publisher, SitePrefix, VllmKvEventSubscriber], Awaitable[None]]
Before = Callable[[VllmEngine, Publisher], Awaitable[None]]


def run(body: Body, buffer: int = 1000, before: Before | None = None) -> None:
    """A publisher (and what it published `before` the gateway listens), then `body` once the
    subscriber has applied a message published after it started listening.

    Not merely once `last_sequence` is set: the start-up replay applies the buffered batches one
    by one and awaits the socket between them, so `last_sequence` is set by the first replayed
    batch while later ones (a removal, say) are still on their way (seen once in CI: a block
    stored, then removed before the gateway listened, still matched)."""

    async def main() -> None:
        context = zmq.asyncio.Context()
        engine, publisher = VllmEngine(), Publisher(context, buffer)
        try:
            if before is not None:
                await before(engine, publisher)
            live = publisher.sequence  # the first sequence published after the gateway listens
            async with listening(publisher, context) as (prefix, subscriber):

                def following() -> bool:
                    return subscriber.last_sequence is not None and subscriber.last_sequence >= live

                await until(following, publisher)
                await body(engine, publisher, prefix, subscriber)
        finally:
            await publisher.close()
            context.destroy(linger=0)

    asyncio.run(main())


def test_a_late_gateway_rebuilds_from_the_replay_buffer_then_follows_live() -> None:
    async def before(engine: VllmEngine, publisher: Publisher) -> None:
        for tokens in PROMPTS[:3]:
            await publisher.publish([engine.store(tokens)])
        await publisher.publish([engine.removed(engine.hashes_of(PROMPTS[0]))])

    async def body(engine: VllmEngine, publisher: Publisher, prefix: SitePrefix, _: Any) -> None:
        assert prefix.match(req(PROMPTS[0])) == UNKNOWN  # stored, then removed: replayed
        assert prefix.match(req(PROMPTS[1])) == MATCHED
        assert prefix.match(req(PROMPTS[2])) == MATCHED
        await publisher.publish([engine.store(PROMPTS[3])])
        await until(lambda: prefix.match(req(PROMPTS[3])) == MATCHED)

    run(body, before=before)


def test_a_lost_message_is_replayed() -> None:
    async def body(
        engine: VllmEngine, publisher: Publisher, prefix: SitePrefix, subscriber: Subscriber
    ) -> None:
        await publisher.publish([engine.store(PROMPTS[0])])
        await publisher.publish([engine.removed(engine.hashes_of(PROMPTS[0])[1:])], send=False)
        await publisher.publish([engine.store(PROMPTS[1])])
        await until(lambda: prefix.match(req(PROMPTS[1])) == MATCHED)
        assert prefix.match(req(PROMPTS[0])) == PrefixMatch(16, 16)  # the lost removal
        assert subscriber.restarts == 1  # the start only

    run(body)


def test_a_buffer_that_no_longer_reaches_back_makes_the_index_start_over() -> None:
    async def body(
        engine: VllmEngine, publisher: Publisher, prefix: SitePrefix, subscriber: Subscriber
    ) -> None:
        await publisher.publish([engine.store(PROMPTS[0])])
        await until(lambda: prefix.match(req(PROMPTS[0])) == MATCHED)
        restarts = subscriber.restarts
        await publisher.publish([engine.removed(engine.hashes_of(PROMPTS[0]))], send=False)
        await publisher.publish([engine.store(PROMPTS[1])], send=False)
        await publisher.publish([engine.store(PROMPTS[2])])  # the buffer holds only this
        await until(lambda: prefix.match(req(PROMPTS[2])) == MATCHED)
        assert subscriber.restarts == restarts + 1
        assert prefix.match(req(PROMPTS[0])) == UNKNOWN
        assert prefix.match(req(PROMPTS[1])) == UNKNOWN  # stored, but its event was lost

    run(body, buffer=1)


def test_a_restarted_publisher_empties_the_index() -> None:
    async def body(engine: VllmEngine, publisher: Publisher, prefix: SitePrefix, _: Any) -> None:
        await publisher.publish([engine.store(PROMPTS[0])])
        await until(lambda: prefix.match(req(PROMPTS[0])) == MATCHED)
        publisher.sequence = 0  # a new process: numbering starts over, its cache is empty
        publisher.buffer.clear()
        await publisher.publish([VllmEngine().store(PROMPTS[4])])
        await until(lambda: prefix.match(req(PROMPTS[4])) == MATCHED)
        assert prefix.match(req(PROMPTS[0])) == UNKNOWN

    run(body)
