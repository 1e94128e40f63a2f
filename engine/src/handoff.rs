//! Prefill/decode disaggregation inside one instance: computing a prompt and handing its KV
//! to another instance, and taking a prompt's KV by transfer to decode it.
//!
//! # Sending side (a prefill instance)
//!
//! 1. [`Instance::enqueue_prefill_only`] queues a request that stops after its first token
//!    (the prefill samples it), scheduled like any other prompt.
//! 2. When that token is out, the sequence *parks*: it leaves the running queue but keeps its
//!    blocks, since the transfer reads them, and [`Instance::take_handoffs`] hands the driver
//!    a [`Handoff`]: the request with its timeline (`resume`: one token generated, first-token
//!    time) and the KV it holds.
//! 3. [`Instance::release_handoff`] frees the blocks once the transfer has ended.
//!
//! # Receiving side (a decode instance)
//!
//! 1. [`Instance::receive_transfer`] reserves blocks for the request's KV at once (the
//!    transfer writes into them; all or nothing, so a full instance says so before the
//!    transfer starts) and parks the sequence.
//! 2. [`Instance::finish_transfer`] moves it to the running queue as a decoding sequence: no
//!    prompt token is computed here. If KV later runs short it may be preempted and
//!    recomputed here like any other sequence.
//!
//! During a transfer the KV is held on both sides; each side's blocks are accounted in its
//! own cache (`Instance::check_invariants` counts parked sequences), so no block leaks.

use crate::instance::{Instance, Rejected};
use crate::request::{Handoff, Request, Resume};
use crate::sequence::{Parked, Seq};
use crate::time::Time;
use crate::{BlockId, RequestId};

impl Instance {
    /// Queues a request that this instance only prefills: once its first token is sampled it
    /// is handed off (see the module doc) instead of decoding here. A request asking for at
    /// most one token simply finishes here.
    pub fn enqueue_prefill_only(&mut self, now: Time, request: Request) -> Result<(), (Rejected, Request)> {
        let id = request.id;
        let s = self.enqueue_slot(now, request)?;
        let seq = self.seq_mut(s);
        debug_assert_eq!(seq.request.id, id);
        let before = seq.declared_left();
        seq.handoff = true;
        let after = seq.declared_left();
        self.decode_tokens_left -= u64::from(before - after);
        Ok(())
    }

    /// Moves the handoffs of prefill-only requests whose prefill ended since the last call
    /// into `out`, in the order their prefills ended.
    pub fn take_handoffs(&mut self, out: &mut Vec<Handoff>) {
        out.append(&mut self.handoffs);
    }

    /// Parks running sequence `s`, whose prefill-only work is done, until its KV is sent.
    pub(crate) fn park_sending(&mut self, now: Time, s: u32) {
        let seq = self.seq_mut(s);
        seq.parked = Some(Parked::Sending);
        let mut request = seq.request.clone();
        request.resume = Some(Box::new(Resume {
            generated: seq.generated,
            admitted_at: seq.admitted_at.unwrap_or(now),
            first_token_at: seq.first_token_at.unwrap_or(now),
            cached_tokens: seq.cached_tokens,
            preemptions: seq.preemptions,
            yields: seq.yields,
            paused_wait: seq.paused_wait,
            evictions: seq.evictions,
        }));
        let kv_tokens = seq.kv_len;
        self.parked.push(s);
        self.handoffs.push(Handoff { request, kv_tokens });
    }

    /// The KV of handed-off request `id` has been sent: frees its blocks here. False when no
    /// such request is parked here.
    pub fn release_handoff(&mut self, now: Time, id: RequestId) -> bool {
        self.unpark(now, id, Parked::Sending)
    }

    /// Reserves blocks for the KV of `request` (handed off by a prefill instance: its
    /// `resume` holds the first token), which will arrive by transfer. Refused, changing
    /// nothing, when the request could never fit, has not been prefilled, or the blocks are
    /// not available now.
    pub fn receive_transfer(&mut self, now: Time, request: Request) -> Result<(), (Rejected, Request)> {
        if let Err(e) = self.admissible(&request) {
            return Err((e, request));
        }
        let generated = request.generated_before();
        if generated == 0 || generated >= request.output_len() {
            return Err((Rejected::NotPrefilled, request));
        }
        // The prompt's KV and that of every generated token but the last (whose KV the next
        // decode step writes).
        let kv_tokens = request.prompt_tokens + generated - 1;
        let needed_blocks = self.kv.blocks_for(kv_tokens);
        let available_blocks = self.kv.available_blocks();
        if needed_blocks > available_blocks {
            return Err((Rejected::NoKvRoom { needed_blocks, available_blocks }, request));
        }
        let mut seq = Seq::new(request, self.paused_clock(now));
        seq.reserve_table(self.config.block_size, self.kv.total_blocks());
        let ok = self.kv.allocate(&mut seq.kv, needed_blocks);
        debug_assert!(ok, "the blocks were counted available");
        seq.prefill_len = kv_tokens;
        seq.kv_len = kv_tokens;
        seq.parked = Some(Parked::Receiving);
        self.decode_tokens_left += u64::from(seq.declared_left());
        let s = crate::slots::place(&mut self.slots, &mut self.free_slots, Some(seq));
        self.parked.push(s);
        self.debug_check_handoff();
        Ok(())
    }

