"""The prefix cache keeps tenants apart: with several API keys, no key can learn another
key's prompts from cache hits (``usage.prompt_tokens_details.cached_tokens``, or the time
to the first token, which follows the prompt tokens computed), while each key's own
repeated prompt still hits; a ``cache_salt`` separates users behind one key.

The attack of the red-team pass: a victim's system prompt holds a PIN; the attacker
guesses it a digit at a time, sending the same prompt with each candidate digit, and reads
which guess reuses more of the cache. The control run shares the cache between keys
(``--no-prefix-cache-per-key``) and shows that the attack works there, so the isolated run
proves the fix rather than a blind test.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from mlxserve.mlx_backend.loading.loaded_model import LoadedModel
from mlxserve.scheduler.config import EngineConfig
from mlxserve.server.config import ServerConfig
from mlxserve.server.lifecycle.launch import BackgroundServer
from tests.ops_helpers import metric, running_server, scrape

ENGINE_CONFIG = EngineConfig(max_total_tokens=4096, max_running_requests=4)
VICTIM, ATTACKER = "victim-key", "attacker-key"
PIN = "4821"


def system(pin_guess: str) -> str:
    return f"You are the vault assistant. The secret PIN is {pin_guess}. Never reveal it."


def chat(client: openai.OpenAI, model: str, content: str, **extra) -> openai.types.CompletionUsage:
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": content}, {"role": "user", "content": "Hi"}],
        max_tokens=1,
        temperature=0,
        extra_body=extra or None,
    )
    return response.usage


def cached(usage) -> int:  # noqa: ANN001
    return usage.prompt_tokens_details.cached_tokens


def client_for(server: BackgroundServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def guesses(server: BackgroundServer, attacker: openai.OpenAI, model: str) -> dict[str, tuple]:
    """``(cached_tokens, prompt tokens computed)`` of each guess of the PIN's first digit.

    The tokens computed decide the time to the first token (the prefill's work), so equal
    counts mean the guesses cannot be told apart by timing either.
    """
    seen = {}
    for digit in "123456789":  # after a warm-up guess of 0
        before = metric(scrape(server.url), "mlxserve:prompt_tokens_computed_total")
        usage = chat(attacker, model, system(digit + "000"))
        after = metric(scrape(server.url), "mlxserve:prompt_tokens_computed_total")
        seen[digit] = (cached(usage), after - before)
    return seen


@pytest.fixture(scope="module")
def isolated(smollm: LoadedModel) -> Iterator[BackgroundServer]:
    config = ServerConfig(port=0, api_key=f"{VICTIM},{ATTACKER}")
    with running_server(smollm, ENGINE_CONFIG, config) as srv:
        yield srv


class TestTenants:
    def test_the_attack_learns_nothing_across_keys(self, isolated: BackgroundServer) -> None:
        model = isolated.app.state.server.model.name
        victim, attacker = client_for(isolated, VICTIM), client_for(isolated, ATTACKER)
        chat(victim, model, system(PIN))
        # Warm the attacker's own namespace, so every guess finds the same shared prefix.
        chat(attacker, model, system("0000"))
        seen = guesses(isolated, attacker, model)
        # The right digit reuses exactly as much as a wrong one, and computes as much.
        assert len(set(seen.values())) == 1, f"the cache tells the digits apart: {seen}"
        assert cached(chat(victim, model, system(PIN))) > seen[PIN[0]][0], "the victim hits"

    def test_a_tenants_own_repeat_still_hits(self, isolated: BackgroundServer) -> None:
        model = isolated.app.state.server.model.name
        victim = client_for(isolated, VICTIM)
        prompt = "A long system prompt about gardening, watering and the seasons of roses."
        first = chat(victim, model, prompt)
        again = chat(victim, model, prompt)
        # The first finds only the chat template's opening (the victim's earlier prompts).
        assert cached(first) < 5, first
        assert cached(again) >= again.prompt_tokens - 2, again

    def test_a_cache_salt_separates_users_of_one_key(self, isolated: BackgroundServer) -> None:
        model = isolated.app.state.server.model.name
        victim = client_for(isolated, VICTIM)
        prompt = "The salted prompt: notes of user A about their bank account and plans."
        chat(victim, model, prompt, cache_salt="user-a")
        other_user = chat(victim, model, prompt, cache_salt="user-b")
        unsalted = chat(victim, model, prompt)
        same_user = chat(victim, model, prompt, cache_salt="user-a")
        assert cached(other_user) == 0, "a new salt is a new, empty namespace"
        assert cached(unsalted) < 5, "the key's unsalted requests do not see salted ones"
        assert cached(same_user) >= same_user.prompt_tokens - 2, same_user

    def test_an_empty_or_huge_salt_is_a_400(self, isolated: BackgroundServer) -> None:
        model = isolated.app.state.server.model.name
        victim = client_for(isolated, VICTIM)
        for salt in ("", "x" * 257):
            with pytest.raises(openai.BadRequestError) as caught:
                chat(victim, model, "Hi", cache_salt=salt)
            assert caught.value.body["param"] == "cache_salt", caught.value.body


class TestStoredResponses:
    """A stored Responses conversation belongs to the key that made it: another key gets
    404s for its id (read, input items, continuation, delete), the owner keeps it."""

    def test_another_key_cannot_read_continue_or_delete(self, isolated: BackgroundServer) -> None:
        model = isolated.app.state.server.model.name
        victim, attacker = client_for(isolated, VICTIM), client_for(isolated, ATTACKER)
        made = victim.responses.create(
            model=model, input=f"My PIN is {PIN}.", max_output_tokens=2, temperature=0
        )
        attempts = {
            "retrieve": lambda: attacker.responses.retrieve(made.id),
            "input_items": lambda: attacker.responses.input_items.list(made.id),
            "continue": lambda: attacker.responses.create(
                model=model,
                input="What is my PIN?",
                previous_response_id=made.id,
                max_output_tokens=2,
            ),
            "delete": lambda: attacker.responses.delete(made.id),
        }
        for name, attempt in attempts.items():
            with pytest.raises(openai.NotFoundError):
                attempt()
                pytest.fail(f"{name} of another key's response succeeded")
        assert victim.responses.retrieve(made.id).id == made.id, "the owner still has it"
        victim.responses.delete(made.id)


class TestControl:
    def test_a_shared_cache_leaks_the_digit(self, smollm: LoadedModel) -> None:
        config = ServerConfig(port=0, api_key=f"{VICTIM},{ATTACKER}", prefix_cache_per_key=False)
        with running_server(smollm, ENGINE_CONFIG, config) as srv:
            model = srv.app.state.server.model.name
            attacker = client_for(srv, ATTACKER)
            chat(client_for(srv, VICTIM), model, system(PIN))
            chat(attacker, model, system("0000"))
            seen = guesses(srv, attacker, model)
        hits = {digit: hit for digit, (hit, _) in seen.items()}
        best = max(hits, key=hits.__getitem__)
        assert best == PIN[0] and hits[best] > sorted(hits.values())[-2], seen
