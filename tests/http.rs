//! End to end: the real `snapserve serve` binary with the real SmolLM2 on the CPU, spoken to
//! over HTTP as an OpenAI client would.

mod common;

use std::io::{BufReader, Write};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use engine::DType;
use engine::cpu::{CpuBackend, CpuOptions};
use engine::generate::{Vocabulary, generate};
use engine::model::ModelFiles;
use engine::sampling::SamplingParams;
use serde_json::{Value, json};

const CONFIG: &str = "[cache]\npool_tokens = 16384\n[admission]\nmax_running = 8\n\
                      [snapshots]\nmin_save_tokens = 32\n";

/// The text a greedy run of `prompt` gives alone, in process, with the CPU backend.
fn solo_text(files: &ModelFiles, prompt: &str, max_tokens: usize) -> String {
    let ids = files.tokenizer.encode_prompt(prompt).unwrap();
    let mut backend =
        CpuBackend::load(files, &CpuOptions::for_tokens(ids.len() + max_tokens)).unwrap();
    let vocab = Vocabulary {
        tokenizer: &files.tokenizer,
        eos_token_ids: &files.eos_token_ids,
    };
    let params = SamplingParams {
        max_tokens,
        ..SamplingParams::default()
    };
    let mut text = String::new();
    generate(&mut backend, &vocab, &ids, &params, 512, |t| text += t).unwrap();
    text
}

#[test]
fn completions_whole_and_streamed_match_a_solo_run_and_reuse_snapshots() {
    let dir = smollm2();
    let server = Server::start(&dir, CONFIG);
    let files = ModelFiles::open(&dir).unwrap();
    let prompt = "The capital of France is";
    let expected = solo_text(&files, prompt, 12);

    let request = json!({"model": "smollm2", "prompt": prompt, "max_tokens": 12, "temperature": 0});
    let (status, _, body) = server.post("/v1/completions", &request);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], "smollm2");
    assert_eq!(body["choices"][0]["text"], expected.as_str());
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 12);
    assert_eq!(body["usage"]["prompt_tokens"], 5);

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = server.post_stream("/v1/completions", &streamed);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, expected);
    let finish = chunks
        .iter()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("length"));
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 12);

    // A long prompt, twice: the second restores the first's snapshot.
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(10);
    let request = json!({"prompt": long, "max_tokens": 4, "temperature": 0});
    let (_, _, first) = server.post("/v1/completions", &request);
    let (_, _, second) = server.post("/v1/completions", &request);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= 64, "{second}");
    assert_eq!(first["choices"][0]["text"], second["choices"][0]["text"]);
    // Prometheus saw all of it.
    let (status, text) = server.get_text("/metrics");
    assert_eq!(status, 200);
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
    };
    assert_eq!(value("snapserve_requests_total{outcome=\"finished\"}"), 4.0);
    assert_eq!(value("snapserve_generation_tokens_total"), 32.0);
    assert_eq!(value("snapserve_snapshot_hits_total"), 1.0);
    assert_eq!(value("snapserve_prefix_reused_tokens_total"), cached as f64);
    assert_eq!(value("snapserve_time_to_first_token_seconds_count"), 4.0);
    assert_eq!(
        value("snapserve_engine_info{backend=\"cpu\",quantization=\"none\",tensor_parallel=\"1\"}"),
        1.0
    );
    assert_eq!(value("snapserve_queue_requests"), 0.0);
    assert!(value("snapserve_step_duration_seconds_count") > 0.0);
    assert!(value("snapserve_prompt_tokens_total") > 100.0);
    assert!(value("snapserve_snapshot_bytes{tier=\"device\"}") > 0.0);

    // Ended by a stop string (the caller's side ends it), it still reports what it restored.
    let answer = first["choices"][0]["text"].as_str().unwrap();
    let stop: String = answer.chars().skip(1).collect();
    assert!(!stop.is_empty(), "{answer:?}");
    let stopped_early = json!({"prompt": long, "max_tokens": 8, "temperature": 0, "stop": [stop]});
    let (status, _, third) = server.post("/v1/completions", &stopped_early);
    assert_eq!(status, 200, "{third}");
    assert_eq!(third["choices"][0]["finish_reason"], "stop", "{third}");
    assert_eq!(
        third["usage"]["prompt_tokens_details"]["cached_tokens"], cached,
        "{third}"
    );
}