    /// The KV of request `id` has arrived: it joins the running queue and decodes from the
    /// next step. False when no such transfer is being received here.
    pub fn finish_transfer(&mut self, now: Time, id: RequestId) -> bool {
        let Some(pos) = self.parked_position(id, Parked::Receiving) else { return false };
        let s = self.parked.remove(pos);
        let seq = self.seq_mut(s);
        seq.parked = None;
        seq.admitted_at.get_or_insert(now);
        self.running.push(s);
        self.debug_check_handoff();
        true
    }

    /// Gives back the blocks reserved for request `id`'s KV when its transfer failed (the
    /// bytes never arrived, or did not fit this model): the request leaves this instance as if
    /// it had never been received. False when no such transfer is being received here.
    pub fn abort_transfer(&mut self, now: Time, id: RequestId) -> bool {
        self.unpark(now, id, Parked::Receiving)
    }

    /// Drops request `id` parked here `how`, freeing its blocks and its slot.
    fn unpark(&mut self, now: Time, id: RequestId, how: Parked) -> bool {
        let Some(pos) = self.parked_position(id, how) else { return false };
        let s = self.parked.remove(pos);
        let mut seq = self.slots[s as usize].take().expect("parked slot is empty");
        // A sending sequence's one token is out; a receiving one had its output to come.
        self.decode_tokens_left -= u64::from(seq.declared_left());
        self.kv.release(now, &mut seq.kv);
        self.free_slots.push(s);
        self.debug_check_handoff();
        true
    }

    /// The KV blocks of request `id`, parked here for a transfer in either direction, in
    /// sequence order: those its KV is read from (sending), or those reserved for the KV that
    /// arrives (receiving). A real executor copies the KV through them.
    pub fn parked_blocks(&self, id: RequestId) -> Option<&[BlockId]> {
        let &s = self.parked.iter().find(|&&s| self.seq(s).request.id == id)?;
        Some(&self.seq(s).kv.blocks)
    }

    /// Requests parked here for a transfer, in either direction.
    pub fn transfers_in_flight(&self) -> usize {
        self.parked.len()
    }

    fn parked_position(&self, id: RequestId, how: Parked) -> Option<usize> {
        self.parked.iter().position(|&s| {
            let seq = self.seq(s);
            seq.request.id == id && seq.parked == Some(how)
        })
    }

