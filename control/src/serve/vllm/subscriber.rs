//! An engine's KV events over ZMQ: the engine's PUB socket connects to the endpoint it was
//! given, so the control plane binds a SUB socket there. Every message carries a sequence
//! number; a gap (messages lost, e.g. sent before the subscriber was up) is filled from the
//! engine's replay socket (a ROUTER: ask with the first missing number, get every buffered
//! message from it, then an end marker), and a number that goes back means the engine
//! restarted: its blocks are cleared from the index.

use super::hashes::BlockMap;
use super::kv_events::{decode_message, decode_seq, Batch, Batched, END_OF_REPLAY};
use crate::serve::lock::lock;
use crate::serve::news::News;
use bytes::Bytes;
use engine::kv::KvEvents;
use engine::InstanceId;
use policies::FleetEvent;
use std::sync::{Arc, Mutex};
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
    replay_from(endpoint, u64::MAX - 1).await.map(|_| ())
}

/// The messages the engine still buffers from `from` on.
async fn replay_from(endpoint: &str, from: u64) -> Result<Vec<Batch>, String> {
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
                Some((&[], rest)) => rest,
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

/// How an engine's KV event stream has gone (`GET /api/engines`).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct EventStats {
    /// Messages applied, live or replayed.
    pub messages: u64,
    /// The last sequence number applied.
    pub last_seq: Option<u64>,
    /// Messages the replay socket gave back (at start-up or for a gap).
    pub replayed: u64,
    /// Gaps seen, and messages of them that could not be fetched.
    pub gaps: u64,
    pub lost: u64,
    /// Events that could not be read, each skipped alone (its message's others applied).
    pub skipped: u64,
    /// The start-up replay is done: the index knows what the engine cached before.
    pub caught_up: bool,
    /// Blocks the engine holds by our hashes, and stored blocks left out (parent unknown).
    pub blocks: usize,
    pub unmapped: u64,
    pub restarts: u64,
}

/// One engine's event stream as it is read: order, hash map, and what goes to the driver.
struct Reader {
    instance: InstanceId,
    block_size: u32,
    seq: Sequence,
    blocks: BlockMap,
    out: KvEvents,
    news: mpsc::UnboundedSender<News>,
    stats: Arc<Mutex<EventStats>>,
}

impl Reader {
    /// Applies one message unless it was applied already.
    fn apply(&mut self, batch: Batch) {
        if self.seq.order(batch.seq) == Order::Seen {
            return;
        }
        let Batched { events, skipped } = &batch.events;
        tracing::debug!(instance = %self.instance, seq = batch.seq, events = events.len(), "KV events");
        for why in skipped {
            tracing::warn!(instance = %self.instance, seq = batch.seq, "KV event skipped, the rest of its message read: {why}");
        }
        for e in events {
            if let Err(why) = self.blocks.translate(e, self.block_size, &mut self.out) {
                tracing::warn!(instance = %self.instance, "KV event skipped: {why}");
            }
        }
        self.seq.applied(batch.seq);
        let mut st = lock(&self.stats);
        st.messages += 1;
        st.skipped += skipped.len() as u64;
        st.last_seq = Some(batch.seq);
    }

    /// Fetches messages `from..to` (`to`: none, all the engine buffers) and applies them.
    async fn fill(&mut self, replay: &str, from: u64, to: Option<u64>) -> Result<(), String> {
        let batches = replay_from(replay, from).await?;
        let batches: Vec<_> = batches.into_iter().filter(|b| to.is_none_or(|t| b.seq < t)).collect();
        lock(&self.stats).replayed += batches.len() as u64;
        for b in batches {
            self.apply(b);
        }
        Ok(())
    }

    /// Hands the translated events to the driver, and updates the stats.
    fn send(&mut self) {
        let mut st = lock(&self.stats);
        st.blocks = self.blocks.len();
        st.unmapped = self.blocks.unmapped;
        drop(st);
        if self.out.is_empty() {
            return;
        }
        let events = std::mem::take(&mut self.out);
        let _ = self.news.send(News::Event(FleetEvent::Kv { instance: self.instance, events }));
    }
}

