//! What the end-to-end tests share: the real SmolLM2, a running `snapserve serve` spoken to
//! over HTTP as a client would, and raw connections for what HTTP clients will not send.

#![allow(dead_code)] // Each test binary uses its own share of these.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use engine::DType;
use serde_json::Value;

/// The SmolLM2 bf16 folder (what `snapserve serve` loads by default on a GPU; the CPU default
/// keeps the GGUF's blocks), fetched into the shared cache.
pub fn smollm2() -> PathBuf {
    let cache = std::env::var_os("SNAPSERVE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| engine::fetch::default_cache_dir(std::env::home_dir().as_deref()));
    engine::fetch::fetch(
        &engine::fetch::SMOLLM2,
        &engine::fetch::FetchOptions::new(cache, DType::BF16),
    )
    .expect("fetching SmolLM2")
}

/// A running server, stopped when dropped.
pub struct Server {
    pub child: Child,
    pub base: String,
    pub port: u16,
    agent: ureq::Agent,
    _dir: tempfile::TempDir,
}

impl Server {
    pub fn start(model: &Path, config: &str) -> Server {
        Server::start_on("cpu", model, config)
    }

    pub fn start_on(backend: &str, model: &Path, config: &str) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let config_path = dir.path().join("serve.toml");
        std::fs::write(&config_path, config).unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // SNAPSERVE_BIN runs a binary copied to another machine (the GPU test).
        let binary = std::env::var_os("SNAPSERVE_BIN").map_or_else(
            || PathBuf::from(env!("CARGO_BIN_EXE_snapserve")),
            PathBuf::from,
        );
        let child = Command::new(binary)
            .args(["serve", "--backend", backend, "--port", &port.to_string()])
            .args(["--served-model-name", "smollm2", "--model"])
            .arg(model)
            .arg("--config")
            .arg(&config_path)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("server.log")).unwrap())
            .spawn()
            .expect("starting snapserve");
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        let mut server = Server {
            child,
            base: format!("http://127.0.0.1:{port}"),
            port,
            agent,
            _dir: dir,
        };
        server.wait_ready();
        server
    }

    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("snapserve exited before serving: {status}\n{}", self.log());
            }
            if let Ok(response) = self.agent.get(format!("{}/health", self.base)).call()
                && response.status() == 200
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("snapserve did not answer /health within 120 s");
    }

    /// POSTs `body`; returns the status, the `Retry-After` header and the JSON answer.
    pub fn post(&self, path: &str, body: &Value) -> (u16, Option<String>, Value) {
        let mut response = self
            .agent
            .post(format!("{}{path}", self.base))
            .send_json(body)
            .unwrap();
        let retry_after = response
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        let status = response.status().as_u16();
        let json = response.body_mut().read_json::<Value>().unwrap();
        (status, retry_after, json)
    }

    /// Sends `method` to `path` with an optional bearer key and JSON body; returns the status
    /// and the JSON answer.
    pub fn call(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<&Value>,
    ) -> (u16, Value) {
        let url = format!("{}{path}", self.base);
        let auth = key.map(|k| format!("Bearer {k}"));
        let mut response = match (method, body) {
            ("GET", _) => {
                let mut r = self.agent.get(&url);
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.call()
            }
            ("DELETE", _) => {
                let mut r = self.agent.delete(&url);
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.call()
            }
            ("POST", Some(body)) => {
                let mut r = self.agent.post(&url);
                if let Some(a) = &auth {
                    r = r.header("Authorization", a);
                }
                r.send_json(body)
            }
            other => panic!("no helper for {other:?}"),
        }
        .unwrap();
        let status = response.status().as_u16();
        let json = response.body_mut().read_json::<Value>().unwrap();
        (status, json)
    }

    /// GETs `path` as text.
    pub fn get_text(&self, path: &str) -> (u16, String) {
        let mut response = self
            .agent
            .get(format!("{}{path}", self.base))
            .call()
            .unwrap();
        let status = response.status().as_u16();
        (status, response.body_mut().read_to_string().unwrap())
    }

    /// POSTs a streaming request; returns every `data:` payload in order.
    pub fn post_stream(&self, path: &str, body: &Value) -> Vec<String> {
        let mut response = self
            .agent
            .post(format!("{}{path}", self.base))
            .send_json(body)
            .unwrap();
        assert_eq!(response.status(), 200);
        let content_type = response.headers().get("content-type").unwrap();
        assert_eq!(content_type, "text/event-stream");
        BufReader::new(response.body_mut().as_reader())
            .lines()
            .map(|line| line.unwrap())
            .filter_map(|line| line.strip_prefix("data: ").map(str::to_string))
            .collect()
    }
}

