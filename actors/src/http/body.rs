//! Reading a request's JSON body within the server's limits: at most [`MAX_BODY_BYTES`], and
//! all of it within `server.body_timeout_s` of the headers, so a client that declares a body and
//! sends it slowly (or never) cannot hold a connection and a worker's attention forever.
//!
//! Answers 413 for a body over the limit (at once when `Content-Length` says so), 408 for one
//! that did not arrive in time, and 400 for one that is not JSON of the endpoint's shape; the
//! first two close the connection, since the rest of the body was never read.

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{HttpRequest, web};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;

use super::api::Sampling;
use super::error::ApiError;

/// Request bodies up to this size are read; prompts of a long context fit well within it.
pub const MAX_BODY_BYTES: usize = 32 << 20;

/// How long a body may take to arrive.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimits {
    pub timeout: Duration,
    pub max_bytes: usize,
}

/// Reads and parses the body of `request` as `T`.
pub async fn read_json<T: DeserializeOwned>(
    request: &HttpRequest,
    payload: web::Payload,
    limits: BodyLimits,
) -> Result<T, ApiError> {
    if let Some(declared) = declared_length(request)
        && declared > limits.max_bytes
    {
        return Err(too_large(limits.max_bytes));
    }
    let body = tokio::time::timeout(limits.timeout, read_all(payload, limits.max_bytes))
        .await
        .map_err(|_| ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            code: "body_timeout",
            ..ApiError::invalid(format!(
                "the request body did not arrive within {} s",
                limits.timeout.as_secs_f64()
            ))
        })??;
    parse(&body)
}

/// Parses a body, an error naming the field at fault (`param`) in the API's words.
fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    // Without the path tracking first: it costs on every element of a long prompt's token list
    // (a 32,000-token body: 1.14–1.27 ms with it, 0.79–0.90 without, on the 2-vCPU dev VM).
    // Only a body that fails is read again to name the field at fault.
    if let Ok(value) = serde_json::from_slice(body) {
        return Ok(value);
    }
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let error = match serde_path_to_error::deserialize(&mut deserializer) {
        Ok(value) => return deserializer.end().map(|()| value).map_err(not_json),
        Err(error) => error,
    };
    let mut field = error.path().to_string();
    let mut inner = error.into_inner();
    if inner.is_syntax() || inner.is_eof() {
        return Err(not_json(inner));
    }
    if field == "." {
        // A flattened part loses its path; the sampling fields are the one such part, and the
        // whole body parsed as them alone finds the field (other fields are ignored there).
        let located = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|value| serde_path_to_error::deserialize::<_, Sampling>(value).err());
        match located {
            Some(located) => {
                field = located.path().to_string();
                inner = located.into_inner();
            }
            None => return Err(not_json(inner)),
        }
    }
    Err(ApiError::invalid_param(
        &field,
        format!("`{field}`: {}", in_api_words(&inner)),
    ))
}

fn not_json(error: serde_json::Error) -> ApiError {
    ApiError::invalid(format!(
        "the request body is not what this endpoint takes: {error}"
    ))
}

/// serde's message without its Rust types and position: `expected usize` says "a non-negative
/// integer", an untagged enum's failure the shapes it takes (a prompt's visitor names its own).
fn in_api_words(error: &serde_json::Error) -> String {
    let message = error.to_string();
    let message = message
        .split(" at line ")
        .next()
        .unwrap_or(&message)
        .to_string();
    let shapes = [
        ("untagged enum Stop", "a string or a list of strings"),
        (
            "untagged enum Content",
            "a string or a list of content parts",
        ),
    ];
    if let Some((_, shape)) = shapes.iter().find(|(name, _)| message.contains(name)) {
        return format!("must be {shape}");
    }
    [
        ("usize", "a non-negative integer"),
        ("u64", "a non-negative integer"),
        ("u32", "a non-negative integer"),
        ("f32", "a number"),
        ("f64", "a number"),
        ("a boolean", "true or false"),
        ("struct ", "an object "),
    ]
    .iter()
    .fold(message, |m, (rust, api)| m.replace(rust, api))
}

async fn read_all(mut payload: web::Payload, max_bytes: usize) -> Result<Vec<u8>, ApiError> {
    let mut body = Vec::new();
    while let Some(chunk) = payload.next().await {
        let chunk = chunk
            .map_err(|e| ApiError::invalid(format!("the request body could not be read: {e}")))?;
        if body.len() + chunk.len() > max_bytes {
            return Err(too_large(max_bytes));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

fn declared_length(request: &HttpRequest) -> Option<usize> {
    request
        .headers()
        .get(actix_web::http::header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

fn too_large(max_bytes: usize) -> ApiError {
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        code: "body_too_large",
        ..ApiError::invalid(format!(
            "the request body is larger than this server's limit of {max_bytes} bytes"
        ))
    }
}
