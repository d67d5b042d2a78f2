"""A batch's items as the requests of their endpoint: validated at submission exactly as that
endpoint validates a request (CompletionService.prepare, ChatService.prepare), and prepared
again at each start from what was stored.

Everything here tokenizes and is synchronous: the batch service and runner call it on the
tokenize pool (gateway/tokenize_pool.py), a slice of items at a time, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, NoReturn

import msgspec

from fedllm_contract.request_options import Priority
from gateway.batches.records import NewItem
from gateway.batches.request import (
    CHAT,
    chat_request,
    completion_request,
    decode_item,
    item_body,
    item_error,
    line_body,
)
from gateway.chat.service import ChatService
from gateway.dispatch.request import PreparedCompletion
from gateway.errors import GatewayError, invalid_request, model_not_found
from gateway.files.batch_input import Endpoint, InputLine
from gateway.request_path.prepare import Preparer
from gateway.request_path.service import CompletionService

# A slice of items validated in one turn of the tokenize pool: bounded in bytes, so that one
# large batch holds a pool thread for a fraction of a second at a time (tokenizing costs about
# a second per MiB, bench/results/security/tokenize_cost.md) and interactive requests get their
# turns.
SLICE_BYTES = 256 << 10
SLICE_ITEMS = 256
# Keys of a file line's body that a batch does not take as they are: the batch names the model
# and collects answers rather than streaming them.
_NOT_STORED = ("model", "stream", "stream_options")
# Bodies were decoded by msgspec (no lone surrogates, bounded nesting): they encode back.
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


class Entry(NamedTuple):
    """One item as submitted: where it is (for errors), its custom_id, its request body as it
    will be stored (less custom_id and model) as JSON, and the size of the JSON it came in. A
    tuple of strings and numbers, as NewItem (gateway/batches/records.py) and for the same
    reason: a batch's entries wait whole for their validation, and their bodies' dicts and
    lists held as objects made each full collection of the garbage collector walk them all."""

    where: str
    custom_id: str
    body: bytes
    size: int


def slices(entries: Sequence[Entry]) -> list[list[Entry]]:
    out: list[list[Entry]] = []
    size = 0
    for entry in entries:
        if not out or size + entry.size > SLICE_BYTES or len(out[-1]) >= SLICE_ITEMS:
            out.append([])
            size = 0
        out[-1].append(entry)
        size += entry.size
    return out


def inline_entries(requests: Sequence[msgspec.Raw], max_item_bytes: int) -> list[Entry]:
    """The inline requests decoded, or 400 naming the first that is too large, malformed or
    reuses a custom_id."""
    entries: list[Entry] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(requests):
        where = f"requests[{index}]"
        item = decode_item(where, raw, max_item_bytes)
        if item.custom_id in seen:
            raise invalid_request(
                f"{where}: custom_id '{item.custom_id}' is also the custom_id of "
                f"requests[{seen[item.custom_id]}]; custom_ids must be unique in a batch",
                param=f"{where}.custom_id",
            )
        seen[item.custom_id] = index
        entries.append(Entry(where, item.custom_id, _encode(item_body(item)), len(raw)))
    return entries


def file_entries(
    file_id: str, lines: Sequence[InputLine], endpoint: Endpoint
) -> tuple[str, list[Entry]]:
    """The batch's model (the first line's) and the file's requests as entries, or 400 naming
    the first line that names another endpoint or model, streams, or has no model."""
    model: str | None = None
    entries = []
    for line in lines:
        where = f"line {line.number} of {file_id}"
        if line.url != endpoint:
            _refuse(line, where, f"url is {line.url}, not the batch's endpoint {endpoint}", "url")
        try:
            body = line_body(line.body)
        except GatewayError as exc:
            raise item_error(where, line.custom_id, exc) from exc
        named = body.get("model")
        if not isinstance(named, str):
            _refuse(line, where, "body.model is required: the model the request is for", "model")
        if model is not None and named != model:
            _refuse(
                line,
                where,
                f"body.model is '{named}', not '{model}': a batch serves one model",
                "model",
            )
        model = named
        if body.get("stream"):
            _refuse(line, where, "a batch collects answers: body.stream must be false", "stream")
        stored = {key: value for key, value in body.items() if key not in _NOT_STORED}
        entries.append(Entry(where, line.custom_id, _encode(stored), len(line.body)))
    assert model is not None  # parse_lines refuses a file without requests
    return model, entries


def _refuse(line: InputLine, where: str, message: str, param: str) -> NoReturn:
    raise item_error(where, line.custom_id, invalid_request(message, param=param))


class ItemPreparer:
    def __init__(
        self,
        completions: CompletionService,
        chat: ChatService,
        status_of: Callable[[GatewayError], int] = lambda exc: 400,
    ) -> None:
        self._completions = completions
        self._chat = chat
        self._status_of = status_of

    @property
    def requests(self) -> Preparer:
        """What resolves models and adapters (gateway/request_path/prepare.py)."""
        return self._completions.preparer

    def prepare(self, endpoint: str, model: str, body: dict[str, Any]) -> PreparedCompletion:
        """A stored item as its endpoint's prepared request; raises GatewayError (4xx)."""
        if endpoint == CHAT:
            prepared = self._chat.prepare(chat_request(model, body))
        else:
            prepared = self._completions.prepare(completion_request(model, body))
        # Batch work runs in the site engines' lowest class, behind interactive requests.
        return prepared.with_options(priority=Priority.BATCH)

    def validate(self, endpoint: str, model: str, entries: Sequence[Entry]) -> list[NewItem]:
        """The entries as items to store. An entry its endpoint refuses (bad parameters, a
        prompt longer than the context) is stored failed, with the error that endpoint would
        have answered: that line's entry in the batch's error file, as OpenAI does. A model
        nobody serves is the batch's 404."""
        items = []
        for entry in entries:
            body = _decode(entry.body)
            try:
                prepared = self.prepare(endpoint, model, body)
            except GatewayError as exc:
                if exc.code == "model_not_found":
                    raise model_not_found(model) from exc
                failed = NewItem(
                    entry.custom_id, entry.body.decode(), 0, 0, exc.fields(), self._status_of(exc)
                )
                items.append(failed)
                continue
            params = prepared.params
            items.append(
                NewItem(
                    entry.custom_id,
                    entry.body.decode(),
                    len(params.prompt_token_ids),
                    params.max_tokens * params.options.n,
                )
            )
        return items