#[test]
fn chat_completions_stop_strings_and_streams() {
    let server = Server::start(&smollm2(), CONFIG);
    let messages = json!([{"role": "user", "content": "Count from one to ten."}]);
    let request = json!({"messages": messages, "max_tokens": 24, "temperature": 0});
    let (status, _, body) = server.post("/v1/chat/completions", &request);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    let whole = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!whole.is_empty());

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let events = server.post_stream("/v1/chat/completions", &streamed);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, whole, "streamed and whole answers differ");

    // A stop string cut out of the greedy answer ends it right before.
    let cut = whole
        .char_indices()
        .nth(whole.chars().count() / 2)
        .unwrap()
        .0;
    let stop: String = whole[cut..].chars().take(3).collect();
    let mut stopped = request.clone();
    stopped["stop"] = json!([stop]);
    let (_, _, body) = server.post("/v1/chat/completions", &stopped);
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    assert!(!content.contains(&stop), "{content:?} contains {stop:?}");
    assert!(
        whole.starts_with(content),
        "{content:?} is not a prefix of {whole:?}"
    );

    // The stop string ended the request through the scheduler: finished, not cancelled, and
    // its pages released.
    server.wait_until("the stopped request ends", Duration::from_secs(10), |s| {
        s.metric("snapserve_requests_total{outcome=\"finished\"}") == 3.0
    });
    assert_eq!(
        server.metric("snapserve_requests_total{outcome=\"cancelled\"}"),
        0.0
    );
    assert!(server.is_idle());
}

#[test]
fn bad_requests_get_clear_errors_and_a_full_queue_gets_429() {
    let config = "[cache]\npool_tokens = 16384\n[admission]\nmax_running = 1\nmax_queue = 1\n";
    let server = Server::start(&smollm2(), config);
    let cases = [
        (
            json!({"prompt": "hi", "temperature": -1}),
            400,
            "temperature",
        ),
        (json!({"prompt": "hi", "n": 3}), 400, "queues at most 1"),
        (
            json!({"prompt": ["hi", "there"]}),
            400,
            "2 prompts with n = 1 are 2 sequences; this server queues at most 1",
        ),
        (json!({"prompt": "hi", "model": "gpt-4"}), 404, "smollm2"),
        (
            json!({"prompt": "hi", "max_tokens": 100000}),
            400,
            "context",
        ),
        (json!({"prompt": ""}), 400, "empty"),
        (json!({"prompt": [1, 2, 999999]}), 400, "vocabulary"),
        (json!({"prompt": "hi", "logprobs": 21}), 400, "at most 20"),
        (json!({"prompt": 5}), 400, "list of token ids"),
    ];
    for (body, status, needle) in cases {
        let (got, _, answer) = server.post("/v1/completions", &body);
        assert_eq!(got, status, "{body} → {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{body} → {message}");
    }
    let (status, _, answer) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    );
    assert_eq!(status, 400, "{answer}");

    // One running, one queued: of six at once, some are refused with a Retry-After.
    let long = json!({"prompt": "Once upon a time", "max_tokens": 150, "ignore_eos": true});
    let answers: Vec<(u16, Option<String>, Value)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..6)
            .map(|_| scope.spawn(|| server.post("/v1/completions", &long)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let refused: Vec<_> = answers.iter().filter(|(s, _, _)| *s == 429).collect();
    assert!(!refused.is_empty(), "nothing was refused: {answers:?}");
    for (_, retry_after, body) in &refused {
        let seconds: u64 = retry_after.as_ref().expect("Retry-After").parse().unwrap();
        assert!(seconds >= 1);
        assert_eq!(body["error"]["code"], "overloaded");
    }
    assert!(answers.iter().any(|(s, _, _)| *s == 200));
    // And the server still serves.
    let (status, _, _) = server.post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}));
    assert_eq!(status, 200);
}

