//! The CUDA engine process end to end: `fleetplane make-model --config tiny`, then
//! `fleetplane engine --executor cuda` on it, driven over its gRPC interface by a tonic client.
//!
//! Needs a GPU and the CUDA libraries; without them it prints "skipped" and passes (CI). On the
//! H200 `scripts/gpu-check.sh` runs it with `FLEETPLANE_BIN` pointing at the carried binary
//! (the path cargo bakes in, `CARGO_BIN_EXE_fleetplane`, is this machine's).

mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("fleetplane.v1");
}

use proto::engine_client::EngineClient;
use proto::{GenerateChunk, GenerateRequest};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn bin() -> PathBuf {
    std::env::var_os("FLEETPLANE_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_fleetplane")), PathBuf::from)
}

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
    /// Starts `fleetplane engine` and returns it with the address from its
    /// `engine NAME listening on ADDR` line.
    fn start(model: &std::path::Path) -> (Engine, String) {
        let mut child = Command::new(bin())
            .args(["engine", "--executor", "cuda", "--model"])
            .arg(model)
            .args(["--gpu-memory-gib", "4", "--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "warn")
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

/// Streams one greedy request to its end; returns its tokens and last chunk.
async fn generate(
    client: &mut EngineClient<tonic::transport::Channel>,
    id: u64,
    prompt: &[u32],
) -> (Vec<u32>, GenerateChunk) {
    let req = GenerateRequest {
        request_id: id,
        prompt: prompt.to_vec(),
        max_tokens: 16,
        temperature: 0.0,
        top_p: 1.0,
        seed: 7,
        generated: Vec::new(),
    };
    let mut stream = client.generate(req).await.expect("Generate is accepted").into_inner();
    let mut tokens = Vec::new();
    loop {
        let chunk = stream.message().await.expect("the stream stays healthy").expect("a last chunk");
        tokens.extend_from_slice(&chunk.tokens);
        if !chunk.finish_reason.is_empty() {
            return (tokens, chunk);
        }
    }
}

#[tokio::test]
async fn cuda_engine_streams_greedy_tokens_and_reuses_the_prefix_cache() {
    if !engine::cuda::gpu_available() {
        println!("skipped: no CUDA driver, libraries or GPU here");
        return;
    }
    let dir = std::env::temp_dir().join(format!("fleetplane-cuda-engine-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let made = Command::new(bin())
        .args(["make-model", "--config", "tiny", "--out"])
        .arg(&dir)
        .output()
        .expect("fleetplane make-model runs");
    assert!(made.status.success(), "make-model failed: {}", String::from_utf8_lossy(&made.stderr));

    let (engine, addr) = Engine::start(&dir);
    let run = async {
        let mut client =
            EngineClient::connect(format!("http://{addr}")).await.expect("the engine accepts a connection");
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
    assert_eq!(last1.finish_reason, "length");
    assert_eq!(last2.finish_reason, "length");
    let cached = last2.cached_tokens.first().copied().unwrap_or(0);
    assert!(cached > 0, "the second request found no prefix in the cache: {:?}", last2.cached_tokens);
    println!(
        "cuda engine: 16 tokens twice, identical {:?}; second request reused {cached} prompt tokens from the prefix cache",
        &t1[..4]
    );
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);
}
