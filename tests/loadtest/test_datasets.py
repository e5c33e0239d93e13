"""Datasets: the JSONL reader (good lines of every shape, bad lines named by file and line), the
synthetic prompts and the benchmark workloads."""

from __future__ import annotations

import json

import pytest

from loadtest.datasets import DatasetError, load_requests, read_jsonl, synthetic_requests


def write_lines(tmp_path, lines: list[str]):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_prompts_messages_and_sharegpt_conversations(tmp_path):
    path = write_lines(tmp_path, [
        json.dumps({"prompt": "Say hi.", "max_tokens": 8}),
        "",
        json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Name a colour."}]}),
        json.dumps({"conversations": [{"from": "human", "value": "2+2?"},
                                      {"from": "gpt", "value": "4"}]}),
    ])
    prompt, chat, sharegpt = read_jsonl(path)
    assert prompt.chat_messages() == [{"role": "user", "content": "Say hi."}]
    assert prompt.completion_prompt() == "Say hi."
    assert prompt.max_tokens == 8
    assert chat.chat_messages()[1] == {"role": "user", "content": "Name a colour."}
    assert chat.max_tokens is None
    # the recorded answer is what the server should produce: it is not sent
    assert sharegpt.chat_messages() == [{"role": "user", "content": "2+2?"}]
    with pytest.raises(DatasetError, match="conversation cannot go to /v1/completions"):
        chat.completion_prompt()


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"text": "hi"}', "needs exactly one of"),
    ('{"prompt": "a", "messages": []}', "needs exactly one of"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be a positive integer"),
    ('{"prompt": "a", "max_tokens": "8"}', "max_tokens must be a positive integer"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "each message needs a role"),
    ('{"messages": []}', "non-empty list"),
    ('{"conversations": [{"from": "gpt", "value": "only an answer"}]}', "no user turn"),
])
def test_a_bad_line_names_the_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path, [json.dumps({"prompt": "fine"}), line])
    with pytest.raises(DatasetError, match=message) as caught:
        read_jsonl(path)
    assert f"{path}:2:" in str(caught.value)


def test_an_empty_or_missing_file_is_an_error(tmp_path):
    with pytest.raises(DatasetError, match="no requests"):
        read_jsonl(write_lines(tmp_path, ["", "  "]))
    with pytest.raises(DatasetError, match="cannot read"):
        read_jsonl(tmp_path / "absent.jsonl")


def test_a_short_dataset_is_cycled_in_order(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"prompt": p}) for p in ("a", "b")])
    requests = load_requests("jsonl", 5, path=str(path))
    assert [r.prompt for r in requests] == ["a", "b", "a", "b", "a"]
    with pytest.raises(DatasetError, match="--dataset-path"):
        load_requests("jsonl", 5)


def test_synthetic_prompts_are_seeded_and_sized():
    first = synthetic_requests(3, num_words=10, seed=1)
    assert first == synthetic_requests(3, num_words=10, seed=1)
    assert first != synthetic_requests(3, num_words=10, seed=2)
    assert all(len(r.prompt.splitlines()[1].split()) == 10 for r in first)


def test_the_three_benchmark_workloads():
    requests = load_requests("workloads", 4)
    assert [r.source for r in requests] == ["workload:code_editing", "workload:extraction",
                                            "workload:open_chat", "workload:code_editing"]
    assert "def dumps" in requests[0].prompt
