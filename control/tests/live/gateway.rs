//! The OpenAI-compatible gateway in front of engine processes: routing, streaming, errors, tokenizers, models.

use super::*;

#[test]
fn the_gateway_routes_through_the_controller_to_engine_processes() {
    let db = Db::fresh("gateway");
    let s = serve(&db, &[]);
    let _e0 = engine(&s.grpc, "e0", &[]);
    let _e1 = engine(&s.grpc, "e1", &[]);
    wait_serving(&s.http, 2);

    let (status, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
    assert_eq!(status, 200);
    let mut names: Vec<&str> =
        v["instances"].as_array().expect("list").iter().filter_map(|i| i["name"].as_str()).collect();
    names.sort();
    assert_eq!(names, ["e0", "e1"]);

    let (status, v) = get(&format!("{}/v1/models", s.http), Some(ADMIN));
    assert_eq!((status, v["data"][0]["id"].as_str()), (200, Some(MODEL)));

    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "Hello, fleet", "max_tokens": 7}));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["usage"]["completion_tokens"], 7);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert!(!v["choices"][0]["text"].as_str().unwrap_or_default().is_empty());

    // The same long prompt twice: the second finds its prefix cached (cache-aware routing),
    // all but the last block, whose last token is computed again to sample from.
    let prompt: Vec<u32> = (0..2048).map(|i| 1000 + i).collect();
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let (_, first) = completion(&s.http, ADMIN, body.clone());
    let (_, second) = completion(&s.http, ADMIN, body);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], 2048 - 16, "{second}");

    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": true,
        "stream_options": {"include_usage": true}});
    let chunks = streamed(&s.http, "/v1/chat/completions", body);
    let content: usize =
        chunks.iter().filter(|c| c["choices"][0]["delta"]["content"].as_str().is_some_and(|t| !t.is_empty())).count();
    assert_eq!(content, 5);
    assert_eq!(chunks.last().expect("usage")["usage"]["completion_tokens"], 5);

    let metrics = common::client().get(format!("{}/metrics", s.http)).send().expect("metrics").text().expect("text");
    assert!(metrics.contains("fleetplane_gateway_requests_total{outcome=\"ok\"} 4"), "{metrics}");
    assert!(metrics.contains("fleetplane_instances_serving 2"));
    assert!(metrics.contains("fleetplane_controller_unmatched_ends 0"), "{metrics}");
}

