"""Chat templates: how a model's conversation becomes the one prompt string it was trained on.

Where a model's template comes from, first found wins:
1. `chat_template` of the model in the federation file (a Jinja file, set by the operator);
2. the tokenizer directory, as transformers reads it: `chat_template.jinja`, else the
   `chat_template` of `tokenizer_config.json` (a string, or a list of named templates of which
   "default" is used);
3. none: the model serves /v1/completions only, and a chat request gets a 400 that says why.
   A model without a template (a base model) has no conversation format; guessing one (say
   ChatML) would serve answers the model was never trained to give. An operator who knows the
   format names a Jinja file in the federation file.

Templates are untrusted code (they come with downloaded models), so they run in Jinja's immutable
sandbox with the same environment as transformers' chat templates: trim_blocks/lstrip_blocks,
loop controls, a non-escaping `tojson`, `raise_exception(message)` and `strftime_now(format)`,
and the variables `messages`, `add_generation_prompt`, `tools`, `documents` and the tokenizer's
special tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fedllm_contract.tokenizer import CHATML_TEMPLATE as CHATML_TEMPLATE
from gateway.federation import ModelConfig

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


class ChatTemplateError(ValueError):
    """A configured template cannot be read or compiled; raised at start-up, naming the model."""


class ChatRenderError(ValueError):
    """The template refused the conversation (raise_exception) or failed on it."""


class NoChatTemplate(LookupError):
    """The model has no chat template: it serves completions only."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; serving only needs its body rendered as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 reads this class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        body: list[jinja2.nodes.Node] = parser.parse_statements(
            ("name:endgeneration",), drop_needle=True
        )
        return body


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _environment()


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str
    origin: str  # where it came from, for logs and errors
    special_tokens: Mapping[str, str]
    _compiled: jinja2.Template

    @classmethod
    def compile(
        cls, source: str, origin: str, special_tokens: Mapping[str, str] | None = None
    ) -> ChatTemplate:
        try:
            compiled = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template from {origin} does not compile: {exc.message} (line {exc.lineno})"
            ) from exc
        tokens = {name: (special_tokens or {}).get(name, "") for name in SPECIAL_TOKENS}
        return cls(source, origin, tokens, compiled)

    def knows(self, variable: str) -> bool:
        """Whether the template's source mentions `variable` (e.g. `tools`, `developer`): how
        the gateway tells a template that renders tools or a developer turn itself."""
        return variable in self.source

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        try:
            return self._compiled.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=[dict(t) for t in tools] if tools else None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:  # raise_exception, undefined names, sandbox refusals
            raise ChatRenderError(str(exc) or type(exc).__name__) from exc
        except (TypeError, ValueError, LookupError) as exc:  # e.g. indexing an empty list
            raise ChatRenderError(f"the chat template failed on these messages: {exc}") from exc


