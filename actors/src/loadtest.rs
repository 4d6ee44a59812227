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

use std::io::{BufRead, BufReader};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
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
    /// Words in each shared opening (or in each whole prompt when `prefixes` is 0).
    pub prefix_words: usize,
    /// Distinct shared openings; 0 makes every prompt new.
    pub prefixes: usize,
    /// Words each request adds after its opening; 0 repeats the opening alone.
    pub suffix_words: usize,
    pub max_tokens: usize,
    pub seed: u64,
    /// Shows a progress bar on stderr.
    pub progress: bool,
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
}

/// Everything a run measured.
#[derive(Debug, Clone)]
pub struct LoadReport {
    pub spec: LoadSpec,
    pub wall: Duration,
    pub samples: Vec<Sample>,
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

impl LoadSpec {
    /// The prompt of request `index`: reproducible from the seed.
    pub fn prompt(&self, index: usize) -> String {
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed ^ (index as u64).wrapping_mul(0x9e37));
        if self.prefixes == 0 {
            return words(&mut rng, self.prefix_words + self.suffix_words);
        }
        let which = rng.random_range(0..self.prefixes);
        let mut opening = ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(which as u64 + 1));
        let opening = words(&mut opening, self.prefix_words);
        if self.suffix_words == 0 {
            return opening;
        }
        format!(
            "{opening}\nQuestion {index}: {}?",
            words(&mut rng, self.suffix_words)
        )
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
    let samples = Mutex::new(Vec::with_capacity(spec.requests));
    let bar = spec.progress.then(|| {
        let bar = indicatif::ProgressBar::new(spec.requests as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} requests ({per_sec}) {msg}",
            )
            .expect("the template is valid")
            .progress_chars("=> "),
        );
        bar
    });
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..spec.concurrency.max(1) {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    if index >= spec.requests {
                        break;
                    }
                    let sample = one(&agent, spec, index);
                    if let Some(bar) = &bar {
                        bar.inc(1);
                        if let Some(error) = &sample.error {
                            bar.set_message(format!("last error: {error}"));
                        }
                    }
                    samples.lock().expect("no panic holds it").push(sample);
                }
            });
        }
    });
    if let Some(bar) = bar {
        bar.finish();
    }
    LoadReport {
        spec: spec.clone(),
        wall: started.elapsed(),
        samples: samples.into_inner().expect("no panic holds it"),
    }
}

/// Sends request `index` and reads its stream.
fn one(agent: &ureq::Agent, spec: &LoadSpec, index: usize) -> Sample {
    let body = json!({
        "prompt": spec.prompt(index),
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let started = Instant::now();
    let mut sample = Sample::default();
    let url = format!("{}/v1/completions", spec.url.trim_end_matches('/'));
    let mut response = match agent.post(&url).send_json(&body) {
        Ok(response) => response,
        Err(e) => {
            sample.error = Some(e.to_string());
            sample.latency = started.elapsed();
            return sample;
        }
    };
    sample.status = response.status().as_u16();
    if sample.status != 200 {
        let text = response.body_mut().read_to_string().unwrap_or_default();
        let answer: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let code = answer["error"]["code"].as_str().unwrap_or("unknown");
        sample.error = Some(format!("{} {code}", sample.status));
        sample.latency = started.elapsed();
        return sample;
    }
    let mut last_text: Option<Instant> = None;
    for line in BufReader::new(response.body_mut().as_reader()).lines() {
        let Ok(line) = line else {
            sample.error = Some("the stream broke off".into());
            break;
        };
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
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
            sample.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
            sample.completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
            sample.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
        }
    }
    sample.latency = started.elapsed();
    sample
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
    /// The summary table `snapserve loadtest` prints.
    pub fn table(&self) -> String {
        let ok: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.status == 200 && s.error.is_none())
            .collect();
        let failed = self.samples.len() - ok.len();
        let mut errors: Vec<(String, usize)> = Vec::new();
        for error in self.samples.iter().filter_map(|s| s.error.clone()) {
            match errors.iter_mut().find(|(e, _)| *e == error) {
                Some((_, n)) => *n += 1,
                None => errors.push((error, 1)),
            }
        }
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
            "{} requests, {} at a time, against {}: {} ok, {failed} failed, in {wall:.2} s",
            self.samples.len(),
            spec.concurrency,
            spec.url,
            ok.len()
        ));
        for (error, n) in &errors {
            line(format!("  {n} × {error}"));
        }
        line(format!(
            "throughput: {:.2} requests/s, {:.1} generated tokens/s; prompt tokens {prompt}, \
             {cached} of them restored from snapshots ({:.1}%)",
            ok.len() as f64 / wall,
            generated as f64 / wall,
            100.0 * cached as f64 / prompt.max(1) as f64
        ));
        line(format!(
            "{:<34} {:>7} {:>10} {:>10} {:>10}",
            "", "count", "p50 ms", "p90 ms", "p99 ms"
        ));
        let mut row = |name: &str, mut values: Vec<Duration>| {
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
            line(format!(
                "{name:<34} {count:>7} {p50:>10} {p90:>10} {p99:>10}"
            ));
        };
        let ttft = |hit: Option<bool>| -> Vec<Duration> {
            ok.iter()
                .filter(|s| hit.is_none_or(|h| (s.cached_tokens > 0) == h))
                .filter_map(|s| s.ttft)
                .collect()
        };
        row("time to first token", ttft(None));
        row("  with a snapshot restored", ttft(Some(true)));
        row("  computed from scratch", ttft(Some(false)));
        row(
            "gap between chunks",
            ok.iter().flat_map(|s| s.gaps.iter().copied()).collect(),
        );
        row("request", ok.iter().map(|s| s.latency).collect());
        out
    }
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
            url: String::new(),
            requests: 10,
            concurrency: 1,
            prefix_words: 50,
            prefixes: 2,
            suffix_words: 5,
            max_tokens: 1,
            seed: 7,
            progress: false,
        };
        let openings: std::collections::HashSet<String> = (0..10)
            .map(|i| spec.prompt(i).split('\n').next().unwrap().to_string())
            .collect();
        assert_eq!(openings.len(), 2, "{openings:?}");
        assert_eq!(spec.prompt(3), spec.prompt(3));
        assert_ne!(spec.prompt(3), spec.prompt(4));
        let fresh = LoadSpec {
            prefixes: 0,
            ..spec
        };
        assert_ne!(fresh.prompt(1)[..40], fresh.prompt(2)[..40]);
    }
}
