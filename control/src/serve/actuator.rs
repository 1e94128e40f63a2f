//! Actuators: what carries out the autoscaler's `Command::Start` and stops a drained engine.
//!
//! The controller decides; an [`Actuator`] makes an engine exist or cease to. A started
//! engine is not a member of the fleet until it registers (its heartbeat), exactly like one
//! started by hand, so the controller counts it as starting until then. Stopping is the end of
//! a drain: the controller's `Command::Drain` stops routing to the engine, [`watch_drain`]
//! waits until the engine holds no request (parked hand-offs included), and only then does
//! the actuator stop the process, so no request is dropped.
//!
//! Only the leader replica runs the autoscaler, so only its actuator acts.
//!
//! | actuator | how |
//! | --- | --- |
//! | [`LocalProcesses`] | child processes on this machine: `fleetplane engine`, or an operator's command (a vLLM server) |
//!
//! Another backend (a Kubernetes deployment, a cloud API) implements the same three calls.

use super::news::News;
use super::vllm::{self, EngineKind};
use crate::engine_auth::EngineLink;
use crate::proto;
use anyhow::Context;
use engine::InstanceId;
use policies::Role;
use std::collections::BTreeMap;
use std::os::fd::AsFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// Starts and stops engines.
pub trait Actuator: Send {
    fn name(&self) -> &'static str;
    /// Starts an engine of `role`; it registers itself once up.
    fn start(&mut self, role: Role) -> anyhow::Result<()>;
    /// Whether this actuator started the engine at `address` (only those it may stop).
    fn owns(&self, address: &str) -> bool;
    /// Stops the engine at `address`, which holds no request.
    fn stop(&mut self, address: &str);
    /// Engines that stopped by themselves since the last call (crashed, or failed to start),
    /// by address and role.
    fn exited(&mut self) -> Vec<(String, Role)>;
}

/// What the local actuator starts.
#[derive(Clone, Debug)]
pub enum Launch {
    /// `fleetplane engine --executor sim`, which registers itself.
    Ours(OurEngine),
    /// An operator's command line for a vLLM server, registered once it answers.
    Command(EngineCommand),
}

/// What a started engine of ours runs as (the flags of `fleetplane engine`).
#[derive(Clone, Debug)]
pub struct OurEngine {
    /// The `fleetplane` binary (this one).
    pub exe: PathBuf,
    /// This control plane's gRPC address, where the engine registers.
    pub control: String,
    pub engine_token: String,
    pub model: String,
    pub gpu: String,
    /// The step profile its cost model is calibrated on (`serve --engine-profile`).
    pub profile: Option<PathBuf>,
    pub time_scale: f64,
    pub kv_blocks: Option<u32>,
}

/// `serve --engine-command`: a vLLM server's command line, run as `sh -c 'exec LINE'` with
/// `{port}` (its OpenAI API), `{kv_port}` and `{replay_port}` (its KV events' endpoint and
/// replay socket, which the control plane binds and reads), `{side_port}` (a KV connector's
/// side channel, e.g. `VLLM_NIXL_SIDE_CHANNEL_PORT`), `{role}` and `{name}` filled in.
#[derive(Clone, Debug)]
pub struct EngineCommand {
    pub template: String,
    /// Where a started engine's spec goes to be registered ([`super::engines`]).
    pub register: mpsc::UnboundedSender<vllm::EngineSpec>,
}

/// The placeholders of an [`EngineCommand`].
pub const PLACEHOLDERS: [&str; 6] = ["{port}", "{kv_port}", "{replay_port}", "{side_port}", "{role}", "{name}"];

impl EngineCommand {
    /// Checks the template: it must say where the engine listens; every `{...}` is known.
    pub fn check(template: &str) -> Result<(), String> {
        if !template.contains("{port}") {
            return Err("--engine-command has no {port}: the engine's OpenAI API must listen there".into());
        }
        if template.contains("{replay_port}") && !template.contains("{kv_port}") {
            return Err("--engine-command has {replay_port} without {kv_port}".into());
        }
        let mut rest = template;
        while let Some(start) = rest.find('{') {
            let Some(len) = rest[start..].find('}') else { break };
            let word = &rest[start..start + len + 1];
            // JSON in the line (`--kv-transfer-config '{"kv_connector": ...}'`) is not ours.
            if word.chars().skip(1).take(len - 1).all(|c| c.is_ascii_lowercase() || c == '_')
                && !PLACEHOLDERS.contains(&word)
            {
                return Err(format!(
                    "--engine-command: unknown placeholder {word} (known: {})",
                    PLACEHOLDERS.join(" ")
                ));
            }
            rest = &rest[start + 1..];
        }
        Ok(())
    }