#[test]
fn a_speculating_engine_streams_every_accepted_token_once() {
    let db = Db::fresh("spec");
    let s = serve(&db, &[]);
    let _e = engine(&s.grpc, "drafting", &["--spec", "dspark", "--seed", "7"]);
    wait_serving(&s.http, 1);
    let body = json!({"model": MODEL, "prompt": "draft ahead", "max_tokens": 40, "stream": true,
        "stream_options": {"include_usage": true}});
    let chunks = streamed(&s.http, "/v1/completions", body);
    let tokens = chunks.iter().filter(|c| c["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty())).count();
    assert_eq!(tokens, 40, "steps of several tokens stream each token once");
    assert_eq!(chunks.last().expect("usage")["usage"]["completion_tokens"], 40);
}

#[test]
fn tokens_are_checked_and_bad_requests_get_openai_errors() {
    let db = Db::fresh("auth");
    let s = serve(&db, &[]);
    // A small KV (64 blocks of 16 tokens) so that an oversized request is easy to make.
    let _e = engine(&s.grpc, "small", &["--kv-blocks", "64"]);
    let _intruder = engine_with_token(&s.grpc, "intruder", &[], "wrong-token");
    wait_serving(&s.http, 1);

    let fleet = format!("{}/api/fleet", s.http);
    assert_eq!(get(&fleet, None).0, 401);
    assert_eq!(get(&fleet, Some("nope")).0, 401);
    let (status, v) =
        post(&format!("{}/api/tokens", s.http), Some(ADMIN), &json!({"name": "app", "role": "inference"}));
    assert_eq!(status, 201, "{v}");
    let app_token = v["token"].as_str().expect("token").to_string();
    let (status, v) = get(&fleet, Some(&app_token));
    assert_eq!(status, 403);
    assert_eq!(v["error"]["type"], "permission_error");
    assert_eq!(db.query("SELECT count(*) FROM api_tokens WHERE token_sha256 = sha256(convert_to('x', 'UTF8'))"), "0");
    assert!(!db.query("SELECT encode(token_sha256, 'hex') FROM api_tokens").contains(&app_token), "stored hashed");

    let ok = json!({"model": MODEL, "prompt": "hi", "max_tokens": 2});
    assert_eq!(completion(&s.http, &app_token, ok.clone()).0, 200);
    assert_eq!(post(&format!("{}/v1/completions", s.http), None, &ok).0, 401);

    // Only the engine with the right token registered.
    std::thread::sleep(Duration::from_millis(1500));
    let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
    assert_eq!(v["instances"].as_array().map(Vec::len), Some(1), "{v}");

    let bad = |body: Value, status: u16, code: &str| {
        let (got, v) = completion(&s.http, ADMIN, body);
        assert_eq!(got, status, "{v}");
        assert_eq!(v["error"]["code"], code, "{v}");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    };
    bad(json!({"model": MODEL, "prompt": "hi", "max_tokens": 5000}), 400, "context_length_exceeded");
    bad(json!({"model": "gpt-9", "prompt": "hi"}), 404, "model_not_found");
    bad(json!({"model": MODEL, "prompt": ""}), 400, "invalid_value");
    bad(json!({"model": MODEL, "prompt": "hi", "n": 3}), 400, "invalid_value");
    bad(json!({"model": MODEL, "prompt": "hi", "temperature": 9}), 400, "invalid_value");
    // Fields that would change the output and that engines of ours do not honour are refused,
    // naming the field, instead of ignored; their defaults are taken.
    let refused = |path: &str, body: Value, param: &str| {
        let (status, v) = post(&format!("{}{path}", s.http), Some(ADMIN), &body);
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{body}: {v}");
    };
    let chat = |extra: Value| {
        let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        body.as_object_mut().expect("an object").extend(extra.as_object().expect("an object").clone());
        body
    };
    refused("/v1/chat/completions", chat(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})), "tools");
    refused("/v1/chat/completions", chat(json!({"response_format": {"type": "json_object"}})), "response_format");
    refused("/v1/chat/completions", chat(json!({"logit_bias": {"7": 3}})), "logit_bias");
    refused("/v1/completions", json!({"model": MODEL, "prompt": "hi", "best_of": 2}), "best_of");
    let wizard = json!({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]});
    refused("/v1/chat/completions", wizard, "messages[0].role");
    let defaults = chat(json!({"tools": [], "response_format": {"type": "text"}, "logit_bias": {}, "best_of": 1}));
    assert_eq!(post(&format!("{}/v1/chat/completions", s.http), Some(ADMIN), &defaults).0, 200);
    let raw = common::client()
        .post(format!("{}/v1/completions", s.http))
        .bearer_auth(ADMIN)
        .header("content-type", "application/json")
        .body("{\"model\": ")
        .send()
        .expect("post");
    assert_eq!(raw.status().as_u16(), 400);
    let v: Value = raw.json().expect("json error");
    assert_eq!(v["error"]["code"], "invalid_json");
    let huge = "x".repeat(17 << 20);
    let raw =
        common::client().post(format!("{}/v1/completions", s.http)).bearer_auth(ADMIN).body(huge).send().expect("post");
    assert_eq!(raw.status().as_u16(), 413);

    // A field of the wrong type is named, in the gateway and in the API.
    let (status, v) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "hi", "max_tokens": "five"}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("max_tokens")), "{v}");
    let (status, v) = post(&format!("{}/api/tokens", s.http), Some(ADMIN), &json!({"name": 7, "role": "admin"}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("name")), "{v}");

    // The scheme is case-insensitive (RFC 9110): `bearer` is Bearer.
    let lower = common::client().get(&fleet).header("authorization", format!("bearer {ADMIN}")).send().expect("get");
    assert_eq!(lower.status().as_u16(), 200);
    // A token name with a control character is the caller's mistake, named.
    let (status, v) =
        post(&format!("{}/api/tokens", s.http), Some(ADMIN), &json!({"name": "a\u{0}b", "role": "inference"}));
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("name")), "{v}");
    // A name is counted in characters, not bytes.
    let (status, v) =
        post(&format!("{}/api/tokens", s.http), Some(ADMIN), &json!({"name": "é".repeat(64), "role": "inference"}));
    assert_eq!(status, 201, "{v}");
    // Revoking a token that does not exist changes nothing, so audits nothing; a name no token
    // can have (a NUL) is no database error.
    let (status, _) = send(reqwest::Method::DELETE, &format!("{}/api/tokens/nobody", s.http), Some(ADMIN), &json!({}));
    assert_eq!(status, 404);
    let (status, v) = send(reqwest::Method::DELETE, &format!("{}/api/tokens/a%00b", s.http), Some(ADMIN), &json!({}));
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("not_found")), "{v}");
    assert_eq!(db.query("SELECT count(*) FROM audit_log WHERE action = 'token.revoke'"), "0");
    // An unknown path, a method a path does not take and a malformed path parameter answer
    // in the error shape too, not with empty or plain-text bodies.
    let (status, v) = get(&format!("{}/api/nothing-here", s.http), Some(ADMIN));
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("not_found")), "{v}");
    let (status, v) = send(reqwest::Method::DELETE, &format!("{}/v1/completions", s.http), Some(ADMIN), &json!({}));
    assert_eq!((status, v["error"]["code"].as_str()), (405, Some("method_not_allowed")), "{v}");
    let (status, v) = get(&format!("{}/api/simulations/not-a-number", s.http), Some(ADMIN));
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("invalid_path")), "{v}");

    // The server is still fine.
    assert_eq!(completion(&s.http, ADMIN, ok).0, 200);
}

