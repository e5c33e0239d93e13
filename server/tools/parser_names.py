"""The names `--tool-call-parser` takes (vLLM's), importable without the parsers themselves: the
command line is read before anything heavy loads, so the engine process starts at once
(server/tools/conventions.py maps each name to its parser)."""

TOOL_CALL_PARSER_NAMES = ("hermes", "llama3_json")
