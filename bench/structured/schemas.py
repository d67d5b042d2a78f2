"""JSON schemas as clients send them: what pydantic writes for the models the openai SDK's
`parse` and instructor take (nested models under $defs, Optional as anyOf with null, enums,
lists with bounds, constrained strings and numbers, a recursive model), and OpenAI tool
parameter schemas. The structured-output bench uses them."""

from __future__ import annotations

import json
import sys
from datetime import date
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    street: str
    city: str
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)
    email: str | None = None
    addresses: list[Address] = Field(max_length=3)


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0, le=1)


class Event(BaseModel):
    title: str = Field(min_length=1, max_length=80)
    day: date
    attendees: list[str] = Field(min_length=1, max_length=5)
    color: Color


class TreeNode(BaseModel):
    value: int
    children: list[TreeNode] = Field(default_factory=list, max_length=2)


class Invoice(BaseModel):
    number: str
    currency: Literal["EUR", "USD", "JPY"]
    lines: list[dict[str, float]]
    paid: bool
    notes: str | None = None


class Extraction(BaseModel):
    """A typical RAG extraction: several typed fields with descriptions."""

    company: str = Field(description="The company named in the text")
    founded: int = Field(ge=1800, le=2100)
    tags: list[str] = Field(max_length=4)
    public: bool
    ceo: Person | None = None


_WEATHER_TOOL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
_SEARCH_TOOL: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer", "minimum": 1, "maximum": 50},
        "filters": {
            "type": "object",
            "properties": {"site": {"type": "string"}, "after": {"type": "string"}},
            "additionalProperties": False,
        },
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
}
_STRICT_ORDER: dict[str, Any] = {  # OpenAI strict mode: every property required, no extras
    "type": "object",
    "properties": {
        "item": {"type": "string"},
        "quantity": {"type": "integer"},
        "gift": {"type": ["boolean", "null"]},
    },
    "required": ["item", "quantity", "gift"],
    "additionalProperties": False,
}


def realistic_schemas() -> dict[str, dict[str, Any]]:
    """Name -> JSON schema, in a fixed order."""
    models: list[type[BaseModel]] = [Person, Sentiment, Event, TreeNode, Invoice, Extraction]
    schemas = {model.__name__: model.model_json_schema() for model in models}
    schemas["weather_tool"] = _WEATHER_TOOL
    schemas["search_tool"] = _SEARCH_TOOL
    schemas["strict_order"] = _STRICT_ORDER
    schemas["any_object"] = {"type": "object"}
    schemas["format_email"] = {
        "type": "object",
        "properties": {"to": {"type": "string", "format": "email"}},
        "required": ["to"],
    }
    schemas["one_of"] = {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
             "required": ["kind", "x"]},
            {"type": "object", "properties": {"kind": {"const": "b"}, "y": {"type": "string"}},
             "required": ["kind", "y"]},
        ]
    }  # fmt: skip
    return schemas


# The schemas as JSON, for machines without pydantic (the GPU machine's image has none):
# `python -m bench.structured.schemas` rewrites it; a unit test keeps it in step.
SCHEMAS_FILE = Path(__file__).with_name("client_schemas.json")


if __name__ == "__main__":
    SCHEMAS_FILE.write_text(json.dumps(realistic_schemas(), indent=1, sort_keys=True) + "\n")
    sys.stdout.write(f"wrote {SCHEMAS_FILE}\n")
