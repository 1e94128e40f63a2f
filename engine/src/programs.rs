//! Program-aware KV: an agent session's context kept in GPU memory while its tool runs.
//!
//! A turn of a session (`Service::session`) that finishes on an instance leaves its prompt's
//! blocks in the prefix tree, unreferenced: under plain LRU the sessions whose turns come
//! next lose them to whatever ran since, and reload them from L2/L3 or recompute them. With
//! [`ProgramHold`] the instance keeps a reference on the finished turn's path instead (a
//! *hold*), priced against the session's pauses:
//!
//! - **hold or let go**: a session is held when its expected pause (the last one seen on this
//!   instance, between a turn's end and the next turn's admission) is at most `max_pause`;
//!   one whose tools take longer is left to LRU (demoted to L2 and L3 when L1 needs room,
//!   reloaded at its next turn). A first pause is unknown and held.
//! - **bounded**: held blocks stay under `share` of the instance's KV; a hold older than
//!   `max_pause` is dropped (the session ended, or its tool is slow).
//! - **pressure**: when a request cannot be admitted or a running one cannot grow, holds are
//!   dropped before anything is preempted or left waiting, the shortest program first (the
//!   fewest held blocks: the cheapest context to bring back), so the long contexts, the
//!   costliest to reload or recompute, are kept longest.
//! - **resume**: the session's next turn matches the held path like any cached prefix; once
//!   it is admitted the hold is dropped (the turn holds the path itself).
//! - **prefetch** (`prefetch`): a session that was not held, or lost its hold, has its
//!   context demoted to L2/L3 under pressure; it is loaded back into L1 (and held) `prefetch`
//!   before its next turn is expected (its last pause after its last turn's end), and as soon
//!   as a turn of it waits here. The transfer runs in the background of the steps (the cost
//!   model adds it to the steps' layer-wise loads, hidden under compute while it fits), at
//!   most a step's token budget per step, only into room beyond the admission watermark, and
//!   a not-yet-arrived session's only while nothing waits: it never takes the room of work
//!   that is here.
//!
//! A session's pause is measured on this instance, from its turn's end to its next turn's
//! arrival; a session is forgotten [`FORGET`] after its last turn ended here.
//!
//! What holds alone keep does not count as used, in load reports and for the KV high-water
//! protection: it is reclaimable on demand, as cached blocks are (counted as used, holds made
//! flow control and routers see full instances and queue work). For the cap and the choice of
//! victim a hold's blocks are its whole path, so a prefix several sessions share (a system
//! prompt) counts in each: the cap errs on the side of holding less.

use crate::ids::BlockHash;
use crate::kv::NodeId;
use crate::service::SessionId;
use crate::time::{Dur, Time};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// How long after its last turn ended here a session's pause is remembered.
pub const FORGET: Dur = Dur(300_000_000);

/// Holding sessions' KV through their tool calls (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProgramHold {
    /// Longest pause held: a session expected to pause longer is not held, and a hold older
    /// than this is dropped.
    pub max_pause: Dur,
    /// Share of the instance's KV blocks holds may take, in (0, 1].
    pub share: f64,
    /// Load a session's context back from L2/L3 this long before its next turn is expected,
    /// and when one waits here; `None`: no prefetch.
    pub prefetch: Option<Dur>,
}

impl Default for ProgramHold {
    fn default() -> Self {
        ProgramHold { max_pause: Dur::from_millis(10_000), share: 0.5, prefetch: None }
    }
}

/// One session's held path.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Hold {
    pub session: SessionId,
    /// The deepest node of the held path.
    pub node: NodeId,
    pub blocks: u32,
    pub since: Time,
}

/// The holds of one instance.
#[derive(Clone, Debug, Default)]
pub(crate) struct Holds {
    list: Vec<Hold>,
    blocks: u32,
}

impl Holds {
    /// Blocks held.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// The deepest node of every held path.
    pub fn nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.list.iter().map(|h| h.node)
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Whether a session that paused `last_pause` the last time (`None`: never seen) is held.
    pub fn worth_holding(config: &ProgramHold, last_pause: Option<Dur>) -> bool {
        last_pause.is_none_or(|p| p <= config.max_pause)
    }

