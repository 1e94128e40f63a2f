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
//! | [`LocalProcesses`] | `fleetplane engine` child processes on this machine |
//!
//! Another backend (a Kubernetes deployment, a cloud API) implements the same three calls.

use super::live_fleet::News;
use crate::proto::{self, engine_client::EngineClient};
use anyhow::Context;
use engine::InstanceId;
use policies::Role;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio::sync::mpsc;
use tonic::transport::Channel;

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

/// What a started engine runs as (the flags of `fleetplane engine`).
#[derive(Clone, Debug)]
pub struct EngineSpec {
    /// The `fleetplane` binary (this one).
    pub exe: PathBuf,
    /// This control plane's gRPC address, where the engine registers.
    pub control: String,
    pub engine_token: String,
    pub model: String,
    pub gpu: String,
    pub time_scale: f64,
    pub kv_blocks: Option<u32>,
}

/// Engines as child processes of this control plane. Each gets `--exit-with-parent`, so
/// none outlives the control plane that started it.
pub struct LocalProcesses {
    spec: EngineSpec,
    /// Children by the address they listen on, with their role.
    children: BTreeMap<String, (Role, Child)>,
}

impl LocalProcesses {
    pub fn new(spec: EngineSpec) -> LocalProcesses {
        LocalProcesses { spec, children: BTreeMap::new() }
    }
}

/// A port free now on the loopback interface (the engine binds it a moment later).
fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("no free port for an engine")?;
    Ok(listener.local_addr()?.port())
}

impl Actuator for LocalProcesses {
    fn name(&self) -> &'static str {
        "local"
    }

    fn start(&mut self, role: Role) -> anyhow::Result<()> {
        let s = &self.spec;
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
        let child = command.spawn().with_context(|| format!("cannot run {}", s.exe.display()))?;
        tracing::info!(role = role.name(), %address, pid = child.id(), "engine process started");
        self.children.insert(address, (role, child));
        Ok(())
    }

    fn owns(&self, address: &str) -> bool {
        self.children.contains_key(address)
    }

    fn stop(&mut self, address: &str) {
        let Some((role, mut child)) = self.children.remove(address) else { return };
        // It holds no request and owns no state worth flushing: a kill loses nothing.
        if let Err(e) = child.kill() {
            tracing::warn!(%address, "cannot stop the engine process: {e}");
        }
        let pid = child.id();
        std::thread::spawn(move || child.wait());
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
        for (_, (_, child)) in self.children.iter_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// How often a draining engine is asked what it still holds.
const DRAIN_POLL: Duration = Duration::from_millis(250);

/// Asks a draining engine until it holds no request, then reports it drained (also when it
/// cannot be asked: it is gone, and nothing on it can be saved).
pub async fn watch_drain(instance: InstanceId, mut client: EngineClient<Channel>, news: mpsc::UnboundedSender<News>) {
    loop {
        match client.drain(proto::DrainRequest {}).await {
            Ok(r) if r.get_ref().in_flight > 0 => tokio::time::sleep(DRAIN_POLL).await,
            _ => break,
        }
    }
    let _ = news.send(News::Drained { instance });
}
