"""Several API keys: --api-key repeated, --api-key-file (one key per line), $SPECSERVE_API_KEY only
when neither is given; a file without keys, or a key with whitespace, stops the server at start-up."""

from __future__ import annotations

import pytest

from server.api_key import key_tenant
from server.cli import resolve_api_keys


def test_flags_and_file_add_up_and_the_environment_is_the_fallback(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nk-file-1\n\n  k-file-2  \nk-a\n")
    env = {"SPECSERVE_API_KEY": "k-env"}
    assert resolve_api_keys(["k-a", "k-b"], str(path), env) == ("k-a", "k-b", "k-file-1",
                                                                "k-file-2")
    assert resolve_api_keys(None, None, env) == ("k-env",)
    assert resolve_api_keys(None, None, {}) == ()


@pytest.mark.parametrize("content, message", [
    ("", "holds no keys"),
    ("# only a comment\n\n", "holds no keys"),
    ("two words\n", "whitespace"),
])
def test_a_bad_key_file_is_refused(tmp_path, content, message):
    path = tmp_path / "keys"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        resolve_api_keys(None, str(path), {})


def test_a_missing_key_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        resolve_api_keys(None, str(tmp_path / "absent"), {})


def test_a_blank_repeated_key_is_refused():
    with pytest.raises(ValueError, match="--api-key is set but empty"):
        resolve_api_keys(["good", ""], None, {})


def test_a_tenant_is_a_digest_of_its_key():
    assert key_tenant("sk-a") != key_tenant("sk-b")
    assert "sk-a" not in key_tenant("sk-a") and key_tenant("sk-a").startswith("key:")
