//! Optional API keys: with `[server] api_keys` (or `serve --api-key`) set, every request but
//! `/health` and `/metrics` (unless `keys_guard_health_and_metrics`) must carry
//! `Authorization: Bearer KEY` with one of them, or is answered 401 in OpenAI's shape before
//! its body is read. Keys are compared in constant time (`subtle`), against every key, so the
//! time of a refusal says nothing of how much of a key was right.
//!
//! The snapshot admin routes (`/v1/snapshots...`) answer to their own key instead
//! ([`ApiKeys::check_admin`]), and do not exist without one.

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::middleware::Next;
use actix_web::web;
use subtle::ConstantTimeEq;

use super::ApiState;
use super::error::ApiError;

/// The keys a server accepts.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    keys: Vec<Vec<u8>>,
    guard_health_and_metrics: bool,
    /// The key of the snapshot admin routes; `None`: they are off.
    admin: Option<Vec<u8>>,
}

impl ApiKeys {
    /// No keys: every request is let through.
    pub fn open() -> Self {
        ApiKeys::default()
    }

    pub fn new(keys: &[String], guard_health_and_metrics: bool) -> Self {
        ApiKeys {
            keys: keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
            guard_health_and_metrics,
            admin: None,
        }
    }

    /// Turns the snapshot admin routes on, behind `key`.
    pub fn with_admin(self, key: Option<&str>) -> Self {
        ApiKeys {
            admin: key.map(|k| k.as_bytes().to_vec()),
            ..self
        }
    }

    /// Whether a request for the admin route `path` with this `Authorization` header may go
    /// on: a 404 when the admin routes are off, a 401 without the admin key.
    pub fn check_admin(&self, path: &str, authorization: Option<&[u8]>) -> Result<(), ApiError> {
        let Some(admin) = &self.admin else {
            return Err(ApiError {
                status: StatusCode::NOT_FOUND,
                code: "not_found",
                ..ApiError::invalid(format!(
                    "no route for {path}: the snapshot admin API is off (start the server \
                     with --admin-api-key to turn it on)"
                ))
            });
        };
        let Some(key) = authorization.and_then(|h| h.strip_prefix(b"Bearer ")) else {
            return Err(unauthorized(
                "no admin key: send it as `Authorization: Bearer KEY`",
            ));
        };
        if bool::from(admin.ct_eq(key)) {
            Ok(())
        } else {
            Err(unauthorized("the admin key is not this server's"))
        }
    }

    pub fn is_open(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether a request for `path` with this `Authorization` header may go on.
    pub fn check(&self, path: &str, authorization: Option<&[u8]>) -> Result<(), ApiError> {
        let open_path = matches!(path, "/health" | "/metrics") && !self.guard_health_and_metrics;
        // The admin routes check their own key.
        let admin_path = path == "/v1/snapshots" || path.starts_with("/v1/snapshots/");
        if self.is_open() || open_path || admin_path {
            return Ok(());
        }
        let Some(key) = authorization.and_then(|h| h.strip_prefix(b"Bearer ")) else {
            return Err(unauthorized(
                "no API key: send it as `Authorization: Bearer KEY`",
            ));
        };
        let matched = self
            .keys
            .iter()
            .fold(subtle::Choice::from(0), |any, k| any | k.ct_eq(key));
        if bool::from(matched) {
            Ok(())
        } else {
            Err(unauthorized("the API key is not one this server accepts"))
        }
    }
}

fn unauthorized(message: &str) -> ApiError {
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        code: "invalid_api_key",
        ..ApiError::invalid(message)
    }
}

/// The middleware: refuses a request without an accepted key before any handler runs.
pub async fn require_key(
    request: ServiceRequest,
    next: Next<impl MessageBody>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    if let Some(state) = request.app_data::<web::Data<ApiState>>() {
        let authorization = request
            .headers()
            .get(actix_web::http::header::AUTHORIZATION)
            .map(|v| v.as_bytes());
        state.keys.check(request.path(), authorization)?;
    }
    next.call(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_guard_all_but_health_and_metrics_unless_asked() {
        let keys = ApiKeys::new(&["sk-first-key".into(), "sk-second-key".into()], false);
        let code = |r: Result<(), ApiError>| r.map_err(|e| (e.status.as_u16(), e.code));
        assert_eq!(
            code(keys.check("/v1/models", None)),
            Err((401, "invalid_api_key"))
        );
        assert_eq!(
            code(keys.check("/v1/models", Some(b"Bearer sk-first-ke"))),
            Err((401, "invalid_api_key"))
        );
        assert_eq!(
            code(keys.check("/v1/models", Some(b"sk-first-key"))),
            Err((401, "invalid_api_key"))
        );
        assert_eq!(
            code(keys.check("/v1/models", Some(b"Bearer sk-first-key"))),
            Ok(())
        );
        assert_eq!(
            code(keys.check("/v1/completions", Some(b"Bearer sk-second-key"))),
            Ok(())
        );
        assert_eq!(code(keys.check("/health", None)), Ok(()));
        assert_eq!(code(keys.check("/metrics", None)), Ok(()));
        let guarded = ApiKeys::new(&["sk-first-key".into()], true);
        assert_eq!(
            code(guarded.check("/metrics", None)),
            Err((401, "invalid_api_key"))
        );
        assert_eq!(code(ApiKeys::open().check("/v1/models", None)), Ok(()));
    }

    #[test]
    fn the_admin_routes_need_their_own_key_and_are_off_without_one() {
        let code = |r: Result<(), ApiError>| r.map_err(|e| (e.status.as_u16(), e.code));
        let off = ApiKeys::new(&["sk-first-key".into()], false);
        assert_eq!(
            code(off.check_admin("/v1/snapshots", Some(b"Bearer sk-first-key"))),
            Err((404, "not_found"))
        );
        let on = off.with_admin(Some("admin-key-123"));
        assert_eq!(
            code(on.check("/v1/snapshots", None)),
            Ok(()),
            "not an API key's"
        );
        assert_eq!(
            code(on.check_admin("/v1/snapshots", Some(b"Bearer sk-first-key"))),
            Err((401, "invalid_api_key"))
        );
        assert_eq!(
            code(on.check_admin("/v1/snapshots/snap-1", None)),
            Err((401, "invalid_api_key"))
        );
        assert_eq!(
            code(on.check_admin("/v1/snapshots", Some(b"Bearer admin-key-123"))),
            Ok(())
        );
    }
}
