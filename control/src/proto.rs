//! The engine/control-plane protocol (proto/fleetplane.proto), and conversions between its
//! messages and the engine's types.

#![allow(clippy::all, missing_docs)]

tonic::include_proto!("fleetplane.v1");

use anyhow::{anyhow, Result};

/// The largest message engines and control planes take from each other: a P/D hand-off
/// carries a prompt's whole KV in one message (a CUDA engine's: 32 KiB a token for a Llama
/// 3.2 1B, 128 KiB for an 8B), and gRPC frames a message in at most 4 GiB.
pub const MAX_MESSAGE_BYTES: usize = (4 << 30) - 1;
use engine::kv::{KvEvent as EngineKvEvent, KvEvents as EngineKvEvents, KvRun, PageKey, Tier as EngineTier};

/// A request class on the wire, and back: the one mapping.
pub fn class_of(c: RequestClass) -> engine::Class {
    match c {
        RequestClass::Standard => engine::Class::Standard,
        RequestClass::Interactive => engine::Class::Interactive,
        RequestClass::Batch => engine::Class::Batch,
    }
}

pub fn wire_class(c: engine::Class) -> RequestClass {
    match c {
        engine::Class::Standard => RequestClass::Standard,
        engine::Class::Interactive => RequestClass::Interactive,
        engine::Class::Batch => RequestClass::Batch,
    }
}

/// OpenAI's `finish_reason`, both ways: the one place the gateway and the vLLM relay map it.
impl FinishReason {
    /// What an OpenAI client is told. A request the engine cut short reached a limit (its
    /// KV protection's), which OpenAI's vocabulary calls "length"; EVICTED and PREFILLED end
    /// a stream but never a request.
    pub fn openai(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length | FinishReason::CutShort => "length",
            FinishReason::Unspecified | FinishReason::Evicted | FinishReason::Prefilled => "length",
        }
    }

    /// An OpenAI engine's (vLLM's) reason on the token-id completions the relay sends:
    /// "stop" or "length" (anything else, such as vLLM's "abort", ended it short).
    pub fn of_openai(reason: &str) -> FinishReason {
        match reason {
            "stop" => FinishReason::Stop,
            "length" => FinishReason::Length,
            _ => FinishReason::CutShort,
        }
    }
}
use engine::BlockHash;

impl From<engine::Load> for Load {
    fn from(l: engine::Load) -> Load {
        Load {
            waiting: l.waiting,
            running: l.running,
            kv_used_blocks: l.kv_used_blocks,
            kv_total_blocks: l.kv_total_blocks,
            kv_cached_blocks: l.kv_cached_blocks,
            prefill_tokens_left: l.prefill_tokens_left,
            decode_tokens_left: l.decode_tokens_left,
            admission_paused: l.admission_paused,
            scheduling: None,
        }
    }
}

impl From<Load> for engine::Load {
    fn from(l: Load) -> engine::Load {
        engine::Load {
            waiting: l.waiting,
            running: l.running,
            kv_used_blocks: l.kv_used_blocks,
            kv_total_blocks: l.kv_total_blocks,
            kv_cached_blocks: l.kv_cached_blocks,
            prefill_tokens_left: l.prefill_tokens_left,
            decode_tokens_left: l.decode_tokens_left,
            admission_paused: l.admission_paused,
        }
    }
}

fn tier_to_wire(t: EngineTier) -> i32 {
    match t {
        EngineTier::L1 => Tier::L1 as i32,
        EngineTier::L2 => Tier::L2 as i32,
        EngineTier::L3 => Tier::L3 as i32,
    }
}

fn tier_from_wire(t: i32) -> Result<EngineTier> {
    match Tier::try_from(t) {
        Ok(Tier::L1) => Ok(EngineTier::L1),
        Ok(Tier::L2) => Ok(EngineTier::L2),
        Ok(Tier::L3) => Ok(EngineTier::L3),
        Err(_) => Err(anyhow!("unknown KV tier {t}")),
    }
}

