//! Programs in progress, for admission at program boundaries: an agent session's turns are
//! one program, and a program's context is reused turn after turn only while the fleet's KV
//! holds it. Starting more programs than the KV holds makes every one recompute its context
//! each turn (thrashing), so a rule may admit a *new* program only while the contexts of
//! those in progress fit in a share of the fleet's GPU KV; a program's later turns always
//! pass. A program is in progress from its first turn placed until no turn of it was placed
//! for `idle` (the controller is not told when a session ends).
//!
//! **Packing** (`packing`): programs grow turn by turn, so those in progress can outgrow the
//! share. Then, at a request boundary (a later turn of a program arriving without room),
//! the shortest programs in progress (the smallest contexts, the cheapest to bring back) are
//! **paused**, shortest first, to make room for it, or, when it is itself the shortest, it
//! pauses: a paused program no longer counts, its engines' LRU demotes its context, and its
//! next turn waits as a new program's would (ahead of new ones in its band). Room is then
//! filled **best-fit-decreasing**: when no program's turn at the head of its tenant's queue
//! fits, the waiting program turn with the largest context that fits the room left goes
//! (for the one budget of the fleet, the best fit), unless a head has waited longer than
//! `idle` (no program starves behind smaller ones).

use engine::{Dur, Request, SessionId, Time};
use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

/// What admission by program does beyond holding new programs back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// Waiting programs start in their queues' order; later turns always pass.
    Off,
    /// When the program at the head does not fit, the one that best fits the room left goes.
    BestFit,
    /// Also: programs that outgrow the share pause, shortest first.
    PauseAndBestFit,
}

impl Packing {
    /// From `program_packing`: 0, 1 or 2.
    pub fn of(n: u32) -> Packing {
        match n {
            0 => Packing::Off,
            1 => Packing::BestFit,
            _ => Packing::PauseAndBestFit,
        }
    }
}

#[derive(Debug)]
pub struct Programs {
    /// Share of the candidates' GPU KV the contexts in progress may fill.
    share: f64,
    idle: Dur,
    packing: Packing,
    /// Session → (its context's tokens, when its last turn was placed).
    active: HashMap<SessionId, (u64, Time)>,
    /// The programs in progress by context, smallest first.
    by_size: BTreeSet<(u64, SessionId)>,
    /// Programs paused so far.
    paused: u64,
    /// (time it goes idle, session); stale entries are skipped.
    expiry: BinaryHeap<Reverse<(Time, SessionId)>>,
    /// Tokens of the contexts in progress.
    footprint: u64,
}

impl Programs {
    pub fn new(share: f64, idle: Dur, packing: Packing) -> Programs {
        Programs {
            share,
            idle,
            packing,
            active: HashMap::new(),
            by_size: BTreeSet::new(),
            paused: 0,
            expiry: BinaryHeap::new(),
            footprint: 0,
        }
    }

    /// Whether waiting programs start best-fit-decreasing.
    pub fn packing(&self) -> bool {
        self.packing != Packing::Off
    }

    /// Whether programs that outgrow the share pause, shortest first.
    fn pausing(&self) -> bool {
        self.packing == Packing::PauseAndBestFit
    }

    pub fn idle(&self) -> Dur {
        self.idle
    }

    /// Whether `request` is a later turn of a program in progress.
    pub fn continues(&self, request: &Request) -> bool {
        request.service.session.is_some_and(|s| self.active.contains_key(&s))
    }

    /// Whether `request` may start now on candidates of `kv_tokens` of GPU KV: it is no
    /// program's first turn, or the contexts in progress and its own fit in the share (or
    /// none is in progress: one program always runs). With packing, a later turn whose
    /// program outgrew the share passes only if pausing shorter programs makes room.
    pub fn admits(&self, request: &Request, kv_tokens: u64) -> bool {
        let Some(session) = request.service.session else { return true };
        let budget = self.share * kv_tokens as f64;
        let tokens = context(request);
        match self.active.get(&session) {
            Some(_) if !self.pausing() => true,
            Some(&(old, _)) => {
                let shorter: u64 = self.shorter_than(session, tokens).map(|(t, _)| t).sum();
                (self.footprint - old + tokens - shorter) as f64 <= budget
            }
            None => self.footprint == 0 || (self.footprint + tokens) as f64 <= budget,
        }
    }

