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
    let eos_ids = TokenId::vec(booted.tokenizer.eos_ids());
    // Copies after the first differ in their second token, so they share no
    // cached prefix: each decodes over KV of its own, as distinct requests do.
    let vocab = booted.tokenizer.vocab_size().min(booted.engine.info().config.vocab_size).max(1) as u32;
    let prompt_of = |copy: u32| {
        let mut p = prompt.clone();
        if copy > 0 && p.len() > 1 {
            p[1] = (p[1] + copy) % vocab;
        }
        p
    };
    let request = |copy: u32| GenerateRequest {
        prompt: TokenId::vec(&prompt_of(copy)),
        params: SamplingParams { seed: params.seed.map(|s| s.wrapping_add(copy as u64)), ..params.clone() },
        max_new_tokens: a.max_tokens,
        eos_ids: eos_ids.clone(),
        constraint: None,
    };
    let started = Instant::now();
    let mut stream = booted.engine.submit(request(0))?;
    // The other copies, each drained by a thread of its own.
    let others = (1..a.batch).map(|c| booted.engine.submit(request(c))).collect::<Result<Vec<_>, _>>()?;
    let copies = std::thread::scope(|scope| -> Result<Vec<Run>> {
        let drains: Vec<_> = others.into_iter().map(|s| scope.spawn(move || drain(s, |_| Ok(())))).collect();
        let mut decoder = booted.tokenizer.decode_stream(true);
        let mut out = std::io::stdout().lock();
        let first = drain(&mut stream, |token| {
            if let Some(piece) = decoder.push(&booted.tokenizer, token.get())? {
                write!(out, "{piece}")?;
                out.flush()?;
            }
            Ok(())
        })?;
        write!(out, "{}", decoder.finish(&booted.tokenizer)?)?;
        writeln!(out)?;
        let mut all = vec![first];
        for d in drains {
            all.push(d.join().expect("a drain thread panicked")?);
        }
        Ok(all)
    })?;
    let total = started.elapsed().as_secs_f64();
    let n = copies[0].tokens;
    let ttft = copies[0].first.map(|f| (f - started).as_secs_f64()).unwrap_or(total);
    let decode_tps = decode_rate(&copies);
    let batch = if a.batch > 1 { format!(" over {} sequences", a.batch) } else { String::new() };
    eprintln!(
        "[{} prompt tokens, {} generated, first token {:.0} ms ({:.1} prompt tok/s), decode {:.1} tok/s{batch}, finish: {:?}]",
        prompt.len(),
        n,
        ttft * 1e3,
        prompt.len() as f64 / ttft.max(1e-9),
        decode_tps,
        copies[0].reason
    );
    let reason = copies.iter().map(|c| c.reason.clone()).find(|r| matches!(r, FinishReason::Error(_)));
    booted.engine.shutdown();
    if let Some(FinishReason::Error(e)) = reason {
        anyhow::bail!("generation failed: {e}");
    }
    Ok(())
}

/// What one copy of the prompt did.
struct Run {
    tokens: usize,
    first: Option<Instant>,
    end: Instant,
    reason: FinishReason,
}

impl Run {
    fn new() -> Self {
        Run { tokens: 0, first: None, end: Instant::now(), reason: FinishReason::Aborted }
    }
    fn token(&mut self) {
        self.first.get_or_insert_with(Instant::now);
        self.tokens += 1;
    }
    fn end(&mut self, reason: FinishReason) {
        self.end = Instant::now();
        self.reason = reason;
    }
}

/// Read `stream` to its end, handing each token to `on_token`.
fn drain(
    mut stream: impl std::borrow::BorrowMut<corridor_engine::engine::RequestStream>,
    mut on_token: impl FnMut(TokenId) -> Result<()>,
) -> Result<Run> {
    let mut run = Run::new();
    let reason = loop {
        match stream.borrow_mut().next_blocking() {
            Some(Event::Token { token, .. }) => {
                run.token();
                on_token(token)?;
            }
            Some(Event::Done { reason, .. }) => break reason,
            None => break FinishReason::Aborted,
        }
    };
    run.end(reason);
    Ok(run)
}

/// Decode tokens per second over every copy: the tokens after each copy's
/// first, over the span from the earliest first token to the last end.
fn decode_rate(copies: &[Run]) -> f64 {
    let tokens: usize = copies.iter().map(|c| c.tokens.saturating_sub(1)).sum();
    let Some(from) = copies.iter().filter_map(|c| c.first).min() else { return 0.0 };
    let to = copies.iter().map(|c| c.end).max().unwrap_or(from);
    if tokens == 0 {
        return 0.0;
    }
    tokens as f64 / (to - from).as_secs_f64().max(1e-9)
}
