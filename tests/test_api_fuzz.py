"""API fuzzer: schemathesis generates requests from the daemon's own ``/openapi.json`` —
valid ones and ones that break the schema — against a live in-process daemon. No request
may get a 5xx, every answer must be one the document lists for its route, with a body that
fits the documented model; afterwards ``/sandboxes`` and ``/events`` still answer."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support import fast_config

from sandboxkit.daemon.config import DaemonConfig
from sandboxkit.daemon.server import DaemonServer

EXAMPLES_PER_OPERATION = 10
"""Per operation and mode: ~21 operations x 2 modes x 10 keeps the run near 20 s."""

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture
def daemon_config() -> DaemonConfig:
    # Processes the fuzzer starts die quickly on their own, and the body limit is small
    # enough that oversized bodies are cheap to generate.
    # A long poll of the event journal is cut short, so a generated ``wait`` costs no time.
    return fast_config(max_body=256 * 1024, kill_grace=0.2, events_wait_max=0.05)


@pytest.fixture
def http(daemon: DaemonServer) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {daemon.token}"}
    with httpx.Client(base_url=daemon.url, headers=headers, timeout=10) as client:
        yield client


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_api_fuzz_finds_no_server_error(daemon: DaemonServer, http: httpx.Client) -> None:
    schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
    auth = {"Authorization": f"Bearer {daemon.token}"}
    statuses: Counter[int] = Counter()
    server_errors: list[str] = []

    for result in schema.get_all_operations():
        operation = result.ok()
        # Real targets, so that generated requests reach past "no such sandbox": a fresh
        # sandbox per operation (an earlier one may have deleted it) with an exited
        # process (a stream of it ends at once).
        sid = http.post("/sandboxes", json={"auto_resume": True}).json()["sandbox_id"]
        started = http.post(f"/sandboxes/{sid}/processes", json={"argv": ["echo", "hi"]})
        pid = started.json()["pid"]
        known: dict[str, Any] = {}
        if "{sid}" in operation.path:
            known["sid"] = sid
        if "{pid}" in operation.path:
            known["pid"] = pid
        strategies = [
            operation.as_strategy(mode, path_parameters=params)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
            for params in ([known, None] if known else [None])
        ]

        @settings(
            max_examples=EXAMPLES_PER_OPERATION * 2,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=st.one_of(strategies))
        def fuzz(case: Any) -> None:
            response = case.call(base_url=daemon.url, headers=auth, timeout=10)
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                server_errors.append(f"{case.method} {case.formatted_path}: {response.text[:300]}")
            case.validate_response(response, checks=CHECKS)

        fuzz()

    tried = sum(statuses.values())
    print(f"\napi fuzz: {tried} requests, statuses {dict(sorted(statuses.items()))}")
    assert not server_errors, server_errors
    assert tried >= 200
    assert any(200 <= s < 300 for s in statuses) and any(400 <= s < 500 for s in statuses)
    # The daemon still answers, and what it stores still serialises.
    assert http.get("/sandboxes").status_code == 200
    assert http.get("/events").status_code == 200
    assert http.get("/consumers").status_code == 200
    assert http.get("/health").json()["status"] == "ok"
