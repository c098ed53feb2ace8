//! `corridor generate`: one prompt, streamed to stdout, with tokens/s at the end.

use crate::GenerateArgs;
use anyhow::{Context, Result};
use corridor_engine::engine::{Event, FinishReason, GenerateRequest};
use corridor_engine::sampling::SamplingParams;
use corridor_server::template::RenderOptions;
use corridor_units::TokenId;
use std::io::Write;
use std::time::Instant;

pub fn run(a: &GenerateArgs, cache: &std::path::Path) -> Result<()> {
    let opts = a.model.boot_options(cache)?;
    let booted = crate::boot_with_progress(&opts)?;
    let text = if a.chat {
        let messages = serde_json::json!([{ "role": "user", "content": a.prompt }]);
        booted
            .template
            .render(&messages, &RenderOptions { add_generation_prompt: true, ..Default::default() })
            .context("rendering the chat template")?
    } else {
        a.prompt.clone()
    };
    let prompt = booted.tokenizer.encode(&text, !a.chat).context("tokenizing the prompt")?;
    let params = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
        ignore_eos: a.ignore_eos,
        ..Default::default()
    };
    params
        .validate(booted.tokenizer.vocab_size().max(booted.engine.info().config.vocab_size))
        .map_err(|e| anyhow::anyhow!("--{}: {}", e.param.replace('_', "-"), e.message))?;
    let started = Instant::now();
    let mut stream = booted.engine.submit(GenerateRequest {
        prompt: TokenId::vec(&prompt),
        params,
        max_new_tokens: a.max_tokens,
        eos_ids: TokenId::vec(booted.tokenizer.eos_ids()),
        constraint: None,
    })?;
    let mut decoder = booted.tokenizer.decode_stream(true);
    let mut out = std::io::stdout().lock();
    let mut first: Option<Instant> = None;
    let mut n = 0usize;
    let reason = loop {
        match stream.next_blocking() {
            Some(Event::Token { token, .. }) => {
                first.get_or_insert_with(Instant::now);
                n += 1;
                if let Some(piece) = decoder.push(&booted.tokenizer, token.get())? {
                    write!(out, "{piece}")?;
                    out.flush()?;
                }
            }
            Some(Event::Done { reason, .. }) => break reason,
            None => break FinishReason::Aborted,
        }
    };
    write!(out, "{}", decoder.finish(&booted.tokenizer)?)?;
    writeln!(out)?;
    let total = started.elapsed().as_secs_f64();
    let ttft = first.map(|f| (f - started).as_secs_f64()).unwrap_or(total);
    let decode_tps = if n > 1 { (n - 1) as f64 / (total - ttft).max(1e-9) } else { 0.0 };
    eprintln!(
        "[{} prompt tokens, {} generated, first token {:.0} ms ({:.1} prompt tok/s), decode {:.1} tok/s, finish: {:?}]",
        prompt.len(),
        n,
        ttft * 1e3,
        prompt.len() as f64 / ttft.max(1e-9),
        decode_tps,
        reason
    );
    booted.engine.shutdown();
    if let FinishReason::Error(e) = reason {
        anyhow::bail!("generation failed: {e}");
    }
    Ok(())
}
