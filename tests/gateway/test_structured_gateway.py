"""Structured output end to end through the real Shepherd Model Gateway, on the default
model: OpenAI chat completions with `response_format` (a JSON schema, streamed and not;
a JSON object), `tools` with `tool_choice` "required" and a named function, and the
`regex` / `ebnf` extensions the gateway forwards. Every answer parses and validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.client import SpecserveClient
from tests.gateway.gateway import Gateway
from tests.server.helpers import ServerProcess, wait_until

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Describe a person called Ana who lives in Lisbon."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def gateway():
    worker = ServerProcess("smollm2-135m-instruct", "--log-level", "WARNING")
    gw = None
    try:
        worker.start()
        with SpecserveClient(worker.target) as client:
            client.wait_serving(600)
        gw = Gateway([worker.target], None)
        wait_until(lambda: gw.num_healthy_workers() == 1, 120, "the gateway to take the worker")
        gw.model = gw.get("/v1/models")["data"][0]["id"]
        yield gw
    finally:
        if gw is not None:
            gw.stop()
        worker.kill()


def _chat(gateway: Gateway, messages, **kw) -> dict:
    body = {"model": gateway.model, "messages": messages, "max_tokens": 200, **kw}
    return gateway.post_json("/v1/chat/completions", body)[0]["choices"][0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_response_format_json_schema_validates(gateway, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    choice = _chat(gateway, ASK, response_format=fmt, temperature=temperature, seed=3)
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    assert choice["finish_reason"] == "stop"


def test_streamed_json_schema_validates_and_equals_the_whole_reply(gateway):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"model": gateway.model, "messages": ASK, "max_tokens": 200, "temperature": 0.0}
    events = gateway.stream("/v1/chat/completions", {**body, "response_format": fmt})
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    jsonschema.validate(json.loads(text), PERSON)
    whole = _chat(gateway, ASK, response_format=fmt, temperature=0.0)
    assert whole["message"]["content"] == text


def test_response_format_json_object_is_an_object(gateway):
    choice = _chat(gateway, ASK, response_format={"type": "json_object"}, temperature=0.0)
    assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tool_calls_come_back_parsed_with_valid_arguments(gateway, tool_choice):
    """ "required" lets the model make several calls (the gateway's schema is a non-empty
    array of calls); a named function, exactly one."""
    choice = _chat(gateway, WEATHER_ASK, tools=[WEATHER], tool_choice=tool_choice, temperature=0.0)
    calls = choice["message"]["tool_calls"]
    assert len(calls) >= 1 if tool_choice == "required" else len(calls) == 1
    for call in calls:
        assert call["function"]["name"] == "get_weather"
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_the_regex_and_ebnf_extensions_constrain_the_answer(gateway):
    """A choice goes through smg as ebnf (or a regex): smg 1.13 forwards no choice list."""
    choice = _chat(gateway, ASK, regex="(yes|no), [a-z ]{3,20}\\.", temperature=0.0)
    assert re.fullmatch("(yes|no), [a-z ]{3,20}\\.", choice["message"]["content"])
    grammar = 'root ::= ("red" | "green" | "blue")'
    choice = _chat(gateway, ASK, ebnf=grammar, temperature=0.0)
    assert choice["message"]["content"] in ("red", "green", "blue")
