//! `fleetplane-bench index`: how fast the global prefix index applies KV events and answers
//! routing queries, and how much memory it takes, on one core.
//!
//! The fleet is synthetic and seeded (ChaCha8), so a run replays from its flags:
//!
//! - two fleet-wide prompts (64-128 blocks) held in L1 by every instance;
//! - groups of 25 instances, each with two system prompts (32-192 blocks, following a
//!   fleet-wide one) held in L1 by every member;
//! - conversations (histories of 50-800 blocks after a group prompt) until the index holds
//!   `--blocks` blocks: each on 1-3 instances of its group (L1 prefix, sometimes an L2 tail),
//!   30% with a tail in the shared L3 store, 10% in L3 only.
//!
//! Phases, each timed on the index calls alone (event generation is outside the clock):
//!
//! 1. build: the events that create the fleet above, stored runs in chain order;
//! 2. churn: a steady-state stream: new turns (L2 promoted back to L1, recomputed blocks and
//!    new blocks stored), leaf evictions (L1 to L2 demotions, L2 to L3), replication of a
//!    conversation to another instance, and retirement of whole conversations (leaves first).
//!    Both phases alternate, chunk by chunk, between `apply` (one event at a time, as the
//!    controller calls it) and `apply_batch`. (The engine now also writes L3 through at L1
//!    eviction; this stream moves blocks to L3 when L2 evicts them: the mix of events
//!    differs, not their kinds.)
//! 3. queries: prompts of Mooncake-like length (60% continue a conversation, 25% start a new
//!    one after a group prompt, 15% share nothing), each timed alone with `Instant`:
//!    `match_prefix` alone, and followed by either `longest` or a `get` for every instance
//!    (what a router scoring all instances adds).
//!
//! Memory: the index's heap estimate (`PrefixIndex::heap_bytes`) per block, and the
//! process's peak RSS (which also holds the generator's model of the fleet).

use anyhow::anyhow;
use clap::Args as ClapArgs;
use control::{peak_rss_kib, Failure};
use engine::kv::{KvEvent, KvEvents, PageKey, Tier, PAGE_BLOCKS};
use engine::{BlockHash, InstanceId};
use policies::{PrefixIndex, PrefixMatches};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::{Duration, Instant};

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Engine instances.
    #[arg(long, default_value_t = 1_000)]
    pub instances: u32,

    /// Distinct blocks to index before measuring.
    #[arg(long, default_value_t = 10_000_000)]
    pub blocks: u64,

    /// Events of the steady-state churn phase.
    #[arg(long, default_value_t = 5_000_000)]
    pub events: u64,

    /// Queries to time.
    #[arg(long, default_value_t = 200_000)]
    pub queries: u64,

    /// Seed of the synthetic fleet.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

const GROUP_SIZE: u32 = 25;
/// Events generated ahead of being applied, so that generation stays off the clock (small
/// enough that chunks applied one event at a time and in batches see the same mix).
const CHUNK_EVENTS: usize = 1 << 16;
/// Largest L2 tail a conversation replica keeps before its oldest L2 blocks go to L3.
const L2_TAIL_BLOCKS: u32 = 96;

/// One instance's replica of a conversation: history blocks `[0, l1)` in L1, `[l1, l2)` in L2
/// (a prefix in the fast tier and the demoted part after it, as an engine's LRU leaves it).
#[derive(Clone, Copy, Debug)]
struct Replica {
    instance: u32,
    l1: u32,
    l2: u32,
}

#[derive(Clone, Debug)]
struct Conversation {
    group: u32,
    /// Index into `Fleet::prompts`: the group prompt this history follows.
    prompt: usize,
    history: Vec<BlockHash>,
    replicas: Vec<Replica>,
    /// History blocks `[lo, hi)` in the shared L3 store.
    l3: (u32, u32),
}

/// The generator's model of what every instance holds, kept so that the events it emits are
/// the ones a real fleet would (no removal of a block that is not there).
struct Fleet {
    rng: ChaCha8Rng,
    instances: u32,
    /// Full chains (fleet-wide part included) of the group prompts, and their groups.
    prompts: Vec<(u32, Vec<BlockHash>)>,
    conversations: Vec<Conversation>,
    events: Vec<(InstanceId, KvEvent)>,
}

/// The page (`engine::kv::PageKey`) of history block `p` after the prompt chain `prompt`.
fn page_of(prompt: &[BlockHash], history: &[BlockHash], p: u32) -> BlockHash {
    let first = (prompt.len() + p as usize) / PAGE_BLOCKS * PAGE_BLOCKS;
    if first < prompt.len() {
        prompt[first]
    } else {
        history[first - prompt.len()]
    }
}

