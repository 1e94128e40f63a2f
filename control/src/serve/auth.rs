//! Bearer tokens. The admin token (FLEETPLANE_ADMIN_TOKEN, or one generated and printed at
//! start) may do everything; tokens made through the API have a role; engines register with
//! a separate engine token. Only SHA-256 hashes of tokens are kept, in memory and in the
//! database.

use super::errors::ApiError;
use axum::http::{header, HeaderMap, StatusCode};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::RwLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// May call the gateway.
    Inference,
    /// May also read and change the fleet through the API and console.
    Admin,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "inference" => Some(Role::Inference),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Role::Inference => "inference",
            Role::Admin => "admin",
        }
    }
}

/// Who made a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    pub name: String,
    pub role: Role,
}

pub type TokenHash = [u8; 32];

pub fn hash(token: &str) -> TokenHash {
    Sha256::digest(token.as_bytes()).into()
}

/// A new random token: `fp_` and 32 hex digits.
pub fn generate() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| anyhow::anyhow!("no randomness for a token: {e}"))?;
    Ok(format!("fp_{}", hex::encode(bytes)))
}

pub struct Auth {
    tokens: RwLock<HashMap<TokenHash, Principal>>,
    engine: TokenHash,
}

impl Auth {
    pub fn new(admin_token: &str, engine_token: &str) -> Auth {
        let mut tokens = HashMap::new();
        tokens.insert(hash(admin_token), Principal { name: "admin".into(), role: Role::Admin });
        Auth { tokens: RwLock::new(tokens), engine: hash(engine_token) }
    }

    /// Adds (or replaces) tokens known from the database.
    pub fn learn(&self, known: impl IntoIterator<Item = (TokenHash, Principal)>) {
        let mut tokens = self.tokens.write().unwrap_or_else(|p| p.into_inner());
        tokens.extend(known);
    }

    pub fn forget(&self, h: &TokenHash) {
        self.tokens.write().unwrap_or_else(|p| p.into_inner()).remove(h);
    }

    /// The caller, if its bearer token is known and has at least `need`'s rights: 401 for a
    /// missing or unknown token, 403 for one without the rights.
    pub fn check(&self, headers: &HeaderMap, need: Role) -> Result<Principal, ApiError> {
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing_token",
                "send `Authorization: Bearer <token>`",
            ));
        };
        // The scheme is case-insensitive (RFC 9110 §11.1): `bearer` and `BEARER` are Bearer.
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t.trim());
        let Some(token) = token.filter(|t| !t.is_empty()) else {
            return Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_token",
                "the Authorization header is not `Bearer <token>`",
            ));
        };
        let principal = self.tokens.read().unwrap_or_else(|p| p.into_inner()).get(&hash(token)).cloned();
        match principal {
            None => Err(ApiError::new(StatusCode::UNAUTHORIZED, "invalid_token", "unknown token")),
            Some(p) if p.role < need => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!("token `{}` has the {} role; this needs {}", p.name, p.role.name(), need.name()),
            )),
            Some(p) => Ok(p),
        }
    }

    /// Whether `token` is the engine token (compared in constant time).
    pub fn is_engine(&self, token: &str) -> bool {
        use subtle::ConstantTimeEq;
        bool::from(hash(token).ct_eq(&self.engine))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn bearer(t: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(&format!("Bearer {t}")).expect("header"));
        h
    }

    #[test]
    fn roles_gate_access() {
        let auth = Auth::new("root", "eng");
        auth.learn([(hash("inf"), Principal { name: "app".into(), role: Role::Inference })]);
        assert!(auth.check(&bearer("root"), Role::Admin).is_ok());
        assert!(auth.check(&bearer("inf"), Role::Inference).is_ok());
        let mut lower = HeaderMap::new();
        lower.insert(header::AUTHORIZATION, HeaderValue::from_static("bearer root"));
        assert!(auth.check(&lower, Role::Admin).is_ok());
        lower.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic root"));
        assert!(auth.check(&lower, Role::Admin).is_err());
        assert_eq!(auth.check(&bearer("inf"), Role::Admin).err().map(|e| e.status()), Some(StatusCode::FORBIDDEN));
        assert_eq!(
            auth.check(&bearer("nope"), Role::Inference).err().map(|e| e.status()),
            Some(StatusCode::UNAUTHORIZED)
        );
        assert_eq!(
            auth.check(&HeaderMap::new(), Role::Inference).err().map(|e| e.status()),
            Some(StatusCode::UNAUTHORIZED)
        );
        assert!(auth.is_engine("eng") && !auth.is_engine("root"));
    }

    #[test]
    fn generated_tokens_differ() {
        let (a, b) = (generate().expect("token"), generate().expect("token"));
        assert_ne!(a, b);
        assert!(a.starts_with("fp_") && a.len() == 35);
    }
}
