"""Health and admission without an engine: a dead engine or a draining server answers 503, and
/health says so, so load balancers and Kubernetes stop sending traffic."""

from __future__ import annotations

from types import SimpleNamespace

from fastapi.testclient import TestClient

from engine.messages import EngineReady
from server.app import ServerState, build_app
from server.metrics import ServerMetrics
from server.openai_serving import OpenAIServing


def make_state(alive: bool, draining: bool = False) -> ServerState:
    ready = EngineReady("tiny", 128, 96, "float32", "cpu", 8, 16, None, 0)
    client = SimpleNamespace(is_alive=alive, ready=ready)
    metrics = ServerMetrics("tiny", None, 0)
    serving = OpenAIServing(client, None, "tiny", metrics, max_waiting_requests=4)
    return ServerState(client, serving, metrics, draining=draining)


def test_dead_engine_turns_health_and_requests_to_503():
    app = TestClient(build_app(make_state(alive=False)))
    assert app.get("/health").status_code == 503
    response = app.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "the engine is not running"


def test_draining_server_refuses_new_work_with_retry_after():
    app = TestClient(build_app(make_state(alive=True, draining=True)))
    assert app.get("/health").status_code == 503
    response = app.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert response.status_code == 503 and response.headers["retry-after"] == "5"


def test_healthy_server_and_openapi():
    app = TestClient(build_app(make_state(alive=True)))
    assert app.get("/health").status_code == 200
    assert app.get("/version").json()["version"]
    paths = app.get("/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(paths)
    # the statuses it documents are the ones it answers: 400 for bad input, never 422
    for route in ("/v1/completions", "/v1/chat/completions"):
        statuses = set(paths[route]["post"]["responses"])
        assert statuses == {"200", "400", "401", "404", "413", "429", "503"}
    assert app.get("/no/such/route").json()["error"]["type"] == "NotFoundError"
