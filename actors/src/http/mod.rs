//! The OpenAI-compatible HTTP API over the actors: `POST /v1/completions` and
//! `POST /v1/chat/completions` (whole or streamed as server-sent events), `GET /v1/models` and
//! `GET /health`.
//!
//! A handler tokenizes and checks the request ([`api`]), submits it through [`Handles`] and
//! reads the request's own channel, turning tokens into text as they become final
//! ([`output`]). A full queue is a 429 with `Retry-After`; bad input a 400 that says why
//! ([`error`]). A client that goes away drops its stream, which cancels the request and frees
//! its pages within a step.

mod api;
mod error;
mod output;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::http::StatusCode;
use actix_web::{App, HttpResponse, HttpServer, web};
use engine::chat::ChatTemplate;
use engine::model::ModelFiles;
use engine::tokenizer::Tokenizer;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;

pub use error::ApiError;

use crate::request::GenerateRequest;
use crate::start::Handles;
use api::{ChatRequest, CompletionRequest, Prepared};
use output::{Kind, Output};

/// What the API knows of the served model.
pub struct Model {
    /// The name clients pass as `model`.
    pub id: String,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// Positions a sequence may reach: prompt plus generated tokens.
    pub context_tokens: usize,
    /// When the server started, in seconds since the epoch (`created` in `/v1/models`).
    pub created: u64,
}

impl Model {
    /// The API's view of `files`, served under `id`, with `context_tokens` positions a sequence.
    pub fn new(files: ModelFiles, id: String, context_tokens: usize) -> Self {
        Model {
            id,
            tokenizer: files.tokenizer,
            chat_template: files.chat_template,
            context_tokens,
            created: unix_now(),
        }
    }
}

/// What every handler reads.
#[derive(Clone)]
pub struct ApiState {
    pub handles: Handles,
    pub model: Arc<Model>,
    /// Renders `/metrics`; `None` answers it with a 404.
    pub prometheus: Option<PrometheusHandle>,
}

/// Request bodies up to this size are read; prompts of a long context fit well within it.
const MAX_BODY_BYTES: usize = 32 << 20;

/// Adds the API's routes to an actix-web app.
pub fn routes(config: &mut web::ServiceConfig) {
    let json = web::JsonConfig::default()
        .limit(MAX_BODY_BYTES)
        .error_handler(|error, _| {
            ApiError::invalid(format!(
                "the request body is not what this endpoint takes: {error}"
            ))
            .into()
        });
    config
        .app_data(json)
        .route("/health", web::get().to(health))
        .route("/v1/models", web::get().to(models))
        .route("/metrics", web::get().to(prometheus_metrics))
        .route("/v1/completions", web::post().to(completions))
        .route("/v1/chat/completions", web::post().to(chat_completions))
        .default_service(web::to(not_found));
}

/// Serves the API on `address` with `workers` HTTP threads until the process is told to stop
/// (SIGINT or SIGTERM), then lets requests in flight finish.
pub async fn serve(state: ApiState, address: &str, workers: usize) -> std::io::Result<()> {
    HttpServer::new(move || {
        App::new()
            .app_data(web::Data::new(state.clone()))
            .configure(routes)
    })
    .workers(workers.max(1))
    .bind(address)?
    .run()
    .await
}

/// 200 while the engine's thread is alive; 503 once it has died (a backend that panicked), so
/// that a load balancer stops sending requests that could only fail.
async fn health(state: web::Data<ApiState>) -> HttpResponse {
    if state.handles.engine_alive() {
        HttpResponse::Ok().json(json!({"status": "ok"}))
    } else {
        HttpResponse::ServiceUnavailable().json(json!({"status": "the engine has stopped"}))
    }
}

async fn models(state: web::Data<ApiState>) -> HttpResponse {
    let model = &state.model;
    HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [{
            "id": model.id,
            "object": "model",
            "created": model.created,
            "owned_by": "snapserve",
            "max_model_len": model.context_tokens,
        }],
    }))
}

async fn prometheus_metrics(state: web::Data<ApiState>) -> Result<HttpResponse, ApiError> {
    let Some(prometheus) = &state.prometheus else {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            code: "not_found",
            ..ApiError::invalid("metrics are not enabled on this server")
        });
    };
    let text = crate::metrics::render(&state.handles, prometheus).await;
    Ok(HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(text))
}

async fn not_found(request: actix_web::HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError {
        status: StatusCode::NOT_FOUND,
        code: "not_found",
        ..ApiError::invalid(format!(
            "no route for {} {}; this server has GET /health, GET /v1/models, \
             GET /metrics, POST /v1/completions and POST /v1/chat/completions",
            request.method(),
            request.path()
        ))
    })
}

async fn completions(
    state: web::Data<ApiState>,
    body: web::Json<CompletionRequest>,
) -> Result<HttpResponse, ApiError> {
    let prepared = body.prepare(&state.model)?;
    respond(&state, prepared, Kind::Completion).await
}

async fn chat_completions(
    state: web::Data<ApiState>,
    body: web::Json<ChatRequest>,
) -> Result<HttpResponse, ApiError> {
    let prepared = body.prepare(&state.model)?;
    respond(&state, prepared, Kind::Chat).await
}

/// Submits the request and answers it whole or as a stream of events.
async fn respond(
    state: &ApiState,
    prepared: Prepared,
    kind: Kind,
) -> Result<HttpResponse, ApiError> {
    let Prepared {
        prompt,
        params,
        stream,
        include_usage,
    } = prepared;
    let prompt_tokens = prompt.len();
    let stops = params.stop.clone();
    let events = state
        .handles
        .submit(GenerateRequest { prompt, params })
        .await?;
    crate::metrics::prompt_accepted(prompt_tokens);
    let output = Output::new(state.model.clone(), events, &stops, prompt_tokens, kind);
    if stream {
        Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(output.into_events(include_usage)))
    } else {
        let body = output.whole().await?;
        Ok(HttpResponse::Ok().json(body))
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
