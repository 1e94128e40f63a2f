//! Closed-loop agentic sessions: programs of turns separated by tool calls.
//!
//! A session (one agent's program) starts at an arrival drawn from `arrival`; its first turn's
//! prompt is an optional shared system prompt and the task. Each turn's answer is followed by
//! a tool call lasting `tool_ms`, whose result (`tool_output` tokens) is appended; the next
//! turn's prompt is the whole context so far. A turn is sent only when the previous answer
//! *and* its tool call are done, so the load reacts to latency, as agent traffic does: the
//! simulator tells the workload when a turn ended ([`Workload::ended`]).
//!
//! ```toml
//! [workload.agentic]
//! sessions = 2000
//! arrival = { kind = "poisson", rate_rps = 2.0 }              # session starts
//! turns = { kind = "uniform", min = 2, max = 12 }
//! task = { kind = "lognormal", median = 1500, sigma = 0.6, min = 64, max = 16384 }
//! output = { kind = "lognormal", median = 250, sigma = 0.8, min = 8, max = 4096 }
//! tool_output = { kind = "lognormal", median = 800, sigma = 1.0, min = 16, max = 16384 }
//! tool_ms = { kind = "lognormal", median = 2000, sigma = 1.0, min = 50, max = 60000 }
//! system = { groups = 8, tokens = 4096, share = 1.0 }          # optional
//! max_context_tokens = 65536                                   # a session ends there
//! ```
//!
//! Block hashes follow the context: block `i` of a session is the same block in every turn,
//! so a turn's prompt shares its predecessor's prompt as a prefix (the previous answer's
//! tokens are prompt tokens of the next turn, as an engine's cache of prompts sees them).
//! A session whose turn is refused or shed ends there, failed.

use super::synthetic::{invalid, Gaps, Lengths};
use super::{Arrival, ArrivalProcess, LengthDist, PrefixGroups, Workload, WorkloadError, WorkloadOptions};
use engine::ids::mix64;
use engine::{BlockHash, Dur, Service, SessionId, Time};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgenticConfig {
    /// Sessions to start.
    pub sessions: u64,
    /// When sessions start, at the base rate (before `rate_scale`).
    pub arrival: ArrivalProcess,
    /// Turns per session (at least 1).
    pub turns: LengthDist,
    /// The task: the first turn's own prompt tokens.
    pub task: LengthDist,
    /// Tokens each answer generates.
    pub output: LengthDist,
    /// Tokens each tool call's result appends to the context.
    pub tool_output: LengthDist,
    /// How long each tool call takes, in milliseconds (not scaled by `rate_scale`).
    pub tool_ms: LengthDist,
    /// Shared system prompts: `share` of the sessions start with one of `groups`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<PrefixGroups>,
    /// A session ends (completed) before a turn whose prompt would pass this [default: 131072].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_context_tokens: Option<u32>,
}

const DEFAULT_MAX_CONTEXT: u32 = 131_072;

impl AgenticConfig {
    /// Checks every field; the error names the first bad key, like `agentic.turns.min`.
    pub fn validate(&self) -> Result<(), WorkloadError> {
        if self.sessions == 0 {
            return Err(invalid("agentic.sessions", "must be at least 1".into()));
        }
        self.arrival.validate("agentic.arrival")?;
        self.turns.validate("agentic.turns", 1)?;
        self.task.validate("agentic.task", 1)?;
        self.output.validate("agentic.output", 1)?;
        self.tool_output.validate("agentic.tool_output", 0)?;
        self.tool_ms.validate("agentic.tool_ms", 0)?;
        if let Some(p) = &self.system {
            if p.groups == 0 || p.tokens == 0 {
                return Err(invalid("agentic.system", "needs at least 1 group of at least 1 token".into()));
            }
            if !(0.0..=1.0).contains(&p.share) {
                return Err(invalid("agentic.system.share", format!("must be in [0, 1] (got {})", p.share)));
            }
        }
        if self.max_context_tokens == Some(0) {
            return Err(invalid("agentic.max_context_tokens", "must be at least 1".into()));
        }
        Ok(())
    }
}

/// How the sessions of a run went, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionStats {
    pub started: u64,
    /// Every turn finished.
    pub completed: u64,
    /// Completed with every turn within its class's SLO.
    pub completed_within_slo: u64,
    /// Ended by a turn refused or shed.
    pub failed: u64,
    pub turns: u64,
    /// Seconds from a completed session's first arrival to its last answer, summed.
    pub completed_seconds: f64,
}

