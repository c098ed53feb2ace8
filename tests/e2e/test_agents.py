"""Tool calls, reasoning and structured output through the official OpenAI client.

The tool-calling loop (a call, the tool's result, a final answer) runs on the
default model, SmolLM2-135M-Instruct, with the call forced by `tool_choice`:
a model that small does not decide to call tools reliably by itself, but held
to the function's schema by constrained decoding its call is always
well-formed, which is what the loop needs. Structured output runs on the
random-weight tiny model: whatever it would have written, every answer under
`json_schema` parses into the Pydantic model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Literal

import pytest
from openai.types.chat import ChatCompletionToolParam
from pydantic import BaseModel, Field

from conftest import MODEL, start_server

CACHE = Path(os.environ.get("CORRIDOR_CACHE_DIR", Path.home() / ".cache" / "corridor"))
DEFAULT_MODEL = CACHE / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

WEATHER: ChatCompletionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: ChatCompletionToolParam = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


@pytest.fixture(scope="module")
def smol():
    if not DEFAULT_MODEL.exists():
        if os.environ.get("CORRIDOR_REQUIRE_ASSETS"):
            pytest.fail(f"{DEFAULT_MODEL} is missing: run `corridor pull`")
        pytest.skip(f"{DEFAULT_MODEL} is missing: run `corridor pull`")
    s = start_server(model=None)
    yield s
    assert s.stop() == 0


def check_weather_call(call) -> dict:
    assert call.id.startswith("call_"), call.id
    assert call.type == "function"
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"}, args
    assert isinstance(args["city"], str) and len(args["city"]) <= 40
    assert args["unit"] in ("celsius", "fahrenheit")
    return args


def weather_loop(client, model: str, stream: bool):
    messages = [
        {"role": "system", "content": "You are a helpful assistant with tools."},
        {"role": "user", "content": "What is the weather in Paris right now?"},
    ]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        with client.beta.chat.completions.stream(
            model=model, messages=messages, tools=[WEATHER, TIME], tool_choice=forced, max_tokens=64, temperature=0,
            stream_options={"include_usage": True},
        ) as s:
            first = s.get_final_completion()
    else:
        first = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER, TIME], tool_choice=forced, max_tokens=64, temperature=0
        )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    check_weather_call(call)

    # The call goes back as the client's own message object, then the result.
    messages.append(choice.message)
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "clear"})})
    if stream:
        with client.beta.chat.completions.stream(
            model=model, messages=messages, tools=[WEATHER, TIME], tool_choice="none", max_tokens=32, temperature=0,
            stream_options={"include_usage": True},
        ) as s:
            final = s.get_final_completion()
    else:
        final = client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER, TIME], tool_choice="none", max_tokens=32, temperature=0
        )
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length")
    assert not answer.message.tool_calls
    assert answer.message.content and answer.message.content.strip()
    # The result reached the prompt: the second turn is longer than the
    # first by at least the call and the result.
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + 10
    return call


def test_tool_loop_on_the_default_model(smol):
    client = smol.client()
    model = client.models.list().data[0].id
    plain = weather_loop(client, model, stream=False)
    streamed = weather_loop(client, model, stream=True)
    # Greedy and held to the same grammar: the same call both ways.
    assert json.loads(plain.function.arguments) == json.loads(streamed.function.arguments)


def test_required_tool_choice_calls_a_listed_tool(smol):
    client = smol.client()
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What time is it, and the weather in Rome?"}],
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=96,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            check_weather_call(call)
        else:
            assert json.loads(call.function.arguments) == {}
    assert len(choice.message.tool_calls) == 1


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]
    vaccinated: bool
    toys: List[Literal["ball", "rope"]] = Field(max_length=2)


def test_parse_with_a_pydantic_model_on_random_weights(client):
    # Sampled at temperature 1 with different seeds: the tiny model's
    # preferences are random, and only the grammar keeps the answer valid.
    for seed in range(6):
        r = client.beta.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a pet as JSON."}],
            response_format=Pet,
            temperature=1.0,
            seed=seed,
            max_tokens=150,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        pet = choice.message.parsed
        assert isinstance(pet, Pet), choice.message.content
        Pet.model_validate_json(choice.message.content)


def test_json_object_and_schema_streamed_equal_plain(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "answer"}], max_tokens=100, temperature=0)
    plain = client.chat.completions.create(response_format=fmt, **kwargs)
    text = plain.choices[0].message.content
    value = json.loads(text)
    assert isinstance(value["ok"], bool) and 0 <= value["n"] <= 99 and set(value) == {"ok", "n"}
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(response_format=fmt, stream=True, **kwargs)
        if c.choices
    )
    assert streamed == text
    # `json_object` bounds nothing, so a random model may run out of tokens
    # inside a key; what it wrote is still the start of an object, and a
    # finished one parses.
    obj = client.chat.completions.create(response_format={"type": "json_object"}, **kwargs).choices[0]
    assert obj.message.content.startswith("{"), obj.message.content
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)


def test_named_tool_choice_streams_name_then_arguments(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "weather?"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            stream=True,
            max_tokens=120,
            temperature=1.0,
            seed=3,
        )
    )
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2, "the arguments arrive in fragments"
    args = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert args["unit"] in ("celsius", "fahrenheit")
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["tool_calls"]


# A thinking template on the tiny model: the generation prompt opens a
# `<think>` block unless `enable_thinking` is false, as Qwen3's does.
THINKING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    import shutil

    from conftest import TINY

    model = tmp_path_factory.mktemp("thinking") / "tiny"
    shutil.copytree(TINY, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    s = start_server(model=model)
    yield s
    assert s.stop() == 0


def test_reasoning_content_and_enable_thinking(thinking_server):
    client = thinking_server.client()
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=24, temperature=0)
    # The prompt opened the block, so the (cut-off) answer is all reasoning.
    thinking = client.chat.completions.create(**kwargs).choices[0]
    reasoning = thinking.message.model_extra.get("reasoning_content")
    assert reasoning, thinking.message
    assert not thinking.message.content
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            parts["content"] += delta.content or ""
    assert parts == {"reasoning_content": reasoning, "content": ""}
    # With thinking switched off through the template kwargs, the prompt
    # closes the block itself and what the model writes is the answer.
    plain = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kwargs)
    message = plain.choices[0].message
    assert message.content and not (message.model_extra or {}).get("reasoning_content")
