"""Tool calling, the request side: `tools`, `tool_choice` and `parallel_tool_calls` checked as
OpenAI checks them, the conversation's tool turns rendered for the model, and the constraint
that makes `required` and named calls always parse.

Rendering follows the model's chat template where it knows tools (transformers' convention: the
template reads `tools`, assistant turns' `tool_calls` and `tool` turns). For a template that
does not, the gateway writes the model's tool-call format (federation file `tool_call_format`,
by default Hermes-style JSON in <tool_call> tags) itself: the tools and the format go into the
system turn, earlier calls into assistant text, tool results into user turns in
<tool_response> tags, which every template renders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from fedllm_contract.grammar import ConstraintSpec
from gateway.chat.closed_objects import admits_objects, closed_arguments
from gateway.chat.response_format import NAME, checked, schema_text
from gateway.errors import invalid_request
from gateway.federation import ToolCallFormat

Choice = Literal["none", "auto", "required"]
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools, validated: each {"type": "function", "function": {...}}."""

    tools: tuple[dict[str, Any], ...]
    choice: Choice | str  # a function's name for a named call
    parallel: bool

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool["function"]["name"] for tool in self.tools)

    @property
    def calls_allowed(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """`required` or a named function: the answer is calls only."""
        return self.choice not in ("auto", "none")

    @property
    def called(self) -> str | None:
        """The function a forced answer calls, when only one can be: the named one, or the
        only tool of a `required` choice."""
        if not self.forced:
            return None
        if self.choice != "required":
            return self.choice
        return next(iter(self.names)) if len(self.names) == 1 else None


def _function(tool: object, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid_request("a tool is {'type': 'function', 'function': {...}}", f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise invalid_request("a tool needs its function", param=f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid_request(
            "a function's name is 1-64 letters, digits, '_' or '-'",
            param=f"{where}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_request("description must be a string", f"{where}.function.description")
    parameters = function.get("parameters", _ANY_OBJECT)
    param = f"{where}.function.parameters"
    text = schema_text(parameters, param)
    if not admits_objects(parameters):
        # As OpenAI refuses it: a call's arguments are a JSON object.
        raise invalid_request(
            f"the parameters of '{name}' must be a JSON schema of type 'object' "
            f"(got type {parameters.get('type')!r})",
            param=param,
        )
    checked(ConstraintSpec("json_schema", schema=text), param, f"the parameters of '{name}'")
    out: dict[str, Any] = {"name": name, "parameters": parameters}
    if description is not None:
        out["description"] = description
    return {"type": "function", "function": out}


def _choice(value: str | dict[str, Any] | None, names: set[str]) -> Choice | str:
    if value is None:
        return "auto" if names else "none"
    if value in ("none", "auto", "required"):
        if value != "none" and not names:
            raise invalid_request(f"tool_choice '{value}' needs tools", param="tool_choice")
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise invalid_request(
                f"tool_choice names function {name!r}, which is not among the tools "
                f"({', '.join(sorted(names)) or 'none given'})",
                param="tool_choice",
            )
        return str(name)
    raise invalid_request(
        "tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'function': "
        "{'name': ...}}",
        param="tool_choice",
    )


def check_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel: bool | None,
) -> ToolRequest | None:
    """The request's tools (None: it offers none, or tool_choice 'none' keeps them unused)."""
    functions = [_function(tool, f"tools[{i}]") for i, tool in enumerate(tools or [])]
    names: set[str] = set()
    for i, function in enumerate(functions):
        name = function["function"]["name"]
        if name in names:
            raise invalid_request(f"two tools are named '{name}'", f"tools[{i}].function.name")
        names.add(name)
    choice = _choice(tool_choice, names)
    if not functions or choice == "none":
        return None
    return ToolRequest(tuple(functions), choice, parallel is not False)


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    # The parameters as a schema resource of their own ($id), so that their local references
    # ("#/$defs/...", as pydantic writes them) resolve inside them, not at this schema's root.
    arguments = {
        "$id": f"urn:fedllm:tool:{function['name']}",
        **closed_arguments(function["parameters"]),
    }
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_constraint(request: ToolRequest, fmt: ToolCallFormat) -> ConstraintSpec | None:
    """For `required` and named calls: the answer is nothing but calls in the model's format,
    each a function of the request with valid arguments (one when named or not parallel),
    held to its schema with the objects closed (gateway/chat/closed_objects.py).

    llguidance writes an object's properties in the order its schema lists them; the schema is
    sent with its keys sorted, so a call is written arguments first and the arguments in
    alphabetical order (not the client's). Kept as it was: with the declared order, the name
    first, SmolLM2 looped in a string of pydantic-ai's City output (see docs/openai-api.md)."""
    if not request.forced:
        return None
    if request.choice == "required":
        offered = list(request.tools)
    else:
        offered = [t for t in request.tools if t["function"]["name"] == request.choice]
    schemas = [_call_schema(tool) for tool in offered]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    single = request.choice != "required" or not request.parallel
    return ConstraintSpec(
        "tagged_json",
        schema=json.dumps(schema, sort_keys=True),
        begin=fmt.begin,
        end=fmt.end,
        separator="\n",
        min_items=1,
        max_items=1 if single else 0,
    )


def tools_prompt(request: ToolRequest, fmt: ToolCallFormat) -> str:
    """The system text that shows a model without tool support the tools and the format
    (Hermes' wording)."""
    listed = "\n".join(json.dumps(tool["function"], sort_keys=True) for tool in request.tools)
    example = '{"name": <function-name>, "arguments": <args-json-object>}'
    return (
        "You are a function calling AI model. You may call one or more functions to assist "
        "with the user query. Don't make assumptions about what values to plug into functions. "
        f"Here are the available tools: <tools>\n{listed}\n</tools>\n"
        "For each function call, return a json object with function name and arguments within "
        f"{fmt.begin.strip()}{fmt.end.strip()} tags:\n{fmt.begin}{example}{fmt.end}"
    )


def _arguments(call: object, where: str) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise invalid_request("a tool call is {'function': {'name', 'arguments'}}", param=where)
    raw = function.get("arguments", "{}") if isinstance(function, dict) else "{}"
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        raise invalid_request("a tool call's arguments are JSON text", f"{where}.function") from exc
    return name, arguments


def call_text(call: object, where: str, fmt: ToolCallFormat) -> str:
    """An earlier assistant tool call as the model writes one."""
    name, arguments = _arguments(call, where)
    return f"{fmt.begin}{json.dumps({'name': name, 'arguments': arguments})}{fmt.end}"


def template_call(call: object, where: str) -> dict[str, Any]:
    """An earlier tool call as chat templates with tool support read it (arguments a dict)."""
    name, arguments = _arguments(call, where)
    call_id = call.get("id") if isinstance(call, dict) else None
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if isinstance(call_id, str):
        out["id"] = call_id
    return out