impl Server {
    /// Stops the server as an operator would (SIGTERM) and checks that it exits cleanly.
    pub fn stop_gracefully(mut self) {
        self.sigterm();
        let status = self.wait_exit(Duration::from_secs(60));
        assert!(
            status.success(),
            "snapserve exited with {status} after SIGTERM\n{}",
            self.log()
        );
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 answer read off a raw connection.
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    /// Header lines, lower-cased names.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl RawResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }
}

/// Reads one answer with a `Content-Length` body; `None` if the connection closes first.
pub fn read_response(stream: &mut BufReader<TcpStream>) -> Option<RawResponse> {
    let mut line = String::new();
    if stream.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let status = line.split_whitespace().nth(1)?.parse().ok()?;
    let mut headers = Vec::new();
    loop {
        line.clear();
        stream.read_line(&mut line).ok()?;
        let trimmed = line.trim_end();
        if trimmed.is_empty() {
            break;
        }
        let (name, value) = trimmed.split_once(':')?;
        headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
    }
    let length: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .map_or(0, |(_, v)| v.parse().unwrap());
    let mut body = vec![0; length];
    stream.read_exact(&mut body).ok()?;
    Some(RawResponse {
        status,
        headers,
        body,
    })
}

/// Whether the server closed `stream` (a read returns end of file) within `within`.
pub fn closed_within(stream: &mut BufReader<TcpStream>, within: Duration) -> bool {
    stream.get_ref().set_read_timeout(Some(within)).unwrap();
    let mut rest = Vec::new();
    stream.read_to_end(&mut rest).is_ok()
}

impl Server {
    /// What the server wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("server.log")).unwrap_or_default()
    }

    /// A raw connection, reads timing out after 30 s.
    pub fn raw(&self) -> TcpStream {
        let stream = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        stream
    }

    /// Writes `request` on a new connection and reads the answer.
    pub fn raw_exchange(&self, request: &[u8]) -> Option<RawResponse> {
        let mut stream = self.raw();
        stream.write_all(request).ok()?;
        read_response(&mut BufReader::new(stream))
    }

    /// A metric's value from `/metrics` (a line `name value`; the name with its labels).
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get_text("/metrics");
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
    }

    /// Polls `condition` every 50 ms for up to `within`; panics with `what` if it never holds.
    pub fn wait_until(&self, what: &str, within: Duration, condition: impl Fn(&Server) -> bool) {
        let deadline = Instant::now() + within;
        while !condition(self) {
            assert!(
                Instant::now() < deadline,
                "{what}: not within {within:?}\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Nothing queued, running or holding a page.
    /// Whether nothing is queued, running or holding pages, within 2 s: a finished request
    /// may hold its pages a step or two longer, to save its reply.
    pub fn is_idle(&self) -> bool {
        let idle = |s: &Server| {
            s.metric("snapserve_queue_requests") == 0.0
                && s.metric("snapserve_running_requests") == 0.0
                && s.metric("snapserve_kv_pool_pages{state=\"used\"}") == 0.0
        };
        let deadline = Instant::now() + Duration::from_secs(2);
        while !idle(self) {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    pub fn sigterm(&self) {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(sent.success());
    }

    /// Waits for the process to exit, for up to `within`.
    pub fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "snapserve still running {within:?} after SIGTERM\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
