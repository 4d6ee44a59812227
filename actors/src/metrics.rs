//! Prometheus metrics at `GET /metrics`, named `snapserve_*` with units in the names.
//!
//! Two sources. The actors' own counters (queue, pool, snapshot store, scheduler, memory) are
//! read with [`Handles::stats`] when Prometheus scrapes, so nothing on the step path updates a
//! metric for them. Latencies are recorded where they happen: time to first token, time
//! between tokens and request duration by the HTTP layer, step duration by the scheduler loop.
//! Without an installed recorder (library use, tests) the recording calls do nothing.

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};

use crate::scheduler::Phase;
use crate::start::Handles;

/// Bucket bounds, in seconds, of every `_seconds` histogram: from a fast decode step to a long
/// request.
const SECONDS_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0, 120.0,
];

/// Installs the process-wide Prometheus recorder, every family described (its `# HELP`); its
/// handle renders the text format.
pub fn install() -> Result<PrometheusHandle, BuildError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)?
        .install_recorder()?;
    describe();
    Ok(handle)
}

/// Every family's help text, the one place its meaning is written down.
fn describe() {
    let counters = [
        (
            "snapserve_requests_total",
            "Requests that ended, by outcome (finished, failed, cancelled).",
        ),
        (
            "snapserve_request_errors_total",
            "HTTP error answers, by their error code.",
        ),
        (
            "snapserve_prompt_tokens_total",
            "Prompt tokens of accepted requests.",
        ),
        (
            "snapserve_generation_tokens_total",
            "Tokens generated and delivered.",
        ),
        (
            "snapserve_prefix_reused_tokens_total",
            "Prompt tokens restored from snapshots instead of computed.",
        ),
        (
            "snapserve_prefix_forked_tokens_total",
            "Prompt tokens a request's other choices (n > 1) copied from its first instead of computing.",
        ),
        (
            "snapserve_first_tokens_from_kept_logits_total",
            "Requests whose first token came from the logits kept after their whole prompt, with no forward pass before it.",
        ),
        (
            "snapserve_kept_logits_dropped_total",
            "Rows of kept prompt logits dropped to make room for newer ones.",
        ),
        (
            "snapserve_context_full_backoffs_total",
            "Times a request backed off because the KV pool could not grow its sequence.",
        ),
        (
            "snapserve_preemptions_total",
            "Running requests sent back to the queue to free KV pages.",
        ),
        ("snapserve_scheduler_steps_total", "Scheduler steps run."),
        (
            "snapserve_multi_step_steps_total",
            "Scheduler steps that ran several decode steps in one engine step.",
        ),
        (
            "snapserve_multi_step_cut_short_total",
            "Multi-step decodes ended early because a request arrived or was cancelled.",
        ),
        (
            "snapserve_steps_planned_ahead_total",
            "Engine steps planned and sent while the step before them was still running.",
        ),
        (
            "snapserve_decode_steps_run_ahead_total",
            "Decode steps the GPU backend launched before their tokens were read (engine \
             run_ahead), by outcome: kept (the step asked for next) or dropped (computed for \
             nothing: a sequence ended or joined).",
        ),
        (
            "snapserve_engine_waits_total",
            "Engine steps planned ahead whose wait after the step before them was measured.",
        ),
        (
            "snapserve_engine_wait_microseconds_total",
            "The engine's time between the end of a step and the start of the next one planned \
             ahead of it: the scheduling the device waits for in steady work (over \
             snapserve_engine_waits_total: the wait a step).",
        ),
        (
            "snapserve_speculative_draft_tokens_total",
            "Tokens prompt lookup drafted for verification (speculative decoding).",
        ),
        (
            "snapserve_speculative_accepted_tokens_total",
            "Drafted tokens a verification kept.",
        ),
        (
            "snapserve_speculative_verify_steps_total",
            "Verifications of a draft, by how many drafted tokens they kept (label accepted, 0 to 7): \
             the acceptance-length histogram.",
        ),
        (
            "snapserve_snapshot_hits_total",
            "Snapshot lookups that found a stored prefix.",
        ),
        (
            "snapserve_snapshot_promotions_total",
            "Snapshots read back from the disk tier into memory for a request that found them there.",
        ),
        (
            "snapserve_snapshot_corrupt_total",
            "Snapshots refused because a copy's frame or block checksums did not match, by the tier read; the request recomputed.",
        ),
        (
            "snapserve_snapshot_misses_total",
            "Snapshot lookups that found none.",
        ),
        (
            "snapserve_snapshot_evictions_total",
            "Snapshots dropped, least recently used first, to make room in a tier.",
        ),
        (
            "snapserve_snapshot_demotions_total",
            "Snapshots moved from the device tier to the host tier.",
        ),
        (
            "snapserve_snapshot_refusals_total",
            "Snapshot saves refused: larger than what the tier could free.",
        ),
        ("snapserve_snapshot_saves_total", "Snapshots saved."),
        (
            "snapserve_snapshot_saves_skipped_total",
            "Prompt saves skipped by the save policy (not seen often enough yet).",
        ),
    ];
    for (name, help) in counters {
        describe_counter!(name, Unit::Count, help);
    }
    describe_counter!(
        "snapserve_scheduler_phase_microseconds_total",
        Unit::Microseconds,
        "Time the scheduler's thread spent planning steps and applying their answers, by phase \
         (begin, pool, engine, finish); compare its rate with the forward passes' time."
    );
    let gauges = [
        (
            "snapserve_queue_requests",
            Unit::Count,
            "Requests waiting in the queue.",
        ),
        (
            "snapserve_running_requests",
            Unit::Count,
            "Requests being computed.",
        ),
        (
            "snapserve_kv_pool_usage_ratio",
            Unit::Percent,
            "Share of the KV pool's pages in use, 0 to 1.",
        ),
        (
            "snapserve_kv_pool_pages",
            Unit::Count,
            "KV pool pages, by state (used, free, reserved).",
        ),
        (
            "snapserve_snapshot_bytes",
            Unit::Bytes,
            "Bytes of snapshots charged to each tier (device, host).",
        ),
        (
            "snapserve_snapshot_kept_bytes",
            Unit::Bytes,
            "Bytes of kept (pinned) snapshots in each tier, never evicted.",
        ),
        (
            "snapserve_snapshot_budget_bytes",
            Unit::Bytes,
            "Byte budget of each snapshot tier.",
        ),
        (
            "snapserve_kept_logits_bytes",
            Unit::Bytes,
            "Host bytes of the logits kept after whole prompts (snapshots.prompt_logits_bytes).",
        ),
        (
            "snapserve_snapshots",
            Unit::Count,
            "Snapshots held in each tier.",
        ),
        (
            "snapserve_engine_info",
            Unit::Count,
            "Always 1; its labels say what the engine runs: backend (cpu, cuda), quantization \
             (none, fp8, int8) and tensor_parallel (GPUs a model is split over).",
        ),
        (
            "snapserve_memory_bytes",
            Unit::Bytes,
            "Memory the engine holds, by kind (weights, kv_pool, device_snapshots, host_snapshots).",
        ),
    ];
    for (name, unit, help) in gauges {
        describe_gauge!(name, unit, help);
    }
    let histograms = [
        (
            "snapserve_time_to_first_token_seconds",
            "Time from a request's arrival to its first token.",
        ),
        (
            "snapserve_inter_token_latency_seconds",
            "Time between consecutive chunks of a streamed answer.",
        ),
        (
            "snapserve_request_duration_seconds",
            "Time from a request's arrival to its end, by finish reason.",
        ),
        (
            "snapserve_step_duration_seconds",
            "One scheduler step, from planning to the engine's answer (with overlapped steps, \
             the wait for the step ahead of it included).",
        ),
        (
            "snapserve_forward_duration_seconds",
            "The engine's forward pass and sampling of one step.",
        ),
    ];
    for (name, help) in histograms {
        describe_histogram!(name, Unit::Seconds, help);
    }
}

