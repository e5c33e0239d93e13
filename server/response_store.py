"""Stored responses (`store: true`, OpenAI's default), for GET /v1/responses/{id} and for
`previous_response_id`: each response with the conversation it ended, in memory, bounded.

Each API key's tenant has a store of its own (DESIGN.md "Tenancy"): one tenant can neither read
another's responses nor evict them. Within a tenant the least recently used response goes first
once the cap is reached; a client that continues an evicted one gets a 404.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from server.responses_api import InputItem
from server.responses_formatter import ResponseObject

# responses kept per tenant; tenants are the server's API keys plus the anonymous one
DEFAULT_MAX_RESPONSES = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    # the conversation up to and including this response's output, as input items: what a
    # response continuing it is prepended with (instructions are not carried over, as OpenAI's)
    conversation: tuple[InputItem, ...]


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES) -> None:
        """`max_responses`: per tenant."""
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, got {max_responses}")
        self.max_responses = max_responses
        self._tenants: dict[str | None, OrderedDict[str, StoredResponse]] = {}

    def put(self, tenant: str | None, stored: StoredResponse) -> None:
        responses = self._tenants.setdefault(tenant, OrderedDict())
        responses[stored.response.id] = stored
        responses.move_to_end(stored.response.id)
        while len(responses) > self.max_responses:
            responses.popitem(last=False)

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        responses = self._tenants.get(tenant)
        stored = None if responses is None else responses.get(response_id)
        if stored is not None:
            responses.move_to_end(response_id)
        return stored

    def delete(self, tenant: str | None, response_id: str) -> bool:
        responses = self._tenants.get(tenant)
        return responses is not None and responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        return sum(len(responses) for responses in self._tenants.values())
