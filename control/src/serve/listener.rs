//! The HTTP listener: the router served by hyper with the limits a public endpoint needs and
//! `axum::serve` does not offer: a deadline for a request's headers and for each part of its
//! body, a cap on open connections, and a bounded wait for open requests (streams) at
//! shutdown. Without them, clients holding half-sent headers kept their connections (and a
//! file descriptor each) open for as long as they liked.

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower_http::timeout::RequestBodyTimeoutLayer;

/// What one client may hold of the server.
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct Limits {
    /// Seconds a request's headers may take to arrive (and an idle keep-alive connection to
    /// send its next request): then the connection is closed.
    #[arg(long, default_value_t = 10.0, value_name = "S")]
    pub header_timeout_s: f64,

    /// Seconds a request body may go without sending more of itself: then reading it fails
    /// (the request is refused) and the connection closes.
    #[arg(long, default_value_t = 30.0, value_name = "S")]
    pub body_timeout_s: f64,

    /// Connections open at once; the next client waits in the kernel's queue until one
    /// closes.
    #[arg(long, default_value_t = 4096, value_name = "N")]
    pub max_connections: usize,

    /// Seconds a shutdown waits for open requests (streams) to finish before closing them.
    #[arg(long, default_value_t = 30.0, value_name = "S")]
    pub shutdown_grace_s: f64,
}

impl Limits {
    /// The limits as durations, or the flag that is not a positive number of seconds.
    fn durations(&self) -> Result<[Duration; 3], String> {
        let mut out = [Duration::ZERO; 3];
        let flags = [
            ("--header-timeout-s", self.header_timeout_s),
            ("--body-timeout-s", self.body_timeout_s),
            ("--shutdown-grace-s", self.shutdown_grace_s),
        ];
        for (d, (flag, s)) in out.iter_mut().zip(flags) {
            *d = Duration::try_from_secs_f64(s)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| format!("{flag} {s} is not a positive number of seconds"))?;
        }
        Ok(out)
    }

    /// Checks the flags before anything starts.
    pub fn check(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("--max-connections must be at least 1".into());
        }
        self.durations().map(|_| ())
    }
}

/// Serves `router` on `listener` until `shutdown` resolves, then waits up to the grace for
/// open requests.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let [header, body, grace] = limits.durations().map_err(anyhow::Error::msg)?;
    let router = router.layer(RequestBodyTimeoutLayer::new(body));
    let permits = Arc::new(Semaphore::new(limits.max_connections.min(Semaphore::MAX_PERMITS)));
    let graceful = GracefulShutdown::new();
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.timer(TokioTimer::new()).header_read_timeout(header);
    tokio::pin!(shutdown);
    loop {
        // A permit first: at the cap, new clients wait in the kernel's accept queue.
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break, // closed: never, the semaphore is ours
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, say: the listener is fine, try again shortly.
                    tracing::warn!("cannot accept a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Nagle off: SSE writes one small event per token.
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let connection = graceful.watch(http1.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(%peer, "connection ended: {e}");
            }
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("requests still open {grace:?} after the shutdown began were cut off");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(header: f64, body: f64, grace: f64, max_connections: usize) -> Limits {
        Limits { header_timeout_s: header, body_timeout_s: body, max_connections, shutdown_grace_s: grace }
    }

    #[test]
    fn limits_that_are_not_positive_are_named() {
        assert_eq!(limits(10.0, 30.0, 30.0, 8).check(), Ok(()));
        let e = limits(0.0, 30.0, 30.0, 8).check().unwrap_err();
        assert!(e.contains("--header-timeout-s 0"), "{e}");
        let e = limits(10.0, f64::NAN, 30.0, 8).check().unwrap_err();
        assert!(e.contains("--body-timeout-s NaN"), "{e}");
        let e = limits(10.0, 30.0, -1.0, 8).check().unwrap_err();
        assert!(e.contains("--shutdown-grace-s -1"), "{e}");
        let e = limits(10.0, 30.0, 30.0, 0).check().unwrap_err();
        assert!(e.contains("--max-connections"), "{e}");
    }
}
