"""Client mistakes get the OpenAI error object with the right status, `param` and
`code`, over raw HTTP and through the official client; none is a 500."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from conftest import MODEL

MSGS = [{"role": "user", "content": "hi"}]
LONG = "word " * 400

CHAT_CASES = [
    ({"messages": MSGS, "temperature": "hot"}, "temperature", None),
    ({"messages": MSGS, "temperature": 5}, "temperature", None),
    ({"messages": MSGS, "max_tokens": 0}, "max_tokens", None),
    ({"messages": MSGS, "max_tokens": -1}, "max_tokens", None),
    ({"messages": MSGS, "n": 0}, "n", None),
    ({"messages": MSGS, "top_logprobs": 2}, "top_logprobs", None),
    ({"messages": MSGS, "logprobs": True, "top_logprobs": 50}, "top_logprobs", None),
    ({"messages": MSGS, "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"messages": MSGS, "logit_bias": {"not-a-token": 1}}, "logit_bias", None),
    ({"messages": []}, "messages", None),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content", None),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is in this picture?"},
                        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    ],
                }
            ]
        },
        "messages[0].content[1]",
        None,
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
        "messages[0].content[0]",
        None,
    ),
    ({"messages": [{"role": "user", "content": LONG}], "max_tokens": 8}, "messages", "context_length_exceeded"),
    ({"messages": MSGS, "max_tokens": 100000}, "messages", "context_length_exceeded"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", None),
    ({"messages": MSGS, "tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", None),
    (
        {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
        "tools[0].function.parameters",
        None,
    ),
    ({"messages": MSGS, "tools": [{"type": "code_interpreter"}]}, "tools[0].type", None),
    ({"messages": MSGS, "tool_choice": "required"}, "tool_choice", None),
    (
        {
            "messages": MSGS,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
        None,
    ),
    ({"messages": MSGS, "response_format": {"type": "yaml"}}, "response_format.type", None),
    ({"messages": MSGS, "response_format": {"type": "json_schema"}}, "response_format.json_schema", None),
    (
        {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}}},
        "response_format.json_schema.schema",
        None,
    ),
    (
        {
            "messages": MSGS,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}},
            },
        },
        "response_format.json_schema.schema",
        None,
    ),
]


def check_error(r: requests.Response, status: int, param, code) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["message"]
    assert err["param"] == param, err
    assert err["code"] == code, err
    return err


@pytest.mark.parametrize("body,param,code", CHAT_CASES)
def test_chat_mistakes_are_400(server, body, param, code):
    r = requests.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, **body}, timeout=30)
    err = check_error(r, 400, param, code)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body,param,code",
    [
        ({"prompt": "hi", "logprobs": 99}, "logprobs", None),
        ({"prompt": []}, "prompt", None),
        ({"prompt": [1, 2, 10**6]}, "prompt", None),
        ({"prompt": [1, 2, 3], "max_tokens": 1000}, "prompt", "context_length_exceeded"),
        ({}, "prompt", None),
    ],
)
def test_completion_mistakes_are_400(server, body, param, code):
    r = requests.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=30)
    check_error(r, 400, param, code)


def test_malformed_json_and_unknown_model(server):
    r = requests.post(
        f"{server.url}/v1/chat/completions", data=b'{"model": ', headers={"Content-Type": "application/json"}, timeout=30
    )
    check_error(r, 400, None, None)
    r = requests.post(f"{server.url}/v1/chat/completions", json={"model": "gpt-4o", "messages": MSGS}, timeout=30)
    check_error(r, 404, "model", "model_not_found")
    r = requests.get(f"{server.url}/v1/models/gpt-4o", timeout=30)
    check_error(r, 404, "model", "model_not_found")
    r = requests.get(f"{server.url}/v1/no-such-route", timeout=30)
    assert r.status_code == 404 and "error" in r.json()


def test_body_size_limit(server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (9 * 1024 * 1024)}]})
    r = requests.post(
        f"{server.url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert r.status_code == 413, r.text[:200]
    assert r.json()["error"]["message"]


def test_official_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=0)
    assert e.value.status_code == 400
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=8)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSGS)
    assert e.value.code == "model_not_found"