    /// The programs in progress other than `session` with contexts under `tokens`, shortest
    /// first.
    fn shorter_than(&self, session: SessionId, tokens: u64) -> impl Iterator<Item = (u64, SessionId)> + '_ {
        self.by_size.iter().copied().take_while(move |&(t, _)| t < tokens).filter(move |&(_, s)| s != session)
    }

    /// `request` was placed on candidates of `kv_tokens` of GPU KV: its program is in
    /// progress, with its context; with packing, the shortest others are paused while the
    /// programs in progress pass the share.
    pub fn placed(&mut self, now: Time, request: &Request, kv_tokens: u64) {
        let Some(session) = request.service.session else { return };
        let tokens = context(request);
        if let Some((old, _)) = self.active.insert(session, (tokens, now)) {
            self.by_size.remove(&(old, session));
            self.footprint -= old;
        }
        self.by_size.insert((tokens, session));
        self.footprint += tokens;
        self.expiry.push(Reverse((now + self.idle, session)));
        let budget = self.share * kv_tokens as f64;
        while self.pausing() && self.footprint as f64 > budget {
            let Some((_, shortest)) = self.shorter_than(session, tokens).next() else { break };
            self.pause(shortest);
        }
    }

    /// `session`'s program stops counting as in progress (its next turn waits as a new
    /// program's would).
    pub fn pause(&mut self, session: SessionId) {
        if let Some((tokens, _)) = self.active.remove(&session) {
            self.by_size.remove(&(tokens, session));
            self.footprint -= tokens;
            self.paused += 1;
        }
    }

    /// Programs paused so far.
    pub fn paused(&self) -> u64 {
        self.paused
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
                    self.by_size.remove(&(tokens, session));
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
pub(crate) fn context(request: &Request) -> u64 {
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
            ends_after: None,
            block_hashes: Vec::new(),
            resume: None,
            service: Service { session: SessionId::new(session), ..Service::default() },
            model: Default::default(),
        }
    }

    #[test]
    fn new_programs_wait_while_those_in_progress_fill_the_budget_and_later_turns_never_do() {
        // Half of 2,000 tokens of KV for programs.
        let mut p = Programs::new(0.5, Dur::from_secs_f64(10.0), Packing::Off);
        assert!(p.admits(&turn(1, 900), 200), "one program always runs");
        p.placed(Time::ZERO, &turn(1, 900), 2000);
        assert!(!p.admits(&turn(2, 200), 2000), "900 + 200 > 1000");
        assert!(p.admits(&turn(2, 100), 2000));
        assert!(p.admits(&turn(1, 5000), 2000), "a later turn passes");
        p.placed(Time::from_millis(5000), &turn(1, 950), 2000);
        assert_eq!(p.footprint(), 950, "a program counts its latest context");
        // Idle from 15 s (its latest turn at 5 s), not from 10 s.
        p.expire(Time::from_millis(12_000));
        assert_eq!(p.in_progress(), 1);
        p.expire(Time::from_millis(15_000));
        assert_eq!((p.in_progress(), p.footprint()), (0, 0));
        assert!(p.admits(&turn(2, 200), 2000));
    }

    #[test]
    fn with_packing_a_grown_program_pauses_the_shorter_ones_or_itself() {
        // 1,000 tokens of KV for programs.
        let mut p = Programs::new(0.5, Dur::from_secs_f64(10.0), Packing::PauseAndBestFit);
        for (session, tokens) in [(1, 300), (2, 200), (3, 400)] {
            assert!(p.admits(&turn(session, tokens), 2000));
            p.placed(Time::ZERO, &turn(session, tokens), 2000);
        }
        assert_eq!(p.footprint(), 900);
        // Session 3 grows to 600: pausing session 2 (200) leaves 900.
        assert!(p.admits(&turn(3, 600), 2000));
        p.placed(Time::ZERO, &turn(3, 600), 2000);
        assert_eq!((p.in_progress(), p.footprint(), p.paused()), (2, 900, 1));
        assert!(!p.continues(&turn(2, 250)), "session 2's next turn waits as a new program's");
        // Session 1 grows to 450 (none shorter in progress): it cannot make room, it waits.
        assert!(!p.admits(&turn(1, 450), 2000));
        p.pause(SessionId::new(1).expect("nonzero"));
        assert_eq!((p.in_progress(), p.footprint()), (1, 600));
        assert!(p.admits(&turn(1, 400), 2000), "it resumes once it fits");
    }
}
