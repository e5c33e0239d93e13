"""The grammar that makes the output a call when tool_choice demands one ("required", or a named
function): it goes down the response_format path, so the engine masks every position with it,
drafts included, and speculation stays lossless (engine/structured/)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.structured import ResponseFormat, UnsupportedSchemaError, check_grammar_support
from server.tools.parser import ToolCallParser
from server.tools.tool_request import FunctionSpec, ToolChoice


class UnenforceableToolError(ValueError):
    """A function's parameters schema the grammar cannot enforce; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def forced_call_format(functions: Sequence[FunctionSpec], choice: ToolChoice,
                       parallel: bool, parser: ToolCallParser) -> ResponseFormat | None:
    """The grammar for `choice`; None where nothing is forced ("none" and "auto")."""
    if choice.mode == "required":
        return ResponseFormat(type="lark", grammar=parser.forced_grammar(functions, parallel))
    if choice.mode == "named":
        named = [f for f in functions if f.name == choice.function_name]
        return ResponseFormat(type="lark", grammar=parser.forced_grammar(named, parallel=False))
    return None


def check_enforceable(functions: Sequence[FunctionSpec], choice: ToolChoice,
                      fmt: ResponseFormat) -> None:
    """Raise UnenforceableToolError unless the grammar can enforce every function `choice` may
    call: each schema on its own first, so the error names the tool at fault (up to ~1 s for a
    large schema: the server runs this on a thread)."""
    for index, function in enumerate(functions):
        if choice.mode == "named" and function.name != choice.function_name:
            continue
        where = f"tools[{index}].function.parameters"
        try:
            check_grammar_support(ResponseFormat(type="json_schema", schema=function.parameters))
        except UnsupportedSchemaError as error:
            reason = str(error).split("cannot be enforced: ", 1)[-1]
            raise UnenforceableToolError(f"{where} cannot be enforced: {reason}", where) from None
    try:
        check_grammar_support(fmt)
    except UnsupportedSchemaError as error:
        raise UnenforceableToolError(str(error), "tools") from None
