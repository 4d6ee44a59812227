//! The OpenAI-compatible HTTP API over the actors: `POST /v1/completions` and
//! `POST /v1/chat/completions` (whole or streamed as server-sent events), `GET /v1/models`,
//! `GET /v1/models/{id}`, `POST /tokenize`, `POST /detokenize`, `GET /metrics`, `GET /health`,
//! and the snapshot admin routes under `/v1/snapshots` when an admin key is set; another method
//! on one of those paths is a 405 with `Allow`.
//!
//! A handler tokenizes and checks the request (`api`), submits it through [`Handles`] and
//! reads the request's own channel, turning tokens into text as they become final
//! (`output`). A full queue is a 429 with `Retry-After`; bad input a 400 that says why
//! (`error`); a body too large or too slow a 413 or 408 (`body`). A client that goes away
//! (its connection closes, whether or not the answer is streamed) drops the request's stream,
//! which cancels the request and frees its pages within a step. [`serve`] runs the server
//! and its shutdown.

mod api;
mod auth;
mod body;
mod error;
mod output;
mod serve;
mod snapshots;
mod tokens;

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use engine::chat::ChatTemplate;
use engine::grammar::Grammars;
use engine::model::ModelFiles;
use engine::tokenizer::Tokenizer;
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::json;

pub use auth::ApiKeys;
pub use body::{BodyLimits, MAX_BODY_BYTES};
pub use error::ApiError;
pub use serve::{ServeOptions, Served, serve};
pub use snapshots::KeepRequest;

use crate::request::GenerateRequest;
use crate::scheduler::SequenceLimit;
use crate::start::Handles;
use api::{ChatRequest, CompletionRequest, Prepared};
use output::{Kind, Output};

/// What the API knows of the served model.
pub struct Model {
    /// The name clients pass as `model`.
    pub id: String,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// Positions a sequence may reach, prompt plus generated tokens, and what sets that.
    pub limit: SequenceLimit,
    /// Token ids below this have logits (`logit_bias` may name no other).
    pub vocab_size: usize,
    /// Ids that end generation; their log-probabilities are not reported.
    pub eos_token_ids: Vec<u32>,
    /// The grammar engine over this vocabulary (structured outputs), or why there is none.
    pub grammars: Result<Arc<Grammars>, String>,
    /// When the server started, in seconds since the epoch (`created` in `/v1/models`).
    pub created: u64,
}

impl Model {
    /// The API's view of `files`, served under `id`, with `limit` positions a sequence.
    pub fn new(files: ModelFiles, id: String, limit: SequenceLimit) -> Self {
        let vocab_size = files.config.vocab_size;
        let grammars = Grammars::new(&files.tokenizer, vocab_size, &files.eos_token_ids)
            .map(Arc::new)
            .map_err(|e| {
                tracing::warn!("structured outputs are off: {e}");
                e.to_string()
            });
        Model {
            id,
            vocab_size,
            eos_token_ids: files.eos_token_ids,
            grammars,
            tokenizer: files.tokenizer,
            chat_template: files.chat_template,
            limit,
            created: unix_now(),
        }
    }

    /// The bytes token `id` stands for, as `logprobs` reports them.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        match &self.grammars {
            Ok(grammars) => grammars.token_bytes(id).to_vec(),
            Err(_) => self
                .tokenizer
                .decode(&[id], false)
                .unwrap_or_default()
                .into_bytes(),
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
    /// How large a request body may be and how long it may take to arrive.
    pub body: BodyLimits,
    /// The API keys requests must carry, if any.
    pub keys: ApiKeys,
}

/// Adds the API's routes to an actix-web app. A known path asked with another method is a 405
/// naming the one it answers (`Allow`); an unknown path a 404 listing the routes.
pub fn routes(config: &mut web::ServiceConfig) {
    config
        .service(only("/health", "GET").route(web::get().to(health)))
        .service(only("/v1/models", "GET").route(web::get().to(models)))
        // Ids may hold slashes (`org/name`), which the SDKs send as they are.
        .service(only("/v1/models/{id:.+}", "GET").route(web::get().to(model)))
        .service(only("/metrics", "GET").route(web::get().to(prometheus_metrics)))
        .service(only("/v1/completions", "POST").route(web::post().to(completions)))
        .service(only("/v1/chat/completions", "POST").route(web::post().to(chat_completions)))
        .service(only("/tokenize", "POST").route(web::post().to(tokens::tokenize)))
        .service(only("/detokenize", "POST").route(web::post().to(tokens::detokenize)))
        .service(
            only("/v1/snapshots", "GET, POST")
                .route(web::get().to(snapshots::list))
                .route(web::post().to(snapshots::keep)),
        )
        .service(
            only("/v1/snapshots/{id}", "GET, DELETE")
                .route(web::get().to(snapshots::show))
                .route(web::delete().to(snapshots::drop_one)),
        )
        .default_service(web::to(not_found));
}