#[test]
#[ignore = "needs a CUDA device"]
fn serves_on_the_gpu() {
    // A SmolLM2-shaped model with random bf16 weights, written here: the real one is not on
    // the GPU machine.
    let model = tempfile::tempdir().unwrap();
    let spec = engine::model::synthetic::SyntheticSpec {
        dtype: DType::BF16,
        max_position_embeddings: 2048,
        ..engine::model::synthetic::SyntheticSpec::smollm2(11)
    };
    engine::model::synthetic::write(model.path(), &spec).unwrap();
    let config = "[engine]\ngpu_memory_fraction = 0.5\n[cache]\npool_tokens = 65536\n\
                  [admission]\nmax_running = 32\ndecode_steps = 4\n\
                  [snapshots]\nmin_save_tokens = 32\nsave_after_sightings = 1\n\
                  device_budget_bytes = 8388608\n\
                  host_budget_bytes = 1073741824\ndemote_to_host = true\n";
    let server = Server::start_on("cuda", model.path(), config);
    let prompt: Vec<u32> = (0..100).map(|i| 10 + i * 7 % 200).collect();
    let request = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true});
    let round = || -> Vec<Value> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..16)
                .map(|_| scope.spawn(|| server.post("/v1/completions", &request)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    let (status, _, body) = h.join().unwrap();
                    assert_eq!(status, 200, "{body}");
                    body
                })
                .collect()
        })
    };
    let ttft = || {
        let (_, metrics) = server.get_text("/metrics");
        let value = |name: &str| -> f64 {
            metrics
                .lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or(0.0)
        };
        (
            value("snapserve_time_to_first_token_seconds_sum"),
            value("snapserve_time_to_first_token_seconds_count"),
        )
    };
    let started = Instant::now();
    let mut answers = round();
    let (cold_sum, cold_count) = ttft();
    let cold_wall = started.elapsed();
    let started = Instant::now();
    answers.extend(round());
    let (sum, count) = ttft();
    println!(
        "16 concurrent requests: cold round {cold_wall:?}, mean TTFT {:.1} ms; warm round {:?}, \
         mean TTFT {:.1} ms",
        cold_sum / cold_count * 1e3,
        started.elapsed(),
        (sum - cold_sum) / (count - cold_count) * 1e3
    );
    // (Equal tokens across schedules is not asserted on the GPU: cuBLAS picks kernels by
    // batch size.)
    for body in &answers {
        assert_eq!(body["usage"]["completion_tokens"], 40, "{body}");
    }
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let events = server.post_stream("/v1/completions", &streamed);
    assert_eq!(events.last().unwrap(), "[DONE]");
    // Distinct prompts overflow the 8 MiB device tier: snapshots demote to pinned host
    // memory, which the backend must release before the process exits.
    std::thread::scope(|scope| {
        for i in 0..16u32 {
            let server = &server;
            scope.spawn(move || {
                let prompt: Vec<u32> = (0..100).map(|t| 10 + (t * 13 + i * 31) % 240).collect();
                let request = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
                assert_eq!(server.post("/v1/completions", &request).0, 200);
            });
        }
    });
    let (_, metrics) = server.get_text("/metrics");
    assert!(
        !metrics.contains("snapserve_snapshot_demotions_total 0\n"),
        "nothing was demoted: {metrics}"
    );
    assert!(
        metrics.contains("snapserve_snapshot_hits_total"),
        "{metrics}"
    );
    println!(
        "{}",
        metrics
            .lines()
            .filter(|l| l.starts_with("snapserve_") && !l.contains("bucket"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    server.stop_gracefully();
}

#[test]
fn loadtest_reports_what_clients_saw() {
    let server = Server::start(&smollm2(), CONFIG);
    let output = Command::new(env!("CARGO_BIN_EXE_snapserve"))
        .args(["loadtest", "--url", &server.base, "--requests", "8"])
        .args([
            "--concurrency",
            "2",
            "--prefix-words",
            "60",
            "--prefixes",
            "1",
        ])
        .args(["--suffix-words", "0", "--max-tokens", "4"])
        .output()
        .unwrap();
    let table = String::from_utf8(output.stdout).unwrap();
    assert!(output.status.success(), "{table}");
    assert!(table.contains("8 ok, 0 failed"), "{table}");
    // Every request repeats one prompt: after the first two, they restore its snapshot.
    let restored = table
        .lines()
        .find(|l| l.starts_with("  with a snapshot restored"))
        .and_then(|l| l.split_whitespace().nth(4))
        .and_then(|count| count.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("{table}"));
    assert!(restored >= 4, "{table}");
    let (_, metrics) = server.get_text("/metrics");
    assert!(metrics.contains("snapserve_requests_total{outcome=\"finished\"} 8"));
    server.stop_gracefully();
}

/// Checks that `answer` is a 4xx in OpenAI's error shape.
fn assert_openai_error(what: &str, answer: &RawResponse) {
    assert!(
        (400..500).contains(&answer.status),
        "{what}: {} {}",
        answer.status,
        String::from_utf8_lossy(&answer.body)
    );
    let body = answer.json();
    let error = &body["error"];
    for key in ["message", "type", "code"] {
        assert!(error[key].is_string(), "{what}: no {key} in {body}");
    }
    assert!(error.get("param").is_some(), "{what}: no param in {body}");
}

fn post_raw(path: &str, body: &[u8]) -> Vec<u8> {
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// Hostile input: every malformed request gets a 4xx in OpenAI's shape, none a 5xx or a hang,
/// and the server answers normally afterwards with nothing left running.
#[test]
fn hostile_input_gets_clear_4xx_answers_and_the_server_lives_on() {
    let config = "[cache]\npool_tokens = 16384\n[server]\nbody_timeout_s = 2\n";
    let server = Server::start(&smollm2(), config);
    let mut cases: Vec<(String, &str, Vec<u8>)> = vec![
        (
            "truncated JSON".into(),
            "/v1/completions",
            b"{\"prompt\": \"hi\",".to_vec(),
        ),
        ("an array".into(), "/v1/completions", b"[1, 2]".to_vec()),
        (
            "a string".into(),
            "/v1/chat/completions",
            b"\"hello\"".to_vec(),
        ),
        ("null".into(), "/v1/completions", b"null".to_vec()),
        ("empty".into(), "/v1/completions", Vec::new()),
        ("not JSON".into(), "/v1/completions", b"prompt=hi".to_vec()),
        (
            "invalid UTF-8".into(),
            "/v1/completions",
            b"{\"prompt\": \"\xff\xfe\"}".to_vec(),
        ),
        (
            "10,000-deep JSON".into(),
            "/v1/completions",
            format!(
                "{{\"prompt\": {}{}}}",
                "[".repeat(10_000),
                "]".repeat(10_000)
            )
            .into_bytes(),
        ),
        (
            "ids outside the vocabulary".into(),
            "/v1/completions",
            br#"{"prompt": [1, 2, 999999999]}"#.to_vec(),
        ),
        (
            "negative ids".into(),
            "/v1/completions",
            br#"{"prompt": [1, -2]}"#.to_vec(),
        ),
        (
            "no messages".into(),
            "/v1/chat/completions",
            br#"{"messages": []}"#.to_vec(),
        ),
    ];
    // A wrong type in every field.
    let completion = json!({"prompt": "hi", "max_tokens": 2});
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let shared = [
        ("model", json!(7)),
        ("max_tokens", json!("two")),
        ("max_tokens", json!(-1)),
        ("max_tokens", json!(2.5)),
        ("temperature", json!("hot")),
        ("top_p", json!([1])),
        ("top_k", json!(-3)),
        ("min_p", json!(true)),
        ("seed", json!("s")),
        ("presence_penalty", json!({})),
        ("frequency_penalty", json!("f")),
        ("repetition_penalty", json!([])),
        ("stop", json!(5)),
        ("stop", json!([1, 2])),
        ("stop_token_ids", json!("x")),
        ("ignore_eos", json!("yes")),
        ("n", json!("one")),
        ("stream", json!("yes")),
        ("stream_options", json!(3)),
    ];
    for (field, value) in &shared {
        for (path, base) in [
            ("/v1/completions", &completion),
            ("/v1/chat/completions", &chat),
        ] {
            let mut body = base.clone();
            body[field] = value.clone();
            cases.push((
                format!("{path} {field} = {value}"),
                path,
                body.to_string().into_bytes(),
            ));
        }
    }
    for (field, value) in [
        ("prompt", json!({"text": "hi"})),
        ("echo", json!(1)),
        ("best_of", json!("b")),
        ("suffix", json!(9)),
    ] {
        let mut body = completion.clone();
        body[field] = value.clone();
        cases.push((
            format!("completions {field} = {value}"),
            "/v1/completions",
            body.to_string().into_bytes(),
        ));
    }
    for (field, value) in [
        ("messages", json!("hi")),
        ("messages", json!([{"role": "user"}, 5])),
        ("messages", json!([{"role": 1, "content": "hi"}])),
        ("messages", json!([{"role": "user", "content": 5}])),
        ("max_completion_tokens", json!("x")),
        ("logprobs", json!("x")),
        ("top_logprobs", json!(-1)),
    ] {
        let mut body = chat.clone();
        body[field] = value.clone();
        cases.push((
            format!("chat {field} = {value}"),
            "/v1/chat/completions",
            body.to_string().into_bytes(),
        ));
    }
    for (what, path, body) in &cases {
        let answer = server
            .raw_exchange(&post_raw(path, body))
            .unwrap_or_else(|| panic!("{what}: the connection closed without an answer"));
        assert_openai_error(what, &answer);
    }

    // Oversized: declared, and sent in chunks with no length declared.
    let answer = server
        .raw_exchange(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40000000\r\n\r\n{",
        )
        .expect("an answer to a declared oversized body");
    assert_eq!(answer.status, 413);
    assert_openai_error("declared oversized", &answer);
    let mut chunked = server.raw();
    chunked
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        )
        .unwrap();
    let chunk = vec![b' '; 1 << 20];
    for _ in 0..40 {
        if write!(chunked, "{:x}\r\n", chunk.len()).is_err()
            || chunked.write_all(&chunk).is_err()
            || chunked.write_all(b"\r\n").is_err()
        {
            break;
        }
    }
    let answer = read_response(&mut BufReader::new(chunked)).expect("an answer to 40 MB");
    assert_eq!(answer.status, 413);

    // A slow body.
    let answer = server
        .raw_exchange(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro",
        )
        .expect("an answer to a slow body");
    assert_eq!(answer.status, 408);
    assert_openai_error("slow body", &answer);

    // Pipelined: two requests in one write, two answers in order on one connection.
    let mut pipelined = post_raw("/v1/completions", br#"{"prompt": "Hi", "max_tokens": 1}"#);
    pipelined.extend(post_raw(
        "/v1/completions",
        br#"{"prompt": "", "max_tokens": 1}"#,
    ));
    let mut connection = server.raw();
    connection.write_all(&pipelined).unwrap();
    let mut connection = BufReader::new(connection);
    assert_eq!(read_response(&mut connection).unwrap().status, 200);
    assert_eq!(read_response(&mut connection).unwrap().status, 400);

    // Abandoned: half a request line, half the headers, half a body, then gone.
    for partial in [
        &b"POST /v1/compl"[..],
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"prompt\"",
    ] {
        for _ in 0..20 {
            server.raw().write_all(partial).unwrap();
        }
    }

    // Still serving, and nothing left over.
    let (status, _, answer) =
        server.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(status, 200, "{answer}");
    assert_eq!(server.get_text("/health").0, 200);
    server.wait_until("idle", Duration::from_secs(10), Server::is_idle);
    assert_eq!(
        server.metric("snapserve_requests_total{outcome=\"failed\"}"),
        0.0
    );
    server.stop_gracefully();
}

/// `GET /v1/models/{id}` answers what the list holds (an SDK's `models.retrieve`), another id is
/// a 404 naming the model, a known path asked with the wrong method a 405 with `Allow`, and
/// every metric family has its `# HELP`.
#[test]
fn models_by_id_wrong_methods_and_described_metrics() {
    let server = Server::start(&smollm2(), CONFIG);
    let (status, list) = server.get_text("/v1/models");
    assert_eq!(status, 200);
    let listed: Value = serde_json::from_str(&list).unwrap();
    let model = &listed["data"][0];
    let id = model["id"].as_str().unwrap();
    let (status, one) = server.get_text(&format!("/v1/models/{id}"));
    assert_eq!(status, 200, "{one}");
    assert_eq!(&serde_json::from_str::<Value>(&one).unwrap(), model);

    let unknown = server
        .raw_exchange(b"GET /v1/models/gpt-4o HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_openai_error("an unknown model", &unknown);
    assert_eq!(unknown.status, 404);
    let error = unknown.json()["error"].clone();
    assert_eq!(error["code"], "model_not_found");
    assert_eq!(error["param"], "model");

    for (request, allow) in [
        (post_raw("/v1/models", b"{}"), "GET"),
        (post_raw("/health", b"{}"), "GET"),
        (
            b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            "POST",
        ),
        (
            b"DELETE /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
            "POST",
        ),
    ] {
        let what = String::from_utf8_lossy(&request[..request.len().min(40)]).into_owned();
        let answer = server.raw_exchange(&request).unwrap();
        assert_openai_error(&what, &answer);
        assert_eq!(answer.status, 405, "{what}");
        assert_eq!(answer.header("allow"), Some(allow), "{what}");
        assert_eq!(answer.json()["error"]["code"], "method_not_allowed");
    }

    // One request, so the latency histograms exist too.
    let request = json!({"prompt": "Hello", "max_tokens": 2, "temperature": 0});
    let (status, _, body) = server.post("/v1/completions", &request);
    assert_eq!(status, 200, "{body}");
    let (_, metrics) = server.get_text("/metrics");
    let families: Vec<&str> = metrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE ")?.split_whitespace().next())
        .collect();
    assert!(families.len() >= 25, "{metrics}");
    for family in families {
        let help = format!("# HELP {family} ");
        assert!(
            metrics.lines().any(|line| line.starts_with(&help)),
            "{family} has no # HELP line:\n{metrics}"
        );
    }
    promtool_checks(&metrics);
}

/// `promtool check metrics` over a scrape: no lint findings. Skipped, saying so, where promtool
/// is not on PATH (Debian: the `prometheus` package).
fn promtool_checks(metrics: &str) {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("skipped: promtool is not on PATH, so `promtool check metrics` did not run");
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(metrics.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let findings =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "promtool check metrics:\n{findings}");
    assert!(
        findings.trim().is_empty(),
        "promtool check metrics:\n{findings}"
    );
}

/// `logit_bias` steers greedy decoding (100 forces a token, -100 bans the one greedy picks), and
/// a bad field is a 400 whose `param` names it, messages included.
#[test]
fn logit_bias_steers_sampling_and_errors_name_their_field() {
    let server = Server::start(&smollm2(), CONFIG);
    let files = ModelFiles::open(&smollm2()).unwrap();
    let forced = 504u32;
    let request = json!({
        "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
        "logit_bias": {forced.to_string(): 100},
    });
    let (status, _, body) = server.post("/v1/completions", &request);
    assert_eq!(status, 200, "{body}");
    let want = files.tokenizer.decode(&[forced; 3], true).unwrap();
    assert_eq!(body["choices"][0]["text"], want.as_str());

    let plain = json!({"prompt": "The capital of France is", "max_tokens": 1, "temperature": 0});
    let (_, _, first) = server.post("/v1/completions", &plain);
    let greedy = first["choices"][0]["text"].as_str().unwrap().to_string();
    let ids = files.tokenizer.encode_prompt(&greedy).unwrap();
    let mut banned = plain.clone();
    banned["logit_bias"] = json!({ids[0].to_string(): -100});
    let (status, _, other) = server.post("/v1/completions", &banned);
    assert_eq!(status, 200, "{other}");
    assert_ne!(other["choices"][0]["text"], greedy.as_str(), "{other}");

    let completions = [
        (json!({"prompt": "hi", "temperature": -1}), "temperature"),
        (
            json!({"prompt": "hi", "logit_bias": {"abc": 1}}),
            "logit_bias",
        ),
        (
            json!({"prompt": "hi", "logit_bias": {"999999": 1}}),
            "logit_bias",
        ),
        (
            json!({"prompt": "hi", "logit_bias": {"50": 101}}),
            "logit_bias",
        ),
        (
            json!({"prompt": "hi", "stream_options": {"include_usage": true}}),
            "stream_options",
        ),
    ];
    for (body, param) in completions {
        let (status, _, answer) = server.post("/v1/completions", &body);
        assert_eq!(status, 400, "{body} → {answer}");
        assert_eq!(answer["error"]["param"], param, "{body} → {answer}");
    }
    let chats = [
        (
            json!([{"role": "wizard", "content": "hi"}]),
            "messages[0].role",
        ),
        (
            json!([{"role": "user", "content": null}]),
            "messages[0].content",
        ),
        (
            json!([{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "text"}]}]),
            "messages[1].content[0].text",
        ),
        (
            json!([{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content[0].type",
        ),
    ];
    for (messages, param) in chats {
        let body = json!({"messages": messages, "max_tokens": 2});
        let (status, _, answer) = server.post("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body} → {answer}");
        assert_eq!(answer["error"]["param"], param, "{body} → {answer}");
    }
    // echo: the prompt's text first, then the completion; streamed, as the first chunk.
    let prompt = "The capital of France is";
    let echoed = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": true});
    let (status, _, body) = server.post("/v1/completions", &echoed);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["text"], format!("{prompt}{greedy}"));
    let mut streamed = echoed.clone();
    streamed["stream"] = json!(true);
    let events = server.post_stream("/v1/completions", &streamed);
    let first: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(first["choices"][0]["text"], prompt);
    let ids = files.tokenizer.encode_prompt(prompt).unwrap();
    let by_ids = json!({"prompt": ids, "max_tokens": 1, "temperature": 0, "echo": true});
    let (_, _, body) = server.post("/v1/completions", &by_ids);
    let text = body["choices"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with(prompt) && text.ends_with(&greedy),
        "{body}"
    );

    // Fields of the wrong type: the field, and what it takes, in the API's words.
    let typed = [
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": "x"}),
            "max_tokens",
            "a non-negative integer",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "temperature": "hot"}),
            "temperature",
            "a number",
        ),
        (
            "/v1/completions",
            json!({"prompt": 5}),
            "prompt",
            "a list of token ids",
        ),
        (
            "/v1/completions",
            json!({"prompt": "hi", "stop": 7}),
            "stop",
            "a list of strings",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": 5}]}),
            "messages[0].content",
            "a list of content parts",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            "messages",
            "a sequence",
        ),
    ];
    for (path, body, param, words) in typed {
        let (status, _, answer) = server.post(path, &body);
        assert_eq!(status, 400, "{body} → {answer}");
        assert_eq!(answer["error"]["param"], param, "{body} → {answer}");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(words), "{body} → {message}");
        for rust in ["usize", "f32", "untagged", "line 1"] {
            assert!(!message.contains(rust), "{body} → {message}");
        }
    }
    // An assistant's turn may be empty, as after a tool call.
    let messages = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": null},
                          {"role": "user", "content": "again"}]);
    let (status, _, answer) = server.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 2}),
    );
    assert_eq!(status, 200, "{answer}");
}