fn fresh(rng: &mut ChaCha8Rng, parent: BlockHash) -> BlockHash {
    parent.chain(rng.random::<u64>())
}

impl Fleet {
    fn groups(&self) -> u32 {
        self.instances.div_ceil(GROUP_SIZE)
    }

    fn members(&self, group: u32) -> std::ops::Range<u32> {
        group * GROUP_SIZE..((group + 1) * GROUP_SIZE).min(self.instances)
    }

    fn stored(&mut self, instance: u32, tier: Tier, hash: BlockHash, page: BlockHash) {
        self.events.push((InstanceId(instance), KvEvent::Stored { tier, hash, page }));
    }

    fn removed(&mut self, instance: u32, tier: Tier, hash: BlockHash, page: BlockHash) {
        self.events.push((InstanceId(instance), KvEvent::Removed { tier, hash, page }));
    }

    /// The page of history block `p` of conversation `c`.
    fn page(&self, c: usize, p: u32) -> BlockHash {
        let conv = &self.conversations[c];
        page_of(&self.prompts[conv.prompt].1, &conv.history, p)
    }

    /// Fleet-wide prompts on every instance, then group prompts on their members.
    fn build_prompts(&mut self) {
        let mut globals = Vec::new();
        for _ in 0..2 {
            let len = self.rng.random_range(64..=128);
            let mut chain = Vec::with_capacity(len);
            let mut h = BlockHash::ROOT;
            for _ in 0..len {
                h = fresh(&mut self.rng, h);
                chain.push(h);
            }
            for i in 0..self.instances {
                for (k, &h) in chain.iter().enumerate() {
                    self.stored(i, Tier::L1, h, PageKey::at(&chain, k).page);
                }
            }
            globals.push(chain);
        }
        for g in 0..self.groups() {
            for _ in 0..2 {
                let mut chain = globals[self.rng.random_range(0..globals.len())].clone();
                let shared = chain.len();
                let len = self.rng.random_range(32..=192);
                for _ in 0..len {
                    let h = fresh(&mut self.rng, *chain.last().expect("not empty"));
                    chain.push(h);
                }
                for i in self.members(g) {
                    for k in shared..chain.len() {
                        self.stored(i, Tier::L1, chain[k], PageKey::at(&chain, k).page);
                    }
                }
                self.prompts.push((g, chain));
            }
        }
    }

    /// A new conversation, with its events.
    fn new_conversation(&mut self) {
        let prompt = self.rng.random_range(0..self.prompts.len());
        let group = self.prompts[prompt].0;
        let len = self.rng.random_range(50..=800u32);
        let mut history = Vec::with_capacity(len as usize);
        let mut h = *self.prompts[prompt].1.last().expect("not empty");
        for _ in 0..len {
            h = fresh(&mut self.rng, h);
            history.push(h);
        }
        let members = self.members(group);
        let mut replicas: Vec<Replica> = Vec::new();
        let l3_only = self.rng.random_bool(0.1);
        if !l3_only {
            let n = 1 + u32::from(self.rng.random_bool(0.4)) + u32::from(self.rng.random_bool(0.1));
            while (replicas.len() as u32) < n.min(members.len() as u32) {
                let instance = self.rng.random_range(members.clone());
                if replicas.iter().any(|c| c.instance == instance) {
                    continue;
                }
                let (l1, l2) = if replicas.is_empty() && self.rng.random_bool(0.8) {
                    (len, len)
                } else {
                    let l1 = self.rng.random_range(len / 4..=len);
                    (l1, self.rng.random_range(l1..=len))
                };
                replicas.push(Replica { instance, l1, l2 });
            }
        }
        let l3 = if l3_only {
            (0, len)
        } else if self.rng.random_bool(0.3) {
            (self.rng.random_range(0..len), len)
        } else {
            (0, 0)
        };
        self.conversations.push(Conversation { group, prompt, history, replicas: replicas.clone(), l3 });
        let c = self.conversations.len() - 1;
        for replica in replicas {
            for p in 0..replica.l2 {
                let tier = if p < replica.l1 { Tier::L1 } else { Tier::L2 };
                let h = self.conversations[c].history[p as usize];
                self.stored(replica.instance, tier, h, self.page(c, p));
            }
        }
        let by = members.start;
        for p in l3.0..l3.1 {
            let h = self.conversations[c].history[p as usize];
            self.stored(by, Tier::L3, h, self.page(c, p));
        }
    }