    fn debug_check_handoff(&self) {
        if cfg!(any(test, feature = "invariants")) {
            self.check_invariants();
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::tests::Fixed;
    use crate::*;
    use proptest::prelude::*;

    fn instance(total_blocks: u32) -> Instance {
        Instance::new(InstanceConfig {
            block_size: 4,
            total_blocks,
            max_batch_tokens: 64,
            max_seqs: 16,
            admission_watermark: 0.0,
            ..InstanceConfig::default()
        })
    }

    fn req(id: u64, prompt: u32, output: u32) -> Request {
        crate::tests::req(id, prompt, output, &[])
    }

    /// Steps `inst` until it has nothing to run; returns the time it went idle.
    fn drain(inst: &mut Instance, mut now: Time, done: &mut Vec<Finished>) -> Time {
        let mut evicted = Vec::new();
        for _ in 0..10_000 {
            let Some(d) = inst.begin_step(now, &mut Fixed).expect("fixed executor") else { break };
            now += d;
            inst.end_step(now, done, &mut evicted);
        }
        assert!(evicted.is_empty());
        now
    }

    #[test]
    fn a_prefill_only_request_hands_off_and_decodes_elsewhere_releasing_kv_on_both_sides() {
        let (mut p, mut d) = (instance(64), instance(64));
        p.enqueue_prefill_only(Time::ZERO, req(1, 30, 5)).unwrap();
        assert_eq!(p.load().decode_tokens_left, 1, "a prefill-only request generates one token here");
        let mut done = Vec::new();
        let t = drain(&mut p, Time::ZERO, &mut done);
        assert!(done.is_empty(), "nothing finishes on the prefill instance");
        let mut handoffs = Vec::new();
        p.take_handoffs(&mut handoffs);
        let [h] = &handoffs[..] else { panic!("one handoff expected, got {}", handoffs.len()) };
        assert_eq!(h.kv_tokens, 30);
        let resume = h.request.resume.as_deref().copied().expect("the handoff carries its first token");
        assert_eq!(resume.generated, 1);
        assert_eq!((p.in_flight(), p.kv().used_blocks()), (1, 8), "the prompt's KV stays while it is sent");

        d.receive_transfer(t, h.request.clone()).unwrap();
        assert_eq!(d.kv().used_blocks(), 8, "the receiver reserves the prompt's blocks at once");
        assert!(!d.has_work(), "nothing to run before the KV arrives");
        assert!(p.release_handoff(t, RequestId(1)));
        assert_eq!((p.in_flight(), p.kv().used_blocks()), (0, 0));
        assert!(!p.release_handoff(t, RequestId(1)), "a handoff is released once");
        assert!(d.finish_transfer(t, RequestId(1)));
        let end = drain(&mut d, t, &mut done);
        let [f] = &done[..] else { panic!("one request finishes") };
        assert_eq!(f.output_tokens, 5);
        assert_eq!(f.first_token_at, resume.first_token_at, "TTFT comes from the prefill instance");
        assert_eq!(f.finished_at, end);
        assert_eq!((d.in_flight(), d.kv().used_blocks()), (0, 0));
        assert_eq!(d.load().decode_tokens_left, 0);
    }

    #[test]
    fn a_one_token_request_finishes_on_the_prefill_instance() {
        let mut p = instance(64);
        p.enqueue_prefill_only(Time::ZERO, req(1, 10, 1)).unwrap();
        let mut done = Vec::new();
        drain(&mut p, Time::ZERO, &mut done);
        let mut handoffs = Vec::new();
        p.take_handoffs(&mut handoffs);
        assert!(handoffs.is_empty());
        assert_eq!(done.len(), 1);
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn a_transfer_without_room_is_refused_and_changes_nothing() {
        let mut d = instance(4);
        let mut r = req(1, 30, 5);
        r.resume = Some(Box::new(Resume {
            generated: 1,
            admitted_at: Time::ZERO,
            first_token_at: Time::ZERO,
            cached_tokens: [0; 3],
            preemptions: 0,
            yields: 0,
            paused_wait: Dur::ZERO,
            evictions: 0,
        }));
        // 30 + 5 tokens do not fit 16 at all.
        assert!(matches!(d.receive_transfer(Time::ZERO, r.clone()), Err((Rejected::TooLarge { .. }, _))));
        let mut d = instance(12);
        let mut busy = req(2, 20, 1);
        busy.resume = None;
        d.enqueue(Time::ZERO, busy).unwrap();
        d.begin_step(Time::ZERO, &mut Fixed).unwrap();
        let err = d.receive_transfer(Time::ZERO, r).unwrap_err().0;
        assert_eq!(err, Rejected::NoKvRoom { needed_blocks: 8, available_blocks: 7 });
        assert_eq!(d.transfers_in_flight(), 0);
        assert!(matches!(d.receive_transfer(Time::ZERO, req(3, 8, 4)), Err((Rejected::NotPrefilled, _))));
    }

    #[test]
    fn parked_blocks_name_the_kv_on_both_sides_and_an_aborted_transfer_frees_its_reservation() {
        let (mut p, mut d) = (instance(64), instance(64));
        p.enqueue_prefill_only(Time::ZERO, req(1, 30, 5)).unwrap();
        let mut done = Vec::new();
        let t = drain(&mut p, Time::ZERO, &mut done);
        let mut handoffs = Vec::new();
        p.take_handoffs(&mut handoffs);
        let sent = p.parked_blocks(RequestId(1)).expect("parked for sending").to_vec();
        assert_eq!(sent.len(), 8, "30 tokens of KV in 4-token blocks");
        assert!(p.parked_blocks(RequestId(2)).is_none());
        d.receive_transfer(t, handoffs[0].request.clone()).unwrap();
        assert_eq!(d.parked_blocks(RequestId(1)).map(<[BlockId]>::len), Some(8));
        assert!(!d.abort_transfer(t, RequestId(2)), "nothing to abort for an unknown request");
        assert!(d.abort_transfer(t, RequestId(1)));
        assert_eq!((d.transfers_in_flight(), d.kv().used_blocks(), d.load().decode_tokens_left), (0, 0, 0));
        assert!(!d.finish_transfer(t, RequestId(1)), "an aborted transfer cannot land");
        assert!(!p.abort_transfer(t, RequestId(1)), "a sending side releases, it does not abort");
        // The same request can be received again, e.g. from a new export.
        d.receive_transfer(t, handoffs[0].request.clone()).unwrap();
        assert!(d.finish_transfer(t, RequestId(1)) && p.release_handoff(t, RequestId(1)));
        drain(&mut d, t, &mut done);
        assert_eq!(done.len(), 1);
        assert_eq!(d.kv().used_blocks(), 0);
    }

    #[test]
    fn a_request_placed_again_after_an_eviction_recomputes_and_hands_off_with_its_progress() {
        let mut p = instance(64);
        let mut r = req(1, 20, 10);
        r.resume = Some(Box::new(Resume {
            generated: 3,
            admitted_at: Time::ZERO,
            first_token_at: Time(5),
            cached_tokens: [0; 3],
            preemptions: 0,
            yields: 0,
            paused_wait: Dur::ZERO,
            evictions: 1,
        }));
        p.enqueue_prefill_only(Time(10), r).unwrap();
        assert_eq!(p.load().decode_tokens_left, 1);
        let mut done = Vec::new();
        drain(&mut p, Time(10), &mut done);
        let mut handoffs = Vec::new();
        p.take_handoffs(&mut handoffs);
        let [h] = &handoffs[..] else { panic!("one handoff") };
        // The prompt and the 3 tokens generated before were recomputed; the 4th was sampled.
        assert_eq!(h.kv_tokens, 23);
        let resume = h.request.resume.as_deref().copied().unwrap();
        assert_eq!((resume.generated, resume.first_token_at), (4, Time(5)));
        let mut d = instance(64);
        d.receive_transfer(Time(20), h.request.clone()).unwrap();
        assert_eq!(d.kv().used_blocks(), 6, "23 tokens of KV in 4-token blocks");
        assert!(p.release_handoff(Time(20), RequestId(1)) && d.finish_transfer(Time(20), RequestId(1)));
        drain(&mut d, Time(20), &mut done);
        assert_eq!(done[0].output_tokens, 10);
        assert_eq!(d.kv().used_blocks(), 0);
    }

    proptest! {
        /// Any mix of requests, prefilled on one instance and decoded on another (speculating
        /// or not) with the transfers ending in any order, finishes every request with its
        /// whole output and leaves no block held on either side.
        #[test]
        fn transfers_in_any_order_leak_no_block(
            reqs in prop::collection::vec((1u32..60, 1u32..12), 1..12),
            release_first in prop::collection::vec(any::<bool>(), 12),
            speculation in proptest::option::of((1u32..8, any::<u64>())),
        ) {
            let mut decoder: Box<dyn crate::Executor> = match speculation {
                None => Box::new(Fixed),
                Some((k, seed)) => Box::new(crate::tests::Speculating::new(k, seed)),
            };
            let (mut p, mut d) = (instance(96), instance(128));
            for (i, &(prompt, output)) in reqs.iter().enumerate() {
                p.enqueue_prefill_only(Time::ZERO, req(i as u64, prompt, output)).unwrap();
            }
            let mut done = Vec::new();
            let mut handoffs = Vec::new();
            let mut now = Time::ZERO;
            let mut evicted = Vec::new();
            for _ in 0..10_000 {
                let stepped = match p.begin_step(now, &mut Fixed).unwrap() {
                    Some(dur) => { now += dur; p.end_step(now, &mut done, &mut evicted); true }
                    None => false,
                };
                p.take_handoffs(&mut handoffs);
                for (k, h) in handoffs.drain(..).enumerate() {
                    let id = h.request.id;
                    d.receive_transfer(now, h.request).unwrap();
                    if release_first[k % release_first.len()] {
                        prop_assert!(p.release_handoff(now, id));
                        prop_assert!(d.finish_transfer(now, id));
                    } else {
                        prop_assert!(d.finish_transfer(now, id));
                        prop_assert!(p.release_handoff(now, id));
                    }
                }
                if let Some(dur) = d.begin_step(now, decoder.as_mut()).unwrap() {
                    now += dur;
                    d.end_step(now, &mut done, &mut evicted);
                } else if !stepped {
                    break;
                }
            }
            prop_assert!(evicted.is_empty());
            prop_assert_eq!(done.len(), reqs.len());
            for f in &done {
                prop_assert_eq!(f.output_tokens, f.request.output_len());
            }
            for inst in [&p, &d] {
                inst.check_invariants();
                prop_assert_eq!(inst.in_flight(), 0);
                prop_assert_eq!(inst.kv().used_blocks(), 0);
                prop_assert_eq!(inst.load().decode_tokens_left + inst.load().prefill_tokens_left, 0);
            }
        }
    }
}
