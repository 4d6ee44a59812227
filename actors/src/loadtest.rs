//! The load-test harness behind `snapserve loadtest`: many streaming completions against a
//! running server, as clients would send them, and what they saw.
//!
//! Prompts are words drawn from a seeded generator. A request either repeats one of
//! `prefixes` shared openings (a system prompt, a document several questions ask about) and
//! adds a short question of its own (none with `suffix_words = 0`: the whole prompt repeats),
//! or, with `prefixes = 0`, is new throughout. Each request
//! streams, so the client times its first token, the gaps between chunks and the whole
//! request; the server's usage chunk says how many prompt tokens it restored from a snapshot,
//! which splits time to first token into snapshot hits and misses.
//!
//! Three more scenarios, for the server's behaviour under stress:
//! - `long_prompt_words`: one more client sends long new prompts back to back while the others
//!   run, to show what a long prefill does to everyone else's time to first token;
//! - `disconnect_fraction`: that share of the clients hang up early (a streamed request after
//!   a random number of chunks, a whole one after a random wait), as timeouts and closed tabs do;
//! - `duration` with `check_idle`: a soak that sends for a set time, then reads `/metrics`
//!   until the queue, the running requests and the pool's used pages are back to zero.
//!
//! A client refused with a 429 waits what its `Retry-After` says (at most five seconds) before
//! its next request, as the OpenAI SDKs do.

use std::io::{BufRead, BufReader};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{Value, json};

/// What to send.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// The server, e.g. `http://127.0.0.1:8000`.
    pub url: String,
    pub requests: usize,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// Words in each shared opening (or in each whole prompt when `prefixes` is 0); tokens
    /// with `token_ids`.
    pub prefix_words: usize,
    /// Distinct shared openings; 0 makes every prompt new.
    pub prefixes: usize,
    /// Words each request adds after its opening; 0 repeats the opening alone. Tokens with
    /// `token_ids`.
    pub suffix_words: usize,
    /// Prompts are lists of random token ids (as a benchmark client sends them) instead of
    /// words: their lengths are exact.
    pub token_ids: bool,
    pub max_tokens: usize,
    pub seed: u64,
    /// Shows a progress bar on stderr.
    pub progress: bool,
    /// Send for this long instead of `requests` requests.
    pub duration: Option<Duration>,
    /// Share of requests whose client hangs up before the end, in `[0, 1]`.
    pub disconnect_fraction: f64,
    /// Words of the long new prompts one more client sends while the others run (0: none).
    pub long_prompt_words: usize,
    /// After the load, wait (up to a minute) for the server to be idle and report it.
    pub check_idle: bool,
    /// Fields added to every request (`response_format`, say), over the defaults.
    pub extra: serde_json::Map<String, Value>,
}

impl LoadSpec {
    /// The plain load: `requests` requests, no long prompts, no disconnects, no idle check.
    pub fn new(url: impl Into<String>, requests: usize, concurrency: usize) -> Self {
        LoadSpec {
            url: url.into(),
            requests,
            concurrency,
            prefix_words: 400,
            prefixes: 4,
            suffix_words: 12,
            token_ids: false,
            max_tokens: 64,
            seed: 0,
            progress: false,
            duration: None,
            disconnect_fraction: 0.0,
            long_prompt_words: 0,
            check_idle: false,
            extra: serde_json::Map::new(),
        }
    }
}

/// One request as the client saw it.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// The HTTP status, or 0 when the connection failed.
    pub status: u16,
    pub error: Option<String>,
    pub ttft: Option<Duration>,
    /// Gaps between consecutive chunks carrying text.
    pub gaps: Vec<Duration>,
    pub latency: Duration,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// The client hung up on purpose before the end.
    pub disconnected: bool,
    /// One of the long prompts sent beside the load.
    pub long: bool,
    /// The server's `Retry-After` on a 429.
    pub retry_after: Option<Duration>,
}

/// The server's state read from `/metrics` once the load was over.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IdleCheck {
    /// From the end of the load to the first reading with everything at zero, or to the
    /// last reading when that never came.
    pub waited: Duration,
    pub idle: bool,
    pub queued: f64,
    pub running: f64,
    pub used_pages: f64,
}