#[test]
fn a_client_that_goes_away_frees_its_engine() {
    let db = Db::fresh("cancel");
    let s = serve(&db, &[]);
    let _e = engine(&s.grpc, "e0", &[]);
    wait_serving(&s.http, 1);
    // ~5 ms a token: 2,000 tokens would hold the engine for about 10 s.
    let response = common::client()
        .post(format!("{}/v1/completions", s.http))
        .bearer_auth(ADMIN)
        .json(&json!({"model": MODEL, "prompt": "a very long story", "max_tokens": 2000, "stream": true}))
        .send()
        .expect("stream");
    let mut lines = BufReader::new(response).lines().map_while(Result::ok);
    let mut tokens = 0;
    while tokens < 20 {
        tokens += usize::from(lines.next().expect("stream open").starts_with("data: {"));
    }
    let running =
        || get(&format!("{}/api/instances", s.http), Some(ADMIN)).1["instances"][0]["load"]["running"].as_u64();
    assert_eq!(running(), Some(1));
    drop(lines);
    eventually(3, "the engine drops the abandoned request", || running() == Some(0));
    let (status, _) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": "next", "max_tokens": 2}));
    assert_eq!(status, 200);
}

/// Whether `text` is `n` words of the word-level test tokenizer, one space apart.
fn is_words(text: &str, n: usize) -> bool {
    let words: Vec<&str> = text.split(' ').collect();
    words.len() == n && words.iter().all(|w| w.strip_prefix('w').is_some_and(|d| d.parse::<u32>().is_ok()))
}

