//! The gateway as the official `openai` Python package sees it (streaming and not, chat and
//! completions, errors). `.ci/run` installs the package in a virtual environment and names its
//! interpreter in FLEETPLANE_OPENAI_PYTHON; elsewhere the test uses `python3` if it has the
//! package, and says so when it skips.

mod common;

use common::*;
use std::process::Command;

#[test]
fn the_official_openai_client_works_against_the_gateway() {
    let required = std::env::var("FLEETPLANE_OPENAI_PYTHON").ok();
    let python = required.clone().unwrap_or_else(|| "python3".into());
    let has_openai = Command::new(&python).args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success());
    if !has_openai {
        assert!(required.is_none(), "{python} cannot import openai, and FLEETPLANE_OPENAI_PYTHON names it");
        eprintln!("skipped: {python} has no `openai` package (pip install openai, or run .ci/run)");
        return;
    }
    let db = Db::fresh("openai");
    let s = serve(&db, &[]);
    let _e = engine(&s.grpc, "e0", &["--kv-blocks", "4096"]);
    wait_serving(&s.http, 1);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/openai_client.py");
    let out =
        Command::new(&python).args([script, &format!("{}/v1", s.http), ADMIN, MODEL]).output().expect("python runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the openai client failed:\n{text}");
    assert!(text.contains("all checks passed"), "{text}");
}
