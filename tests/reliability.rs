//! End to end: the ways a server can hang, orphan work or cut an answer short, each provoked
//! against the real `snapserve serve` with the real SmolLM2 on the CPU.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

/// The chat request of issue 9: 35 prompt tokens through SmolLM2's template.
fn capital_of_france(max_tokens: Option<u64>, stream: bool) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "stream": stream,
    });
    if let Some(max_tokens) = max_tokens {
        body["max_tokens"] = json!(max_tokens);
    }
    body
}

/// Checks an error answer's OpenAI shape and returns its message.
fn error_message(answer: &Value) -> &str {
    let error = &answer["error"];
    assert!(error["type"].is_string(), "{answer}");
    assert!(error["code"].is_string(), "{answer}");
    assert!(error.get("param").is_some(), "{answer}");
    error["message"].as_str().expect("a message")
}

/// A request that can never fit the pool is refused before any byte of an answer, streamed or
/// not, and the server goes on serving (it used to spin its scheduler forever).
#[test]
fn requests_larger_than_the_pool_are_refused_and_the_server_stays_up() {
    let server = Server::start(&smollm2(), "[cache]\npool_tokens = 64\n");
    for stream in [false, true] {
        let (status, _, answer) = server.post(
            "/v1/chat/completions",
            &capital_of_france(Some(100), stream),
        );
        assert_eq!(status, 400, "stream {stream}: {answer}");
        assert_eq!(answer["error"]["param"], "max_tokens");
        let message = error_message(&answer);
        assert!(message.contains("KV pool (64 positions)"), "{message}");

        let long: Vec<u32> = (0..80).map(|i| 100 + i).collect();
        let (status, _, answer) = server.post(
            "/v1/completions",
            &json!({"prompt": long, "max_tokens": 1, "stream": stream}),
        );
        assert_eq!(status, 400, "stream {stream}: {answer}");
        assert_eq!(answer["error"]["param"], "prompt");
    }
    // Without max_tokens the reply gets what the pool leaves.
    let (status, _, answer) = server.post("/v1/chat/completions", &capital_of_france(None, false));
    assert_eq!(status, 200, "{answer}");
    let usage = &answer["usage"];
    assert!(usage["total_tokens"].as_u64().unwrap() <= 64, "{answer}");
    let (_, models) = server.get_text("/v1/models");
    assert!(models.contains("\"max_model_len\":64"), "{models}");
    assert_eq!(server.metric("snapserve_running_requests"), 0.0);
    server.stop_gracefully();
}