/// The engine's identity, as labels of a gauge that is always 1: what a dashboard needs to
/// tell apart servers of one model that compute differently (FP8 weights, a split model).
pub fn engine_info(backend: &str, quantization: policy::Quantization, tensor_parallel: usize) {
    let quantization = match quantization {
        policy::Quantization::None => "none",
        policy::Quantization::Fp8 => "fp8",
        policy::Quantization::Int8 => "int8",
    };
    gauge!(
        "snapserve_engine_info",
        "backend" => backend.to_owned(),
        "quantization" => quantization,
        "tensor_parallel" => tensor_parallel.to_string()
    )
    .set(1.0);
}

/// Sets the gauges and counters that mirror the actors' state, then renders everything.
pub async fn render(handles: &Handles, prometheus: &PrometheusHandle) -> String {
    let stats = handles.stats().await;
    let scheduler = stats.scheduler;
    gauge!("snapserve_queue_requests").set(scheduler.queued as f64);
    gauge!("snapserve_running_requests").set(scheduler.running as f64);
    for (outcome, count) in [
        ("finished", scheduler.finished),
        ("failed", scheduler.failed),
        ("cancelled", scheduler.cancelled),
    ] {
        counter!("snapserve_requests_total", "outcome" => outcome).absolute(count);
    }
    counter!("snapserve_generation_tokens_total").absolute(scheduler.generated_tokens);
    counter!("snapserve_prefix_reused_tokens_total").absolute(scheduler.restored_tokens);
    counter!("snapserve_prefix_forked_tokens_total").absolute(scheduler.forked_tokens);
    counter!("snapserve_first_tokens_from_kept_logits_total")
        .absolute(scheduler.first_tokens_from_kept_logits);
    counter!("snapserve_kept_logits_dropped_total").absolute(scheduler.kept_logits.dropped);
    gauge!("snapserve_kept_logits_bytes").set(scheduler.kept_logits.bytes as f64);
    counter!("snapserve_context_full_backoffs_total").absolute(scheduler.backoffs);
    counter!("snapserve_preemptions_total").absolute(scheduler.preemptions);
    counter!("snapserve_scheduler_steps_total").absolute(scheduler.steps);
    for (phase, nanos) in Phase::ALL.into_iter().zip(scheduler.phase_nanos) {
        counter!("snapserve_scheduler_phase_microseconds_total", "phase" => phase.name())
            .absolute(nanos / 1000);
    }
    counter!("snapserve_multi_step_steps_total").absolute(scheduler.multi_steps);
    counter!("snapserve_multi_step_cut_short_total").absolute(scheduler.multi_steps_cut_short);
    counter!("snapserve_steps_planned_ahead_total").absolute(scheduler.planned_ahead);
    counter!("snapserve_engine_waits_total").absolute(scheduler.engine_waits);
    let (kept, dropped) = scheduler.steps_run_ahead;
    counter!("snapserve_decode_steps_run_ahead_total", "outcome" => "kept").absolute(kept);
    counter!("snapserve_decode_steps_run_ahead_total", "outcome" => "dropped").absolute(dropped);
    counter!("snapserve_engine_wait_microseconds_total")
        .absolute(scheduler.engine_waited_nanos / 1000);
    counter!("snapserve_speculative_draft_tokens_total").absolute(scheduler.drafted_tokens);
    counter!("snapserve_speculative_accepted_tokens_total").absolute(scheduler.accepted_tokens);
    for (kept, &count) in scheduler.verified.iter().enumerate() {
        counter!("snapserve_speculative_verify_steps_total", "accepted" => kept.to_string())
            .absolute(count);
    }
    for (tier, count) in ["device", "host", "disk"]
        .into_iter()
        .zip(scheduler.corrupt_restores)
    {
        counter!("snapserve_snapshot_corrupt_total", "tier" => tier).absolute(count);
    }

    let pool = stats.pool;
    let usage = pool.used_pages as f64 / pool.total_pages.max(1) as f64;
    gauge!("snapserve_kv_pool_usage_ratio").set(usage);
    for (state, pages) in [
        ("used", pool.used_pages),
        ("free", pool.free_pages),
        ("reserved", pool.reserved_pages),
    ] {
        gauge!("snapserve_kv_pool_pages", "state" => state).set(pages as f64);
    }

    let store = stats.store;
    for (tier, t) in [
        ("device", store.device),
        ("host", store.host),
        ("disk", store.disk),
    ] {
        gauge!("snapserve_snapshot_bytes", "tier" => tier).set(t.charged_bytes as f64);
        gauge!("snapserve_snapshot_budget_bytes", "tier" => tier).set(t.budget_bytes as f64);
        gauge!("snapserve_snapshots", "tier" => tier).set(t.snapshots as f64);
        gauge!("snapserve_snapshot_kept_bytes", "tier" => tier).set(t.kept_bytes as f64);
    }
    counter!("snapserve_snapshot_hits_total").absolute(store.hits);
    counter!("snapserve_snapshot_misses_total").absolute(store.misses);
    counter!("snapserve_snapshot_evictions_total").absolute(store.evictions);
    counter!("snapserve_snapshot_demotions_total").absolute(store.demotions);
    counter!("snapserve_snapshot_promotions_total").absolute(store.promotions);
    counter!("snapserve_snapshot_refusals_total").absolute(store.refusals);
    counter!("snapserve_snapshot_saves_total").absolute(store.saves_committed);
    counter!("snapserve_snapshot_saves_skipped_total").absolute(store.saves_skipped);

    let memory = stats.memory;
    for (kind, bytes) in [
        ("weights", memory.weights_bytes),
        ("kv_pool", memory.pool_bytes),
        ("device_snapshots", memory.device_snapshot_bytes),
        ("host_snapshots", memory.host_snapshot_bytes),
    ] {
        gauge!("snapserve_memory_bytes", "kind" => kind).set(bytes as f64);
    }
    // Histograms keep their samples until upkeep folds them in; a scrape is the moment.
    prometheus.run_upkeep();
    prometheus.render()
}

/// A request's prompt, counted when it is accepted.
pub fn prompt_accepted(tokens: usize) {
    counter!("snapserve_prompt_tokens_total").increment(tokens as u64);
}

pub fn time_to_first_token(seconds: f64) {
    histogram!("snapserve_time_to_first_token_seconds").record(seconds);
}

pub fn inter_token(seconds: f64) {
    histogram!("snapserve_inter_token_latency_seconds").record(seconds);
}

pub fn request_done(seconds: f64, finish_reason: &'static str) {
    histogram!("snapserve_request_duration_seconds", "finish_reason" => finish_reason)
        .record(seconds);
}

/// An HTTP error answer, by its code.
pub fn error_answered(code: &'static str) {
    counter!("snapserve_request_errors_total", "code" => code).increment(1);
}

/// One scheduler step from planning to the engine's answer.
pub fn step_done(seconds: f64) {
    histogram!("snapserve_step_duration_seconds").record(seconds);
}

/// The engine's forward pass of one step (its first decode step in a multi-step one),
/// sampling included: what of a step is the model's, not the scheduler's.
pub fn forward_done(seconds: f64) {
    histogram!("snapserve_forward_duration_seconds").record(seconds);
}