    pub fn add(&mut self, hold: Hold) {
        debug_assert!(self.list.iter().all(|h| h.session != hold.session), "{:?} held twice", hold.session);
        self.blocks += hold.blocks;
        self.list.push(hold);
    }

    /// Takes the hold of `session`, if any.
    pub fn take(&mut self, session: SessionId) -> Option<Hold> {
        let i = self.list.iter().position(|h| h.session == session)?;
        Some(self.remove(i))
    }

    /// Takes the hold of the shortest program (fewest blocks; the oldest among equals) other
    /// than `keep`'s.
    pub fn take_shortest(&mut self, keep: Option<SessionId>) -> Option<Hold> {
        let i = (0..self.list.len())
            .filter(|&i| Some(self.list[i].session) != keep)
            .min_by_key(|&i| (self.list[i].blocks, self.list[i].since))?;
        Some(self.remove(i))
    }

    /// Takes one hold older than `max_pause` at `now`, if any.
    pub fn take_expired(&mut self, now: Time, max_pause: Dur) -> Option<Hold> {
        let i = self.list.iter().position(|h| now.since(h.since) > max_pause)?;
        Some(self.remove(i))
    }

    fn remove(&mut self, i: usize) -> Hold {
        let h = self.list.swap_remove(i);
        self.blocks -= h.blocks;
        h
    }

    pub fn check_invariants(&self) {
        assert_eq!(self.list.iter().map(|h| h.blocks).sum::<u32>(), self.blocks, "held blocks");
        for (i, h) in self.list.iter().enumerate() {
            assert!(self.list[i + 1..].iter().all(|o| o.session != h.session), "{:?} held twice", h.session);
        }
    }
}

/// The sessions whose turns ran on one instance: their pauses, and the prefetches due.
#[derive(Clone, Debug, Default)]
pub(crate) struct Sessions {
    map: HashMap<SessionId, Session>,
    /// (when, session, the end of the turn it is for, prefetch or forget); an entry whose
    /// session has ended another turn since (or has one here) is stale.
    due: BinaryHeap<Reverse<(Time, SessionId, Time, bool)>>,
}

#[derive(Clone, Debug, Default)]
struct Session {
    /// When its last turn here ended; `None` while a turn of it is here.
    ended: Option<Time>,
    /// Its last pause here: from a turn's end to the next turn's arrival.
    pause: Option<Dur>,
    /// The cached prompt blocks of its last turn, while a prefetch of them is due.
    hashes: Vec<BlockHash>,
}

impl Sessions {
    /// A turn of `session` arrived: the pause since its last turn here is measured.
    pub fn arrived(&mut self, now: Time, session: SessionId) {
        if let Some(s) = self.map.get_mut(&session) {
            if let Some(ended) = s.ended.take() {
                s.pause = Some(now.since(ended));
            }
            s.hashes = Vec::new();
        }
    }

    /// A turn of `session` whose cached prompt blocks are `hashes` ended; with `prefetch`
    /// (and a pause seen), they are due back `prefetch` before its next turn is expected.
    pub fn ended(&mut self, now: Time, session: SessionId, hashes: &[BlockHash], prefetch: Option<Dur>) {
        if prefetch.is_none() {
            // Nobody takes prefetches: forget here what is due.
            while self.take_due(now).is_some() {}
        }
        let s = self.map.entry(session).or_default();
        s.ended = Some(now);
        if let (Some(lead), Some(pause)) = (prefetch, s.pause) {
            s.hashes.clear();
            s.hashes.extend_from_slice(hashes);
            let at = if pause > lead { now + (pause - lead) } else { now };
            self.due.push(Reverse((at, session, now, true)));
        }
        self.due.push(Reverse((now + FORGET, session, now, false)));
    }

    /// Its last pause here, if one was seen.
    pub fn pause(&self, session: SessionId) -> Option<Dur> {
        self.map.get(&session).and_then(|s| s.pause)
    }