def _token_text(value: object) -> str | None:
    """A special token as tokenizer files store it: a string or an AddedToken-like object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path} is not a JSON object")
    return data


def _special_tokens(tokenizer_dir: Path) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):  # the config's entries take precedence
        path = tokenizer_dir / name
        if path.is_file():
            data = _read_json(path)
            for key in SPECIAL_TOKENS:
                text = _token_text(data.get(key))
                if text is not None:
                    tokens[key] = text
    return tokens


def _tokenizer_template(tokenizer_dir: Path) -> tuple[str, str] | None:
    """The template transformers would load from this directory, with where it was found."""
    template_file = tokenizer_dir / TEMPLATE_FILE
    if template_file.is_file():
        return _read_text(template_file), str(template_file)
    config = tokenizer_dir / TOKENIZER_CONFIG
    if not config.is_file():
        return None
    raw = _read_json(config).get("chat_template")
    origin = f"{config} (chat_template)"
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw, origin
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        default = named.get("default")
        if isinstance(default, str):
            return default, f"{origin}, the one named 'default'"
    raise ChatTemplateError(
        f"{origin} must be a string or a list of named templates including 'default'"
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot read chat template {path}: {exc}") from exc


def load_chat_template(model: ModelConfig) -> ChatTemplate | None:
    """The model's template (see the module docstring for the order), None if it has none;
    ChatTemplateError if a configured one cannot be read or compiled."""
    try:
        tokens = _special_tokens(model.tokenizer)
        if model.chat_template is not None:
            source, origin = _read_text(model.chat_template), str(model.chat_template)
        else:
            found = _tokenizer_template(model.tokenizer)
            if found is None:
                return None
            source, origin = found
        return ChatTemplate.compile(source, origin, tokens)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"model {model.name!r}: {exc}") from exc


class ChatTemplates:
    """Every served model's template, loaded and compiled once at start-up."""

    def __init__(self, templates: Mapping[str, ChatTemplate | None]) -> None:
        self._templates = dict(templates)

    @classmethod
    def load(cls, models: Iterable[ModelConfig]) -> ChatTemplates:
        return cls({model.name: load_chat_template(model) for model in models})

    def __getitem__(self, model: str) -> ChatTemplate:
        """KeyError for an unknown model, NoChatTemplate for a model without a template."""
        template = self._templates[model]
        if template is None:
            raise NoChatTemplate(model)
        return template

    def __contains__(self, model: str) -> bool:
        return model in self._templates


# --- Message content as text (issue 32): special tokens only where the template puts them ---
#
# A rendered conversation is one string; tokenized whole, the text of a special token inside a
# message (`<|im_end|>\n<|im_start|>system ...`) became that control token, and a user could
# write a turn of any role. Here the special tokens' text in messages is set apart before the
# template runs and comes back as pieces to tokenize as plain text. Tokenizers split text at
# special tokens before anything else, so the pieces around them tokenize exactly as before: a
# conversation without such text tokenizes as it always did. The federation file's
# `parse_special_tokens_in_messages` keeps the old behaviour for a model (ChatService).


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """A rendered conversation: its text, and the same text as pieces, each the template's own
    (special tokens in it are control tokens) or, with `literal`, the text of a special token
    that a message carried (tokenized as plain text)."""

    text: str
    pieces: tuple[tuple[str, bool], ...]  # (text, literal)


@lru_cache(maxsize=64)
def _special_text(specials: tuple[str, ...]) -> re.Pattern[str] | None:
    """Any of `specials` (longest first, so that none is found inside a longer one)."""
    return re.compile("|".join(map(re.escape, specials))) if specials else None


def _free_mark(texts: Iterable[str]) -> str:
    """A private-use character that none of `texts` holds."""
    used = set("".join(texts))
    return next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)


def render_messages_as_text(
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    special_tokens: Iterable[str],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> RenderedChat:
    """Renders `messages` (and `tools`, for a template that lists them) with each occurrence of
    a special token's text in their content kept apart as a literal piece; ChatRenderError as
    ChatTemplate.render. Content that is not a string (an assistant turn of tool calls) is
    rendered as the template writes it."""
    specials = tuple(sorted({token for token in special_tokens if token}, key=len, reverse=True))
    found = _special_text(specials)
    contents = [message.get("content") for message in messages]
    texts = [content for content in contents if isinstance(content, str)]
    if found is None or not any(found.search(text) for text in texts):
        text = template.render(messages, add_generation_prompt, tools=tools)
        return RenderedChat(text, ((text, False),))
    mark = _free_mark([template.source, *texts])
    number = {token: n for n, token in enumerate(specials)}
    marked = [
        {**message, "content": found.sub(lambda m: f"{mark}{number[m.group(0)]}{mark}", content)}
        if isinstance(content, str)
        else message
        for message, content in zip(messages, contents, strict=True)
    ]
    rendered = template.render(marked, add_generation_prompt, tools=tools)
    parts = re.split(f"{mark}([0-9]+){mark}", rendered)
    pieces = tuple(
        (specials[int(part)], True) if odd else (part, False)
        for odd, part in ((i % 2 == 1, part) for i, part in enumerate(parts))
        if part
    )
    return RenderedChat("".join(text for text, _ in pieces), pieces)
