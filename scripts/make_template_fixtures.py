#!/usr/bin/env python3
"""Writes the chat-template fixtures under tests/fixtures/templates/.

Renders a fixed set of conversations through real chat templates with
transformers' own renderer (transformers.utils.chat_template_utils, the code
behind `apply_chat_template`), and stores the templates plus the expected
strings, so the Rust renderer can be compared against Python exactly.

Run by hand after scripts/fetch_test_assets.sh has extracted the templates:

    python3 scripts/make_template_fixtures.py [--templates DIR] [--out DIR]

Needs `transformers` (any 4.4x or 5.x) and jinja2 >= 3.1.

Dates: `strftime_now` would make the output depend on the day it runs, so
the script freezes transformers' clock at FROZEN_UNIX (UTC) and records that
instant in every case as `now_unix`; the Rust test hands the same instant to
the renderer. Some Llama cases also pass a fixed `date_string` kwarg, which
those templates prefer over `strftime_now`.
"""

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
from pathlib import Path

import jinja2
import transformers
from transformers.utils import chat_template_utils as ctu

# 2024-07-26 12:34:56 UTC.
FROZEN_UNIX = 1_721_997_296


class FrozenDatetime(_dt.datetime):
    """datetime whose now() is fixed (UTC, without a zone, as the templates print it)."""

    @classmethod
    def now(cls, tz=None):
        return cls.fromtimestamp(FROZEN_UNIX, _dt.timezone.utc).replace(tzinfo=None)


# transformers' strftime_now calls `datetime.now()` through this module global.
ctu.datetime = FrozenDatetime

# Which templates, and the special tokens their tokenizers give them.
TEMPLATES = {
    "Qwen-Qwen3-0.6B.jinja": {"bos_token": None, "eos_token": "<|im_end|>"},
    "meta-llama-Llama-3.1-8B-Instruct.jinja": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "meta-llama-Llama-3.2-3B-Instruct.jinja": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": {"bos_token": "<s>", "eos_token": "</s>"},
    "HuggingFaceTB-SmolLM3-3B.jinja": {"bos_token": None, "eos_token": "<|im_end|>"},
}

# SmolLM2's template as stored in its GGUF (tokenizer.chat_template); it is
# small, so it is kept here rather than read from the 98 MB file.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7.5},
            },
            "required": ["city"],
        },
    },
}

CONVERSATIONS = {
    "single_user": {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "add_generation_prompt": True,
    },
    "system_multi_turn": {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello. How can I help?"},
            {"role": "user", "content": "Name a prime number."},
        ],
        "add_generation_prompt": True,
    },
    "no_generation_prompt": {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
        ],
        "add_generation_prompt": False,
    },
    "unicode_and_quotes": {
        "messages": [
            {
                "role": "user",
                "content": "Grüße, 世界! \"double\" and 'single' quotes, <tag> & ampersand, emoji 🎉\n  indented\ttab",
            }
        ],
        "add_generation_prompt": True,
    },
    "tools": {
        "messages": [
            {"role": "system", "content": "Use tools when useful."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call12345",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call12345", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}"},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    "enable_thinking_false": {
        "messages": [{"role": "user", "content": "Quick answer: 7*6?"}],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": False},
    },
    "reasoning_history": {
        "messages": [
            {"role": "user", "content": "Is 9 prime?"},
            {"role": "assistant", "content": "No, 9 = 3*3.", "reasoning_content": "9 is divisible by 3."},
            {"role": "user", "content": "And 11?"},
        ],
        "add_generation_prompt": True,
    },
    "content_parts": {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Say hi."}]},
        ],
        "add_generation_prompt": True,
    },
    "fixed_date_string": {
        "messages": [{"role": "user", "content": "What day is it?"}],
        "add_generation_prompt": True,
        "kwargs": {"date_string": "01 Jan 2030"},
    },
    "roles_not_alternating": {
        "messages": [
            {"role": "user", "content": "one"},
            {"role": "user", "content": "two"},
        ],
        "add_generation_prompt": True,
    },
}


def render(template, tokens, conv):
    """Renders like tokenizer.apply_chat_template(tokenize=False)."""
    messages = ctu._normalize_chat_messages(conv["messages"])
    kwargs = {k: v for k, v in tokens.items() if v is not None}
    kwargs.update(conv.get("kwargs", {}))
    rendered, _ = ctu.render_jinja_template(
        conversations=[messages],
        tools=conv.get("tools"),
        chat_template=template,
        add_generation_prompt=conv["add_generation_prompt"],
        **kwargs,
    )
    return rendered[0]


def main():
    root = Path(__file__).resolve().parent.parent
    assets = Path(os.environ.get("CORRIDOR_TEST_ASSETS", root / "target" / "test-assets"))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--templates", type=Path, default=assets / "llama-cpp-python" / "templates")
    ap.add_argument("--out", type=Path, default=root / "tests" / "fixtures" / "templates")
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    templates = {}
    for name, tokens in TEMPLATES.items():
        src = args.templates / name
        if not src.is_file():
            sys.exit(f"missing template {src}; run scripts/fetch_test_assets.sh first")
        shutil.copyfile(src, args.out / name)
        templates[name] = (src.read_text(encoding="utf-8"), tokens)
    smollm2 = "SmolLM2-135M-Instruct.gguf.jinja"
    (args.out / smollm2).write_text(SMOLLM2_TEMPLATE, encoding="utf-8")
    templates[smollm2] = (SMOLLM2_TEMPLATE, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})

    cases = []
    for name, (template, tokens) in templates.items():
        for conv_name, conv in CONVERSATIONS.items():
            case = {
                "template": name,
                "conversation": conv_name,
                "bos_token": tokens["bos_token"],
                "eos_token": tokens["eos_token"],
                "messages": conv["messages"],
                "tools": conv.get("tools"),
                "add_generation_prompt": conv["add_generation_prompt"],
                "kwargs": conv.get("kwargs", {}),
                "now_unix": FROZEN_UNIX,
            }
            try:
                case["expected"] = render(template, tokens, conv)
            except jinja2.exceptions.TemplateError as e:
                # raise_exception raises a bare TemplateError; anything else
                # (a type error inside the template) is not a behaviour we pin.
                if type(e) is not jinja2.exceptions.TemplateError:
                    print(f"skip {name} / {conv_name}: {type(e).__name__}: {e}")
                    continue
                case["expected_error"] = str(e)
            except Exception as e:  # noqa: BLE001 - templates fail in many ways on inputs they do not support
                print(f"skip {name} / {conv_name}: {type(e).__name__}: {e}")
                continue
            cases.append(case)

    doc = {
        "generator": "scripts/make_template_fixtures.py",
        "transformers": transformers.__version__,
        "jinja2": jinja2.__version__,
        "frozen_clock": "strftime_now is frozen at now_unix (UTC); pass the same instant to the renderer",
        "cases": cases,
    }
    with open(args.out / "cases.json", "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases for {len(templates)} templates to {args.out}")


if __name__ == "__main__":
    main()
