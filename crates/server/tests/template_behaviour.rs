//! The pieces of transformers' template environment, one at a time.
//! Expected strings were produced with Python's json.dumps and jinja2.

use std::time::{Duration, UNIX_EPOCH};

use corridor_server::template::{ChatTemplate, RenderOptions, TemplateError, CHATML_TEMPLATE};
use serde_json::json;

fn render(source: &str, messages: serde_json::Value, opts: &RenderOptions) -> Result<String, TemplateError> {
    ChatTemplate::new(source, Some("<s>"), Some("</s>"))?.render(&messages, opts)
}

fn with_kwargs(kwargs: serde_json::Value) -> RenderOptions {
    RenderOptions { kwargs: kwargs.as_object().unwrap().clone(), ..RenderOptions::default() }
}

fn sample() -> serde_json::Value {
    // Parsed from text so that key order and float-ness are what a request carries.
    serde_json::from_str(
        r#"{"b": 1, "a": [1.0, 2.5, 1e16, -3, true, null], "s": "<tag> & 'q' \"d\" é\n\t\u0001", "e": {}, "l": []}"#,
    )
    .unwrap()
}

#[test]
fn tojson_is_python_json_dumps() {
    let opts = with_kwargs(json!({ "data": sample() }));
    assert_eq!(
        render("{{ data | tojson }}", json!([]), &opts).unwrap(),
        r#"{"b": 1, "a": [1.0, 2.5, 1e+16, -3, true, null], "s": "<tag> & 'q' \"d\" é\n\t\u0001", "e": {}, "l": []}"#
    );
    assert_eq!(
        render("{{ data | tojson(indent=2) }}", json!([]), &opts).unwrap(),
        "{\n  \"b\": 1,\n  \"a\": [\n    1.0,\n    2.5,\n    1e+16,\n    -3,\n    true,\n    null\n  ],\n  \"s\": \"<tag> & 'q' \\\"d\\\" é\\n\\t\\u0001\",\n  \"e\": {},\n  \"l\": []\n}"
    );
    assert_eq!(
        render(
            "{{ data | tojson(ensure_ascii=true, sort_keys=true, separators=[',', ':']) }}",
            json!([]),
            &opts
        )
        .unwrap(),
        r#"{"a":[1.0,2.5,1e+16,-3,true,null],"b":1,"e":{},"l":[],"s":"<tag> & 'q' \"d\" \u00e9\n\t\u0001"}"#
    );
}

#[test]
fn raise_exception_is_reported_as_the_templates_own_refusal() {
    let err = render(
        "line one\n{{ raise_exception('roles must alternate') }}",
        json!([]),
        &RenderOptions::default(),
    )
    .unwrap_err();
    match err {
        TemplateError::Raised { message, line } => {
            assert_eq!(message, "roles must alternate");
            assert_eq!(line, Some(2));
        }
        other => panic!("expected Raised, got {other:?}"),
    }
    // Other failures are not mistaken for a refusal.
    let err = render("{{ messages.nope.deeper }}", json!([]), &RenderOptions::default()).unwrap_err();
    assert!(matches!(err, TemplateError::Render { .. }), "{err:?}");
}

#[test]
fn printed_values_look_like_python() {
    let opts = with_kwargs(json!({"v": [1, "it's", "a\nb", true, null, {"k": 2.0, "q": "x"}]}));
    assert_eq!(
        render("{{ v }}|{{ v[3] }}|{{ v[4] }}|{{ v[5].k }}|{{ v[1] }}", json!([]), &opts).unwrap(),
        r#"[1, "it's", 'a\nb', True, None, {'k': 2.0, 'q': 'x'}]|True|None|2.0|it's"#
    );
}

#[test]
fn syntax_errors_name_the_line() {
    let err = ChatTemplate::new("ok\n{% if %}", None, None).unwrap_err();
    assert!(matches!(err, TemplateError::Syntax { line: Some(2), .. }), "{err:?}");
}

