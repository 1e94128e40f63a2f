//! What service a request asks for, from its headers and body: its class, tenant, deadline
//! and session (see [`engine::Service`]), for flow control and the engines' class priority.
//!
//! | source | meaning |
//! | --- | --- |
//! | `x-fleetplane-class: interactive \| standard \| batch` | the class (wins over the body) |
//! | body `service_tier` (OpenAI's): `priority`, `default`/`auto`, `flex` | interactive, standard, batch |
//! | `x-fleetplane-tenant: NAME` (1 to 128 characters) | the tenant fair shares are kept for [default: `default`] |
//! | `x-fleetplane-deadline-ms: N` | first token due N ms after arrival (1 to 2^32 − 1) |
//! | `x-fleetplane-session: ID` (up to 1024 characters) | the program (agent session) the request is a turn of |
//!
//! A value outside these is a 400 naming the header or field.

use super::errors::ApiError;
use axum::http::HeaderMap;
use engine::{Class, SessionId};
use std::num::NonZeroU32;

pub const CLASS_HEADER: &str = "x-fleetplane-class";
pub const TENANT_HEADER: &str = "x-fleetplane-tenant";
pub const DEADLINE_HEADER: &str = "x-fleetplane-deadline-ms";
pub const SESSION_HEADER: &str = "x-fleetplane-session";
const MAX_TENANT_CHARS: usize = 128;
const MAX_SESSION_CHARS: usize = 1024;

/// A request's service as the client asked for it; the tenant by name (the hub numbers it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Asked {
    pub class: Class,
    pub tenant: String,
    pub deadline_ms: Option<NonZeroU32>,
    pub session: Option<SessionId>,
}

fn header<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<Option<&'a str>, ApiError> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim()))
            .map_err(|_| ApiError::invalid(name, format!("header `{name}` is not visible ASCII"))),
    }
}

/// The service asked for by `headers` and the body's `service_tier`.
pub fn asked(headers: &HeaderMap, service_tier: Option<&str>) -> Result<Asked, ApiError> {
    let class = match (header(headers, CLASS_HEADER)?, service_tier) {
        (Some(name), _) => name.parse::<Class>().map_err(|e| ApiError::invalid(CLASS_HEADER, e.to_string()))?,
        (None, None | Some("auto" | "default")) => Class::Standard,
        (None, Some("priority")) => Class::Interactive,
        (None, Some("flex")) => Class::Batch,
        (None, Some(other)) => {
            return Err(ApiError::invalid(
                "service_tier",
                format!("`service_tier` is `{other}` (valid: auto, default, priority, flex)"),
            ))
        }
    };
    let tenant = match header(headers, TENANT_HEADER)? {
        None => "default".to_string(),
        Some(t) if !t.is_empty() && t.chars().count() <= MAX_TENANT_CHARS => t.to_string(),
        Some(_) => {
            let why = format!("header `{TENANT_HEADER}` must be 1 to {MAX_TENANT_CHARS} characters");
            return Err(ApiError::invalid(TENANT_HEADER, why));
        }
    };
    let deadline_ms = match header(headers, DEADLINE_HEADER)? {
        None => None,
        Some(v) => Some(v.parse::<NonZeroU32>().map_err(|_| {
            ApiError::invalid(
                DEADLINE_HEADER,
                format!("header `{DEADLINE_HEADER}` is `{v}`, not milliseconds from 1 to {}", u32::MAX),
            )
        })?),
    };
    let session = header(headers, SESSION_HEADER)?.filter(|s| !s.is_empty());
    if session.is_some_and(|s| s.len() > MAX_SESSION_CHARS) {
        let why = format!("header `{SESSION_HEADER}` is over {MAX_SESSION_CHARS} characters");
        return Err(ApiError::invalid(SESSION_HEADER, why));
    }
    let session = session.and_then(|s| {
        // A fixed hash (FNV-1a) so that every replica names a session alike.
        let h = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        SessionId::new(h.max(1))
    });
    Ok(Asked { class, tenant, deadline_ms, session })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().expect("a header value"));
        }
        h
    }

    #[test]
    fn the_class_comes_from_the_header_or_openais_service_tier() {
        assert_eq!(asked(&HeaderMap::new(), None).map(|a| a.class).ok(), Some(Class::Standard));
        assert_eq!(asked(&HeaderMap::new(), Some("flex")).map(|a| a.class).ok(), Some(Class::Batch));
        assert_eq!(asked(&HeaderMap::new(), Some("priority")).map(|a| a.class).ok(), Some(Class::Interactive));
        let h = headers(&[(CLASS_HEADER, "interactive")]);
        assert_eq!(asked(&h, Some("flex")).map(|a| a.class).ok(), Some(Class::Interactive));
    }

    #[test]
    fn bad_values_name_the_header_or_field() {
        let e = asked(&headers(&[(CLASS_HEADER, "urgent")]), None).unwrap_err();
        assert_eq!(e.param(), Some(CLASS_HEADER));
        assert_eq!(asked(&HeaderMap::new(), Some("scale")).unwrap_err().param(), Some("service_tier"));
        assert_eq!(asked(&headers(&[(DEADLINE_HEADER, "0")]), None).unwrap_err().param(), Some(DEADLINE_HEADER));
        let long = "t".repeat(129);
        assert_eq!(asked(&headers(&[(TENANT_HEADER, &long)]), None).unwrap_err().param(), Some(TENANT_HEADER));
    }

    #[test]
    fn tenant_deadline_and_session_are_read() {
        let h = headers(&[(TENANT_HEADER, "acme"), (DEADLINE_HEADER, "1500"), (SESSION_HEADER, "s-1")]);
        let a = asked(&h, None).expect("valid");
        assert_eq!((a.tenant.as_str(), a.deadline_ms.map(|d| d.get())), ("acme", Some(1500)));
        assert_eq!(a.session, asked(&h, None).expect("valid").session, "a session's id is stable");
        assert!(a.session.is_some());
    }
}