#[test]
fn an_engines_tokenizer_turns_text_into_ids_and_output_ids_into_text() {
    let db = Db::fresh("tokenizer");
    let dir = tests::scratch_dir("engine-tokenizer");
    // The cost-model engine's made-up tokens are below 32,000: all of them are words here.
    let file = write_word_level_tokenizer(&dir.join("a"), 32_000);
    let s = serve(&db, &[]);
    let _e0 = engine(&s.grpc, "e0", &["--tokenizer", file.to_str().expect("utf-8 path")]);
    wait_serving(&s.http, 1);

    // Two words of the tokenizer: two ids (the stand-in cuts each into two pieces).
    let body = json!({"model": MODEL, "prompt": "w31999 w31998", "max_tokens": 12, "temperature": 0});
    let (status, v) = completion(&s.http, ADMIN, body.clone());
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 2, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap_or_default().to_string();
    assert!(is_words(&text, 12), "the output reads as the tokenizer's words: {text:?}");

    // Streamed, chunk by chunk: the chunks add up to words too.
    let mut stream_body = body;
    stream_body["stream"] = json!(true);
    let chunks = streamed(&s.http, "/v1/completions", stream_body);
    let streamed_text: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert!(is_words(&streamed_text, 12), "{streamed_text:?}");

    // An engine with another tokenizer for the same model is refused, naming both.
    let other = write_word_level_tokenizer(&dir.join("b"), 100);
    let mut e1 = engine(&s.grpc, "e1", &["--tokenizer", other.to_str().expect("utf-8 path")]);
    let refused = (0..100).find_map(|_| {
        let line = e1.lines.recv_timeout(Duration::from_millis(100)).ok()?;
        line.contains("is not the fleet's").then_some(line)
    });
    assert!(refused.is_some(), "the second engine was not refused for its tokenizer");
    e1.kill();
    let (_, fleet) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert_eq!(fleet["instances"]["serving"], 1, "{fleet}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_tokenizer_given_to_serve_tokenizes_for_engines_that_bring_none() {
    let db = Db::fresh("tokenizer_pin");
    let dir = tests::scratch_dir("serve-tokenizer");
    write_word_level_tokenizer(&dir, 32_000);
    let pin = format!("{MODEL}={}", dir.display());
    let s = serve(&db, &["--tokenizer", &pin]);
    let _e0 = engine(&s.grpc, "e0", &[]);
    wait_serving(&s.http, 1);
    let body = json!({"model": MODEL, "prompt": "w1 w2 w3 unknown", "max_tokens": 3});
    let (status, v) = completion(&s.http, ADMIN, body);
    assert_eq!((status, v["usage"]["prompt_tokens"].as_u64()), (200, Some(4)), "{v}");
    assert!(is_words(v["choices"][0]["text"].as_str().unwrap_or_default(), 3), "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn clients_that_hold_half_sent_requests_are_cut_off_and_the_rest_are_served() {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    let db = Db::fresh("slow");
    let flags = ["--header-timeout-s", "1", "--body-timeout-s", "1", "--max-connections", "8"];
    let s = serve(&db, &flags);
    let address = s.http.trim_start_matches("http://").to_string();
    // Closed by the server: a read that ends (0 bytes, a response, or a reset) within `secs`.
    let closed_within = |c: &mut TcpStream, secs: u64| {
        c.set_read_timeout(Some(Duration::from_secs(secs))).expect("timeout");
        let mut buf = Vec::new();
        match c.read_to_end(&mut buf) {
            Ok(_) => Some(String::from_utf8_lossy(&buf).to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Some(String::new()),
            Err(_) => None,
        }
    };
    // As many half-sent headers as the server takes connections, and one idle connection.
    let mut slow: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut c = TcpStream::connect(&address).expect("connect");
            c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n").expect("part of the headers");
            c
        })
        .collect();
    for c in &mut slow {
        assert!(closed_within(c, 5).is_some(), "a connection holding half its headers stays open");
    }
    // A body that stops halfway: the request fails and the connection closes.
    let mut c = TcpStream::connect(&address).expect("connect");
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"",
    )
    .expect("part of the body");
    let answer = closed_within(&mut c, 5).expect("a half-sent body is not waited for");
    assert!(answer.is_empty() || !answer.starts_with("HTTP/1.1 200"), "{answer}");
    // The server still serves everyone else.
    let (status, _) = get(&format!("{}/healthz", s.http), None);
    assert_eq!(status, 200);
}

