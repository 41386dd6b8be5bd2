"""A dead engine thread: the request in flight gets an error, /health says 503, and the
process exits non-zero (a supervisor can restart it) instead of hanging on.

The real CLI runs in a subprocess whose engine is made to die (a patched ``_run_batch``
that raises a ``SystemError`` for requests asking for exactly 7 tokens, so warm-up and
other requests are unaffected)."""

from __future__ import annotations

import time

import httpx

from tests.ops_helpers import cli_server, completion

DYING_ENGINE = """
import sys
from mlxserve.scheduler.engine import Engine

run_batch = Engine._run_batch

def dying_run_batch(self, batch):
    if any(self._requests[r].params.max_tokens == 7 for r in batch.request_ids):
        raise SystemError("injected engine fault")
    return run_batch(self, batch)

Engine._run_batch = dying_run_batch
from mlxserve.server.cli import main
sys.exit(main())
"""


def test_engine_death_fails_the_request_and_exits_non_zero() -> None:
    args = ["--log-level", "warning", "--max-total-tokens", "512"]
    with cli_server(args, script=DYING_ENGINE) as (proc, url):
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        ok = httpx.post(url + "/v1/completions", json=completion(model, max_tokens=3), timeout=60)
        assert ok.status_code == 200, ok.text
        started = time.monotonic()
        doomed = httpx.post(
            url + "/v1/completions", json=completion(model, max_tokens=7), timeout=60
        )
        assert doomed.status_code >= 500, doomed.text
        assert "error" in doomed.json(), doomed.text
        status = proc.wait(30)
        output = proc.stdout.read()
        assert status != 0, output
        assert "engine thread died" in output, output
        assert time.monotonic() - started < 30
