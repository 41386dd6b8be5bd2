"""An engine stand-in that answers every request with scripted tokens, and apps around it.

For HTTP tests of what the server makes of the engine's output (reasoning split, logprobs
shapes, templates) where a real model's output cannot be chosen: each request gets the
script's tokens, one event per token, with made-up logprobs when the request asks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.constraints import GrammarSpec
from mlxserve.scheduler.outputs import RequestOutput, TokenLogprob
from mlxserve.scheduler.sampling_params import SamplingParams
from mlxserve.scheduler.stats import EngineStats
from mlxserve.server.app import create_app
from mlxserve.server.config import ServerConfig

Script = Callable[[list[int], SamplingParams], list[int]]


class ScriptedConstraint:
    """A compiled grammar as far as the scripted engine cares: its spec."""

    def __init__(self, spec: GrammarSpec) -> None:
        self.spec = spec

    def copy(self) -> ScriptedConstraint:
        return ScriptedConstraint(self.spec)


class ScriptedEngine:
    """Answers with ``script(prompt, params)`` (cut at ``max_tokens``); the logprob of the
    i-th token is ``-0.1 * (i + 1)``, its alternatives the token itself then ``token + 1``.

    Attributes:
        requests: ``(request_id, prompt, params)`` of every request, in order.
        grammars: the grammar of every request (None: unconstrained), in order; the script
            is not checked against it.
        aborted: ids of the requests aborted.
    """

    max_context_len = 4096
    max_running_requests = 32
    error: BaseException | None = None

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.grammars: list[Any] = []
        self.aborted: list[str] = []
        self.observer: Any = None

    @property
    def is_alive(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return EngineStats()

    def compile_grammar(self, spec: GrammarSpec) -> Any:
        """No matcher: the script is not checked against the grammar; the spec is kept."""
        return ScriptedConstraint(spec)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        return True

    def shutdown(self) -> None:
        pass

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        grammar: GrammarSpec | None = None,
        constraint: Any = None,
        cache_namespace: str = "",
    ) -> None:
        self.requests.append((request_id, list(prompt_ids), params))
        self.grammars.append(constraint.spec if constraint is not None else grammar)
        tokens = self.script(list(prompt_ids), params)[: params.max_tokens]
        reason = "length" if len(tokens) == params.max_tokens else "stop"
        for i, token in enumerate(tokens):
            logprobs = None
            if params.logprobs is not None:
                lp = -0.1 * (i + 1)
                top = ((token, lp), (token + 1, lp - 1.0))[: params.logprobs]
                logprobs = [TokenLogprob(token, lp, top)]
            last = i == len(tokens) - 1
            on_output(
                RequestOutput(
                    request_id,
                    [token],
                    finished=last,
                    finish_reason=reason if last else None,
                    logprobs=logprobs,
                )
            )

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.aborted.append(request_id)


def tokenizer_with_template(tokenizer: Any, template: str | None) -> TokenizerWrapper:
    """A copy of an mlx-lm tokenizer with another chat template (None: without one)."""
    hf = copy.copy(tokenizer._tokenizer)
    hf.chat_template = template
    return TokenizerWrapper(hf, eos_token_ids=list(tokenizer.eos_token_ids))


def scripted_client(tokenizer: Any, script: Script) -> tuple[TestClient, ScriptedEngine]:
    """A test client of the app serving ``tokenizer`` through a ``ScriptedEngine``."""
    engine = ScriptedEngine(script)
    vocab = {"vocab_size": len(tokenizer)}
    loaded = LoadedModel(None, tokenizer, "scripted", vocab, context_length=4096)
    app = create_app(loaded, engine, ServerConfig())
    return TestClient(app, base_url="http://localhost"), engine
