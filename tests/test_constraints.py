"""Grammar-constrained decoding inside the batch (llguidance token masks).

With the embedded SmolLM2 (a weak model, which is the point): outputs under a JSON schema
parse and validate at temperature 0.7, regexes and choices are obeyed, invalid grammars
are refused up front, and unconstrained requests in the same batch get exactly the tokens
they get alone.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from mlxserve.scheduler.constraints import GrammarSpec
from mlxserve.scheduler.sampling_params import SamplingParams
from tests.conftest import Collector, greedy_reference, submit

PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


def schemas(n: int) -> list[dict]:
    """``n`` different small schemas, deterministic (bounded strings and arrays so that
    a complete object fits the token budget)."""
    rng = np.random.default_rng(7)
    kinds = [
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "boolean"},
        {"type": "string", "maxLength": 8},
        {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        {"type": "number"},
    ]
    names = ["name", "age", "city", "score", "tags", "ok", "color", "level"]
    out = []
    for i in range(n):
        keys = rng.choice(names, size=1 + i % 3, replace=False).tolist()
        props = {k: kinds[int(rng.integers(len(kinds)))] for k in keys}
        out.append(
            {
                "type": "object",
                "properties": props,
                "required": keys,
                "additionalProperties": False,
            }
        )
    return out


def run(engine, requests: dict[str, tuple[list[int], SamplingParams, GrammarSpec | None]]):
    col = Collector()
    for rid, (prompt, params, grammar) in requests.items():
        engine.add_request(rid, prompt, params, col.callback(rid), grammar=grammar)
    return {rid: (col.tokens[rid], col.wait(rid, timeout=120)) for rid in requests}


def test_twenty_schemas_at_temperature_all_parse_and_validate(smollm, make_engine):
    engine = make_engine(smollm, max_total_tokens=8192, max_prefill_tokens=512)
    prompt = smollm.tokenizer.encode(PROMPT)
    cases = schemas(20)
    requests = {
        str(i): (
            prompt,
            SamplingParams(max_tokens=160, temperature=0.7, seed=i),
            GrammarSpec("json_schema", json.dumps(schema)),
        )
        for i, schema in enumerate(cases)
    }
    results = run(engine, requests)
    for i, schema in enumerate(cases):
        tokens, final = results[str(i)]
        assert final.finish_reason == "stop", (i, final.finish_reason, final.error)
        text = smollm.tokenizer.decode(tokens)
        value = json.loads(text)
        jsonschema.validate(value, schema)


def test_regex_and_choice(smollm, make_engine):
    engine = make_engine(smollm, max_total_tokens=4096)
    prompt = smollm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=3)
    results = run(
        engine,
        {
            "regex": (prompt, params, GrammarSpec("regex", r"[A-Z][a-z]{2,6} [0-9]{2}")),
            "choice": (prompt, params, GrammarSpec("choice", json.dumps(["yes", "no"]))),
        },
    )
    text = smollm.tokenizer.decode(results["regex"][0])
    assert re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", text), text
    assert smollm.tokenizer.decode(results["choice"][0]) in {"yes", "no"}


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("json_schema", '{"type": "no-such-type"}'),
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("regex", "(unclosed"),
        GrammarSpec("lark", "start: undefined_rule"),
    ],
)
def test_invalid_grammars_are_refused_before_queueing(smollm, make_engine, spec):
    engine = make_engine(smollm, max_total_tokens=1024)
    with pytest.raises(ValueError, match="invalid"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(), lambda e: None, grammar=spec)


def test_plain_requests_beside_constrained_ones_are_unchanged(smollm, make_engine):
    engine = make_engine(smollm, max_total_tokens=4096)
    tok = smollm.tokenizer
    plain = [tok.encode("The capital of France is"), tok.encode("One, two, three,")]
    refs = [greedy_reference(smollm.model, p, 12) for p in plain]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    json_spec = GrammarSpec("json_object")
    requests = {
        "c0": (tok.encode(PROMPT), SamplingParams(max_tokens=30, temperature=0.0), json_spec),
        "p0": (plain[0], greedy, None),
        "c1": (tok.encode(PROMPT), SamplingParams(max_tokens=30, temperature=0.7), json_spec),
        "p1": (plain[1], greedy, None),
    }
    results = run(engine, requests)
    assert results["p0"][0] == refs[0]
    assert results["p1"][0] == refs[1]
    # The constrained greedy row starts a JSON object although the model would not.
    assert tok.decode(results["c0"][0]).lstrip().startswith("{")


def test_a_failing_token_hook_fails_only_its_request(tiny_llama, make_engine, monkeypatch):
    engine = make_engine(tiny_llama, max_total_tokens=256)
    scheduler = engine.scheduler
    accept = scheduler._accept

    def faulty_accept(req, token):
        # Fault injection from the test side: taking the victim's third token raises.
        if req.request_id == "victim" and req.output_len == 2:
            raise RuntimeError("injected fault")
        return accept(req, token)

    monkeypatch.setattr(scheduler, "_accept", faulty_accept)
    col = Collector()
    for rid in ("a", "victim", "b"):
        submit(engine, col, rid, [5, 6, 7], max_tokens=6, temperature=0.0, ignore_eos=True)
    assert col.wait("victim").finish_reason == "error"
    assert "injected fault" in col.wait("victim").error
    assert col.wait("a").finish_reason == col.wait("b").finish_reason == "length"
    assert col.tokens["a"] == col.tokens["b"] == greedy_reference(tiny_llama.model, [5, 6, 7], 6)
