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
    serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(format!(
            "the request body is not what this endpoint takes: {e}"
        ))
    })
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
