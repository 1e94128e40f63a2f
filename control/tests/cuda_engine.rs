//! The CUDA engine process end to end: `fleetplane make-model --config tiny`, then
//! `fleetplane engine --executor cuda` on it, driven over its gRPC interface by a tonic client;
//! and a prefill and a decode CUDA engine behind `fleetplane serve`'s gateway.
//!
//! Needs a GPU and the CUDA libraries (the P/D test also PostgreSQL on 127.0.0.1:5432);
//! without them it prints "skipped" and passes (CI). On the H200 `scripts/gpu-check.sh` runs
//! it with `FLEETPLANE_BIN` pointing at the carried binary (the path cargo bakes in,
//! `CARGO_BIN_EXE_fleetplane`, is this machine's).

mod common;

mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("fleetplane.v1");
}

use common::bin;
use proto::engine_client::EngineClient;
use tonic::service::interceptor::InterceptedService;

/// A client of the engine presenting the engine token, as control planes do.
type Link = EngineClient<
    InterceptedService<tonic::transport::Channel, fn(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status>>,
>;

fn with_token(mut r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
    let bearer = format!("Bearer {}", common::ENGINE).parse().expect("ascii token");
    r.metadata_mut().insert("authorization", bearer);
    Ok(r)
}

async fn connect(addr: &str) -> Link {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("a URI")
        .connect()
        .await
        .expect("the engine accepts a connection");
    EngineClient::with_interceptor(channel, with_token as fn(_) -> _)
}
use proto::{FinishReason, GenerateChunk, GenerateRequest};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The engine process, killed when dropped (also when an assertion fails).
struct Engine {
    child: Child,
    /// Its output so far, for failure messages.
    lines: mpsc::Receiver<String>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Engine {
    /// Starts `fleetplane engine --executor cuda` on `model` with `extra` flags and returns
    /// it with the address from its `engine NAME listening on ADDR` line.
    fn start(model: &std::path::Path, extra: &[&str]) -> (Engine, String) {
        let mut child = Command::new(bin())
            .args(["engine", "--executor", "cuda", "--model"])
            .arg(model)
            .args(["--gpu-memory-gib", "4", "--listen", "127.0.0.1:0"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .env("FLEETPLANE_ENGINE_TOKEN", common::ENGINE)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin().display()));
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        for stream in [Box::new(stdout) as Box<dyn std::io::Read + Send>, Box::new(stderr)] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        let mut engine = Engine { child, lines: rx };
        // Start-up compiles the kernels with NVRTC and loads the model: seconds.
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match engine.lines.recv_timeout(left) {
                Ok(line) if line.contains(" listening on ") => {
                    let addr = line.rsplit(' ').next().unwrap_or_default().to_string();
                    return (engine, addr);
                }
                Ok(line) => seen.push(line),
                Err(_) => {
                    let status = engine.child.try_wait().ok().flatten();
                    panic!("the CUDA engine did not come up (exit: {status:?}); output:\n{}", seen.join("\n"));
                }
            }
        }
    }

    fn output(&self) -> String {
        self.lines.try_iter().collect::<Vec<_>>().join("\n")
    }
}

/// Streams one greedy request of 16 tokens to its end; returns its tokens and last chunk.
async fn generate(client: &mut Link, id: u64, prompt: &[u32]) -> (Vec<u32>, GenerateChunk) {
    let req = GenerateRequest {
        request_id: id,
        prompt: prompt.to_vec(),
        max_tokens: 16,
        temperature: 0.0,
        top_p: 1.0,
        seed: 7,
        generated: Vec::new(),
        ..Default::default()
    };
    let mut stream = client.generate(req).await.expect("Generate is accepted").into_inner();
    let mut tokens = Vec::new();
    loop {
        let chunk = stream.message().await.expect("the stream stays healthy").expect("a last chunk");
        tokens.extend_from_slice(&chunk.tokens);
        if chunk.finish_reason() != FinishReason::Unspecified {
            return (tokens, chunk);
        }
    }
}

#[tokio::test]
async fn cuda_engine_streams_greedy_tokens_and_reuses_the_prefix_cache() {
    if !engine_cuda::gpu_available() {
        println!("skipped: no CUDA driver, libraries or GPU here");
        return;
    }
    let dir = tiny_model("cuda-engine", None);

    let (engine, addr) = Engine::start(&dir, &[]);
    let run = async {
        let mut client = connect(&addr).await;
        // 100 ids inside the tiny model's vocabulary of 512.
        let prompt: Vec<u32> = (0..100u32).map(|i| (i * 37 + 11) % 500).collect();
        let first = generate(&mut client, 1, &prompt).await;
        let second = generate(&mut client, 2, &prompt).await;
        (first, second)
    };
    let ((t1, last1), (t2, last2)) = match tokio::time::timeout(Duration::from_secs(120), run).await {
        Ok(r) => r,
        Err(_) => panic!("the engine did not finish two requests in 120 s; output:\n{}", engine.output()),
    };
    assert_eq!(t1.len(), 16, "first request: {t1:?}");
    assert_eq!(t2.len(), 16, "second request: {t2:?}");
    assert_eq!(t1, t2, "greedy decoding of the same prompt must repeat");
    assert_eq!(last1.finish_reason(), FinishReason::Length);
    assert_eq!(last2.finish_reason(), FinishReason::Length);
    let cached = last2.cached_tokens.first().copied().unwrap_or(0);
    assert!(cached > 0, "the second request found no prefix in the cache: {:?}", last2.cached_tokens);
    println!(
        "cuda engine: 16 tokens twice, identical {:?}; second request reused {cached} prompt tokens from the prefix cache",
        &t1[..4]
    );
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes the tiny model (and, with `words`, a word-level tokenizer of that many words) to a
/// fresh folder.
fn tiny_model(tag: &str, words: Option<u32>) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fleetplane-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let made = Command::new(bin())
        .args(["make-model", "--config", "tiny", "--out"])
        .arg(&dir)
        .output()
        .expect("fleetplane make-model runs");
    assert!(made.status.success(), "make-model failed: {}", String::from_utf8_lossy(&made.stderr));
    if let Some(words) = words {
        common::write_word_level_tokenizer(&dir, words);
    }
    dir
}

/// The ids of a word-level text (`w17 w3` is [17, 3]).
fn ids_of(text: &str) -> Vec<u32> {
    text.split_whitespace().map(|w| w.strip_prefix('w').and_then(|d| d.parse().ok()).expect("a word wN")).collect()
}

/// Prefill on one CUDA engine, decode on another, behind the gateway: a text prompt is
/// tokenized with the tokenizer the model folder brings (reported by the engines, fetched by
/// `serve`), the prompt's KV moves from the prefill engine's GPU memory to the decode
/// engine's, and the output is exactly what one engine alone generates (greedy), as text;
/// both engines hold no KV afterwards.
#[test]
fn cuda_prefill_and_decode_engines_behind_the_gateway_generate_as_one_engine() {
    if !engine_cuda::gpu_available() {
        println!("skipped: no CUDA driver, libraries or GPU here");
        return;
    }
    if std::net::TcpStream::connect_timeout(&"127.0.0.1:5432".parse().expect("address"), Duration::from_secs(1))
        .is_err()
    {
        println!("skipped: no PostgreSQL on 127.0.0.1:5432 for fleetplane serve");
        return;
    }
    // The tiny model's vocabulary is 512 ids: a word for each.
    let dir = tiny_model("cuda-pd", Some(512));
    let prompt: Vec<u32> = (0..150u32).map(|i| (i * 37 + 11) % 500).collect();
    let text: Vec<String> = prompt.iter().map(|t| format!("w{t}")).collect();
    let text = text.join(" ");

    // One engine doing everything: the reference.
    let want = {
        let (engine, addr) = Engine::start(&dir, &[]);
        let runtime = tokio::runtime::Runtime::new().expect("a runtime");
        let run = async {
            let mut client = connect(&addr).await;
            generate(&mut client, 1, &prompt).await
        };
        let (tokens, last) = match runtime.block_on(async { tokio::time::timeout(Duration::from_secs(60), run).await })
        {
            Ok(r) => r,
            Err(_) => panic!("the reference engine did not answer in 60 s; output:\n{}", engine.output()),
        };
        assert_eq!((tokens.len(), last.finish_reason()), (16, FinishReason::Length));
        tokens
    };

    let db = common::Db::fresh("cuda_pd");
    let s = common::serve(&db, &["--mode", "pd"]);
    let control = ["--control", s.grpc.as_str(), "--served-model-name", "tiny"];
    let (p, _) = Engine::start(&dir, &[&["--role", "prefill", "--name", "p0"][..], &control].concat());
    let (d, _) = Engine::start(&dir, &[&["--role", "decode", "--name", "d0"][..], &control].concat());
    let serving = (0..300).any(|_| {
        let (_, v) = common::get(&format!("{}/api/fleet", s.http), Some(common::ADMIN));
        let both = v["instances"]["serving"].as_u64() == Some(2);
        if !both {
            std::thread::sleep(Duration::from_millis(100));
        }
        both
    });
    assert!(serving, "the engines did not both serve in 30 s; prefill:\n{}\ndecode:\n{}", p.output(), d.output());

    let body = serde_json::json!({"model": "tiny", "prompt": text, "max_tokens": 16, "temperature": 0});
    let (status, v) = common::post(&format!("{}/v1/completions", s.http), Some(common::ADMIN), &body);
    assert_eq!(status, 200, "{v}; prefill:\n{}\ndecode:\n{}", p.output(), d.output());
    assert_eq!(v["usage"]["prompt_tokens"], 150, "the model folder's tokenizer made the prompt's ids: {v}");
    let got = ids_of(v["choices"][0]["text"].as_str().unwrap_or_default());
    assert_eq!(got, want, "P/D through the gateway against one engine");

    // Streamed, and the prompt's blocks now cached on the prefill engine: the same tokens.
    let mut stream_body = body;
    stream_body["stream"] = serde_json::json!(true);
    let events = common::sse(common::open_stream(&s.http, "/v1/completions", &stream_body));
    let streamed: String = events[..events.len() - 1]
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(ids_of(&streamed), want, "streamed P/D against one engine");

    common::eventually(5, "both engines hold no request and no KV", || {
        let (_, v) = common::get(&format!("{}/api/instances", s.http), Some(common::ADMIN));
        v["instances"].as_array().is_some_and(|all| {
            all.len() == 2
                && all.iter().all(|i| {
                    (i["load"]["running"].as_u64(), i["load"]["kv_used_blocks"].as_u64()) == (Some(0), Some(0))
                })
        })
    });
    println!("cuda P/D: 16 greedy tokens through the gateway, as one engine: {:?}", &want[..4]);
    drop((p, d, s));
    let _ = std::fs::remove_dir_all(&dir);
}
