//! The API's errors: OpenAI's error shape, which the gateway and the REST API share.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    code: &'static str,
    param: Option<std::borrow::Cow<'static, str>>,
    message: String,
    /// Seconds a client should wait before trying again (the `Retry-After` header).
    retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        let kind = match status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        };
        ApiError { status, kind, code, param: None, message: message.into(), retry_after: None }
    }

    pub fn invalid(param: impl Into<std::borrow::Cow<'static, str>>, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_value", message).with_param(param)
    }

    /// The same error telling the client when to try again.
    pub fn retry_after(self, seconds: u64) -> ApiError {
        ApiError { retry_after: Some(seconds), ..self }
    }

    /// The same error naming the field at fault.
    pub fn with_param(self, param: impl Into<std::borrow::Cow<'static, str>>) -> ApiError {
        ApiError { param: Some(param.into()), ..self }
    }

    /// A body that is not JSON, or not of the request's shape: the field at fault named
    /// (its path, e.g. `messages[0].role`) where there is one.
    pub fn invalid_json<E: std::fmt::Display>(what: &str, e: serde_path_to_error::Error<E>) -> ApiError {
        ApiError::invalid_document("invalid_json", what, e)
    }

    /// A document (JSON, TOML) that does not parse or is not of the shape expected, `code`
    /// saying which language: the field at fault named where there is one.
    pub fn invalid_document<E: std::fmt::Display>(
        code: &'static str,
        what: &str,
        e: serde_path_to_error::Error<E>,
    ) -> ApiError {
        let path = e.path().to_string();
        let param = (path != ".").then_some(path);
        let message = match &param {
            Some(p) => format!("{what}: `{p}`: {}", e.inner()),
            None => format!("{what}: {}", e.inner()),
        };
        ApiError { param: param.map(Into::into), ..ApiError::new(StatusCode::BAD_REQUEST, code, message) }
    }

    /// The field a 400 names, if any.
    #[cfg(test)]
    pub fn param(&self) -> Option<&str> {
        self.param.as_deref()
    }

    pub fn message(&self) -> &str {
        &self.message
    }

    #[cfg(test)]
    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub(super) fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from(s));
        }
        response
    }
}
