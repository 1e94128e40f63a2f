//! An engine's KV events over ZMQ: the engine's PUB socket connects to the endpoint it was
//! given, so the control plane binds a SUB socket there. Every message carries a sequence
//! number; a gap (messages lost, e.g. sent before the subscriber was up) is filled from the
//! engine's replay socket (a ROUTER: ask with the first missing number, get every buffered
//! message from it, then an end marker), and a number that goes back means the engine
//! restarted: its blocks are cleared from the index.

use super::hashes::BlockMap;
use super::kv_events::{decode_message, decode_seq, Batch, END_OF_REPLAY};
use crate::serve::live_fleet::News;
use bytes::Bytes;
use engine::kv::KvEvent;
use engine::InstanceId;
use policies::FleetEvent;
use std::time::Duration;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend};

/// How long a replay may take before the gap is given up.
const REPLAY_WAIT: Duration = Duration::from_secs(3);

/// What a message's sequence number says, given the ones before it.
#[derive(Debug, PartialEq, Eq)]
pub enum Order {
    /// The next one.
    Next,
    /// Messages `from..seq` are missing.
    Gap { from: u64 },
    /// Seen already (a replayed message arriving live too, or the reverse).
    Seen,
    /// The number went back: the engine restarted and counts from 0 again.
    Restarted,
}

/// The sequence numbers applied so far.
#[derive(Debug, Default)]
pub struct Sequence {
    /// The next number expected; `None` before the first message.
    next: Option<u64>,
}

impl Sequence {
    pub fn order(&self, seq: u64) -> Order {
        match self.next {
            // The first message heard: whatever came before it was missed.
            None if seq == 0 => Order::Next,
            None => Order::Gap { from: 0 },
            Some(n) if seq == n => Order::Next,
            Some(n) if seq > n => Order::Gap { from: n },
            // Well behind what was applied: a restart, not a late duplicate.
            Some(n) if seq + RESTART_MARGIN < n => Order::Restarted,
            Some(_) => Order::Seen,
        }
    }

    pub fn applied(&mut self, seq: u64) {
        self.next = Some(seq + 1);
    }

    pub fn reset(&mut self) {
        self.next = None;
    }
}

/// A number this far behind the next one expected is a restart rather than a duplicate.
const RESTART_MARGIN: u64 = 16;

/// A bound SUB socket and where to ask for replays.
pub struct Subscriber {
    sub: zeromq::SubSocket,
    pub endpoint: String,
    replay: Option<String>,
}

/// Binds the SUB socket at `endpoint` (the address the engine's `--kv-events-config` names).
pub async fn bind(endpoint: &str, replay: Option<String>) -> Result<Subscriber, String> {
    let mut sub = zeromq::SubSocket::new();
    sub.bind(endpoint).await.map_err(|e| format!("cannot bind the KV event endpoint {endpoint}: {e}"))?;
    sub.subscribe("").await.map_err(|e| format!("cannot subscribe at {endpoint}: {e}"))?;
    Ok(Subscriber { sub, endpoint: endpoint.to_string(), replay })
}

/// Checks that a replay endpoint answers (an empty replay from far ahead).
pub async fn check_replay(endpoint: &str) -> Result<(), String> {
    replay(endpoint, u64::MAX - 1).await.map(|_| ())
}

/// The messages the engine still buffers from `from` on.
async fn replay(endpoint: &str, from: u64) -> Result<Vec<Batch>, String> {
    let ask = async {
        let mut dealer = zeromq::DealerSocket::new();
        dealer.connect(endpoint).await.map_err(|e| format!("cannot connect: {e}"))?;
        let request = zeromq::ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&from.to_be_bytes())])
            .map_err(|e| format!("{e:?}"))?;
        dealer.send(request).await.map_err(|e| format!("cannot ask: {e}"))?;
        let mut batches = Vec::new();
        loop {
            let msg = dealer.recv().await.map_err(|e| format!("reply lost: {e}"))?;
            let frames: Vec<Bytes> = msg.into_vec();
            // [empty delimiter, topic, seq, payload]; the end marker has seq -1.
            let frames: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
            let rest = match frames.split_first() {
                Some((first, rest)) if first.is_empty() => rest,
                _ => &frames[..],
            };
            if rest.len() == 3 && decode_seq(rest[1]) == Ok(END_OF_REPLAY) {
                return Ok::<_, String>(batches);
            }
            batches.push(decode_message(rest).map_err(|e| format!("bad replayed message: {e}"))?);
        }
    };
    match tokio::time::timeout(REPLAY_WAIT, ask).await {
        Ok(r) => r.map_err(|e| format!("replay endpoint {endpoint}: {e}")),
        Err(_) => Err(format!("replay endpoint {endpoint} did not answer within {REPLAY_WAIT:?}")),
    }
}