/// Everything a run measured.
#[derive(Debug, Clone)]
pub struct LoadReport {
    pub spec: LoadSpec,
    pub wall: Duration,
    pub samples: Vec<Sample>,
    pub idle: Option<IdleCheck>,
}

const WORDS: &[&str] = &[
    "the", "river", "network", "quiet", "system", "orange", "memory", "signal", "garden", "engine",
    "winter", "paper", "bridge", "cloud", "number", "market", "forest", "light", "stone", "window",
    "theory", "music", "ocean", "planet", "coffee", "letter", "mountain", "science", "history",
    "language", "table", "summer", "street", "animal", "machine", "story",
];

fn words(rng: &mut ChaCha8Rng, count: usize) -> String {
    (0..count)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect::<Vec<_>>()
        .join(" ")
}

/// `count` random token ids, all of them ordinary tokens in any vocabulary we serve.
fn token_ids(rng: &mut ChaCha8Rng, count: usize) -> Vec<u32> {
    (0..count).map(|_| rng.random_range(100..30_000)).collect()
}

impl LoadSpec {
    /// The prompt of request `index`, as the `prompt` field: reproducible from the seed.
    pub fn prompt(&self, index: usize) -> Value {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ (index as u64).wrapping_mul(0x9e37));
        // A shared opening is drawn from its own seed; a new prompt's from the request's.
        let mut shared = (self.prefixes > 0).then(|| {
            let which = rng.random_range(0..self.prefixes);
            ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(which as u64 + 1))
        });
        let opening_rng = shared.as_mut().unwrap_or(&mut rng);
        if self.token_ids {
            let mut ids = token_ids(opening_rng, self.prefix_words);
            ids.extend(token_ids(&mut rng, self.suffix_words));
            return json!(ids);
        }
        let opening = words(opening_rng, self.prefix_words);
        if self.suffix_words == 0 {
            return json!(opening);
        }
        let question = words(&mut rng, self.suffix_words);
        if self.prefixes == 0 {
            return json!(format!("{opening} {question}"));
        }
        json!(format!("{opening}\nQuestion {index}: {question}?"))
    }
}

/// The longest a client waits after a 429, whatever `Retry-After` says.
const MAX_RETRY_WAIT: Duration = Duration::from_secs(5);

/// What one request does, drawn from the seed.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Plan {
    /// Streams to the end.
    Whole,
    /// Streams, and hangs up after this many chunks (0: as soon as the answer starts).
    HangUpAfterChunks(usize),
    /// Asks for the answer in one body, and hangs up after this wait.
    HangUpAfter(Duration),
}

impl LoadSpec {
    fn plan(&self, index: usize) -> Plan {
        let mut rng = ChaCha8Rng::seed_from_u64(!self.seed ^ (index as u64).wrapping_mul(0x51ed));
        if !rng.random_bool(self.disconnect_fraction.clamp(0.0, 1.0)) {
            return Plan::Whole;
        }
        if rng.random_bool(0.5) {
            Plan::HangUpAfterChunks(rng.random_range(0..=self.max_tokens / 2))
        } else {
            Plan::HangUpAfter(Duration::from_millis(rng.random_range(100..2_000)))
        }
    }

    /// Whether client threads should take another request.
    fn more(&self, index: usize, started: Instant) -> bool {
        match self.duration {
            Some(duration) => started.elapsed() < duration,
            None => index < self.requests,
        }
    }
}