    /// One steady-state step; `grow` says whether the index is below its target size.
    fn churn_step(&mut self, grow: bool) {
        if self.conversations.is_empty() {
            self.new_conversation();
            return;
        }
        let c = self.rng.random_range(0..self.conversations.len());
        let r = self.rng.random::<f64>();
        if r < 0.4 {
            self.turn(c);
        } else if r < 0.8 {
            self.evict(c);
        } else if r < 0.9 {
            self.replicate(c);
        } else {
            self.retire(c);
            if grow {
                self.new_conversation();
            }
        }
    }

    /// A new turn served by the conversation's first replica: its L2 tail is promoted back to
    /// L1, what it lost is recomputed, and 8-64 new blocks are stored.
    fn turn(&mut self, c: usize) {
        if self.conversations[c].replicas.is_empty() {
            let members = self.members(self.conversations[c].group);
            let instance = self.rng.random_range(members);
            self.conversations[c].replicas.push(Replica { instance, l1: 0, l2: 0 });
        }
        let Replica { instance, l1, l2 } = self.conversations[c].replicas[0];
        for p in l1..l2 {
            let h = self.conversations[c].history[p as usize];
            self.removed(instance, Tier::L2, h, self.page(c, p));
            self.stored(instance, Tier::L1, h, self.page(c, p));
        }
        let len = self.conversations[c].history.len() as u32;
        for p in l2..len {
            let h = self.conversations[c].history[p as usize];
            self.stored(instance, Tier::L1, h, self.page(c, p));
        }
        let k = self.rng.random_range(8..=64u32);
        for _ in 0..k {
            let parent = *self.conversations[c].history.last().expect("not empty");
            let h = fresh(&mut self.rng, parent);
            self.conversations[c].history.push(h);
            let page = self.page(c, self.conversations[c].history.len() as u32 - 1);
            self.stored(instance, Tier::L1, h, page);
        }
        let len = self.conversations[c].history.len() as u32;
        self.conversations[c].replicas[0] = Replica { instance, l1: len, l2: len };
    }

    /// 8-64 leaf blocks of one replica leave L1 for L2; L2 beyond its budget goes to L3.
    fn evict(&mut self, c: usize) {
        let n = self.conversations[c].replicas.len();
        if n == 0 {
            return;
        }
        let k = self.rng.random_range(0..n);
        let mut replica = self.conversations[c].replicas[k];
        let evict = self.rng.random_range(8..=64u32).min(replica.l1);
        for _ in 0..evict {
            let p = replica.l1 - 1;
            let h = self.conversations[c].history[p as usize];
            self.removed(replica.instance, Tier::L1, h, self.page(c, p));
            self.stored(replica.instance, Tier::L2, h, self.page(c, p));
            replica.l1 = p;
        }
        while replica.l2 - replica.l1 > L2_TAIL_BLOCKS {
            let p = replica.l2 - 1;
            let (h, page) = (self.conversations[c].history[p as usize], self.page(c, p));
            self.removed(replica.instance, Tier::L2, h, page);
            let (lo, hi) = self.conversations[c].l3;
            if lo == hi {
                self.conversations[c].l3 = (p, p + 1);
                self.stored(replica.instance, Tier::L3, h, page);
            } else if p + 1 == lo {
                self.conversations[c].l3.0 = p;
                self.stored(replica.instance, Tier::L3, h, page);
            } else if p == hi {
                self.conversations[c].l3.1 = p + 1;
                self.stored(replica.instance, Tier::L3, h, page);
            }
            replica.l2 = p;
        }
        self.conversations[c].replicas[k] = replica;
    }

    /// Another instance of the group loads a prefix of the conversation into L1.
    fn replicate(&mut self, c: usize) {
        let conv = &self.conversations[c];
        if conv.replicas.len() >= 3 {
            return;
        }
        let instance = self.rng.random_range(self.members(conv.group));
        if conv.replicas.iter().any(|x| x.instance == instance) {
            return;
        }
        let len = conv.history.len() as u32;
        let m = self.rng.random_range(1..=len);
        for p in 0..m {
            let h = self.conversations[c].history[p as usize];
            self.stored(instance, Tier::L1, h, self.page(c, p));
        }
        self.conversations[c].replicas.push(Replica { instance, l1: m, l2: m });
    }

