//! The OpenAPI document against the running server: the document is valid OpenAPI 3.0.3
//! (openapi-spec-validator), and schemathesis, generating requests from it for every
//! operation, finds no server error and no response the document does not describe (status,
//! content type, body schema, headers), every documented refusal of malformed input, and auth
//! enforced where the document says. `.ci/run` installs schemathesis and the validator in a
//! virtual environment under target/ and names its schemathesis in FLEETPLANE_SCHEMATHESIS,
//! with FLEETPLANE_REQUIRE_SCHEMATHESIS set so that the test fails instead of skipping.

mod common;

use common::*;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

/// The schemathesis executable, or `None` (the test skips) where none is given or required.
fn schemathesis() -> Option<PathBuf> {
    let found = std::env::var_os("FLEETPLANE_SCHEMATHESIS").map(PathBuf::from).filter(|p| p.exists());
    if found.is_none() {
        assert!(
            std::env::var_os("FLEETPLANE_REQUIRE_SCHEMATHESIS").is_none(),
            "FLEETPLANE_REQUIRE_SCHEMATHESIS is set but FLEETPLANE_SCHEMATHESIS names no schemathesis executable"
        );
        eprintln!("skipped: FLEETPLANE_SCHEMATHESIS is not set (pip install schemathesis openapi-spec-validator, or run .ci/run)");
    }
    found
}

fn document() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src/serve/openapi.json")
}

/// Runs `program ARGS`, returning whether it succeeded and its output.
fn run(program: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out =
        Command::new(program).args(args).output().unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

#[test]
fn the_openapi_document_is_valid_openapi_3_0_and_the_server_keeps_to_it() {
    let Some(st) = schemathesis() else { return };
    let validator = st.with_file_name("openapi-spec-validator");
    let doc = document();
    let (ok, out) = run(&validator, &[doc.to_str().expect("a UTF-8 path")]);
    assert!(ok, "the OpenAPI document is not valid OpenAPI 3.0:\n{out}");

    let db = Db::fresh("schemathesis");
    let s = serve(&db, &[]);
    // A fast engine with a small KV: a prompt and max_tokens over 1,024 tokens is refused at
    // once, and what is accepted is generated as fast as the CPU goes.
    let _e = engine(&s.grpc, "e0", &["--kv-blocks", "64", "--time-scale", "0"]);
    wait_serving(&s.http, 1);
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/schemathesis.toml");
    let auth = format!("Authorization: Bearer {ADMIN}");
    let started = Instant::now();
    // Draining takes the fleet's only engine out, after which the gateway rightly answers 503:
    // it runs last, on its own.
    for (pass, filter) in [("everything but drain", "--exclude-path-regex"), ("drain", "--include-path-regex")] {
        let args = [
            "--config-file",
            config,
            "run",
            doc.to_str().expect("a UTF-8 path"),
            "--url",
            &s.http,
            "-H",
            &auth,
            filter,
            "/drain$",
        ];
        let (ok, out) = run(&st, &args);
        eprintln!("schemathesis ({pass}), {:.0} s so far:\n{out}", started.elapsed().as_secs_f64());
        assert!(ok, "schemathesis ({pass}) found failures:\n{out}\nserve's output:\n{}", s.proc.output());
    }
    // The server is still fine.
    let (status, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert_eq!(status, 200, "{v}");
}