/// Runs the load and gathers every request's sample.
pub fn run(spec: &LoadSpec) -> LoadReport {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into();
    let next = AtomicUsize::new(0);
    let load_done = AtomicBool::new(false);
    let samples = Mutex::new(Vec::with_capacity(spec.requests));
    let bar = spec.progress.then(|| progress_bar(spec));
    let started = Instant::now();
    let record = |sample: Sample| {
        if let Some(bar) = &bar {
            bar.inc(1);
            if let Some(error) = &sample.error {
                bar.set_message(format!("last error: {error}"));
            }
        }
        samples.lock().expect("no panic holds it").push(sample);
    };
    std::thread::scope(|scope| {
        if spec.long_prompt_words > 0 {
            scope.spawn(|| {
                let mut index = 0;
                while !load_done.load(Ordering::Relaxed) {
                    record(long_one(&agent, spec, index));
                    index += 1;
                }
            });
        }
        let clients: Vec<_> = (0..spec.concurrency.max(1))
            .map(|_| {
                scope.spawn(|| {
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        if !spec.more(index, started) {
                            break;
                        }
                        let sample = one(&agent, spec, index);
                        // As the OpenAI SDKs do: wait as long as the server asked.
                        let pause = sample.retry_after.map(|after| after.min(MAX_RETRY_WAIT));
                        record(sample);
                        if let Some(pause) = pause {
                            std::thread::sleep(pause);
                        }
                    }
                })
            })
            .collect();
        for client in clients {
            client.join().expect("a client thread panicked");
        }
        load_done.store(true, Ordering::Relaxed);
    });
    if let Some(bar) = bar {
        bar.finish();
    }
    let wall = started.elapsed();
    LoadReport {
        spec: spec.clone(),
        wall,
        samples: samples.into_inner().expect("no panic holds it"),
        idle: spec.check_idle.then(|| wait_idle(&agent, &spec.url)),
    }
}

fn progress_bar(spec: &LoadSpec) -> indicatif::ProgressBar {
    let bar = match spec.duration {
        Some(_) => indicatif::ProgressBar::no_length(),
        None => indicatif::ProgressBar::new(spec.requests as u64),
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests ({per_sec}) {msg}",
        )
        .expect("the template is valid")
        .progress_chars("=> "),
    );
    bar
}

/// Sends request `index` and reads its answer as its plan says.
fn one(agent: &ureq::Agent, spec: &LoadSpec, index: usize) -> Sample {
    let plan = spec.plan(index);
    let stream = !matches!(plan, Plan::HangUpAfter(_));
    let mut body = json!({
        "prompt": spec.prompt(index),
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": stream,
    });
    // The API refuses stream_options on an answer that is not streamed, as OpenAI's does.
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    for (key, value) in &spec.extra {
        body[key] = value.clone();
    }
    send(agent, &spec.url, &body, plan)
}

/// One of the long new prompts sent beside the load: greedy, a few tokens, streamed.
fn long_one(agent: &ureq::Agent, spec: &LoadSpec, index: usize) -> Sample {
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed ^ 0x10e6 ^ (index as u64) << 20);
    let body = json!({
        "prompt": words(&mut rng, spec.long_prompt_words),
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    Sample {
        long: true,
        ..send(agent, &spec.url, &body, Plan::Whole)
    }
}

fn send(agent: &ureq::Agent, url: &str, body: &Value, plan: Plan) -> Sample {
    let started = Instant::now();
    let mut sample = Sample::default();
    let url = format!("{}/v1/completions", url.trim_end_matches('/'));
    let request = match plan {
        Plan::HangUpAfter(wait) => agent.post(&url).config().timeout_global(Some(wait)).build(),
        _ => agent.post(&url).config().build(),
    };
    let mut response = match request.send_json(body) {
        Ok(response) => response,
        Err(ureq::Error::Timeout(_)) if matches!(plan, Plan::HangUpAfter(_)) => {
            sample.disconnected = true;
            sample.latency = started.elapsed();
            return sample;
        }
        Err(e) => {
            sample.error = Some(e.to_string());
            sample.latency = started.elapsed();
            return sample;
        }
    };
    sample.status = response.status().as_u16();
    sample.retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .map(Duration::from_secs);
    if sample.status != 200 {
        let text = response.body_mut().read_to_string().unwrap_or_default();
        let answer: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let code = answer["error"]["code"].as_str().unwrap_or("unknown");
        sample.error = Some(format!("{} {code}", sample.status));
    } else if let Plan::HangUpAfter(_) = plan {
        // Answered before the client's patience ran out.
        match response.body_mut().read_json::<Value>() {
            Ok(answer) => read_usage(&mut sample, &answer["usage"]),
            Err(ureq::Error::Timeout(_)) => sample.disconnected = true,
            Err(e) => sample.error = Some(e.to_string()),
        }
    } else {
        let hang_up = match plan {
            Plan::HangUpAfterChunks(chunks) => Some(chunks),
            _ => None,
        };
        read_stream(
            &mut sample,
            response.body_mut().as_reader(),
            started,
            hang_up,
        );
    }
    sample.latency = started.elapsed();
    sample
}

/// Reads a streamed answer, timing its chunks; hangs up after `hang_up` chunks if given.
fn read_stream(
    sample: &mut Sample,
    body: impl std::io::Read,
    started: Instant,
    hang_up: Option<usize>,
) {
    let mut last_text: Option<Instant> = None;
    let mut chunks = 0;
    for line in BufReader::new(body).lines() {
        if hang_up.is_some_and(|after| chunks >= after) {
            sample.disconnected = true;
            return;
        }
        let Ok(line) = line else {
            sample.error = Some("the stream broke off".into());
            return;
        };
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return;
        }
        chunks += 1;
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        if let Some(error) = chunk.get("error") {
            sample.error = Some(error["code"].as_str().unwrap_or("error").to_string());
        }
        let text = chunk["choices"][0]["text"].as_str().unwrap_or("");
        if !text.is_empty() {
            let now = Instant::now();
            match last_text.replace(now) {
                None => sample.ttft = Some(now - started),
                Some(last) => sample.gaps.push(now - last),
            }
        }
        if let Some(usage) = chunk.get("usage") {
            read_usage(sample, usage);
        }
    }
}

