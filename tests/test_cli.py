"""The `specserve` command line: a demo generation works, bad flags fail with exit 2 and a message."""

from __future__ import annotations

import json

import pytest

from server.cli import main


def test_generate_without_a_tokenizer_fails_clearly(tiny_llama, capsys):
    # the tiny checkpoint has no tokenizer, so chat cannot apply a template
    assert main(["generate", "hi", "--model", tiny_llama]) == 2
    assert "no tokenizer" in capsys.readouterr().err


def test_generate_on_the_embedded_model_with_speculation(capsys):
    code = main(["generate", "Repeat exactly: alpha beta gamma alpha beta gamma", "--json",
                 "--max-tokens", "16", "--num-threads", "2", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["token_ids"]) <= 16 and result["text"]
    assert result["speculative_decoding"]["num_draft_tokens"] >= 0


def test_bad_flags_fail_with_a_message(capsys):
    assert main(["generate", "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    bad_method = '{"method": "magic", "num_speculative_tokens": 2}'
    assert main(["generate", "hi", "--speculative-config", bad_method]) == 2
    assert "method must be one of" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/no/such/model"]) == 2
    assert "--model takes" in capsys.readouterr().err


def test_train_speculator_refuses_bad_numbers_before_any_work(tmp_path, capsys):
    for flags, message in ((["--unroll-steps", "0"], "--unroll-steps must be at least 1"),
                           (["--window", "4"], "--window must be at least 8"),
                           (["--batch-size", "0"], "--batch-size must be at least 1"),
                           (["--answers-per-prompt", "0"], "--answers-per-prompt")):
        code = main(["train-speculator", "--method", "eagle", "--out", str(tmp_path), *flags])
        assert code == 2, flags
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # argparse's own refusal
        main(["train-speculator", "--method", "tree", "--out", str(tmp_path)])
    assert exited.value.code == 2 and "invalid choice" in capsys.readouterr().err
