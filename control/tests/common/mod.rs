//! Real processes for the live tests: a fresh PostgreSQL database per test, `fleetplane serve`
//! and `fleetplane engine` started from the built binary on free ports, killed when dropped.

#![allow(dead_code)]

pub mod vllm;

use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const ADMIN: &str = "test-admin-token";
pub const ENGINE: &str = "test-engine-token";
pub const MODEL: &str = "llama-3.1-8b";

/// The binary under test: `FLEETPLANE_BIN` where the tests run away from the build (the GPU
/// machine, with carried binaries), else the one cargo built.
pub fn bin() -> std::path::PathBuf {
    std::env::var_os("FLEETPLANE_BIN")
        .map_or_else(|| std::path::PathBuf::from(env!("CARGO_BIN_EXE_fleetplane")), std::path::PathBuf::from)
}

/// A database of its own for one test, dropped at the end.
pub struct Db {
    pub name: String,
    pub url: String,
}

fn psql(sql: &str) -> bool {
    Command::new("psql")
        .args(["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-qAtc", sql])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Db {
    pub fn fresh(tag: &str) -> Db {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!("fleetplane_test_{tag}_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        psql(&format!("DROP DATABASE IF EXISTS {name}"));
        let url = format!("postgres://postgres@127.0.0.1:5432/{name}");
        Db { name, url }
    }

    /// Runs a query on the test's database; returns its output (unaligned, tuples only).
    pub fn query(&self, sql: &str) -> String {
        let out = Command::new("psql")
            .args(["-h", "127.0.0.1", "-U", "postgres", "-d", &self.name, "-qAtc", sql])
            .output()
            .expect("psql runs");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Db {
    /// The folder serve spools its queued writes to for this database (removed with it).
    pub fn spool_dir(&self) -> String {
        std::env::temp_dir().join(format!("{}-spool", self.name)).to_string_lossy().into_owned()
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        psql(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name));
        let _ = std::fs::remove_dir_all(self.spool_dir());
    }
}

/// A child process, killed on drop, with its output lines available.
pub struct Proc {
    pub child: Child,
    pub lines: mpsc::Receiver<String>,
    pub first_line: String,
}

impl Proc {
    /// The output lines it printed since the last call (for a failure's message).
    pub fn output(&self) -> String {
        self.lines.try_iter().collect::<Vec<_>>().join("\n")
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Stops it with SIGTERM (a graceful shutdown).
    pub fn terminate(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.child.id().to_string()]).status();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts `fleetplane ARGS` and waits for a stdout line containing `ready`.
pub fn start(args: &[&str], env: &[(&str, &str)], ready: &str) -> Proc {
    let mut child = Command::new(bin())
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", std::env::var("FLEETPLANE_TEST_LOG").unwrap_or_else(|_| "warn".into()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fleetplane starts");
    let (tx, rx) = mpsc::channel();
    for stream in [
        Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().expect("stderr")),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(ready) => return Proc { child, lines: rx, first_line: line },
            Ok(line) => seen.push(line),
            Err(_) => panic!("`fleetplane {}` not ready; output:\n{}", args.join(" "), seen.join("\n")),
        }
    }
}

/// A control plane on free ports.
pub struct Serve {
    pub proc: Proc,
    pub http: String,
    pub grpc: String,
}

pub fn serve(db: &Db, extra: &[&str]) -> Serve {
    serve_on(db, "127.0.0.1:0", "127.0.0.1:0", extra)
}

pub fn serve_on(db: &Db, http: &str, grpc: &str, extra: &[&str]) -> Serve {
    let mut args = vec!["serve", "--listen", http, "--grpc-listen", grpc, "--database-url", &db.url];
    args.extend_from_slice(extra);
    let spool = db.spool_dir();
    let env =
        [("FLEETPLANE_ADMIN_TOKEN", ADMIN), ("FLEETPLANE_ENGINE_TOKEN", ENGINE), ("FLEETPLANE_SPOOL_DIR", &spool)];
    let proc = start(&args, &env, "serving http://");
    let words: Vec<&str> = proc.first_line.split_whitespace().collect();
    let http = words.iter().find(|w| w.starts_with("http://")).expect("http address").to_string();
    let grpc = words.last().expect("grpc address").to_string();
    Serve { proc, http, grpc }
}

/// A cost-model engine registered with `grpc`.
pub fn engine(grpc: &str, name: &str, extra: &[&str]) -> Proc {
    engine_with_token(grpc, name, extra, ENGINE)
}

pub fn engine_with_token(grpc: &str, name: &str, extra: &[&str], token: &str) -> Proc {
    let mut args = vec!["engine", "--executor", "sim", "--model", MODEL, "--control", grpc, "--name", name];
    args.extend_from_slice(extra);
    start(&args, &[("FLEETPLANE_ENGINE_TOKEN", token)], "listening on")
}

pub fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().expect("client")
}