/// Reads the engine's events until the task is aborted, translating them into ours.
pub async fn run(
    mut s: Subscriber,
    instance: InstanceId,
    block_size: u32,
    news: mpsc::UnboundedSender<News>,
    stats: Arc<Mutex<EventStats>>,
) {
    let mut r = Reader {
        instance,
        block_size,
        seq: Sequence::default(),
        blocks: BlockMap::default(),
        out: KvEvents::new(),
        news,
        stats: stats.clone(),
    };
    // Whatever the engine published before the subscriber was up, from its replay buffer.
    if let Some(replay) = s.replay.clone() {
        match r.fill(&replay, 0, None).await {
            Ok(()) => {
                tracing::info!(%instance, messages = r.seq.next.unwrap_or(0), "KV events from before this control plane started, replayed")
            }
            Err(e) => tracing::warn!(%instance, "KV events from before this control plane started are lost: {e}"),
        }
    }
    r.send();
    lock(&stats).caught_up = true;
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
        if r.seq.order(batch.seq) == Order::Restarted {
            tracing::info!(%instance, seq = batch.seq, "engine restarted: its cached blocks are forgotten");
            r.blocks.clear(&mut r.out);
            r.seq.reset();
            lock(&stats).restarts += 1;
        }
        if let Order::Gap { from } = r.seq.order(batch.seq) {
            lock(&stats).gaps += 1;
            let filled = match s.replay.clone() {
                Some(replay) => r.fill(&replay, from, Some(batch.seq)).await,
                None => Err("no replay endpoint".to_string()),
            };
            match filled {
                Ok(()) => tracing::info!(%instance, from, to = batch.seq, "KV event gap filled by replay"),
                Err(e) => tracing::warn!(%instance, from, to = batch.seq, "KV events lost: {e}"),
            }
            // What the replay could not bring is lost.
            let got = r.seq.next.unwrap_or(0);
            lock(&stats).lost += batch.seq.saturating_sub(got.max(from));
        }
        r.apply(batch);
        r.send();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::kv::{KvEvent, Tier};
    use rmpv::Value;

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

    /// A batch storing one block of `tokens` (block size 2) after `parent`, in vLLM's encoding.
    fn stored(hash: u64, parent: Option<u64>, tokens: [u32; 2]) -> Vec<u8> {
        message(vec![stored_event(hash, parent, &tokens, 2)])
    }

    fn stored_event(hash: u64, parent: Option<u64>, tokens: &[u32], block_size: u32) -> Value {
        let s = |x: &str| Value::from(x);
        Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![Value::from(hash)])),
            (s("parent_block_hash"), parent.map_or(Value::Nil, Value::from)),
            (s("token_ids"), Value::Array(tokens.iter().map(|&t| Value::from(t)).collect())),
            (s("block_size"), Value::from(block_size)),
            (s("medium"), s("GPU")),
        ])
    }

    fn message(events: Vec<Value>) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &Value::Array(vec![Value::F64(0.0), Value::Array(events)]))
            .expect("encode");
        out
    }

    fn frames(parts: Vec<Bytes>) -> zeromq::ZmqMessage {
        zeromq::ZmqMessage::try_from(parts).expect("frames")
    }

    /// A publisher as vLLM's: PUB connects to the subscriber, a ROUTER answers replays from its
    /// buffer. Messages 0 to 2 went out before the subscriber was up; it fetches them by
    /// replay, then takes the live ones in order.
    #[tokio::test]
    async fn a_gap_is_filled_from_the_replay_socket_over_real_sockets() {
        let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let (events_ep, replay_ep) = (format!("tcp://127.0.0.1:{}", free()), format!("tcp://127.0.0.1:{}", free()));
        let buffer: Vec<(u64, Vec<u8>)> =
            vec![(0, stored(10, None, [1, 2])), (1, stored(11, Some(10), [3, 4])), (2, stored(12, Some(11), [5, 6]))];
        let mut router = zeromq::RouterSocket::new();
        router.bind(&replay_ep).await.expect("router binds");
        let replayed = buffer.clone();
        tokio::spawn(async move {
            while let Ok(msg) = router.recv().await {
                let parts = msg.into_vec();
                let (client, start) = (parts[0].clone(), decode_seq(&parts[2]).expect("seq"));
                for (seq, payload) in replayed.iter().filter(|(seq, _)| *seq >= start) {
                    let reply = vec![
                        client.clone(),
                        Bytes::new(),
                        Bytes::from_static(b"kv"),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        Bytes::from(payload.clone()),
                    ];
                    router.send(frames(reply)).await.expect("reply");
                }
                let end = vec![
                    client,
                    Bytes::new(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                    Bytes::new(),
                ];
                router.send(frames(end)).await.expect("end");
            }
        });
        check_replay(&replay_ep).await.expect("the replay socket answers");
        let sub = bind(&events_ep, Some(replay_ep.clone())).await.expect("binds");
        let (news, mut rx) = mpsc::unbounded_channel();
        let stats = Arc::new(Mutex::new(EventStats::default()));
        tokio::spawn(run(sub, InstanceId(3), 2, news, stats.clone()));
        let mut publisher = zeromq::PubSocket::new();
        publisher.connect(&events_ep).await.expect("pub connects");
        // Nothing was published live yet: the start-up replay brings the three buffered.
        let mut ours = Vec::new();
        while ours.len() < 3 {
            match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("events").expect("open") {
                News::Event(FleetEvent::Kv { instance, events }) => ours.extend(events.iter().map(|e| (instance, e))),
                _ => panic!("only KV events"),
            }
        }
        let expected = engine::block_hashes(&[1, 2, 3, 4, 5, 6], 2);
        let hashes: Vec<_> = ours
            .iter()
            .map(|(i, e)| match e {
                KvEvent::Stored { tier: Tier::L1, hash, .. } => {
                    assert_eq!(*i, InstanceId(3));
                    *hash
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(hashes, expected);
        // Live now: message 2 again (seen already: nothing), then 3, the next one.
        for (seq, payload) in [(2u64, stored(12, Some(11), [5, 6])), (3, stored(13, Some(12), [7, 8]))] {
            let msg = vec![Bytes::from_static(b"kv"), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload)];
            publisher.send(frames(msg)).await.expect("publish");
        }
        let got = match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("event").expect("open") {
            News::Event(FleetEvent::Kv { instance, events }) => {
                events.iter().map(|e| (instance, e)).collect::<Vec<_>>()
            }
            _ => panic!("only KV events"),
        };
        let next = engine::block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 2)[3];
        assert_eq!(got, vec![(InstanceId(3), KvEvent::Stored { tier: Tier::L1, hash: next, page: expected[0] })]);
        // A message with an event that cannot be read (a placeholder: no tokens, block size
        // 0): that event is skipped, the block beside it still reaches the index, and the
        // next message is no gap.
        let bad = stored_event(99, None, &[], 0);
        for (seq, payload) in
            [(4u64, message(vec![bad, stored_event(14, Some(13), &[9, 10], 2)])), (5, stored(15, Some(14), [11, 12]))]
        {
            let msg = vec![Bytes::from_static(b"kv"), Bytes::copy_from_slice(&seq.to_be_bytes()), Bytes::from(payload)];
            publisher.send(frames(msg)).await.expect("publish");
        }
        let all = engine::block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 2);
        let mut got = Vec::new();
        while got.len() < 2 {
            match tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("event").expect("open") {
                News::Event(FleetEvent::Kv { events, .. }) => got.extend(events.iter().map(|e| match e {
                    KvEvent::Stored { hash, .. } => hash,
                    other => panic!("{other:?}"),
                })),
                _ => panic!("only KV events"),
            }
        }
        assert_eq!(got, all[4..6]);
        let st = lock(&stats).clone();
        assert_eq!((st.skipped, st.gaps, st.last_seq), (1, 0, Some(5)), "{st:?}");
    }
}
