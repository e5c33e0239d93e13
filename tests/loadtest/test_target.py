"""The loopback guard: a load test goes to this machine unless --allow-remote says otherwise."""

from __future__ import annotations

import pytest

from loadtest.cli import main
from loadtest.target import TargetError, is_loopback, normalize_base_url, require_loopback


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1",
                                 "http://127.8.0.3", "http://[::1]:8000"])
def test_loopback_urls_are_allowed(url):
    assert is_loopback(url)
    require_loopback(url, allow_remote=False)


@pytest.mark.parametrize("url", ["http://10.0.0.7:8000", "https://api.example.com",
                                 "http://0.0.0.0:8000", "http://127.0.0.1.example.com"])
def test_other_hosts_need_allow_remote(url):
    assert not is_loopback(url)
    with pytest.raises(TargetError, match="--allow-remote"):
        require_loopback(url, allow_remote=False)
    require_loopback(url, allow_remote=True)


def test_base_urls_are_taken_with_or_without_v1():
    assert normalize_base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    with pytest.raises(TargetError):
        normalize_base_url("127.0.0.1:8000")


def test_the_cli_refuses_a_remote_server_before_sending_anything(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--base-url", "http://192.0.2.10:8000", "--num-requests", "1"])
    assert caught.value.code == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_the_cli_reports_bad_flags_clearly(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    for argv, message in ((["--goodput", "ttft"], "METRIC:MS"),
                          (["--dataset", "jsonl", "--dataset-path", str(bad)], "bad.jsonl:1"),
                          (["--qps", "0"], "must be > 0"),
                          (["--compare", "ngram", "ngram"], "labels must differ")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
