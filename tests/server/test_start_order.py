"""`specserve serve` starts its engine process before it imports anything heavy: reading the flags,
validating them and starting the engine import neither torch nor transformers nor FastAPI, so the
engine loads the model while the HTTP process imports its own side (server/engine_launch.py)."""

from __future__ import annotations

import subprocess
import sys

from server.tools.conventions import PARSERS
from server.tools.parser_names import TOOL_CALL_PARSER_NAMES

HEAVY_MODULES = ("torch", "transformers", "fastapi", "uvicorn", "engine.core", "engine.llm")

# what server/cli.py's run_serve does up to launch_engine(), in a fresh interpreter
UP_TO_THE_LAUNCH = f"""
import sys
from server.cli import build_parser, resolve_api_keys
from engine.engine_args import EngineArgs
import server.engine_launch

args = build_parser().parse_args(["serve", "--dtype", "float32", "--tool-call-parser", "hermes"])
resolve_api_keys(args.api_key, args.api_key_file, {{}})
engine_args = EngineArgs(model=args.model, dtype=args.dtype,
                         speculative_config=args.speculative_config)
engine_args.configs()
engine_args.parallel_config()
print(" ".join(name for name in {HEAVY_MODULES!r} if name in sys.modules))
"""


def test_flags_are_read_and_checked_without_heavy_imports():
    result = subprocess.run([sys.executable, "-c", UP_TO_THE_LAUNCH], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"imported before the engine starts: {result.stdout}"


def test_the_parser_names_the_command_line_offers_are_the_parsers_there_are():
    assert sorted(TOOL_CALL_PARSER_NAMES) == sorted(PARSERS)


def test_the_engine_package_still_offers_the_offline_api():
    from engine import LLM, CompletionOutput, RequestOutput, SamplingParams

    assert LLM.__module__ == "engine.llm" and SamplingParams.__module__ == "engine.sampling_params"
    assert {RequestOutput.__module__, CompletionOutput.__module__} == {"engine.outputs"}
