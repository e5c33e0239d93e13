"""Which tool-call convention a model speaks: `--tool-call-parser` (vLLM's flag and names), else
what its chat template writes, else Hermes, the form the fallback prompt teaches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.tools.hermes import HermesParser
from server.tools.llama3_json import PYTHON_TAG, Llama3JsonParser
from server.tools.parser import ToolCallParser

PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


@dataclass(frozen=True)
class ToolConvention:
    parser: ToolCallParser
    # whether the chat template renders `tools`, assistant `tool_calls` and tool messages itself;
    # if not, the parser writes them into the conversation (server/tools/conversation.py)
    template_knows_tools: bool = False
    # for a template that knows no tools: whether it still renders a message of role "tool" (a
    # ChatML template renders any role); if not, results go back as a user turn
    template_renders_tool_role: bool = False


def tool_convention(tokenizer: Any, parser_name: str | None = None) -> ToolConvention:
    """The convention for `tokenizer`'s chat template (None: no template, tools unused)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if parser_name is None:
        parser_name = "llama3_json" if PYTHON_TAG in template or "ipython" in template \
            else "hermes"
    if parser_name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {parser_name!r}; "
                         f"known: {', '.join(PARSERS)}")
    # NOTE: a template that never reads the `tools` variable drops them without a word
    knows_tools = "tools" in template
    return ToolConvention(PARSERS[parser_name](), knows_tools,
                          not knows_tools and bool(template) and _renders_tool_role(tokenizer))


def _renders_tool_role(tokenizer: Any) -> bool:
    """Whether a tool message comes out of the template with its text (SmolLM2's, as measured,
    answers from a result far better in a turn of its own than in a user turn)."""
    probe = "tool-role-probe-7f3a"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
             {"role": "tool", "content": probe}], tokenize=False, add_generation_prompt=True)
    except Exception:  # jinja's raise_exception: the template allows only its own roles
        return False
    return probe in text
