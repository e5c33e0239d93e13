"""The server under test: where it is, which API and model to use, and the loopback guard (a load
test aimed at someone else's server by a typo is an attack, so remote hosts need --allow-remote)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

API_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


class TargetError(RuntimeError):
    """The server cannot be used: refused URL, unreachable, or no model to name."""


@dataclass(frozen=True)
class Endpoint:
    """Everything a request needs to reach the server."""

    base_url: str         # scheme://host:port, without /v1
    model: str            # the served model name sent in every request
    api: str              # "chat" or "completions"
    api_key: str | None   # sent as a bearer token when set

    @property
    def url(self) -> str:
        return self.base_url + API_PATHS[self.api]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def normalize_base_url(base_url: str) -> str:
    """Accept http://host:port or http://host:port/v1; return the form without /v1."""
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetError(f"not an http(s) URL: {base_url!r}")
    return url


def is_loopback(base_url: str) -> bool:
    host = urlsplit(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def require_loopback(base_url: str, allow_remote: bool) -> None:
    if not allow_remote and not is_loopback(base_url):
        raise TargetError(f"{base_url} is not a loopback address; pass --allow-remote to load-test "
                          "a server on another host")


def discover_model(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The first model the server lists on /v1/models (also proves it is up)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as error:
        raise TargetError(f"cannot reach {base_url}/v1/models: {error}") from error
    if response.status_code != 200:
        raise TargetError(f"{base_url}/v1/models answered {response.status_code}: "
                          f"{response.text[:200]}")
    models = response.json().get("data") or []
    if not models:
        raise TargetError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]