    /// The conversation leaves every tier, leaves first.
    fn retire(&mut self, c: usize) {
        let conv = self.conversations.swap_remove(c);
        let prompt = std::mem::take(&mut self.prompts[conv.prompt].1);
        let at = |p: u32| (conv.history[p as usize], page_of(&prompt, &conv.history, p));
        for replica in &conv.replicas {
            for p in (replica.l1..replica.l2).rev() {
                let (h, page) = at(p);
                self.removed(replica.instance, Tier::L2, h, page);
            }
            for p in (0..replica.l1).rev() {
                let (h, page) = at(p);
                self.removed(replica.instance, Tier::L1, h, page);
            }
        }
        let by = self.members(conv.group).start;
        for p in (conv.l3.0..conv.l3.1).rev() {
            let (h, page) = at(p);
            self.removed(by, Tier::L3, h, page);
        }
        self.prompts[conv.prompt].1 = prompt;
    }

    /// A query's prompt into `out`: 60% continue a conversation (its whole history and 8-64
    /// new blocks), 25% start a new one after a group prompt, 15% share nothing.
    fn query(&mut self, out: &mut Vec<BlockHash>) {
        out.clear();
        let r = self.rng.random::<f64>();
        let mut last = BlockHash::ROOT;
        if r < 0.85 && !self.conversations.is_empty() {
            let c = self.rng.random_range(0..self.conversations.len());
            let conv = &self.conversations[c];
            let prompt = &self.prompts[conv.prompt].1;
            out.extend_from_slice(prompt);
            if r < 0.6 {
                out.extend_from_slice(&conv.history);
            }
            last = *out.last().expect("not empty");
        }
        let new = if r < 0.6 {
            self.rng.random_range(8..=64)
        } else if r < 0.85 {
            self.rng.random_range(50..=800)
        } else {
            self.rng.random_range(50..=1000)
        };
        for _ in 0..new {
            last = fresh(&mut self.rng, last);
            out.push(last);
        }
    }
}

/// Time spent applying events, one at a time (`apply`) and in batches (`apply_batch`),
/// alternating chunk by chunk so that both see the same index.
#[derive(Default)]
struct EventClock {
    spent: [Duration; 2],
    events: [u64; 2],
}

impl EventClock {
    /// Applies the events buffered so far, timed.
    fn apply(&mut self, index: &mut PrefixIndex, events: &mut Vec<(InstanceId, KvEvent)>) {
        let batch = usize::from(self.events[0] > self.events[1]);
        let started = Instant::now();
        if batch == 1 {
            // The instance's runs of events, as engines publish them.
            for run in events.chunk_by(|a, b| a.0 == b.0) {
                let batch: KvEvents = run.iter().map(|&(_, e)| e).collect();
                index.apply_batch(run[0].0, &batch);
            }
        } else {
            for (instance, event) in events.iter() {
                index.apply(*instance, event);
            }
        }
        self.spent[batch] += started.elapsed();
        self.events[batch] += events.len() as u64;
        events.clear();
    }

    fn total(&self) -> u64 {
        self.events[0] + self.events[1]
    }

    /// One row for both calls together (when one-off costs, such as the map doubling, fall in
    /// whichever chunk triggers them), or one per call.
    fn rows(&self, phase: &str, split: bool) {
        if !split {
            let spent = self.spent[0] + self.spent[1];
            println!(
                "| {phase} | both, alternating | {} | {:.2} | {:.0} |",
                self.total(),
                spent.as_secs_f64(),
                self.total() as f64 / spent.as_secs_f64().max(1e-9)
            );
            return;
        }
        for (k, how) in ["apply", "apply_batch"].iter().enumerate() {
            println!(
                "| {phase} | {how} | {} | {:.2} | {:.0} |",
                self.events[k],
                self.spent[k].as_secs_f64(),
                self.events[k] as f64 / self.spent[k].as_secs_f64().max(1e-9)
            );
        }
    }
}

/// Latency percentiles of `ns` (sorted here), in µs.
fn percentiles(ns: &mut [u64]) -> [f64; 4] {
    ns.sort_unstable();
    [0.5, 0.99, 0.999, 1.0].map(|q| {
        if ns.is_empty() {
            return 0.0;
        }
        let i = ((ns.len() as f64 * q).ceil() as usize).clamp(1, ns.len()) - 1;
        ns[i] as f64 / 1000.0
    })
}

