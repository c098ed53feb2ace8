"""The server as the official OpenAI Python client sees it, on the tiny fixture model.

The tiny model has random weights: its text is gibberish, but greedy decoding is
deterministic, which is what these tests lean on. `ignore_eos` (a vLLM extension,
sent through `extra_body`) makes lengths exact whatever the weights prefer.
"""

from __future__ import annotations

from conftest import CONTEXT, MODEL

EXACT = {"ignore_eos": True}


def chat_args(content: str, max_tokens: int | None = 24, **kw) -> dict:
    args = dict(model=MODEL, messages=[{"role": "user", "content": content}], temperature=0, extra_body=EXACT)
    if max_tokens is not None:
        args["max_tokens"] = max_tokens
    args.update(kw)
    return args


def collect_chat_stream(stream) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                assert c.index not in finishes, "two finish reasons for one choice"
                finishes[c.index] = c.finish_reason
    return texts, finishes, chunks


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_greedy_stream_equals_non_stream(client):
    whole = client.chat.completions.create(**chat_args("Tell me a story"))
    assert whole.object == "chat.completion"
    assert whole.model == MODEL
    choice = whole.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24

    stream = client.chat.completions.create(
        **chat_args("Tell me a story"), stream=True, stream_options={"include_usage": True}
    )
    texts, finishes, chunks = collect_chat_stream(stream)
    assert chunks[0].choices[0].delta.role == "assistant", "the first delta carries the role"
    assert texts == {0: choice.message.content}
    assert finishes == {0: "length"}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 24
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_greedy_stream_equals_non_stream(client):
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, extra_body=EXACT)
    whole = client.completions.create(**args)
    assert whole.object == "text_completion"
    text = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True) if c.choices)
    assert text == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length"


def test_stop_sequences_are_excluded(client):
    full = client.chat.completions.create(**chat_args("The weather today", 40)).choices[0].message.content
    middle = len(full) // 2
    stop = full[middle : middle + 2]
    expected = full[: full.index(stop)]

    got = client.chat.completions.create(**chat_args("The weather today", 40), stop=["zzz-never", stop])
    assert got.choices[0].message.content == expected
    assert got.choices[0].finish_reason == "stop"
    assert 0 < got.usage.completion_tokens < 40

    texts, finishes, chunks = collect_chat_stream(
        client.chat.completions.create(**chat_args("The weather today", 40), stop=stop, stream=True)
    )
    assert texts == {0: expected}
    assert finishes == {0: "stop"}
    assert all(stop not in (c.choices[0].delta.content or "") for c in chunks if c.choices)

    comp_full = client.completions.create(
        model=MODEL, prompt="The weather", max_tokens=30, temperature=0, extra_body=EXACT
    ).choices[0].text
    comp_stop = comp_full[len(comp_full) // 2 :][:2]
    got = client.completions.create(
        model=MODEL, prompt="The weather", max_tokens=30, temperature=0, stop=comp_stop, extra_body=EXACT
    )
    assert got.choices[0].text == comp_full[: comp_full.index(comp_stop)]
    assert got.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_repeatable_and_n_choices(client):
    args = chat_args("Pick some words", 16, temperature=1.0, seed=1234, n=3)
    a = client.chat.completions.create(**args)
    b = client.chat.completions.create(**args)
    texts_a = [c.message.content for c in a.choices]
    assert texts_a == [c.message.content for c in b.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len(set(texts_a)) > 1, "choices of one seeded request should differ"
    assert a.usage.completion_tokens == 48
    assert a.system_fingerprint

    texts, finishes, _ = collect_chat_stream(client.chat.completions.create(**args, stream=True))
    assert [texts[i] for i in range(3)] == texts_a
    assert finishes == {0: "length", 1: "length", 2: "length"}


def test_chat_logprobs(client):
    r = client.chat.completions.create(**chat_args("Numbers", 6), logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for t in content:
        assert t.logprob <= 0
        assert isinstance(t.bytes, list)
        assert 1 <= len(t.top_logprobs) <= 3
        assert t.top_logprobs[0].token == t.token  # greedy picks the likeliest
        assert all(isinstance(alt.bytes, list) for alt in t.top_logprobs)
    # Each token's raw bytes, joined, are the reply's UTF-8 (a character split
    # over tokens included).
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", errors="replace") == r.choices[0].message.content
    plain = client.chat.completions.create(**chat_args("Numbers", 2))
    assert plain.choices[0].logprobs is None


def test_completion_forms_echo_and_legacy_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2, extra_body=EXACT)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) <= 2 for t in lp.top_logprobs)

    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=4, temperature=0, echo=True, extra_body=EXACT)
    assert r.choices[0].text.startswith("Hello there")

    r = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=3, temperature=0, extra_body=EXACT)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 6

    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0, extra_body=EXACT)
    assert ids.usage.prompt_tokens == 4
    lists = client.completions.create(
        model=MODEL, prompt=[[5, 6, 7, 8], [9, 10]], max_tokens=3, temperature=0, extra_body=EXACT
    )
    assert lists.choices[0].text == ids.choices[0].text
    assert lists.usage.prompt_tokens == 6


def test_token_limits(client):
    # Absent max_tokens: only the end of the context stops a generation that
    # ignores EOS. Never a silent small cap.
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], temperature=0, extra_body=EXACT)
    assert r.usage.completion_tokens == CONTEXT - 4
    assert r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(**chat_args("hi", 9), max_completion_tokens=4)
    assert r.usage.completion_tokens == 4


def test_chat_template_kwargs_and_unknown_fields_are_accepted(client):
    args = chat_args("hi", 2, user="someone", metadata={"k": "v"})
    args["extra_body"] = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    r = client.chat.completions.create(**args)
    assert r.choices[0].finish_reason == "length"


def test_prefix_cache_serves_a_shared_prompt(server, client):
    shared = "the quick brown fox jumps over the lazy dog " * 8
    first = client.completions.create(model=MODEL, prompt=shared, max_tokens=2, temperature=0, extra_body=EXACT)
    before = server.wait_idle()["prefix_hit_tokens"]
    second = client.completions.create(model=MODEL, prompt=shared + "and then", max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached >= (first.usage.prompt_tokens // 16 - 1) * 16, (cached, first.usage)
    assert server.wait_idle()["prefix_hit_tokens"] - before >= cached
