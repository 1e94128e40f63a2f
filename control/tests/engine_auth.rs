//! An engine's own gRPC service takes calls only from a control plane: one presenting the
//! engine token (`authorization: Bearer FLEETPLANE_ENGINE_TOKEN`).

mod common;

mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("fleetplane.v1");
}

use common::*;
use proto::engine_client::EngineClient;
use std::process::Command;

#[test]
fn an_engine_refuses_calls_without_the_engine_token() {
    // No control plane: the engine keeps trying to register and serves its port meanwhile.
    let e = start(
        &["engine", "--executor", "sim", "--model", MODEL, "--listen", "127.0.0.1:0", "--control", "127.0.0.1:9"],
        &[("FLEETPLANE_ENGINE_TOKEN", ENGINE)],
        "listening on",
    );
    let addr = e.first_line.split_whitespace().last().expect("address").to_string();
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("a URI")
            .connect()
            .await
            .expect("the engine accepts a connection");
        let with = |token: Option<&str>| {
            let bearer: Option<tonic::metadata::MetadataValue<_>> =
                token.map(|t| format!("Bearer {t}").parse().expect("ascii"));
            EngineClient::with_interceptor(channel.clone(), move |mut r: tonic::Request<()>| {
                if let Some(b) = &bearer {
                    r.metadata_mut().insert("authorization", b.clone());
                }
                Ok(r)
            })
        };
        let generate =
            proto::GenerateRequest { request_id: 1, prompt: vec![1, 2, 3], max_tokens: 2, ..Default::default() };
        for token in [None, Some("wrong")] {
            let mut client = with(token);
            let status = client.generate(generate.clone()).await.expect_err("refused");
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{token:?}: {status}");
            let status = client.configure(proto::Scheduling::default()).await.expect_err("refused");
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{token:?}: {status}");
            let status = client.drain(proto::DrainRequest {}).await.expect_err("refused");
            assert_eq!(status.code(), tonic::Code::Unauthenticated, "{token:?}: {status}");
        }
        let info = with(Some(ENGINE)).info(proto::InfoRequest {}).await.expect("the token opens it").into_inner();
        assert_eq!(info.model, MODEL);
    });

    // An engine with no token to require does not start.
    let out = Command::new(bin())
        .args(["engine", "--executor", "sim", "--model", MODEL, "--listen", "127.0.0.1:0"])
        .env_remove("FLEETPLANE_ENGINE_TOKEN")
        .output()
        .expect("engine runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("set FLEETPLANE_ENGINE_TOKEN"), "{out:?}");
}