/// With API keys set, a request without an accepted `Authorization: Bearer` key is a 401 in
/// OpenAI's shape; `/health` and `/metrics` stay open.
#[test]
fn api_keys_guard_the_api_but_not_health_and_metrics() {
    let config = "[cache]\npool_tokens = 16384\n[server]\napi_keys = [\"sk-snapserve-test\"]\n";
    let server = Server::start(&smollm2(), config);
    let body = br#"{"prompt": "Hello", "max_tokens": 2}"#;
    let request = |authorization: &str| {
        let mut raw = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             {authorization}Content-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        raw.extend_from_slice(body);
        server.raw_exchange(&raw).unwrap()
    };
    for authorization in [
        "",
        "Authorization: Bearer sk-snapserve-tes\r\n",
        "Authorization: sk-snapserve-test\r\n",
        "Authorization: Bearer sk-snapserve-test2\r\n",
    ] {
        let answer = request(authorization);
        assert_openai_error(authorization, &answer);
        assert_eq!(answer.status, 401, "{authorization}");
        assert_eq!(answer.json()["error"]["code"], "invalid_api_key");
    }
    let answer = request("Authorization: Bearer sk-snapserve-test\r\n");
    assert_eq!(
        answer.status,
        200,
        "{}",
        String::from_utf8_lossy(&answer.body)
    );
    let models = server
        .raw_exchange(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    assert_eq!(models.status, 401);
    assert_eq!(server.get_text("/health").0, 200);
    assert_eq!(server.get_text("/metrics").0, 200);
}