/// One turn's end, as the simulator tells it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TurnEnd {
    pub session: SessionId,
    pub at: Time,
    /// Finished (not refused or shed).
    pub finished: bool,
    /// Finished within its class's SLO.
    pub within_slo: bool,
}

struct Session {
    key: u64,
    group: Option<u32>,
    started: Time,
    turns_left: u32,
    /// Tokens of context the next turn's prompt holds before its tool result.
    context: u32,
    /// The answer the turn in flight generates.
    output: u32,
    all_within_slo: bool,
}

struct Agentic {
    to_start: u64,
    next_start_s: f64,
    gaps: Gaps,
    turns: Lengths,
    task: Lengths,
    output: Lengths,
    tool_output: Lengths,
    tool_ms: Lengths,
    system: Option<PrefixGroups>,
    max_context: u32,
    sessions: HashMap<u64, Session>,
    /// Next turns due: (time, order, session key).
    due: BinaryHeap<Reverse<(Time, u64, u64)>>,
    order: u64,
    /// Arrivals handed out and given back, not yet handed out again.
    returned: Vec<Arrival>,
    arrival_rng: ChaCha8Rng,
    session_rng: ChaCha8Rng,
    salt: u64,
    block_size: u32,
    rate_scale: f64,
    stats: SessionStats,
}

/// Tags separating the sub-seeds (ASCII of their role).
const ARRIVAL_TAG: u64 = 0x6167_6e5f_6172_7276;
const SESSION_TAG: u64 = 0x6167_6e5f_7365_7373;
const HASH_TAG: u64 = 0x6167_6e5f_6861_7368;
const GROUP_TAG: u64 = 0x6167_6e5f_6772_7570;
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// Builds the generator after validating `cfg` and `opts`.
pub fn agentic(cfg: &AgenticConfig, opts: &WorkloadOptions) -> Result<Box<dyn Workload>, WorkloadError> {
    opts.validate()?;
    cfg.validate()?;
    let mut w = Agentic {
        to_start: cfg.sessions,
        next_start_s: 0.0,
        gaps: Gaps::new(&cfg.arrival, "agentic.arrival")?,
        turns: Lengths::new(&cfg.turns, "agentic.turns")?,
        task: Lengths::new(&cfg.task, "agentic.task")?,
        output: Lengths::new(&cfg.output, "agentic.output")?,
        tool_output: Lengths::new(&cfg.tool_output, "agentic.tool_output")?,
        tool_ms: Lengths::new(&cfg.tool_ms, "agentic.tool_ms")?,
        system: cfg.system,
        max_context: cfg.max_context_tokens.unwrap_or(DEFAULT_MAX_CONTEXT),
        sessions: HashMap::new(),
        due: BinaryHeap::new(),
        order: 0,
        returned: Vec::new(),
        arrival_rng: ChaCha8Rng::seed_from_u64(mix64(opts.seed ^ ARRIVAL_TAG)),
        session_rng: ChaCha8Rng::seed_from_u64(mix64(opts.seed ^ SESSION_TAG)),
        salt: mix64(opts.seed ^ HASH_TAG),
        block_size: opts.block_size,
        rate_scale: opts.rate_scale,
        stats: SessionStats::default(),
    };
    w.next_start_s = w.gaps.sample(&mut w.arrival_rng);
    Ok(Box::new(w))
}

impl Agentic {
    fn start_at(&self) -> Option<Time> {
        // `as` saturates: an unbounded time becomes the last representable one.
        (self.to_start > 0).then(|| Time((self.next_start_s * 1e6 / self.rate_scale).round() as u64))
    }

    /// A new session, its first turn due now.
    fn start(&mut self, at: Time) -> u64 {
        let key = self.stats.started + 1;
        self.to_start -= 1;
        self.next_start_s += self.gaps.sample(&mut self.arrival_rng);
        let rng = &mut self.session_rng;
        let turns = self.turns.sample(rng).max(1);
        let group = match self.system {
            Some(p) if rng.random::<f64>() < p.share => Some(rng.random_range(0..p.groups)),
            _ => None,
        };
        let system_tokens = group.and(self.system).map_or(0, |p| p.tokens);
        let context = system_tokens.saturating_add(self.task.sample(rng));
        self.sessions.insert(
            key,
            Session { key, group, started: at, turns_left: turns, context, output: 0, all_within_slo: true },
        );
        self.stats.started += 1;
        key
    }