/// Reads the engine's events until the task is aborted, translating them into ours.
pub async fn run(mut s: Subscriber, instance: InstanceId, block_size: u32, news: mpsc::UnboundedSender<News>) {
    let mut seq = Sequence::default();
    let mut blocks = BlockMap::default();
    let mut out = Vec::new();
    // Whatever the engine published before the subscriber was up, from its replay buffer.
    if let Some(r) = &s.replay {
        match replay(r, 0).await {
            Ok(batches) => {
                for b in batches {
                    apply(&mut seq, &mut blocks, b, block_size, instance, &mut out);
                }
            }
            Err(e) => tracing::warn!(%instance, "KV events before this control plane started are lost: {e}"),
        }
        send(&news, instance, &mut out);
    }
    loop {
        let msg = match s.sub.recv().await {
            Ok(m) => m,
            Err(e) => {
                // A publisher that went away; the next one to connect is read again.
                tracing::debug!(%instance, "KV event socket: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let frames = msg.into_vec();
        let frames: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        let batch = match decode_message(&frames) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(%instance, endpoint = %s.endpoint, "KV event message skipped: {e}");
                continue;
            }
        };
        if seq.order(batch.seq) == Order::Restarted {
            tracing::info!(%instance, seq = batch.seq, "engine restarted: its cached blocks are forgotten");
            blocks.clear(&mut out);
            seq.reset();
        }
        if let Order::Gap { from } = seq.order(batch.seq) {
            match &s.replay {
                Some(r) => match replay(r, from).await {
                    Ok(batches) => {
                        tracing::info!(%instance, from, to = batch.seq, "KV event gap filled by replay");
                        for b in batches.into_iter().filter(|b| b.seq < batch.seq) {
                            apply(&mut seq, &mut blocks, b, block_size, instance, &mut out);
                        }
                    }
                    Err(e) => tracing::warn!(%instance, from, to = batch.seq, "KV events lost: {e}"),
                },
                None => tracing::warn!(%instance, from, to = batch.seq, "KV events lost (no replay endpoint)"),
            }
        }
        apply(&mut seq, &mut blocks, batch, block_size, instance, &mut out);
        send(&news, instance, &mut out);
    }
}

/// Applies one message unless it was applied already.
fn apply(
    seq: &mut Sequence,
    blocks: &mut BlockMap,
    batch: Batch,
    block_size: u32,
    instance: InstanceId,
    out: &mut Vec<KvEvent>,
) {
    if seq.order(batch.seq) == Order::Seen {
        return;
    }
    for e in &batch.events {
        if let Err(why) = blocks.translate(e, block_size, out) {
            tracing::warn!(%instance, "KV event skipped: {why}");
        }
    }
    seq.applied(batch.seq);
}

fn send(news: &mpsc::UnboundedSender<News>, instance: InstanceId, out: &mut Vec<KvEvent>) {
    if out.is_empty() {
        return;
    }
    let events = out.drain(..).map(|e| (instance, e)).collect();
    let _ = news.send(News::Event(FleetEvent::Kv { events }));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_orders() {
        let mut s = Sequence::default();
        assert_eq!(s.order(0), Order::Next);
        assert_eq!(s.order(5), Order::Gap { from: 0 }, "the first message heard is 5: 0..5 were missed");
        s.applied(0);
        assert_eq!(s.order(1), Order::Next);
        assert_eq!(s.order(4), Order::Gap { from: 1 });
        s.applied(40);
        assert_eq!(s.order(40), Order::Seen);
        assert_eq!(s.order(30), Order::Seen, "a late duplicate");
        assert_eq!(s.order(3), Order::Restarted, "far behind");
        assert_eq!(s.order(0), Order::Restarted);
        s.reset();
        assert_eq!(s.order(0), Order::Next);
    }
}
