//! Errors as OpenAI's API shapes them: a status, and `{"error": {message, type, param, code}}`.
//!
//! This is the one place a [`ServeError`] becomes an HTTP status.

use std::time::Duration;

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use serde_json::json;

use crate::error::ServeError;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`.
    pub kind: &'static str,
    pub code: &'static str,
    pub param: Option<String>,
    pub retry_after: Option<Duration>,
    /// The methods a path answers, for a 405's `Allow` header.
    pub allow: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            code: "invalid_request",
            param: None,
            retry_after: None,
            allow: None,
        }
    }

    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::invalid(message)
        }
    }

    pub fn model_not_found(asked: &str, served: &str) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            code: "model_not_found",
            ..ApiError::invalid_param(
                "model",
                format!("the model `{asked}` does not exist; this server serves `{served}`"),
            )
        }
    }

    /// A path asked with a method it does not answer.
    pub fn method_not_allowed(method: &str, path: &str, allow: &'static str) -> Self {
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            code: "method_not_allowed",
            allow: Some(allow),
            ..ApiError::invalid(format!("{path} answers {allow}, not {method}"))
        }
    }

    /// Whether the connection closes after this answer: the body was not read to its end
    /// (408, 413), or the server is going away.
    fn closes_connection(&self) -> bool {
        matches!(
            self.status,
            StatusCode::REQUEST_TIMEOUT | StatusCode::PAYLOAD_TOO_LARGE
        ) || self.code == "shutting_down"
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl From<ServeError> for ApiError {
    fn from(error: ServeError) -> Self {
        let (status, kind) = match &error {
            ServeError::Overloaded { .. } => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error"),
            ServeError::Invalid(_) | ServeError::TooManyChoices { .. } => {
                (StatusCode::BAD_REQUEST, "invalid_request_error")
            }
            ServeError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
            // Nobody cancels through HTTP; a client that sees this did not ask for it, and
            // retrying is its call.
            ServeError::Cancelled => (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
            ServeError::ContextFull { .. } => (StatusCode::SERVICE_UNAVAILABLE, "server_error"),
            ServeError::NotKept(_) => (StatusCode::CONFLICT, "invalid_request_error"),
            ServeError::Engine(_) | ServeError::Grammar(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "server_error")
            }
        };
        let retry_after = match &error {
            ServeError::Overloaded { retry_after } => Some(*retry_after),
            _ => None,
        };
        ApiError {
            status,
            message: error.to_string(),
            kind,
            code: error.code(),
            param: match error {
                ServeError::TooManyChoices { prompts: 1, .. } => Some("n".to_string()),
                ServeError::TooManyChoices { .. } => Some("prompt".to_string()),
                _ => None,
            },
            retry_after,
            allow: None,
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        crate::metrics::error_answered(self.code);
        let mut response = HttpResponse::build(self.status);
        if self.closes_connection() {
            response.force_close();
        }
        if let Some(after) = self.retry_after {
            // Whole seconds, rounded up: a client that waits that long finds room.
            let seconds = after.as_millis().div_ceil(1000).max(1);
            response.insert_header(("Retry-After", seconds.to_string()));
        }
        if let Some(allow) = self.allow {
            response.insert_header(("Allow", allow));
        }
        response.json(self.body())
    }
}