fn read_usage(sample: &mut Sample, usage: &Value) {
    sample.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
    sample.completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
    sample.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
}

/// Reads the server's queue, running requests and used pages from `/metrics` until all are
/// zero, for up to a minute.
fn wait_idle(agent: &ureq::Agent, url: &str) -> IdleCheck {
    let url = format!("{}/metrics", url.trim_end_matches('/'));
    let started = Instant::now();
    loop {
        let text = agent
            .get(&url)
            .call()
            .ok()
            .and_then(|mut r| r.body_mut().read_to_string().ok())
            .unwrap_or_default();
        let value = |name: &str| -> f64 {
            text.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or(f64::NAN)
        };
        let check = IdleCheck {
            waited: started.elapsed(),
            idle: false,
            queued: value("snapserve_queue_requests"),
            running: value("snapserve_running_requests"),
            used_pages: value("snapserve_kv_pool_pages{state=\"used\"}"),
        };
        let idle = check.queued == 0.0 && check.running == 0.0 && check.used_pages == 0.0;
        if idle || started.elapsed() > Duration::from_secs(60) {
            return IdleCheck { idle, ..check };
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Time to first token at one request in flight, for new prompts of each of `lengths` tokens
/// (random ids), `per_length` requests each, one token generated: what a lone user waits for a
/// prefill, the server's overhead included. Returns the table `snapserve loadtest
/// --ttft-sweep` prints.
pub fn ttft_sweep(url: &str, lengths: &[usize], per_length: usize, seed: u64) -> String {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(600)))
        .build()
        .into();
    let url = format!("{}/v1/completions", url.trim_end_matches('/'));
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x77f7);
    let mut out = format!(
        "time to first token at one request in flight, {per_length} new prompts per length\n\
         {:>14} {:>10} {:>10} {:>10} {:>10} {:>7}\n",
        "prompt tokens", "min ms", "p50 ms", "p90 ms", "p99 ms", "failed"
    );
    for &length in lengths {
        let mut times = Vec::with_capacity(per_length);
        let mut failed = 0;
        for _ in 0..per_length {
            let body = json!({
                "prompt": token_ids(&mut rng, length.max(1)),
                "max_tokens": 1,
                "temperature": 0,
                "ignore_eos": true,
                "stream": true,
            });
            match first_chunk(&agent, &url, &body) {
                Some(time) => times.push(time),
                None => failed += 1,
            }
        }
        let ms = |d: Option<Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1e3);
        let min = times.iter().min().copied();
        out += &format!(
            "{length:>14} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {failed:>7}\n",
            ms(min),
            ms(percentile(&mut times, 0.5)),
            ms(percentile(&mut times, 0.9)),
            ms(percentile(&mut times, 0.99)),
        );
    }
    out
}

