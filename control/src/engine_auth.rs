//! The engine token on the engine's own gRPC service. Engines register with a control plane
//! by presenting `FLEETPLANE_ENGINE_TOKEN`; the same token goes the other way, as
//! `authorization: Bearer TOKEN` on every call a control plane makes to an engine (`Generate`,
//! `Configure`, `Drain`, `Export`...), and an engine refuses a call without it. Without this,
//! anyone who could reach an engine's port could run requests on it or change its scheduling.

use crate::proto::engine_client::EngineClient;
use subtle::ConstantTimeEq;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::Channel;
use tonic::{Request, Status};

/// The environment variable both sides read the token from.
pub const ENV: &str = "FLEETPLANE_ENGINE_TOKEN";

/// A client of an engine that presents the token on each call.
pub type EngineLink = EngineClient<InterceptedService<Channel, Present>>;

/// Adds the token to each outgoing call.
#[derive(Clone)]
pub struct Present(MetadataValue<Ascii>);

impl Present {
    pub fn new(token: &str) -> anyhow::Result<Present> {
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| anyhow::anyhow!("{ENV} holds characters that cannot go in a gRPC header"))?;
        Ok(Present(value))
    }

    /// A client of the engine behind `channel`.
    pub fn link(&self, channel: Channel) -> EngineLink {
        EngineClient::with_interceptor(channel, self.clone())
    }
}

impl Interceptor for Present {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request.metadata_mut().insert("authorization", self.0.clone());
        Ok(request)
    }
}

/// Refuses each incoming call that does not present the token.
#[derive(Clone)]
pub struct Require(Vec<u8>);

impl Require {
    pub fn new(token: &str) -> Require {
        Require(token.as_bytes().to_vec())
    }
}

impl Interceptor for Require {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let presented = request.metadata().get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then_some(token.trim())
        });
        match presented {
            Some(t) if bool::from(t.as_bytes().ct_eq(&self.0)) => Ok(request),
            Some(_) => Err(Status::unauthenticated(format!("wrong engine token ({ENV})"))),
            None => Err(Status::unauthenticated(format!("no engine token: send `authorization: Bearer` and {ENV}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(require: &mut Require, header: Option<&str>) -> Result<(), tonic::Code> {
        let mut request = Request::new(());
        if let Some(h) = header {
            request.metadata_mut().insert("authorization", h.parse().expect("ascii"));
        }
        require.call(request).map(|_| ()).map_err(|s| s.code())
    }

    #[test]
    fn only_the_token_passes() {
        let mut require = Require::new("s3cret");
        assert_eq!(call(&mut require, Some("Bearer s3cret")), Ok(()));
        assert_eq!(call(&mut require, Some("bearer s3cret")), Ok(()));
        assert_eq!(call(&mut require, Some("Bearer s3cre")), Err(tonic::Code::Unauthenticated));
        assert_eq!(call(&mut require, Some("Basic s3cret")), Err(tonic::Code::Unauthenticated));
        assert_eq!(call(&mut require, None), Err(tonic::Code::Unauthenticated));
        // What a control plane sends passes.
        let mut present = Present::new("s3cret").expect("ascii token");
        let sent = present.call(Request::new(())).expect("added");
        assert!(require.call(sent).is_ok());
        assert!(Present::new("new\nline").is_err());
    }
}
