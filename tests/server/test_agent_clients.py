"""The two most used coding agents, installed from the npm registry, pointed at `specserve serve` on
the embedded model by base URL: Codex CLI (OpenAI's Responses API only) and Claude Code (Anthropic's
Messages API only) each get the model's answer, print it and exit 0.

Neither agent sends a temperature, so the server makes them greedy with
--override-generation-config, and the answer is known: Paris. Codex's own prompt (~6.5k tokens, 9
tools) is sent as it is. Claude Code's (~12.3k tokens, 8.2k of them its 12 tools' schemas) is past
SmolLM2's trained 8192 positions, where the 135M model writes nonsense until max_tokens (Claude Code
then exits 1), so it runs with `--system-prompt` and `--tools ""`, which leave ~300 tokens. Skipped
with the reason where npm is absent; the versions are the ones README and TOOLCHAIN name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from live_server import LiveServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
AGENTS = {"@openai/codex": "0.171.0", "@anthropic-ai/claude-code": "2.1.332"}
# an agent's whole run: a ~12k-token prefill on 2 cores, its answer, and its retries on errors
AGENT_TIMEOUT_S = 420
PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def agent_bin() -> Path:
    """The agents' binaries, installed once into a cache folder (SPECSERVE_AGENTS_DIR)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: Codex CLI and Claude Code come from the npm registry")
    folder = Path(os.environ.get("SPECSERVE_AGENTS_DIR",
                                 Path.home() / ".cache" / "specserve" / "agents"))
    bin_dir = folder / "node_modules" / ".bin"
    if not all(_installed(folder, name, version) for name, version in AGENTS.items()):
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(folder),
                        *(f"{name}@{version}" for name, version in AGENTS.items())],
                       check=True, timeout=900, capture_output=True)
    return bin_dir


def _installed(folder: Path, name: str, version: str) -> bool:
    manifest = folder / "node_modules" / name / "package.json"
    return manifest.exists() and json.loads(manifest.read_text()).get("version") == version


@pytest.fixture(scope="module")
def server():
    with LiveServer(["--max-model-len", "16384", "--allow-long-max-model-len",
                     "--kv-cache-memory-gib", "1.5",
                     "--override-generation-config", '{"temperature": 0}']) as live:
        yield live


def _agent_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean home, so no user config or login of the machine's leaks into the run."""
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("OPENAI_", "ANTHROPIC_", "CODEX_", "CLAUDE_"))}
    return {**env, "HOME": str(home), "NO_COLOR": "1", **extra}


def _served(server: LiveServer, route: str) -> int:
    """How many requests the server answered 200 on `route` (its access log)."""
    return sum(f'"POST {route}' in line and '" 200' in line
               for line in server.output().splitlines())


def test_codex_exec_prints_the_models_answer(agent_bin, server, tmp_path) -> None:
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "specserve"\n\n[model_providers.specserve]\n'
        f'name = "specserve"\nbase_url = "{server.api}"\nwire_api = "responses"\n'
        f'env_key = "SPECSERVE_KEY"\n')
    workdir = tmp_path / "work"
    workdir.mkdir()
    run = subprocess.run(
        [str(agent_bin / "codex"), "exec", "--skip-git-repo-check", "--json", PROMPT],
        cwd=workdir, capture_output=True, text=True, timeout=AGENT_TIMEOUT_S,
        env=_agent_env(tmp_path, CODEX_HOME=str(codex_home), SPECSERVE_KEY="unused"))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{server.output()[-4000:]}"
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    answers = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
               and e["item"].get("type") == "agent_message"]
    assert answers and "Paris" in answers[-1], run.stdout
    assert _served(server, "/v1/responses") >= 1


def test_claude_code_prints_the_models_answer(agent_bin, server, tmp_path) -> None:
    workdir = tmp_path / "work"
    workdir.mkdir()
    run = subprocess.run(
        [str(agent_bin / "claude"), "-p", PROMPT, "--model", MODEL, "--output-format", "json",
         "--system-prompt", "You are a helpful assistant. Answer in one short sentence.",
         "--tools", ""],
        cwd=workdir, capture_output=True, text=True, timeout=AGENT_TIMEOUT_S,
        env=_agent_env(tmp_path, ANTHROPIC_BASE_URL=server.url, ANTHROPIC_API_KEY="unused",
                       DISABLE_TELEMETRY="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                       ANTHROPIC_DEFAULT_HAIKU_MODEL=MODEL, CLAUDE_CODE_MAX_OUTPUT_TOKENS="300"))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{server.output()[-4000:]}"
    result = json.loads(run.stdout)
    assert not result["is_error"] and "Paris" in result["result"], result
    assert _served(server, "/v1/messages") >= 1