    /// The command line for an engine of `role`, and the spec it is registered with.
    fn fill(&self, role: Role) -> anyhow::Result<(String, vllm::EngineSpec)> {
        let (port, kv, replay, side) = (free_port()?, free_port()?, free_port()?, free_port()?);
        let name = format!("{}-{port}", role.name());
        let mut line = self.template.clone();
        for (key, value) in [
            ("{port}", port.to_string()),
            ("{kv_port}", kv.to_string()),
            ("{replay_port}", replay.to_string()),
            ("{side_port}", side.to_string()),
            ("{role}", role.name().to_string()),
            ("{name}", name),
        ] {
            line = line.replace(key, &value);
        }
        let endpoint = |p: u16| format!("tcp://127.0.0.1:{p}");
        let spec = vllm::EngineSpec {
            kind: EngineKind::Vllm,
            url: format!("http://127.0.0.1:{port}"),
            kv_events: self.template.contains("{kv_port}").then(|| endpoint(kv)),
            replay: self.template.contains("{replay_port}").then(|| endpoint(replay)),
            role: role.name().to_string(),
            tokenizer: None,
            actuated: true,
            // The engine it starts schedules by priority when its command line says so.
            scheduling_policy: if ["--scheduling-policy priority", "--scheduling-policy=priority"]
                .iter()
                .any(|flag| line.contains(flag))
            {
                vllm::SchedulingPolicy::Priority
            } else {
                vllm::SchedulingPolicy::Fcfs
            },
        };
        Ok((line, spec))
    }
}

/// Engines as child processes of this control plane, each in a process group of its own.
/// None outlives the control plane that started it: ours get `--exit-with-parent`, a
/// command's process the parent-death signal (SIGTERM).
pub struct LocalProcesses {
    launch: Launch,
    /// Children by the address they are known by (the engine's gRPC address, or its URL),
    /// with their role.
    children: BTreeMap<String, (Role, Child)>,
}

impl LocalProcesses {
    pub fn new(launch: Launch) -> LocalProcesses {
        LocalProcesses { launch, children: BTreeMap::new() }
    }

    fn start_ours(&mut self, role: Role, s: &OurEngine) -> anyhow::Result<()> {
        let address = format!("127.0.0.1:{}", free_port()?);
        let name = format!("{}-{}", role.name(), address.rsplit(':').next().unwrap_or_default());
        let mut command = Command::new(&s.exe);
        command
            .args(["engine", "--executor", "sim", "--role", role.name(), "--model", &s.model, "--gpu", &s.gpu])
            .args(["--time-scale", &s.time_scale.to_string(), "--listen", &address, "--control", &s.control])
            .args(["--name", &name, "--exit-with-parent"])
            .env("FLEETPLANE_ENGINE_TOKEN", &s.engine_token)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if let Some(n) = s.kv_blocks {
            command.args(["--kv-blocks", &n.to_string()]);
        }
        if let Some(p) = &s.profile {
            command.arg("--profile").arg(p);
        }
        let child = command.spawn().with_context(|| format!("cannot run {}", s.exe.display()))?;
        tracing::info!(role = role.name(), %address, pid = child.id(), "engine process started");
        self.children.insert(address, (role, child));
        Ok(())
    }

    fn start_command(&mut self, role: Role, c: &EngineCommand) -> anyhow::Result<()> {
        let (line, spec) = c.fill(role)?;
        let mut command = Command::new("sh");
        command.arg("-c").arg(format!("exec {line}")).stdin(Stdio::null()).process_group(0);
        // Its output goes where ours does (a vLLM server logs to stdout).
        if let Ok(err) = std::io::stderr().as_fd().try_clone_to_owned() {
            command.stdout(err);
        }
        die_with_parent(&mut command);
        let child = command.spawn().context("cannot run sh for --engine-command")?;
        tracing::info!(role = role.name(), url = %spec.url, pid = child.id(), "engine process started: {line}");
        let url = spec.url.clone();
        if c.register.send(spec).is_err() {
            tracing::warn!(%url, "nothing registers started engines any more");
        }
        self.children.insert(url, (role, child));
        Ok(())
    }
}

/// Sends `signal` to the process group `group` (a child this actuator made its group's leader).
#[allow(unsafe_code)]
fn signal_group(group: u32, signal: libc::c_int) {
    let Ok(group) = libc::pid_t::try_from(group) else { return };
    // SAFETY: kill(2) takes no pointers; a group that is gone gives ESRCH, ignored.
    unsafe { libc::kill(-group, signal) };
}