    /// The turn of `key` due at `at`, its hashes in `buf`.
    fn turn(&mut self, key: u64, at: Time, mut buf: Vec<BlockHash>) -> Arrival {
        let output = self.output.sample(&mut self.session_rng);
        let s = self.sessions.get_mut(&key).expect("a due session is live");
        s.output = output;
        let prompt_tokens = s.context;
        let system_blocks = s.group.and(self.system).map_or(0, |p| p.tokens / self.block_size);
        let blocks = prompt_tokens / self.block_size;
        buf.clear();
        buf.reserve(blocks as usize);
        let group_base = s.group.map(|g| mix64(self.salt ^ GROUP_TAG ^ u64::from(g).wrapping_mul(GOLDEN)));
        let own_base = mix64(self.salt ^ s.key.wrapping_mul(GOLDEN));
        let mut hash = BlockHash::ROOT;
        for j in 0..blocks {
            let base = match group_base {
                Some(g) if j < system_blocks => g,
                _ => own_base,
            };
            hash = hash.chain(mix64(base.wrapping_add(u64::from(j))));
            buf.push(hash);
        }
        self.stats.turns += 1;
        let service = Service { session: SessionId::new(key), ..Service::default() };
        Arrival { at, prompt_tokens, output_tokens: output, block_hashes: buf, service }
    }
}

impl Workload for Agentic {
    fn next_arrival(&mut self, buf: Vec<BlockHash>) -> Result<Option<Arrival>, WorkloadError> {
        let turn_at = self.due.peek().map(|Reverse((t, ..))| *t);
        let start_at = self.start_at();
        let own = [turn_at, start_at].into_iter().flatten().min();
        // An arrival given back goes first when nothing of ours is earlier (ties: it was first).
        let back = self.returned.iter().enumerate().min_by_key(|(_, a)| a.at).map(|(i, a)| (i, a.at));
        if let Some((i, at)) = back.filter(|&(_, at)| own.is_none_or(|t| at <= t)) {
            debug_assert!(own.is_none_or(|t| at <= t));
            return Ok(Some(self.returned.swap_remove(i)));
        }
        let turn_first = turn_at.is_some_and(|t| start_at.is_none_or(|s| t <= s));
        if turn_first {
            if let Some(Reverse((at, _, key))) = self.due.pop() {
                return Ok(Some(self.turn(key, at, buf)));
            }
        }
        Ok(start_at.map(|s| {
            let key = self.start(s);
            self.turn(key, s, buf)
        }))
    }

    fn closed_loop(&self) -> bool {
        true
    }

    fn put_back(&mut self, a: Arrival) {
        self.returned.push(a);
    }

    fn ended(&mut self, end: TurnEnd) {
        let key = end.session.0.get();
        let Some(s) = self.sessions.get_mut(&key) else { return };
        s.all_within_slo &= end.within_slo;
        if !end.finished {
            self.stats.failed += 1;
            self.sessions.remove(&key);
            return;
        }
        s.turns_left -= 1;
        let tool_output = self.tool_output.sample(&mut self.session_rng);
        let pause = Dur::from_millis(u64::from(self.tool_ms.sample(&mut self.session_rng)));
        let context = s.context.saturating_add(s.output).saturating_add(tool_output);
        if s.turns_left == 0 || context > self.max_context {
            self.stats.completed += 1;
            self.stats.completed_within_slo += u64::from(s.all_within_slo);
            self.stats.completed_seconds += end.at.since(s.started).as_secs_f64();
            self.sessions.remove(&key);
            return;
        }
        s.context = context;
        self.order += 1;
        self.due.push(Reverse((end.at + pause, self.order, key)));
    }