    /// Takes the next session whose prefetch is due by `now`, with its blocks (forgetting
    /// the sessions whose time has come on the way).
    pub fn take_due(&mut self, now: Time) -> Option<(SessionId, Vec<BlockHash>)> {
        while let Some(&Reverse((at, session, ended, prefetch))) = self.due.peek() {
            if at > now {
                return None;
            }
            self.due.pop();
            let Some(s) = self.map.get_mut(&session).filter(|s| s.ended == Some(ended)) else { continue };
            if !prefetch {
                self.map.remove(&session);
            } else if !s.hashes.is_empty() {
                return Some((session, std::mem::take(&mut s.hashes)));
            }
        }
        None
    }

    /// Gives back a prefetch cut short (by the step's transfer budget), due again at `now`.
    pub fn again(&mut self, now: Time, session: SessionId, hashes: Vec<BlockHash>) {
        if let Some(s) = self.map.get_mut(&session) {
            if let Some(ended) = s.ended {
                s.hashes = hashes;
                self.due.push(Reverse((now, session, ended, true)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hold(session: u64, blocks: u32, since_s: u64) -> Hold {
        Hold {
            session: SessionId::new(session).expect("nonzero"),
            node: NodeId::ROOT,
            blocks,
            since: Time::from_millis(since_s * 1000),
        }
    }

    #[test]
    fn the_shortest_program_goes_first_and_expired_holds_are_found() {
        let mut holds = Holds::default();
        holds.add(hold(1, 30, 0));
        holds.add(hold(2, 10, 5));
        holds.add(hold(3, 10, 3));
        assert_eq!(holds.blocks(), 50);
        assert_eq!(holds.take_shortest(None).map(|h| h.session.0.get()), Some(3), "fewest blocks, oldest of equals");
        assert_eq!(holds.take_expired(Time::from_millis(12_000), Dur::from_millis(10_000)).map(|h| h.blocks), Some(30));
        assert!(holds.take_expired(Time::from_millis(12_000), Dur::from_millis(10_000)).is_none());
        assert_eq!(holds.take(SessionId::new(2).expect("nonzero")).map(|h| h.blocks), Some(10));
        assert!(holds.is_empty() && holds.blocks() == 0);
        holds.check_invariants();
    }

    #[test]
    fn sessions_with_long_pauses_are_not_held() {
        let config = ProgramHold { max_pause: Dur::from_millis(5000), ..ProgramHold::default() };
        assert!(Holds::worth_holding(&config, None));
        assert!(Holds::worth_holding(&config, Some(Dur::from_millis(5000))));
        assert!(!Holds::worth_holding(&config, Some(Dur::from_millis(6000))));
    }

    #[test]
    fn sessions_are_forgotten_after_their_last_turn_and_prefetches_fall_due_before_the_next() {
        let (one, two) = (SessionId::new(1).expect("nonzero"), SessionId::new(2).expect("nonzero"));
        let at = |s: u64| Time::from_millis(s * 1000);
        let mut sessions = Sessions::default();
        let lead = Some(Dur::from_millis(1000));
        sessions.ended(at(0), one, &[BlockHash(7)], lead);
        assert!(sessions.take_due(at(100)).is_none(), "no pause seen yet: nothing to predict");
        sessions.arrived(at(4), one);
        assert_eq!(sessions.pause(one), Some(Dur::from_millis(4000)));
        sessions.ended(at(10), one, &[BlockHash(7), BlockHash(8)], lead);
        assert!(sessions.take_due(at(12)).is_none());
        assert_eq!(sessions.take_due(at(13)).map(|(s, h)| (s, h.len())), Some((one, 2)), "due 1 s before 14 s");
        // Without prefetch, entries are forgotten FORGET after the turn's end.
        sessions.ended(at(20), two, &[], None);
        sessions.ended(at(20) + FORGET, two, &[], None);
        assert_eq!(sessions.pause(one), None, "session 1 forgotten");
        assert_eq!(sessions.map.len(), 1);
    }
}