/// The child gets SIGTERM when this process dies, even by SIGKILL (then nothing else could
/// stop it). The signal follows the thread that forked: the runtime's worker threads live
/// as long as the control plane.
#[allow(unsafe_code)]
fn die_with_parent(command: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and makes one
    // async-signal-safe call.
    unsafe {
        command.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
}

/// How long a stopped command's process group has to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Stops a child's process group: SIGTERM, then SIGKILL after `grace` (on a thread of its
/// own, which also reaps it).
fn stop_group(mut child: Child, grace: Duration) {
    let group = child.id();
    signal_group(group, libc::SIGTERM);
    std::thread::spawn(move || {
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // The server may have exited and left its own children (vLLM's engine core).
        signal_group(group, libc::SIGKILL);
        let _ = child.wait();
    });
}

/// A port free now on the loopback interface (the engine binds it a moment later).
fn free_port() -> anyhow::Result<u16> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Below Linux's ephemeral range (32768 and up): a port handed out here is bound by the
    // engine a while later, and a server starting meanwhile (vLLM binds its own ZMQ sockets
    // to ephemeral ports) must not take it first.
    let base = 20_000 + std::process::id() % 6_000;
    for _ in 0..2_000 {
        let port = base + NEXT.fetch_add(1, Ordering::Relaxed) % 6_000;
        let Ok(port) = u16::try_from(port) else { continue };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("no free port for an engine")?;
    Ok(listener.local_addr()?.port())
}

impl Actuator for LocalProcesses {
    fn name(&self) -> &'static str {
        "local"
    }

    fn start(&mut self, role: Role) -> anyhow::Result<()> {
        match self.launch.clone() {
            Launch::Ours(s) => self.start_ours(role, &s),
            Launch::Command(c) => self.start_command(role, &c),
        }
    }

    fn owns(&self, address: &str) -> bool {
        self.children.contains_key(address)
    }

    fn stop(&mut self, address: &str) {
        let Some((role, mut child)) = self.children.remove(address) else { return };
        let pid = child.id();
        match self.launch {
            // It holds no request and owns no state worth flushing: a kill loses nothing.
            Launch::Ours(_) => {
                if let Err(e) = child.kill() {
                    tracing::warn!(%address, "cannot stop the engine process: {e}");
                }
                std::thread::spawn(move || child.wait());
            }
            // A server that is not ours shuts down on SIGTERM (vLLM stops its engine core).
            Launch::Command(_) => stop_group(child, STOP_GRACE),
        }
        tracing::info!(role = role.name(), %address, pid, "engine process stopped");
    }

    fn exited(&mut self) -> Vec<(String, Role)> {
        let mut out = Vec::new();
        self.children.retain(|address, (role, child)| match child.try_wait() {
            Ok(None) => true,
            status => {
                tracing::warn!(%address, "engine process exited by itself: {status:?}");
                out.push((address.clone(), *role));
                false
            }
        });
        out
    }
}

impl Drop for LocalProcesses {
    fn drop(&mut self) {
        for (_, (_, mut child)) in std::mem::take(&mut self.children) {
            if let Launch::Command(_) = self.launch {
                signal_group(child.id(), libc::SIGKILL);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// How often a draining engine is asked what it still holds.
const DRAIN_POLL: Duration = Duration::from_millis(250);

/// Asks a draining engine until it holds no request, then reports it drained (also when it
/// cannot be asked: it is gone, and nothing on it can be saved).
pub async fn watch_drain(instance: InstanceId, mut client: EngineLink, news: mpsc::UnboundedSender<News>) {
    loop {
        match client.drain(proto::DrainRequest {}).await {
            Ok(r) if r.get_ref().in_flight > 0 => tokio::time::sleep(DRAIN_POLL).await,
            _ => break,
        }
    }
    let _ = news.send(News::Drained { instance });
}

/// Waits until an engine with its own API holds no request the control plane sent it (and,
/// for a prefill engine, no KV a parked request still needs: the fleet checks that when it
/// retires it), then reports it drained.
pub async fn watch_drain_external(instance: InstanceId, engine: Arc<vllm::Engine>, news: mpsc::UnboundedSender<News>) {
    while engine.in_flight().requests > 0 {
        tokio::time::sleep(DRAIN_POLL).await;
    }
    let _ = news.send(News::Drained { instance });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_template_is_checked_and_filled() {
        let t = r#"python -m vllm.entrypoints.openai.api_server --port {port} --kv-events-config '{"endpoint":"tcp://127.0.0.1:{kv_port}","replay_endpoint":"tcp://127.0.0.1:{replay_port}"}' --name {name}"#;
        EngineCommand::check(t).unwrap();
        let (tx, _rx) = mpsc::unbounded_channel();
        let (line, spec) = EngineCommand { template: t.into(), register: tx }.fill(Role::Decode).unwrap();
        assert!(!line.contains("{port}") && !line.contains("{kv_port}") && line.contains("--name decode-"), "{line}");
        let port = spec.url.rsplit(':').next().unwrap();
        assert!(line.contains(&format!("--port {port} ")), "{line}");
        assert!(line.contains(spec.kv_events.as_deref().unwrap()), "{line}");
        assert!(line.contains(spec.replay.as_deref().unwrap()), "{line}");
        assert_eq!((spec.role.as_str(), spec.actuated), ("decode", true));
        for (bad, says) in [
            ("vllm serve", "no {port}"),
            ("vllm --port {port} {replay_port}", "without {kv_port}"),
            ("vllm --port {port} --x {prot}", "unknown placeholder {prot}"),
        ] {
            let e = EngineCommand::check(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
