//! Just enough of a W3C WebDriver client to drive headless Chromium through chromedriver:
//! sessions, navigation, elements found by CSS selector, clicks, typing, scripts,
//! screenshots and the browser's console log. Blocking HTTP (the tests are synchronous), so
//! it is a few plain functions over reqwest rather than an async client crate.
//!
//! Chromium and chromedriver are Debian's (`apt-get install chromium chromium-driver`);
//! FLEETPLANE_CHROMIUM and FLEETPLANE_CHROMEDRIVER name other binaries.

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The key under which WebDriver returns an element reference (W3C WebDriver, "Elements").
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// How long a wait for something on the page lasts before the test fails.
pub const WAIT: Duration = Duration::from_secs(30);

pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::blocking::Client,
    profile: PathBuf,
}

fn binary(var: &str, default: &str) -> Option<PathBuf> {
    let path = std::env::var_os(var).map_or_else(|| PathBuf::from(default), PathBuf::from);
    path.is_file().then_some(path)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

impl Browser {
    /// Starts chromedriver and a headless Chromium session; none when either is not installed.
    pub fn start() -> Option<Browser> {
        let chromium = binary("FLEETPLANE_CHROMIUM", "/usr/bin/chromium")?;
        let chromedriver = binary("FLEETPLANE_CHROMEDRIVER", "/usr/bin/chromedriver")?;
        let port = free_port();
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().expect("client");
        let deadline = Instant::now() + WAIT;
        while !http.get(format!("{base}/status")).send().is_ok_and(|r| r.status().is_success()) {
            assert!(Instant::now() < deadline, "chromedriver did not answer on {base}");
            std::thread::sleep(Duration::from_millis(100));
        }
        let profile = std::env::temp_dir().join(format!("fleetplane-console-{}-{port}", std::process::id()));
        // The flags that work on these machines: no sandbox as root, and none of Chromium's
        // own network traffic, which the closed network refuses (and which would slow it).
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1400,1400",
            &format!("--user-data-dir={}", profile.display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:loggingPrefs": {"browser": "ALL"},
            "goog:chromeOptions": {"binary": chromium, "args": args},
        }}});
        let mut b = Browser { driver, base, session: String::new(), http, profile };
        let v = b.command(reqwest::Method::POST, "/session", caps).expect("a browser session");
        b.session = v["sessionId"].as_str().expect("session id").to_string();
        Some(b)
    }

    fn command(&self, method: reqwest::Method, path: &str, body: Value) -> Result<Value, String> {
        let url = if path == "/session" {
            format!("{}/session", self.base)
        } else {
            format!("{}/session/{}{path}", self.base, self.session)
        };
        let mut r = self.http.request(method.clone(), &url);
        if method != reqwest::Method::GET && method != reqwest::Method::DELETE {
            r = r.json(&body);
        }
        let response = r.send().map_err(|e| format!("{method} {path}: {e}"))?;
        let ok = response.status().is_success();
        let v: Value = response.json().map_err(|e| format!("{method} {path}: not JSON: {e}"))?;
        if ok {
            Ok(v["value"].clone())
        } else {
            Err(format!("{method} {path}: {}: {}", v["value"]["error"], v["value"]["message"]))
        }
    }

    fn post(&self, path: &str, body: Value) -> Result<Value, String> {
        self.command(reqwest::Method::POST, path, body)
    }

    pub fn goto(&self, url: &str) {
        self.post("/url", json!({"url": url})).expect("navigates");
    }

    fn find(&self, css: &str) -> Result<String, String> {
        let v = self.post("/element", json!({"using": "css selector", "value": css}))?;
        v[ELEMENT].as_str().map(str::to_string).ok_or_else(|| format!("no element reference for `{css}`: {v}"))
    }

    /// Polls until `check` gives a value: elements come and go as the pages re-render, so
    /// a failed step (missing or stale element) is simply tried again until the deadline.
    pub fn wait_for<T>(&self, what: &str, mut check: impl FnMut(&Browser) -> Result<Option<T>, String>) -> T {
        let deadline = Instant::now() + WAIT;
        let mut last = String::new();
        loop {
            match check(self) {
                Ok(Some(v)) => return v,
                Ok(None) => {}
                Err(e) => last = e,
            }
            assert!(Instant::now() < deadline, "not within {WAIT:?}: {what} (last: {last})");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The visible text of the first element matching `css`.
    pub fn text(&self, css: &str) -> Result<String, String> {
        let id = self.find(css)?;
        let v = self.command(reqwest::Method::GET, &format!("/element/{id}/text"), Value::Null)?;
        Ok(v.as_str().unwrap_or_default().to_string())
    }

    /// Waits until the text of `css` contains every one of `parts`; returns the text.
    pub fn wait_text(&self, css: &str, parts: &[&str]) -> String {
        let mut seen = String::new();
        self.wait_for(&format!("`{css}` shows {parts:?}"), |b| {
            seen = b.text(css)?;
            Ok(parts.iter().all(|p| seen.contains(p)).then(|| seen.clone()))
        })
    }

    pub fn click(&self, css: &str) {
        self.wait_for(&format!("click `{css}`"), |b| {
            let id = b.find(css)?;
            b.post(&format!("/element/{id}/click"), json!({})).map(|_| Some(()))
        })
    }

    /// Replaces the text of an input with `text`, typed as keystrokes.
    pub fn type_into(&self, css: &str, text: &str) {
        self.wait_for(&format!("type into `{css}`"), |b| {
            let id = b.find(css)?;
            b.post(&format!("/element/{id}/clear"), json!({}))?;
            b.post(&format!("/element/{id}/value"), json!({"text": text})).map(|_| Some(()))
        })
    }

    /// Chooses the file at `path` in a file input, as the operator's file dialog would.
    pub fn choose_file(&self, css: &str, path: &Path) {
        let path = path.to_str().expect("a UTF-8 path");
        self.wait_for(&format!("choose a file in `{css}`"), |b| {
            let id = b.find(css)?;
            b.post(&format!("/element/{id}/value"), json!({"text": path})).map(|_| Some(()))
        })
    }

    /// Sets a form field's value as a paste would, with the `input` and `change` events the
    /// page listens to (typing a whole scenario key by key would take minutes).
    pub fn set_value(&self, css: &str, value: &str) {
        let js = "const el = document.querySelector(arguments[0]); if (!el) return false; el.value = arguments[1];
                  el.dispatchEvent(new Event('input', {bubbles: true})); el.dispatchEvent(new Event('change', {bubbles: true})); return true;";
        self.wait_for(&format!("set `{css}`"), |b| Ok(b.script(js, json!([css, value]))?.as_bool().filter(|&ok| ok)));
    }

    pub fn script(&self, js: &str, args: Value) -> Result<Value, String> {
        self.post("/execute/sync", json!({"script": js, "args": args}))
    }

    /// Saves a PNG of the whole page: the window is first sized to the page's content, as
    /// WebDriver's screenshot covers only the window.
    pub fn screenshot(&self, path: &Path) {
        // The window's height includes what is not page (its frame): add that difference.
        let js = "const content = document.querySelector('main').getBoundingClientRect().bottom + window.scrollY;
                  return Math.ceil(content + window.outerHeight - window.innerHeight) + 24;";
        let height = self.script(js, json!([])).ok().and_then(|v| v.as_u64()).unwrap_or(1000).clamp(700, 5000);
        self.post("/window/rect", json!({"width": 1400, "height": height})).expect("window resized");
        let v = self.command(reqwest::Method::GET, "/screenshot", Value::Null).expect("screenshot");
        let png = decode_base64(v.as_str().expect("base64 text")).expect("valid base64");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("screenshot folder");
        }
        std::fs::write(path, png).expect("screenshot written");
    }

    /// Uncaught script errors the page logged since the last call.
    pub fn script_errors(&self) -> Vec<String> {
        let v = self.post("/se/log", json!({"type": "browser"})).unwrap_or(Value::Null);
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e["message"].as_str())
            .filter(|m| m.contains("Uncaught"))
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self.command(reqwest::Method::DELETE, "", Value::Null);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

/// Standard base64 (RFC 4648, with padding), as WebDriver sends screenshots.
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let digits: Vec<u8> = text.bytes().filter(|c| !c.is_ascii_whitespace() && *c != b'=').collect();
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= u32::from(value(c)?) << (18 - 6 * i);
        }
        let bytes = acc.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    Some(out)
}

#[test]
fn base64_decodes_as_rfc_4648_says() {
    assert_eq!(decode_base64("TWFu"), Some(b"Man".to_vec()));
    assert_eq!(decode_base64("TWE="), Some(b"Ma".to_vec()));
    assert_eq!(decode_base64("TQ=="), Some(b"M".to_vec()));
    assert_eq!(decode_base64("iVBORw0KGgo="), Some(vec![0x89, b'P', b'N', b'G', 13, 10, 26, 10]));
    assert_eq!(decode_base64("T!=="), None);
}