/// A resource at `path` whose methods other than `allow` (the one its route takes) are
/// answered with a 405 naming it.
fn only(path: &str, allow: &'static str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(move |request: actix_web::HttpRequest| {
        let error = ApiError::method_not_allowed(request.method().as_str(), request.path(), allow);
        async move { Err::<HttpResponse, ApiError>(error) }
    }))
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
    HttpResponse::Ok().json(json!({
        "object": "list",
        "data": [model_object(&state.model)],
    }))
}

/// `GET /v1/models/{id}`: the served model, or a 404 naming it.
async fn model(
    state: web::Data<ApiState>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let model = &state.model;
    if *id != model.id {
        return Err(ApiError::model_not_found(&id, &model.id));
    }
    Ok(HttpResponse::Ok().json(model_object(model)))
}

/// The model as OpenAI's API describes one.
fn model_object(model: &Model) -> serde_json::Value {
    json!({
        "id": model.id,
        "object": "model",
        "created": model.created,
        "owned_by": "snapserve",
        "max_model_len": model.limit.tokens,
    })
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
             GET /v1/models/{{id}}, GET /metrics, POST /v1/completions, \
             POST /v1/chat/completions, POST /tokenize, POST /detokenize and \
             /v1/snapshots",
            request.method(),
            request.path()
        ))
    })
}

async fn completions(
    state: web::Data<ApiState>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: CompletionRequest = body::read_json(&request, payload, state.body).await?;
    let model = state.model.clone();
    let prepared = off_the_worker(move || body.prepare(&model)).await?;
    respond(&state, prepared, Kind::Completion).await
}

async fn chat_completions(
    state: web::Data<ApiState>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: ChatRequest = body::read_json(&request, payload, state.body).await?;
    let model = state.model.clone();
    let prepared = off_the_worker(move || body.prepare(&model)).await?;
    respond(&state, prepared, Kind::Chat).await
}

/// Runs a request's preparation (tokenizing a prompt that may be a whole context, rendering the
/// chat template, compiling a JSON schema's grammar) on actix's blocking pool, so a heavy one
/// never stalls the other connections of its HTTP worker.
async fn off_the_worker<T: Send + 'static>(
    prepare: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    web::block(prepare).await.map_err(|e| {
        ApiError::from(crate::error::ServeError::Engine(format!(
            "preparing the request: {e}"
        )))
    })?
}

/// Submits the request and answers it whole or as a stream of events.
async fn respond(
    state: &ApiState,
    prepared: Prepared,
    kind: Kind,
) -> Result<HttpResponse, ApiError> {
    let Prepared {
        prompts,
        params,
        stream,
        include_usage,
        echo,
        tools,
        n,
        best_of,
        echo_only,
    } = prepared;
    let prompt_tokens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    // The first token of each prompt whose tokens' logprobs are answered (it has none).
    let scored_from: Vec<Option<u32>> = prompts
        .iter()
        .map(|prompt| params.prompt_logprobs.and(prompt.first().copied()))
        .collect();
    let stops = params.stop.clone();
    let logprobs = params.logprobs.is_some();
    let mut params = params;
    if best_of.is_some() {
        // Candidates are ranked by their tokens' log-probabilities.
        params.logprobs.get_or_insert(0);
    }
    let candidates = best_of.unwrap_or(n);
    let requests = prompts
        .into_iter()
        .map(|prompt| GenerateRequest {
            prompt,
            params: params.clone(),
        })
        .collect();
    let groups = state.handles.submit_prompts(requests, candidates).await?;
    let mut outputs: Vec<Output> = Vec::with_capacity(groups.len() * candidates);
    for (p, streams) in groups.into_iter().enumerate() {
        crate::metrics::prompt_accepted(prompt_tokens[p]);
        for events in streams {
            let output = Output::new(state.model.clone(), events, &stops, prompt_tokens[p], kind)
                .echoing(echo.as_ref().map(|texts| texts[p].clone()))
                .scoring_prompt(scored_from[p])
                .echo_only(echo_only)
                .with_logprobs(logprobs)
                .reading_tools(tools.clone())
                .for_prompt(p);
            // Numbered across the prompts: streamed, every candidate is answered.
            let output = match outputs.first() {
                Some(first) => output.choice_of(first, outputs.len()),
                None => output,
            };
            outputs.push(output);
        }
    }
    if stream {
        Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(Output::events(outputs, include_usage)))
    } else {
        let body = Output::whole(outputs, n).await?;
        Ok(HttpResponse::Ok().json(body))
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