#[test]
fn requests_go_only_to_engines_of_their_model() {
    let db = Db::fresh("models");
    let s = serve(&db, &["--router", "least-outstanding"]);
    let _llama = engine(&s.grpc, "l", &[]);
    // A small qwen engine: 64 blocks of 16 tokens.
    let qwen_args = ["engine", "--executor", "sim", "--model", "qwen3-32b", "--kv-blocks", "64"];
    let _qwen = start(
        &[&qwen_args[..], &["--control", &s.grpc, "--name", "q"]].concat(),
        &[("FLEETPLANE_ENGINE_TOKEN", ENGINE)],
        "listening on",
    );
    wait_serving(&s.http, 2);
    let (_, v) = get(&format!("{}/v1/models", s.http), Some(ADMIN));
    let ids: Vec<&str> = v["data"].as_array().expect("models").iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, ["llama-3.1-8b", "qwen3-32b"], "{v}");

    // The size check is the model's own: the llama engine would hold it, qwen's does not.
    let long: Vec<u32> = (0..2000).map(|i| 100 + i % 1000).collect();
    let (status, v) = completion(&s.http, ADMIN, json!({"model": "qwen3-32b", "prompt": long, "max_tokens": 8}));
    assert_eq!((status, v["error"]["code"].as_str()), (400, Some("context_length_exceeded")), "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("`qwen3-32b` holds 1024")), "{v}");
    let (status, _) = completion(&s.http, ADMIN, json!({"model": MODEL, "prompt": long, "max_tokens": 8}));
    assert_eq!(status, 200);
    // Loads are the engines' own reports: wait for the one that shows the llama request gone,
    // or a report sent while it ran reads as a qwen request below.
    let llama_running = || {
        let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
        v["instances"]
            .as_array()
            .expect("instances")
            .iter()
            .filter(|i| i["model"] == MODEL)
            .map(|i| i["load"]["running"].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    eventually(10, "the llama engine reports its request done", || llama_running() == 0);

    // Streams for qwen run on the qwen engine only, however busy it is.
    let streams: Vec<_> = (0..4)
        .map(|k| {
            let http = s.http.clone();
            std::thread::spawn(move || {
                streamed(
                    &http,
                    "/v1/completions",
                    json!({"model": "qwen3-32b", "prompt": format!("story {k}"), "max_tokens": 200, "stream": true}),
                )
            })
        })
        .collect();
    let mut seen_running = false;
    while !streams.iter().all(|t| t.is_finished()) {
        let (_, v) = get(&format!("{}/api/instances", s.http), Some(ADMIN));
        for i in v["instances"].as_array().expect("instances") {
            let running = i["load"]["running"].as_u64().unwrap_or(0);
            if i["model"] == MODEL {
                assert_eq!(running, 0, "a qwen request on the llama engine: {v}");
            } else {
                seen_running |= running > 0;
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for t in streams {
        assert!(!t.join().expect("stream").is_empty());
    }
    assert!(seen_running, "the qwen engine ran them");
    let (status, v) = completion(&s.http, ADMIN, json!({"model": "gpt-9", "prompt": "hi", "max_tokens": 2}));
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("model_not_found")), "{v}");
}

#[test]
fn the_routers_price_steps_by_the_model_and_gpu_the_engines_registered_with() {
    let db = Db::fresh("hints");
    let s = serve(&db, &[]);
    let _e = engine(&s.grpc, "a100", &["--gpu", "a100"]);
    wait_serving(&s.http, 1);
    let (model, gpu) = (cost::model_by_name(MODEL).expect("model"), cost::gpu_by_name("a100").expect("gpu"));
    let a100 = cost::CostModel::new(model, gpu, cost::Deployment::tensor_parallel(1), cost::CostParams::default())
        .expect("cost model");
    let instance = engine::InstanceConfig { block_size: 16, max_batch_tokens: 8192, ..Default::default() };
    // Through text, as the response came: serde_json may parse a number's last digit off.
    let text = serde_json::to_string(&cost::cost_hints(&a100, &instance)).expect("json");
    let want: Value = serde_json::from_str(&text).expect("json");
    let (_, v) = get(&format!("{}/api/fleet", s.http), Some(ADMIN));
    assert_eq!(v["cost_hints"], want, "{v}");
}