    fn sessions(&self) -> Option<SessionStats> {
        Some(self.stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> AgenticConfig {
        AgenticConfig {
            sessions: 3,
            arrival: ArrivalProcess::Poisson { rate_rps: 1.0 },
            turns: LengthDist::Constant { tokens: 3 },
            task: LengthDist::Uniform { min: 100, max: 300 },
            output: LengthDist::Uniform { min: 10, max: 50 },
            tool_output: LengthDist::Uniform { min: 20, max: 80 },
            tool_ms: LengthDist::Constant { tokens: 500 },
            system: Some(PrefixGroups { groups: 1, tokens: 64, share: 1.0 }),
            max_context_tokens: None,
        }
    }

    fn open(cfg: &AgenticConfig) -> Box<dyn Workload> {
        agentic(cfg, &WorkloadOptions { block_size: 16, rate_scale: 1.0, seed: 5 }).expect("valid")
    }

    fn done(a: &Arrival, after_ms: u64) -> TurnEnd {
        let session = a.service.session.expect("a turn has its session");
        TurnEnd { session, at: a.at + Dur::from_millis(after_ms), finished: true, within_slo: true }
    }

    #[test]
    fn a_turn_comes_after_the_previous_answer_and_tool_call_and_extends_its_prompt() {
        let mut w = open(&config());
        let first = w.next_arrival(Vec::new()).expect("ok").expect("a first session");
        assert_eq!(first.block_hashes.len() as u32, first.prompt_tokens / 16);
        let second_session = w.next_arrival(Vec::new()).expect("ok").expect("a second session");
        assert_ne!(first.service.session, second_session.service.session);
        assert_eq!(first.block_hashes[..4], second_session.block_hashes[..4], "the system prompt is shared");
        assert_ne!(first.block_hashes[4..5], second_session.block_hashes[4..5], "the tasks are not");
        // The first session's answer comes 100 ms after it arrived: its next turn is due
        // 500 ms later, before the held arrival, which is given back.
        w.ended(done(&first, 100));
        w.put_back(second_session.clone());
        let mut next = Vec::new();
        while let Some(a) = w.next_arrival(Vec::new()).expect("ok") {
            next.push(a);
            if next.len() == 2 {
                break;
            }
        }
        let (a, b) = (&next[0], &next[1]);
        let turn = if a.service.session == first.service.session { a } else { b };
        let other = if a.service.session == first.service.session { b } else { a };
        assert!(a.at <= b.at, "in time order");
        assert_eq!(turn.at, first.at + Dur::from_millis(600));
        assert_eq!(other, &second_session, "the arrival given back comes out unchanged");
        assert!(turn.prompt_tokens >= first.prompt_tokens + 10 + 20);
        assert_eq!(turn.block_hashes[..first.block_hashes.len()], first.block_hashes[..], "a prefix of the context");
    }

    #[test]
    fn sessions_end_after_their_turns_or_a_failed_turn_and_are_counted() {
        let mut w = open(&config());
        let mut open_turns = Vec::new();
        let mut turns = 0;
        let mut seen = HashMap::new();
        loop {
            match w.next_arrival(Vec::new()).expect("ok") {
                Some(a) => {
                    turns += 1;
                    open_turns.push(a);
                }
                None if open_turns.is_empty() => break,
                None => {}
            }
            // The first session's second turn is refused; every other turn finishes.
            if let Some(a) = open_turns.pop() {
                let session = a.service.session.expect("a turn has its session");
                *seen.entry(session).or_insert(0) += 1;
                let failed = session == SessionId::new(1).expect("1 is not 0") && seen[&session] == 2;
                let end = TurnEnd { finished: !failed, ..done(&a, 50) };
                w.ended(end);
            }
        }
        let s = w.sessions().expect("stats");
        assert_eq!((s.started, s.completed, s.failed), (3, 2, 1), "{s:?}");
        assert_eq!(s.turns, turns);
        assert_eq!(s.completed_within_slo, 2);
    }

    #[test]
    fn a_session_ends_before_a_turn_past_the_longest_context() {
        // Contexts of 64 + 150 tokens, then 50 more a turn: 214, 264, 314.
        let turns_sent = |max: u32| {
            let cfg = AgenticConfig {
                sessions: 1,
                task: LengthDist::Constant { tokens: 150 },
                output: LengthDist::Constant { tokens: 20 },
                tool_output: LengthDist::Constant { tokens: 30 },
                max_context_tokens: Some(max),
                ..config()
            };
            let mut w = open(&cfg);
            let mut prompts = Vec::new();
            while let Some(a) = w.next_arrival(Vec::new()).expect("ok") {
                prompts.push(a.prompt_tokens);
                w.ended(done(&a, 10));
            }
            assert_eq!(w.sessions().map(|s| s.completed), Some(1));
            prompts
        };
        assert_eq!(turns_sent(250), [214]);
        assert_eq!(turns_sent(300), [214, 264]);
        assert_eq!(turns_sent(10_000), [214, 264, 314]);
    }

    #[test]
    fn bad_configs_name_the_key() {
        let e = |cfg: AgenticConfig| agentic(&cfg, &WorkloadOptions::default()).err().expect("refused").to_string();
        assert!(e(AgenticConfig { sessions: 0, ..config() }).contains("agentic.sessions"));
        let turns = LengthDist::Uniform { min: 0, max: 3 };
        assert!(e(AgenticConfig { turns, ..config() }).contains("agentic.turns.min"));
        let arrival = ArrivalProcess::Poisson { rate_rps: 0.0 };
        assert!(e(AgenticConfig { arrival, ..config() }).contains("agentic.arrival.rate_rps"));
    }
}