pub fn get(url: &str, token: Option<&str>) -> (u16, Value) {
    let mut r = client().get(url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let r = r.send().expect("GET");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

pub fn send(method: reqwest::Method, url: &str, token: Option<&str>, body: &Value) -> (u16, Value) {
    let mut r = client().request(method, url).json(body);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    let r = r.send().expect("request");
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

pub fn post(url: &str, token: Option<&str>, body: &Value) -> (u16, Value) {
    send(reqwest::Method::POST, url, token, body)
}

/// Waits until `n` engines serve.
pub fn wait_serving(http: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, v) = get(&format!("{http}/api/fleet"), Some(ADMIN));
        if v["instances"]["serving"].as_u64().unwrap_or(0) == n {
            return;
        }
        assert!(Instant::now() < deadline, "{n} engines never served: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Polls `check` every 100 ms until it is true or `secs` pass.
pub fn eventually(secs: u64, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !check() {
        assert!(Instant::now() < deadline, "not within {secs} s: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Opens a streaming request (`stream: true` in `body`) on gateway path `path`.
pub fn open_stream(http: &str, path: &str, body: &Value) -> reqwest::blocking::Response {
    let response = client().post(format!("{http}{path}")).bearer_auth(ADMIN).json(body).send().expect("stream");
    assert_eq!(response.status().as_u16(), 200);
    response
}

/// Reads an SSE response into its `data:` payloads.
pub fn sse(response: reqwest::blocking::Response) -> Vec<String> {
    BufReader::new(response)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// Runs `fleetplane demo` on free ports and database `db` until its replay ends; returns its
/// standard output, after checking it succeeded.
pub fn run_demo(db: &Db, extra: &[&str]) -> String {
    let out = Command::new(bin())
        .args(["demo", "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--exit-after-replay"])
        .args(["--database-url", &db.url])
        .args(extra)
        .env("FLEETPLANE_SPOOL_DIR", db.spool_dir())
        .env("RUST_LOG", "warn")
        .output()
        .expect("demo runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    stdout
}

/// A loopback address with a port free now (for processes that must know each other's
/// addresses before they start).
pub fn free_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("address").to_string()
}

/// Writes a word-level tokenizer of `words` words to `DIR/tokenizer.json`: id N is the word
/// `wN`, words are split on whitespace and joined by spaces (unknown words are `[UNK]`, id
/// `words`). A real Hugging Face tokenizer small enough to make in a test.
pub fn write_word_level_tokenizer(dir: &std::path::Path, words: u32) -> std::path::PathBuf {
    use tokenizers::models::wordlevel::WordLevel;
    let vocab = (0..words).map(|i| (format!("w{i}"), i)).chain([("[UNK]".to_string(), words)]).collect();
    let model = WordLevel::builder().vocab(vocab).unk_token("[UNK]".into()).build().expect("a word-level model");
    let mut t = tokenizers::Tokenizer::new(model);
    t.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::WhitespaceSplit));
    std::fs::create_dir_all(dir).expect("tokenizer folder");
    let path = dir.join("tokenizer.json");
    t.save(&path, false).expect("tokenizer.json written");
    path
}