/// A client that hangs up cancels its request within a step, whether it streams or waits for
/// the whole answer (a whole one used to run on for minutes for nobody).
#[test]
fn a_client_that_hangs_up_cancels_its_request() {
    let server = Server::start(&smollm2(), "[cache]\npool_tokens = 16384\n");
    let long = |stream: bool| {
        json!({"prompt": "Once upon a time", "max_tokens": 6000, "ignore_eos": true,
               "stream": stream})
        .to_string()
    };
    for (round, stream) in [false, true].into_iter().enumerate() {
        let body = long(stream);
        let mut connection = server.raw();
        write!(
            connection,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        server.wait_until("the request runs", Duration::from_secs(30), |s| {
            s.metric("snapserve_running_requests") == 1.0
        });
        let generated = server.metric("snapserve_generation_tokens_total");
        drop(connection);
        server.wait_until("the request is cancelled", Duration::from_secs(10), |s| {
            s.metric("snapserve_requests_total{outcome=\"cancelled\"}") == (round + 1) as f64
        });
        assert!(server.is_idle());
        let after = server.metric("snapserve_generation_tokens_total");
        assert!(
            after - generated < 1000.0,
            "stream {stream}: {} tokens after the client left",
            after - generated
        );
    }
    assert_eq!(
        server.metric("snapserve_requests_total{outcome=\"finished\"}"),
        0.0
    );
    server.stop_gracefully();
}

/// SIGTERM: new connections are refused, a request that finishes within the grace finishes,
/// the streams still running when it runs out end with an error event and `[DONE]`, and the
/// process says so with its exit status.
#[test]
fn sigterm_lets_requests_finish_within_the_grace_and_cuts_the_rest_cleanly() {
    // A grace long enough for 30 tokens on a busy 2-core CI machine, far too short for 3000.
    let config = "[cache]\npool_tokens = 16384\n[server]\nshutdown_grace_s = 20\n";
    let mut server = Server::start(&smollm2(), config);
    let streams: Vec<_> = (0..3)
        .map(|_| {
            let mut connection = server.raw();
            let body = json!({"prompt": "Once upon a time", "max_tokens": 3000,
                              "ignore_eos": true, "stream": true})
            .to_string();
            write!(
                connection,
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            BufReader::new(connection)
        })
        .collect();
    server.wait_until("three streams run", Duration::from_secs(30), |s| {
        s.metric("snapserve_running_requests") == 3.0
    });
    let short = std::thread::scope(|scope| {
        let short = scope.spawn(|| {
            server.post(
                "/v1/completions",
                &json!({"prompt": "The capital of France is", "max_tokens": 30,
                        "ignore_eos": true}),
            )
        });
        server.wait_until("the short request runs", Duration::from_secs(30), |s| {
            s.metric("snapserve_running_requests") == 4.0
        });
        server.sigterm();
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", server.port)).is_err(),
            "still accepting connections after SIGTERM"
        );
        short.join().unwrap()
    });
    assert_eq!(short.0, 200, "{}", short.2);
    assert_eq!(short.2["usage"]["completion_tokens"], 30);
    let started = Instant::now();
    for mut stream in streams {
        let lines: Vec<String> = (&mut stream)
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
            .collect();
        let n = lines.len();
        assert!(n >= 3, "{lines:?}");
        assert_eq!(lines[n - 1], "[DONE]");
        let error: Value = serde_json::from_str(&lines[n - 2]).unwrap();
        assert_eq!(error["error"]["code"], "shutting_down", "{error}");
        let last_text: Value = serde_json::from_str(&lines[n - 3]).unwrap();
        assert!(last_text["choices"][0]["text"].is_string(), "{last_text}");
    }
    assert!(started.elapsed() < Duration::from_secs(45));
    let status = server.wait_exit(Duration::from_secs(30));
    assert!(!status.success(), "cut requests but exited {status}");
    let log = server.log();
    assert!(log.contains("cut 3 requests"), "{log}");
}

/// A short request sent while a long prompt is prefilled gets its answer before the long
/// prompt's first token: it no longer waits for the whole prefill.
#[test]
fn a_short_request_is_not_queued_behind_a_long_prompts_prefill() {
    let config = "[cache]\npool_tokens = 16384\n[admission]\nstep_token_budget = 1024\n\
                  max_step_ms = 100\n[snapshots]\nsave_prompts = false\n";
    let server = Server::start(&smollm2(), config);
    let long: Vec<u32> = (0..2500).map(|i| 100 + (i * 7) % 5000).collect();
    let (short_done, long_done) = std::thread::scope(|scope| {
        let long = scope.spawn(|| {
            let (status, _, answer) = server.post(
                "/v1/completions",
                &json!({"prompt": long, "max_tokens": 1, "ignore_eos": true}),
            );
            assert_eq!(status, 200, "{answer}");
            Instant::now()
        });
        server.wait_until("the long prompt runs", Duration::from_secs(30), |s| {
            s.metric("snapserve_running_requests") == 1.0
        });
        let (status, _, answer) = server.post(
            "/v1/completions",
            &json!({"prompt": "Hi", "max_tokens": 1, "ignore_eos": true}),
        );
        assert_eq!(status, 200, "{answer}");
        (Instant::now(), long.join().unwrap())
    });
    assert!(
        short_done < long_done,
        "the short request finished {:?} after the long prompt",
        short_done - long_done
    );
    server.stop_gracefully();
}

/// A body declared but sent slowly is cut off with a 408 and its connection closed; an idle
/// keep-alive connection is closed after `keep_alive_s`.
#[test]
fn slow_bodies_and_idle_connections_are_cut_off() {
    let config = "[cache]\npool_tokens = 16384\n[server]\nbody_timeout_s = 1\nkeep_alive_s = 1\n";
    let server = Server::start(&smollm2(), config);
    let mut connection = server.raw();
    connection
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
              Content-Length: 10000000\r\n\r\n{\"prompt\": \"hello",
        )
        .unwrap();
    let mut connection = BufReader::new(connection);
    let answer = read_response(&mut connection).expect("an answer to a slow body");
    assert_eq!(answer.status, 408);
    assert_eq!(answer.json()["error"]["code"], "body_timeout");
    assert_eq!(answer.header("connection"), Some("close"));
    assert!(closed_within(&mut connection, Duration::from_secs(10)));

    let mut connection = server.raw();
    let body = json!({"prompt": "Hi", "max_tokens": 1}).to_string();
    write!(
        connection,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut connection = BufReader::new(connection);
    assert_eq!(read_response(&mut connection).unwrap().status, 200);
    assert!(
        closed_within(&mut connection, Duration::from_secs(10)),
        "an idle keep-alive connection stayed open"
    );
    server.stop_gracefully();
}

/// Ten times the queue for a few seconds, a third of the clients hanging up early: every
/// answer is a 200 or a 429, and the server is idle afterwards.
#[test]
fn an_overload_with_disconnects_leaves_the_server_idle() {
    let config = "[cache]\npool_tokens = 16384\n[admission]\nmax_queue = 4\nmax_running = 4\n";
    let server = Server::start(&smollm2(), config);
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_snapserve"))
        .args(["loadtest", "--url", &server.base, "--concurrency", "40"])
        .args(["--duration-s", "8", "--disconnect-fraction", "0.3"])
        .args([
            "--prefixes",
            "0",
            "--prefix-words",
            "20",
            "--max-tokens",
            "16",
        ])
        .arg("--check-idle")
        .output()
        .unwrap();
    let table = String::from_utf8(output.stdout).unwrap();
    assert!(
        output.status.success(),
        "{table}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let statuses = table
        .lines()
        .find_map(|l| l.trim().strip_prefix("statuses: "))
        .unwrap_or_else(|| panic!("{table}"));
    for part in statuses.split(", ") {
        let status = part.split(" × ").next().unwrap();
        assert!(["200", "429"].contains(&status), "{table}");
    }
    assert!(statuses.contains("429"), "the queue never filled: {table}");
    assert!(table.contains("after the load: idle"), "{table}");
    assert!(server.is_idle());
    server.stop_gracefully();
}

/// Quantization asked of a server that cannot have it (FP8 without a GPU, int8 without GGUF
/// blocks): refused before it serves, with the reason, and a non-zero exit.
#[test]
fn fp8_weights_without_a_gpu_are_refused_with_the_reason() {
    let model = smollm2();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fp8.toml");
    std::fs::write(&config, "[engine]\nquantization = \"fp8\"\n").unwrap();
    let refused = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_snapserve"))
            .args(args)
            .arg("--model")
            .arg(&model)
            .output()
            .unwrap();
        assert!(
            !output.status.success(),
            "{args:?}: FP8 weights ran on the CPU"
        );
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let config = config.to_str().unwrap();
    let serve = refused(&[
        "serve",
        "--port",
        "0",
        "--backend",
        "cpu",
        "--config",
        config,
    ]);
    assert!(
        serve.contains("quantization = \"fp8\" runs on the CUDA backend only"),
        "{serve}"
    );
    let bench = refused(&["bench", "--backend", "cpu", "--quantization", "fp8"]);
    assert!(
        bench.contains("--quantization fp8 runs on the GPU only"),
        "{bench}"
    );
    // The CPU's integer products need a folder that keeps the GGUF's blocks; this one is bf16.
    let int8 = dir.path().join("int8.toml");
    std::fs::write(&int8, "[engine]\nquantization = \"int8\"\n").unwrap();
    let int8 = int8.to_str().unwrap();
    let serve = refused(&["serve", "--port", "0", "--backend", "cpu", "--config", int8]);
    assert!(serve.contains("fetch-model --keep-blocks"), "{serve}");
}

#[test]
fn a_split_model_the_server_cannot_run_is_refused_with_the_reason() {
    let model = smollm2();
    let refused = |args: &[&str], config: Option<&str>| {
        let dir = tempfile::tempdir().unwrap();
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_snapserve"));
        command
            .args(["serve", "--port", "0", "--model"])
            .arg(&model)
            .args(args);
        if let Some(config) = config {
            let path = dir.path().join("split.toml");
            std::fs::write(&path, config).unwrap();
            command.arg("--config").arg(path);
        }
        let output = command.output().unwrap();
        assert!(!output.status.success(), "{args:?} was served");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let cpu = refused(&["--backend", "cpu", "--tensor-parallel", "2"], None);
    assert!(cpu.contains("needs the CUDA backend"), "{cpu}");
    let many = refused(&["--tensor-parallel", "9"], None);
    assert!(many.contains("--tensor-parallel"), "{many}");
    let disk = "[engine]\ntensor_parallel = 2\n[snapshots]\ndisk_dir = \"/tmp/x\"\n\
                disk_budget_bytes = 1000000\n";
    let disk = refused(&["--backend", "cpu"], Some(disk));
    assert!(disk.contains("snapshots.disk_dir"), "{disk}");
    let devices = refused(
        &["--tensor-parallel", "2"],
        Some("[engine]\ndevices = [0, 1, 2]\n"),
    );
    assert!(devices.contains("devices"), "{devices}");
}
