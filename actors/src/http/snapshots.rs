//! The snapshot admin API: `POST /v1/snapshots` computes a prefix (a `prompt`, or `messages`
//! rendered through the chat template without the assistant's opening) and keeps it, never
//! evicted; `GET /v1/snapshots` lists every snapshot; `GET /v1/snapshots/{id}` shows one;
//! `DELETE /v1/snapshots/{id}` drops one, kept or not.
//!
//! The routes exist only when an admin key is set (`serve --admin-api-key`, or `[server]
//! admin_api_key`): without one they are a 404 like any unknown path, and with one every
//! request must carry `Authorization: Bearer ADMIN_KEY` (compared in constant time; the API's
//! own keys do not open them).

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, HttpResponse, web};
use cache::{CacheError, SnapshotId, SnapshotInfo, SnapshotState};
use serde::Deserialize;
use serde_json::{Value, json};

use super::api::{Message, Prompt, check_vocabulary, message_of};
use super::error::ApiError;
use super::{ApiState, Model, body};

/// The body of `POST /v1/snapshots`: one of `prompt` and `messages`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeepRequest {
    pub prompt: Option<Prompt>,
    pub messages: Option<Vec<Message>>,
}

impl KeepRequest {
    /// The tokens to keep.
    pub fn tokens(&self, model: &Model) -> Result<Vec<u32>, ApiError> {
        let tokens = match (&self.prompt, &self.messages) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(ApiError::invalid(
                    "give the prefix to keep as `prompt` or as `messages`, one of them",
                ));
            }
            (Some(prompt), None) => prompt.single(model, "prefix")?,
            (None, Some(messages)) => {
                let Some(template) = &model.chat_template else {
                    return Err(ApiError::invalid_param(
                        "messages",
                        format!("{} has no chat template; keep a `prompt`", model.id),
                    ));
                };
                if messages.is_empty() {
                    return Err(ApiError::invalid_param("messages", "no messages"));
                }
                let messages = messages
                    .iter()
                    .enumerate()
                    .map(|(i, m)| message_of(i, m, None))
                    .collect::<Result<Vec<_>, _>>()?;
                // Without the assistant's opening: later chats go on from here.
                let rendered = template
                    .render(&messages, false)
                    .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
                model
                    .tokenizer
                    .encode_rendered(&rendered)
                    .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?
            }
        };
        check_vocabulary(&tokens, model, "prompt")?;
        Ok(tokens)
    }
}

/// A snapshot as the API shows it.
pub fn snapshot_object(info: &SnapshotInfo) -> Value {
    let last_used = info
        .last_used
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    json!({
        "id": api_id(info.id),
        "object": "snapshot",
        "tokens": info.tokens,
        "bytes": info.bytes,
        "tier": info.tier.to_string(),
        "pinned": info.kept,
        "hits": info.hits,
        "last_used": last_used,
        "state": match info.state {
            SnapshotState::Saving => "saving",
            SnapshotState::Ready => "ready",
            SnapshotState::Demoting => "demoting",
            SnapshotState::Promoting => "promoting",
        },
    })
}

/// Refuses the request unless admin routes are on and it carries the admin key; without a
/// key the routes do not exist.
fn admin(state: &ApiState, request: &HttpRequest) -> Result<(), ApiError> {
    let authorization = request
        .headers()
        .get(actix_web::http::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    state.keys.check_admin(request.path(), authorization)
}

pub async fn keep(
    state: web::Data<ApiState>,
    request: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    admin(&state, &request)?;
    let body: KeepRequest = body::read_json(&request, payload, state.body).await?;
    let model = state.model.clone();
    let tokens = super::off_the_worker(move || body.tokens(&model)).await?;
    let info = state.handles.keep_prefix(tokens).await?;
    tracing::info!(
        "kept {} ({} tokens, {} bytes)",
        info.id,
        info.tokens,
        info.bytes
    );
    Ok(HttpResponse::Ok().json(snapshot_object(&info)))
}

pub async fn list(
    state: web::Data<ApiState>,
    request: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    admin(&state, &request)?;
    let mut snapshots = state.handles.snapshots().await;
    snapshots.sort_by_key(|s| s.id);
    let data: Vec<Value> = snapshots.iter().map(snapshot_object).collect();
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": data})))
}

pub async fn show(
    state: web::Data<ApiState>,
    request: HttpRequest,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    admin(&state, &request)?;
    let id = parse_id(&id)?;
    let info = state.handles.snapshot(id).await.map_err(store_error)?;
    Ok(HttpResponse::Ok().json(snapshot_object(&info)))
}

pub async fn drop_one(
    state: web::Data<ApiState>,
    request: HttpRequest,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    admin(&state, &request)?;
    let id = parse_id(&id)?;
    state
        .handles
        .discard_snapshot(id)
        .await
        .map_err(store_error)?;
    tracing::info!("dropped {id} through the admin API");
    Ok(HttpResponse::Ok().json(json!({"id": api_id(id), "object": "snapshot", "deleted": true})))
}

/// How the API names a snapshot.
fn api_id(id: SnapshotId) -> String {
    format!("snap-{}", id.0)
}

/// `snap-7` (as the API shows ids) or `7`.
fn parse_id(text: &str) -> Result<SnapshotId, ApiError> {
    text.strip_prefix("snap-")
        .unwrap_or(text)
        .parse()
        .map(SnapshotId)
        .map_err(|_| ApiError {
            status: StatusCode::NOT_FOUND,
            code: "not_found",
            ..ApiError::invalid(format!("no snapshot {text}"))
        })
}

fn store_error(error: CacheError) -> ApiError {
    match error {
        CacheError::UnknownSnapshot { snapshot } => ApiError {
            status: StatusCode::NOT_FOUND,
            code: "not_found",
            ..ApiError::invalid(format!("no snapshot {snapshot}"))
        },
        other => ApiError {
            status: StatusCode::CONFLICT,
            code: "snapshot_busy",
            ..ApiError::invalid(format!("{other}; try again"))
        },
    }
}
