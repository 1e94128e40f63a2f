//! The live control plane end to end: real `fleetplane serve` and `fleetplane engine`
//! processes over real sockets, a real PostgreSQL database, the gateway driven over HTTP.

mod commands;
#[path = "../common/mod.rs"]
mod common;
mod faults;
mod flow;
mod gateway;
mod policy;

use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::time::Duration;

fn completion(http: &str, token: &str, body: Value) -> (u16, Value) {
    post(&format!("{http}/v1/completions"), Some(token), &body)
}

/// Posts a streaming request to `path` and reads its SSE response: the JSON chunks before the
/// final `[DONE]`.
fn streamed(http: &str, path: &str, body: Value) -> Vec<Value> {
    let response =
        common::client().post(format!("{http}{path}")).bearer_auth(ADMIN).json(&body).send().expect("stream");
    assert_eq!(response.status().as_u16(), 200);
    let events: Vec<String> = BufReader::new(response)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("json")).collect()
}