/// Sends a streamed request and times its first event, then reads it to the end; `None` if it
/// failed.
fn first_chunk(agent: &ureq::Agent, url: &str, body: &Value) -> Option<Duration> {
    let started = Instant::now();
    let mut response = agent.post(url).send_json(body).ok()?;
    if response.status() != 200 {
        return None;
    }
    let mut first = None;
    for line in BufReader::new(response.body_mut().as_reader()).lines() {
        let line = line.ok()?;
        if let Some(data) = line.strip_prefix("data: ") {
            first.get_or_insert_with(|| started.elapsed());
            if data == "[DONE]" {
                break;
            }
        }
    }
    first
}

/// The value below which `q` of `values` fall (nearest rank), or `None` when empty.
pub fn percentile(values: &mut [Duration], q: f64) -> Option<Duration> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
    Some(values[rank - 1])
}

impl LoadReport {
    /// The load's own requests (not the long prompts beside it).
    fn load(&self) -> impl Iterator<Item = &Sample> {
        self.samples.iter().filter(|s| !s.long)
    }

    /// Requests of the load that ran to their end.
    pub fn ok(&self) -> Vec<&Sample> {
        self.load()
            .filter(|s| s.status == 200 && s.error.is_none() && !s.disconnected)
            .collect()
    }

    /// The summary table `snapserve loadtest` prints.
    pub fn table(&self) -> String {
        let ok = self.ok();
        let disconnected = self.load().filter(|s| s.disconnected).count();
        let failed = self.load().count() - ok.len() - disconnected;
        let wall = self.wall.as_secs_f64();
        let generated: u64 = ok.iter().map(|s| s.completion_tokens).sum();
        let prompt: u64 = ok.iter().map(|s| s.prompt_tokens).sum();
        let cached: u64 = ok.iter().map(|s| s.cached_tokens).sum();
        let mut out = String::new();
        let mut line = |s: String| {
            out.push_str(&s);
            out.push('\n');
        };
        let spec = &self.spec;
        line(format!(
            "{} requests, {} at a time, against {}: {} ok, {failed} failed, \
             {disconnected} hung up by the client, in {wall:.2} s",
            self.load().count(),
            spec.concurrency,
            spec.url,
            ok.len()
        ));
        line(format!("  statuses: {}", self.statuses()));
        for (error, n) in count_by(self.load().filter_map(|s| s.error.clone())) {
            line(format!("  {n} × {error}"));
        }
        line(format!(
            "throughput: {:.2} requests/s, {:.1} generated tokens/s, {:.1} tokens/s with the \
             prompts'; prompt tokens {prompt}, {cached} of them restored from snapshots ({:.1}%)",
            ok.len() as f64 / wall,
            generated as f64 / wall,
            (prompt + generated) as f64 / wall,
            100.0 * cached as f64 / prompt.max(1) as f64
        ));
        line(format!(
            "{:<34} {:>7} {:>10} {:>10} {:>10}",
            "", "count", "p50 ms", "p90 ms", "p99 ms"
        ));
        let ttft = |hit: Option<bool>| -> Vec<Duration> {
            ok.iter()
                .filter(|s| hit.is_none_or(|h| (s.cached_tokens > 0) == h))
                .filter_map(|s| s.ttft)
                .collect()
        };
        line(row("time to first token", ttft(None)));
        line(row("  with a snapshot restored", ttft(Some(true))));
        line(row("  computed from scratch", ttft(Some(false))));
        line(row(
            "gap between chunks",
            ok.iter().flat_map(|s| s.gaps.iter().copied()).collect(),
        ));
        line(row("request", ok.iter().map(|s| s.latency).collect()));
        let long: Vec<&Sample> = self.samples.iter().filter(|s| s.long).collect();
        if !long.is_empty() {
            let failed = long.iter().filter(|s| s.error.is_some()).count();
            line(row(
                &format!("long prompt, first token ({failed} failed)"),
                long.iter().filter_map(|s| s.ttft).collect(),
            ));
        }
        if let Some(idle) = self.idle {
            line(format!(
                "after the load: {} in {:.1} s: queue {}, running {}, used KV pages {}",
                if idle.idle { "idle" } else { "NOT idle" },
                idle.waited.as_secs_f64(),
                idle.queued,
                idle.running,
                idle.used_pages
            ));
        }
        out
    }