pub fn run(args: Args) -> Result<(), Failure> {
    if args.instances == 0 || args.blocks == 0 {
        return Err(Failure::Input(anyhow!("--instances and --blocks must be positive")));
    }
    eprintln!("seed {} instances {} blocks {}", args.seed, args.instances, args.blocks);
    let mut fleet = Fleet {
        rng: ChaCha8Rng::seed_from_u64(args.seed),
        instances: args.instances,
        prompts: Vec::new(),
        conversations: Vec::new(),
        events: Vec::with_capacity(CHUNK_EVENTS + (1 << 16)),
    };
    let mut index = PrefixIndex::new();

    let mut build = EventClock::default();
    fleet.build_prompts();
    while (index.blocks() as u64) < args.blocks {
        // An event adds one block at most, so a chunk no longer than the blocks missing
        // overshoots by one conversation at most.
        let missing = (args.blocks - index.blocks() as u64) as usize;
        while fleet.events.len() < CHUNK_EVENTS.min(missing) {
            fleet.new_conversation();
        }
        build.apply(&mut index, &mut fleet.events);
    }
    let built_blocks = index.blocks();

    let mut churn = EventClock::default();
    let mut kinds = [0u64; 6];
    while churn.total() < args.events {
        let grow = (index.blocks() as u64) < args.blocks;
        while fleet.events.len() < CHUNK_EVENTS.min((args.events - churn.total()) as usize) {
            fleet.churn_step(grow);
        }
        for (_, e) in &fleet.events {
            match *e {
                KvEvent::Stored { tier, .. } => kinds[tier.index()] += 1,
                KvEvent::Removed { tier, .. } => kinds[3 + tier.index()] += 1,
                KvEvent::Cleared => {}
            }
        }
        churn.apply(&mut index, &mut fleet.events);
    }

    let mut matches = PrefixMatches::default();
    let mut prompt = Vec::new();
    // Each query is timed three ways: the match alone; the match and the instance with the
    // longest prefix (`longest`); the match and every instance's `get`, as a router that
    // scores all instances does.
    let mut ns: [Vec<u64>; 3] = std::array::from_fn(|_| Vec::with_capacity(args.queries as usize));
    let mut spent = [Duration::ZERO; 3];
    let (mut prompt_blocks, mut best_blocks, mut hits, mut sink) = (0u64, 0u64, 0u64, 0u64);
    for q in 0..args.queries {
        fleet.query(&mut prompt);
        let started = Instant::now();
        index.match_prefix(&prompt, &mut matches);
        let matched = started.elapsed();
        let took = if q.is_multiple_of(2) {
            let best = matches.longest();
            let took = started.elapsed();
            let best = best.map_or(0, |(_, m)| m.total()).max(matches.shared().total());
            prompt_blocks += 2 * prompt.len() as u64;
            best_blocks += 2 * u64::from(best);
            hits += 2 * u64::from(best > 0);
            took
        } else {
            sink += (0..args.instances).map(|i| u64::from(matches.get(InstanceId(i)).l1)).sum::<u64>();
            started.elapsed()
        };
        let k = 1 + (q % 2) as usize;
        spent[0] += matched;
        spent[k] += took;
        ns[0].push(matched.as_nanos() as u64);
        ns[k].push(took.as_nanos() as u64);
    }
    std::hint::black_box(sink);

    let blocks = index.blocks();
    let heap = index.heap_bytes();
    let peak_mib = peak_rss_kib().map(|k| format!("{:.0}", k as f64 / 1024.0)).unwrap_or_else(|| "n/a".into());
    println!("| instances | blocks indexed (after build / at end) | index MiB | bytes per block | peak RSS MiB |");
    println!("| --- | --- | --- | --- | --- |");
    println!(
        "| {} | {built_blocks} / {blocks} | {:.0} | {:.1} | {peak_mib} |",
        args.instances,
        heap as f64 / (1 << 20) as f64,
        heap as f64 / blocks.max(1) as f64
    );
    println!();
    println!("| phase | call | events | s (index only) | events/s |");
    println!("| --- | --- | --- | --- | --- |");
    build.rows("build: stored runs in chain order, the map growing", false);
    churn.rows(
        &format!(
            "churn: stored L1/L2/L3 {}/{}/{}, removed {}/{}/{}",
            kinds[0], kinds[1], kinds[2], kinds[3], kinds[4], kinds[5]
        ),
        true,
    );
    println!();
    let q = args.queries.max(1) as f64;
    println!(
        "{} queries: mean prompt {:.0} blocks, mean longest match {:.0} blocks, {:.1}% with a match",
        args.queries,
        prompt_blocks as f64 / q,
        best_blocks as f64 / q,
        100.0 * hits as f64 / q
    );
    println!();
    println!("| query | queries/s | P50 µs | P99 µs | P99.9 µs | max µs |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let names = ["match_prefix", "match_prefix + longest", "match_prefix + get for every instance"];
    for k in 0..3 {
        let [p50, p99, p999, max] = percentiles(&mut ns[k]);
        println!(
            "| {} | {:.0} | {p50:.2} | {p99:.2} | {p999:.2} | {max:.1} |",
            names[k],
            ns[k].len() as f64 / spent[k].as_secs_f64().max(1e-9)
        );
    }
    Ok(())
}
