//! Programs in progress, for admission at program boundaries: an agent session's turns are
//! one program, and a program's context is reused turn after turn only while the fleet's KV
//! holds it. Starting more programs than the KV holds makes every one recompute its context
//! each turn (thrashing), so a rule may admit a *new* program only while the contexts of
//! those in progress fit in a share of the fleet's GPU KV; a program's later turns always
//! pass. A program is in progress from its first turn placed until no turn of it was placed
//! for `idle` (the controller is not told when a session ends).

use engine::{Dur, Request, SessionId, Time};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

#[derive(Debug)]
pub struct Programs {
    /// Share of the candidates' GPU KV the contexts in progress may fill.
    share: f64,
    idle: Dur,
    /// Session → (its context's tokens, when its last turn was placed).
    active: HashMap<SessionId, (u64, Time)>,
    /// (time it goes idle, session); stale entries are skipped.
    expiry: BinaryHeap<Reverse<(Time, SessionId)>>,
    /// Tokens of the contexts in progress.
    footprint: u64,
}

impl Programs {
    pub fn new(share: f64, idle: Dur) -> Programs {
        Programs { share, idle, active: HashMap::new(), expiry: BinaryHeap::new(), footprint: 0 }
    }

    /// Whether `request` is a later turn of a program in progress.
    pub fn continues(&self, request: &Request) -> bool {
        request.service.session.is_some_and(|s| self.active.contains_key(&s))
    }

    /// Whether `request` may start now on candidates of `kv_tokens` of GPU KV: it is no
    /// program's first turn, or the contexts in progress and its own fit in the share (or
    /// none is in progress: one program always runs).
    pub fn admits(&self, request: &Request, kv_tokens: u64) -> bool {
        request.service.session.is_none()
            || self.continues(request)
            || self.footprint == 0
            || (self.footprint + context(request)) as f64 <= self.share * kv_tokens as f64
    }

    /// `request` was placed: its program is in progress, with its context.
    pub fn placed(&mut self, now: Time, request: &Request) {
        let Some(session) = request.service.session else { return };
        let tokens = context(request);
        let old = self.active.insert(session, (tokens, now)).map_or(0, |(t, _)| t);
        self.footprint = self.footprint - old + tokens;
        self.expiry.push(Reverse((now + self.idle, session)));
    }

    /// Programs with no turn placed for `idle` are over.
    pub fn expire(&mut self, now: Time) {
        while let Some(&Reverse((t, session))) = self.expiry.peek() {
            if t > now {
                break;
            }
            self.expiry.pop();
            // Only the entry of its latest turn ends it.
            if let Some(&(tokens, last)) = self.active.get(&session) {
                if last + self.idle <= now {
                    self.active.remove(&session);
                    self.footprint -= tokens;
                }
            }
        }
    }

    /// When the next program may go idle, if any is in progress.
    pub fn next_expiry(&self) -> Option<Time> {
        self.expiry.peek().map(|Reverse((t, _))| *t)
    }

    pub fn in_progress(&self) -> usize {
        self.active.len()
    }

    pub fn footprint(&self) -> u64 {
        self.footprint
    }
}

/// The KV a turn's program holds: its prompt and its output.
fn context(request: &Request) -> u64 {
    u64::from(request.prompt_tokens) + u64::from(request.max_output_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::{RequestId, Service};

    fn turn(session: u64, tokens: u32) -> Request {
        Request {
            id: RequestId(session),
            arrival: Time::ZERO,
            prompt_tokens: tokens,
            max_output_tokens: 0,
            block_hashes: Vec::new(),
            resume: None,
            service: Service { session: SessionId::new(session), ..Service::default() },
            model: Default::default(),
        }
    }

    #[test]
    fn new_programs_wait_while_those_in_progress_fill_the_budget_and_later_turns_never_do() {
        // Half of 2,000 tokens of KV for programs.
        let mut p = Programs::new(0.5, Dur::from_secs_f64(10.0));
        assert!(p.admits(&turn(1, 900), 200), "one program always runs");
        p.placed(Time::ZERO, &turn(1, 900));
        assert!(!p.admits(&turn(2, 200), 2000), "900 + 200 > 1000");
        assert!(p.admits(&turn(2, 100), 2000));
        assert!(p.admits(&turn(1, 5000), 2000), "a later turn passes");
        p.placed(Time::from_millis(5000), &turn(1, 950));
        assert_eq!(p.footprint(), 950, "a program counts its latest context");
        // Idle from 15 s (its latest turn at 5 s), not from 10 s.
        p.expire(Time::from_millis(12_000));
        assert_eq!(p.in_progress(), 1);
        p.expire(Time::from_millis(15_000));
        assert_eq!((p.in_progress(), p.footprint()), (0, 0));
        assert!(p.admits(&turn(2, 200), 2000));
    }
}
