//! `corridor bench` against the real corridor server on a tiny model: the
//! numbers add up (sent = completed + failed, tokens reported = tokens
//! streamed, percentiles ordered) and injected bad requests are counted as
//! 400s without stopping the run.

use corridor_bench::{run, BenchArgs};
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn start(port: u16) -> Server {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/llama-f32");
    let mut child = Command::new(env!("CARGO_BIN_EXE_corridor"))
        .args(["--log", "info", "serve", "--port", &port.to_string(), "--served-model-name", "tiny"])
        .args(["--max-running-requests", "16", "--context-length", "256", "--model"])
        .arg(&model)
        .stderr(Stdio::piped())
        .spawn()
        .expect("the corridor binary starts");
    // Wait for the "serving at" log line (bounded).
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("serving at") {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60)).expect("the server comes up within a minute");
    Server(child)
}

#[test]
fn bench_numbers_add_up_against_the_real_server() {
    let port = free_port();
    let _server = start(port);
    let mut args = BenchArgs::new(format!("http://127.0.0.1:{port}"), "tiny");
    args.input_tokens = 24;
    args.output_tokens = 12;
    args.concurrency = Some(4);
    args.num_requests = Some(20);
    args.inject_errors = 0.2;
    args.seed = 7;
    args.no_progress = true;
    args.request_timeout = 60.0;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let started = Instant::now();
    let r = rt.block_on(run(args)).expect("the bench runs");
    assert!(started.elapsed() < Duration::from_secs(120));

    assert_eq!(r.requests_sent, 20);
    assert_eq!(r.requests_sent, r.requests_completed + r.requests_failed);
    assert_eq!(r.injected_errors.sent, 4, "a fifth of the requests carry an invalid parameter");
    assert_eq!(r.errors.get("http_400").copied(), Some(4), "each is rejected with a 400: {:?}", r.errors);
    assert_eq!(r.requests_failed, 4, "nothing else fails: {:?}", r.error_examples);
    // Every completed request produced exactly the requested length (ignore_eos + min_tokens).
    assert_eq!(r.output_tokens.get(), 16 * 12);
    assert_eq!(r.token_check.output_tokens_reported, r.output_tokens);
    // A chunk carries whole characters, so a token that ends inside a UTF-8
    // character rides with the next one: never more chunks than tokens.
    assert!(r.token_check.output_tokens_streamed <= r.output_tokens);
    assert_eq!(r.token_check.usage_present, 16, "usage arrives on every completed stream");
    for p in [&r.ttft_ms, &r.itl_ms, &r.e2e_ms] {
        let (p50, p90, p99, max) = (p.p50.unwrap(), p.p90.unwrap(), p.p99.unwrap(), p.max.unwrap());
        assert!(p50 <= p90 && p90 <= p99 && p99 <= max, "percentiles ordered: {p:?}");
    }
    assert!(r.ttft_ms.max.unwrap() <= r.e2e_ms.max.unwrap());
    assert!(r.output_tokens_per_s > 0.0 && r.request_throughput > 0.0);
}