impl From<&EngineKvEvents> for KvEvents {
    /// A batch on the wire, a run a message.
    fn from(batch: &EngineKvEvents) -> KvEvents {
        let wire = |hashes: &[BlockHash]| hashes.iter().map(|h| h.0).collect();
        let events = batch
            .runs()
            .map(|run| {
                let kind = match run {
                    KvRun::Stored { tier, page, hashes } => kv_event::Kind::Stored(BlockStored {
                        tier: tier_to_wire(tier),
                        page: page.0,
                        hashes: wire(hashes),
                    }),
                    KvRun::Removed { tier, page, hashes } => kv_event::Kind::Removed(BlockRemoved {
                        tier: tier_to_wire(tier),
                        page: page.0,
                        hashes: wire(hashes),
                    }),
                    KvRun::Cleared => kv_event::Kind::Cleared(AllCleared {}),
                };
                KvEvent { kind: Some(kind) }
            })
            .collect();
        KvEvents { events }
    }
}

impl KvEvent {
    /// Appends the run's events to `out`; an error, appending nothing, names what is wrong
    /// with it.
    pub fn decode_into(&self, out: &mut EngineKvEvents) -> Result<()> {
        let (stored, tier, page, hashes) = match &self.kind {
            Some(kv_event::Kind::Stored(s)) => (true, s.tier, s.page, &s.hashes),
            Some(kv_event::Kind::Removed(r)) => (false, r.tier, r.page, &r.hashes),
            Some(kv_event::Kind::Cleared(_)) => {
                out.push(EngineKvEvent::Cleared);
                return Ok(());
            }
            None => return Err(anyhow!("KV event without a kind")),
        };
        let (tier, page) = (tier_from_wire(tier)?, BlockHash(page));
        let keys = hashes.iter().map(|&h| PageKey { hash: BlockHash(h), page });
        if stored {
            out.stored_all(tier, keys);
        } else {
            out.removed_all(tier, keys);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_events_survive_the_wire() {
        let events: EngineKvEvents = [
            EngineKvEvent::Stored { tier: EngineTier::L2, hash: BlockHash(5), page: BlockHash(4) },
            EngineKvEvent::Stored { tier: EngineTier::L2, hash: BlockHash(6), page: BlockHash(4) },
            EngineKvEvent::Stored { tier: EngineTier::L1, hash: BlockHash(4), page: BlockHash(4) },
            EngineKvEvent::Removed { tier: EngineTier::L3, hash: BlockHash(9), page: BlockHash(8) },
            EngineKvEvent::Cleared,
        ]
        .into_iter()
        .collect();
        let wire = KvEvents::from(&events);
        assert_eq!(wire.events.len(), 4, "a run a message");
        let mut back = EngineKvEvents::new();
        for e in &wire.events {
            e.decode_into(&mut back).expect("a good run");
        }
        assert_eq!(back, events);
        let bad = KvEvent { kind: Some(kv_event::Kind::Removed(BlockRemoved { tier: 7, page: 1, hashes: vec![1] })) };
        let err = bad.decode_into(&mut back).expect_err("an unknown tier");
        assert!(err.to_string().contains("unknown KV tier 7"), "{err}");
        assert_eq!(back, events, "nothing of a bad run is kept");
    }

    #[test]
    fn finish_reasons_map_to_openais_and_back() {
        assert_eq!(FinishReason::Length.openai(), "length");
        assert_eq!(FinishReason::Stop.openai(), "stop");
        assert_eq!(FinishReason::CutShort.openai(), "length");
        for r in [FinishReason::Length, FinishReason::Stop] {
            assert_eq!(FinishReason::of_openai(r.openai()), r);
        }
        assert_eq!(FinishReason::of_openai("abort"), FinishReason::CutShort);
        // The wire carries the enum: a chunk's reason reads back as sent.
        let chunk = GenerateChunk { finish_reason: FinishReason::CutShort.into(), ..Default::default() };
        assert_eq!(chunk.finish_reason(), FinishReason::CutShort);
    }
}
