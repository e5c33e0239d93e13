"""A chat request's messages and tools as a chat template takes them.

A template that knows tools gets OpenAI's shapes (arguments as objects, as Hugging Face templates
expect). One that does not (the embedded SmolLM2's) gets plain messages: the tools described in the
system message, earlier calls written in the convention's form, and results as tool messages where
the template renders that role, else as one user turn in the convention's form.
With tool_choice "none" the tools are not shown, so the model answers in words.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from server.api_requests import ChatMessage
from server.tools.conventions import ToolConvention
from server.tools.tool_request import FunctionSpec, ToolChoice


def template_inputs(messages: Sequence[ChatMessage], functions: Sequence[FunctionSpec] | None,
                    choice: ToolChoice, convention: ToolConvention
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for `tokenizer.apply_chat_template(messages, tools=tools, ...)`."""
    shown = list(functions or ()) if choice.mode != "none" else []
    if convention.template_knows_tools:
        return ([_templated(m, messages) for m in messages],
                [f.as_openai_tool() for f in shown] or None)
    rendered = _written_out(messages, convention)
    if shown:
        prompt = convention.parser.tools_prompt(shown)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _role(message: ChatMessage) -> str:
    # NOTE: Hugging Face templates know `system` but rarely `developer`
    return "system" if message.role == "developer" else message.role


def _templated(message: ChatMessage, messages: Sequence[ChatMessage]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(message), "content": message.content or ""}
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls]
    if message.role == "tool":
        out["tool_call_id"] = message.tool_call_id
        name = _called_function(message.tool_call_id, messages)
        if name is not None:  # some templates (Llama 3.1's) name the function a result is from
            out["name"] = name
    return out


def _written_out(messages: Sequence[ChatMessage], convention: ToolConvention
                 ) -> list[dict[str, Any]]:
    parser = convention.parser
    out: list[dict[str, Any]] = []
    results: list[str] = []
    for message in messages:
        if message.role == "tool" and convention.template_renders_tool_role:
            out.append({"role": "tool", "content": message.content or ""})
            continue
        if message.role == "tool":
            results.append(message.content or "")
            continue
        if results:  # consecutive results go back as one user turn: templates alternate turns
            out.append({"role": "user", "content": parser.write_results(results)})
            results = []
        content = message.content or ""
        if message.tool_calls:
            calls = parser.write_calls([(c.function.name, c.function.arguments)
                                        for c in message.tool_calls])
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": _role(message), "content": content})
    if results:
        out.append({"role": "user", "content": parser.write_results(results)})
    return out


def _arguments(text: str) -> Any:
    """The arguments as an object where they are one; as sent otherwise."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _called_function(call_id: str | None, messages: Sequence[ChatMessage]) -> str | None:
    for message in messages:
        for call in message.tool_calls or ():
            if call.id == call_id:
                return call.function.name
    return None