    /// "200 × 812, 429 × 1,433, ..." over the load's requests that the client did not hang up
    /// on before an answer (0: the connection failed).
    fn statuses(&self) -> String {
        let answered = self.load().filter(|s| !(s.disconnected && s.status == 0));
        let mut statuses: Vec<(u16, usize)> = count_by(answered.map(|s| s.status));
        statuses.sort_unstable();
        statuses
            .iter()
            .map(|(status, n)| format!("{status} × {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// One line of the table: the count and percentiles of `values`, in milliseconds.
fn row(name: &str, mut values: Vec<Duration>) -> String {
    let ms = |d: Option<Duration>| {
        d.map_or_else(
            || "-".to_string(),
            |d| format!("{:.1}", d.as_secs_f64() * 1e3),
        )
    };
    let count = values.len();
    let p50 = ms(percentile(&mut values, 0.5));
    let p90 = ms(percentile(&mut values, 0.9));
    let p99 = ms(percentile(&mut values, 0.99));
    format!("{name:<34} {count:>7} {p50:>10} {p90:>10} {p99:>10}")
}

/// Each distinct value with how often it occurs, in order of first occurrence.
fn count_by<T: PartialEq>(values: impl Iterator<Item = T>) -> Vec<(T, usize)> {
    let mut counts: Vec<(T, usize)> = Vec::new();
    for value in values {
        match counts.iter_mut().find(|(v, _)| *v == value) {
            Some((_, n)) => *n += 1,
            None => counts.push((value, 1)),
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let mut values: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(
            percentile(&mut values, 0.5),
            Some(Duration::from_millis(50))
        );
        assert_eq!(
            percentile(&mut values, 0.99),
            Some(Duration::from_millis(99))
        );
        assert_eq!(
            percentile(&mut values, 1.0),
            Some(Duration::from_millis(100))
        );
        assert_eq!(percentile(&mut [], 0.5), None);
    }

    #[test]
    fn prompts_repeat_their_opening_and_are_reproducible() {
        let spec = LoadSpec {
            prefix_words: 50,
            prefixes: 2,
            suffix_words: 5,
            max_tokens: 1,
            seed: 7,
            ..LoadSpec::new("", 10, 1)
        };
        let openings: std::collections::HashSet<String> = (0..10)
            .map(|i| {
                let prompt = spec.prompt(i);
                prompt
                    .as_str()
                    .unwrap()
                    .split('\n')
                    .next()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(openings.len(), 2, "{openings:?}");
        assert_eq!(spec.prompt(3), spec.prompt(3));
        assert_ne!(spec.prompt(3), spec.prompt(4));
        let fresh = LoadSpec {
            prefixes: 0,
            ..spec
        };
        let (one, two) = (fresh.prompt(1), fresh.prompt(2));
        assert_ne!(one.as_str().unwrap()[..40], two.as_str().unwrap()[..40]);
        let ids = LoadSpec {
            token_ids: true,
            prefixes: 1,
            prefix_words: 100,
            suffix_words: 7,
            ..fresh
        };
        let (one, two) = (ids.prompt(1), ids.prompt(2));
        let (one, two) = (one.as_array().unwrap(), two.as_array().unwrap());
        assert_eq!((one.len(), two.len()), (107, 107));
        assert_eq!(one[..100], two[..100], "one shared opening");
        assert_ne!(one[100..], two[100..], "each request's own tokens");
    }

    #[test]
    fn about_the_asked_share_of_clients_hang_up() {
        let spec = LoadSpec {
            disconnect_fraction: 0.25,
            max_tokens: 40,
            ..LoadSpec::new("", 0, 1)
        };
        let plans: Vec<Plan> = (0..2_000).map(|i| spec.plan(i)).collect();
        let hang_ups = plans.iter().filter(|p| **p != Plan::Whole).count();
        assert!((400..600).contains(&hang_ups), "{hang_ups}");
        assert!(plans.contains(&Plan::HangUpAfterChunks(0)));
        assert!(plans.iter().any(|p| matches!(p, Plan::HangUpAfter(_))));
        assert!(plans.iter().all(|p| match p {
            Plan::HangUpAfterChunks(n) => *n <= 20,
            _ => true,
        }));
        assert_eq!(spec.plan(17), spec.plan(17));
        let none = LoadSpec {
            disconnect_fraction: 0.0,
            ..spec
        };
        assert!((0..100).all(|i| none.plan(i) == Plan::Whole));
    }
}