#[test]
fn strftime_now_uses_the_given_clock() {
    let opts = RenderOptions {
        now: Some(UNIX_EPOCH + Duration::from_secs(1_721_997_296)),
        ..RenderOptions::default()
    };
    assert_eq!(
        render("{{ strftime_now('%d %b %Y, %H:%M') }}", json!([]), &opts).unwrap(),
        "26 Jul 2024, 12:34"
    );
    // Without a fixed clock it still renders (today's date).
    let today = render("{{ strftime_now('%Y') }}", json!([]), &RenderOptions::default()).unwrap();
    assert!(today.parse::<u32>().unwrap() >= 2024);
}

#[test]
fn blocks_trim_like_transformers() {
    // trim_blocks drops the newline after a tag; lstrip_blocks the indent before it.
    let source = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n";
    let out = render(
        source,
        json!([{"role": "user", "content": "a"}, {"role": "x", "content": "b"}]),
        &RenderOptions::default(),
    );
    assert_eq!(out.unwrap(), "[a]\n");
}

#[test]
fn variables_match_transformers() {
    let source = "{{ bos_token }}|{{ eos_token }}|{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}|{{ enable_thinking }}";
    let opts = RenderOptions {
        add_generation_prompt: true,
        kwargs: json!({"enable_thinking": false}).as_object().unwrap().clone(),
        ..RenderOptions::default()
    };
    assert_eq!(render(source, json!([]), &opts).unwrap(), "<s>|</s>|True|True|True|False");
    let opts = RenderOptions {
        tools: Some(json!([{"type": "function", "function": {"name": "f"}}])),
        ..RenderOptions::default()
    };
    assert_eq!(render("{{ tools[0].function.name }}", json!([]), &opts).unwrap(), "f");
    // Kwargs may override the special tokens but not what the renderer sets.
    let opts = with_kwargs(json!({"bos_token": "<B>"}));
    assert_eq!(render("{{ bos_token }}", json!([]), &opts).unwrap(), "<B>");
    let err = render("", json!([]), &with_kwargs(json!({"messages": []}))).unwrap_err();
    assert!(matches!(err, TemplateError::ReservedKwarg { name } if name == "messages"));
}

#[test]
fn messages_are_normalized_like_transformers() {
    // A null key is dropped, so "is defined" tests see it as absent.
    let source = "{% for m in messages %}{{ m.tool_calls is defined }}{% endfor %}";
    let out = render(
        source,
        json!([{"role": "assistant", "content": "x", "tool_calls": null}]),
        &RenderOptions::default(),
    );
    assert_eq!(out.unwrap(), "False");
    // Reasoning given under any of its names is visible under both template names.
    let source = "{% for m in messages %}{{ m.reasoning_content }}/{{ m.thinking }}{% endfor %}";
    let out = render(
        source,
        json!([{"role": "assistant", "content": "x", "reasoning": "r"}]),
        &RenderOptions::default(),
    );
    assert_eq!(out.unwrap(), "r/r");
    let err = render("", json!({"role": "user"}), &RenderOptions::default()).unwrap_err();
    assert!(matches!(err, TemplateError::InvalidMessages { .. }));
}

#[test]
fn python_string_methods_and_generation_blocks_work() {
    let source = "{% for m in messages %}{%- generation -%}{{ m.content.strip().split('</think>')[-1].lstrip('\\n') }}{%- endgeneration -%}{% endfor %}";
    let out = render(
        source,
        json!([{"role": "assistant", "content": "  <think>x</think>\n\nanswer "}]),
        &RenderOptions::default(),
    );
    assert_eq!(out.unwrap(), "answer");
}

#[test]
fn chatml_fallback_accepts_strings_and_parts() {
    let template = ChatTemplate::for_checkpoint(None, None, None).unwrap();
    assert_eq!(template.source(), CHATML_TEMPLATE);
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "image_url", "image_url": {}}, {"type": "text", "text": "there"}]},
    ]);
    let opts = RenderOptions { add_generation_prompt: true, ..RenderOptions::default() };
    assert_eq!(
        template.render(&messages, &opts).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    );
    // A checkpoint template, when present, is used instead.
    let own = ChatTemplate::for_checkpoint(Some("X"), None, None).unwrap();
    assert_eq!(own.render(&messages, &opts).unwrap(), "X");
}
