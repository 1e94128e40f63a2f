//! `fleetplane-bench matching`: what the per-sequence cursor (`engine::kv::SeqKv`) saves when
//! a long prompt is prefilled in chunks.
//!
//! One prompt (128K tokens by default) is prefilled in chunks (8K tokens), and each chunk's
//! scheduler-side KV work is done through the engine's public API under three strategies,
//! each starting from a copy of the same cache:
//!
//! | strategy | per chunk | blocks touched by chunk k of n |
//! | --- | --- | --- |
//! | `cursor` | `match_more` from the cursor, `allocate`, `commit` from the cursor | the chunk's own |
//! | `rescan` | release, match the prefix so far from the root, `allocate`; then release again, match from the root again to find where the new blocks go, and `commit` | 2k − 1 chunks' worth |
//! | `rescan-lookup` | as `rescan`, but insertion resumes from the lookup's end | k chunks' worth |
//!
//! `rescan` is an engine without a cursor: it both looks the prefix up and re-inserts it from
//! the root at every chunk. `rescan-lookup` is the bound for an engine that keeps its insertion
//! point but still looks up from the root. Over n chunks `rescan` touches n² chunks' worth
//! of blocks and `cursor` n, so the work ratio is about n (16 at the defaults).
//!
//! # Cache state
//!
//! The cache has the KV capacity of Llama-3.1-8B on one H100 (28,181 blocks of 16 tokens),
//! and it is full before the prefill starts, so every chunk's allocation evicts:
//! - the conversation this prompt continues: its earlier turn (the first `--history-tokens`
//!   of this prompt) and a regenerated reply that shares the first half of that turn and
//!   then diverges, so the prompt's path crosses a branching node;
//! - other prompts filling the rest, 1,024 to 8,192 tokens long, half of them after the same
//!   `--system-tokens` system prompt this prompt starts with (whose node thus has many
//!   children, found through the tree's hash index).
//!
//! The conversation is the most recently used, so eviction takes the other prompts. Between
//! two chunks (untimed) the benchmark writes `--flush-kib` of memory, so that each chunk
//! starts with the tree out of the core's L1 and L2 caches, as after a GPU step's worth of
//! other scheduling work.
//!
//! # Counting
//!
//! Blocks touched: blocks walked by `match_more` (the count it returns) plus blocks inserted
//! by `commit` (the sequence's `tree_blocks` before and after). Time: `Instant` around each
//! chunk's KV calls. After every prefill the three strategies must leave identical caches:
//! the same block table, the same cached and available counts, and the same blocks matched
//! by a probe of every prompt in the cache.

use anyhow::anyhow;
use clap::Args as ClapArgs;
use control::Failure;
use engine::ids::derive_seed;
use engine::kv::{KvCache, SeqKv};
use engine::{BlockHash, BlockId, Time};
use std::hint::black_box;
use std::time::{Duration, Instant};

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// Tokens of the prompt that is prefilled.
    #[arg(long, default_value_t = 131_072)]
    pub prompt_tokens: u32,

    /// Tokens per prefill chunk (a multiple of the block size).
    #[arg(long, default_value_t = 8_192)]
    pub chunk_tokens: u32,

    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,

    /// Prefills per strategy; times are medians over them.
    #[arg(long, default_value_t = 21)]
    pub repetitions: u32,

    /// KV blocks of the instance (default: Llama-3.1-8B on one H100, TP 1).
    #[arg(long, default_value_t = 28_181)]
    pub cache_blocks: u32,

    /// Tokens of the system prompt this prompt and half of the other prompts start with.
    #[arg(long, default_value_t = 2_048)]
    pub system_tokens: u32,

    /// Tokens of this prompt cached by the conversation's earlier turn (including the system
    /// prompt).
    #[arg(long, default_value_t = 12_288)]
    pub history_tokens: u32,

    /// KiB of memory written between chunks (untimed) to push the tree out of L1 and L2.
    #[arg(long, default_value_t = 8_192)]
    pub flush_kib: u32,

    /// GPU time of one chunk, to express the scheduler's cost as a share of it (an 8K chunk
    /// of Llama-3.1-8B on H100 at no context, per the cost model; later chunks take longer).
    #[arg(long, default_value_t = 200.0)]
    pub chunk_gpu_ms: f64,

    /// Seed of the prompts' contents.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    Cursor,
    RescanLookup,
    Rescan,
}

impl Strategy {
    const ALL: [Strategy; 3] = [Strategy::Cursor, Strategy::RescanLookup, Strategy::Rescan];

    fn name(self) -> &'static str {
        match self {
            Strategy::Cursor => "cursor",
            Strategy::RescanLookup => "rescan-lookup",
            Strategy::Rescan => "rescan",
        }
    }
}

/// The cache before the prefill, and every prompt in it (for the end-state probe).
struct Setup {
    kv: KvCache,
    prompt: Vec<BlockHash>,
    cached: Vec<Vec<BlockHash>>,
    /// Blocks of the prompt already cached (system prompt and history).
    prompt_cached_blocks: u32,
    /// Other prompts cached (besides the conversation's two).
    others: u32,
    /// Virtual time after the setup; the prefill's chunks come after it.
    now: u64,
}

/// What a strategy leaves behind, compared across strategies.
#[derive(Debug, PartialEq, Eq)]
struct EndState {
    table: Vec<BlockId>,
    cached_blocks: u32,
    available_blocks: u32,
    probes: Vec<Vec<BlockId>>,
}

/// One strategy's measurements over all repetitions.
struct Measured {
    strategy: Strategy,
    blocks_touched: u64,
    prefill: Vec<Duration>,
    max_chunk: Vec<Duration>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    validate(&args).map_err(Failure::Input)?;
    println!("seed {}", args.seed);
    let setup = populate(&args);
    let prompt_blocks = setup.prompt.len() as u32;
    let chunks = args.prompt_tokens.div_ceil(args.chunk_tokens);
    println!(
        "prompt {} tokens in {chunks} chunks of {} (block {}: {prompt_blocks} full blocks, {} cached before: \
         system prompt and history); cache {} of {} blocks: {} other prompts and 2 of the conversation",
        args.prompt_tokens,
        args.chunk_tokens,
        args.block_size,
        setup.prompt_cached_blocks,
        setup.kv.cached_blocks(),
        args.cache_blocks,
        setup.others,
    );
    let mut flush = vec![0u8; args.flush_kib as usize * 1024];
    let mut measured: Vec<Measured> = Strategy::ALL
        .iter()
        .map(|&strategy| Measured { strategy, blocks_touched: 0, prefill: Vec::new(), max_chunk: Vec::new() })
        .collect();
    let mut reference: Option<EndState> = None;
    let mut chunk_times = Vec::with_capacity(chunks as usize);
    // Strategies alternate within each repetition, so that drift in the machine's speed
    // affects them alike.
    for _ in 0..args.repetitions {
        for m in &mut measured {
            let mut kv = setup.kv.clone();
            chunk_times.clear();
            let (mut seq, touched) =
                prefill(&mut kv, m.strategy, &setup, &args, &mut flush, &mut chunk_times).map_err(Failure::Output)?;
            m.blocks_touched = touched;
            m.prefill.push(chunk_times.iter().sum());
            m.max_chunk.push(chunk_times.iter().copied().max().unwrap_or_default());
            let end = end_state(&mut kv, &mut seq, &setup);
            match &reference {
                None => reference = Some(end),
                Some(r) if *r == end => {}
                Some(_) => {
                    return Err(Failure::Output(anyhow!(
                        "strategy {} left a different cache than {}",
                        m.strategy.name(),
                        Strategy::ALL[0].name()
                    )))
                }
            }
        }
    }
    print_table(&mut measured, prompt_blocks, args.chunk_gpu_ms);
    println!("end state identical across strategies and repetitions: block table, cached and available blocks, probes");
    Ok(())
}

fn validate(args: &Args) -> anyhow::Result<()> {
    let bs = args.block_size;
    if bs == 0 || args.prompt_tokens == 0 || args.chunk_tokens == 0 || args.repetitions == 0 {
        return Err(anyhow!("--block-size, --prompt-tokens, --chunk-tokens and --repetitions must be positive"));
    }
    if !args.chunk_tokens.is_multiple_of(bs) {
        return Err(anyhow!("--chunk-tokens {} is not a multiple of --block-size {bs}", args.chunk_tokens));
    }
    if args.system_tokens > args.history_tokens || args.history_tokens > args.prompt_tokens {
        return Err(anyhow!(
            "need --system-tokens ({}) <= --history-tokens ({}) <= --prompt-tokens ({})",
            args.system_tokens,
            args.history_tokens,
            args.prompt_tokens
        ));
    }
    // The prompt, plus the regenerated reply's own tail held while it was cached.
    let needed = args.prompt_tokens.div_ceil(bs) + OTHER_MAX_TOKENS.div_ceil(bs);
    if args.cache_blocks < needed {
        return Err(anyhow!("--cache-blocks {} cannot hold the prompt: need at least {needed}", args.cache_blocks));
    }
    Ok(())
}

/// Length range of the other prompts, and of the regenerated reply's own tail.
const OTHER_MIN_TOKENS: u32 = 1_024;
const OTHER_MAX_TOKENS: u32 = 8_192;

/// Chained hashes of `blocks` blocks whose contents come from `stream`, after `parent`.
fn chain(seed: u64, stream: &str, from: u64, blocks: u32, mut parent: BlockHash, out: &mut Vec<BlockHash>) {
    for i in 0..u64::from(blocks) {
        parent = parent.chain(derive_seed(seed, stream, from + i));
        out.push(parent);
    }
}

/// Fills the cache: other prompts first (least recently used), then the conversation.
fn populate(args: &Args) -> Setup {
    let bs = args.block_size;
    let mut kv = KvCache::new(args.cache_blocks, bs);
    let system_blocks = args.system_tokens / bs;
    let history_blocks = args.history_tokens / bs;
    let mut prompt = Vec::with_capacity((args.prompt_tokens / bs) as usize);
    chain(args.seed, "system", 0, system_blocks, BlockHash::ROOT, &mut prompt);
    let system_end = prompt.last().copied().unwrap_or(BlockHash::ROOT);
    chain(args.seed, "conversation", 0, args.prompt_tokens / bs - system_blocks, system_end, &mut prompt);

    let history = prompt[..history_blocks as usize].to_vec();
    let branch_at = history_blocks / 2;
    let mut regenerated = prompt[..branch_at as usize].to_vec();
    let branch_parent = regenerated.last().copied().unwrap_or(BlockHash::ROOT);
    chain(args.seed, "regenerated", 0, OTHER_MAX_TOKENS / bs, branch_parent, &mut regenerated);

    // Blocks the conversation adds beyond the system prompt, which the other prompts cache.
    let conversation_blocks = history_blocks - system_blocks + (regenerated.len() as u32 - branch_at);
    let mut cached = Vec::new();
    let mut now = 0;
    // Bounded: each other prompt adds at least OTHER_MIN_TOKENS - system_tokens tokens or
    // shares nothing; stop when the cache (less the conversation's share) is full.
    let other_budget = args.cache_blocks.saturating_sub(conversation_blocks);
    let mut others = 0u32;
    while kv.cached_blocks() < other_budget && others < args.cache_blocks {
        let id = u64::from(others);
        let span = u64::from((OTHER_MAX_TOKENS - OTHER_MIN_TOKENS) / bs + 1);
        let blocks = OTHER_MIN_TOKENS / bs + (derive_seed(args.seed, "other-length", id) % span) as u32;
        let blocks = blocks.min(other_budget - kv.cached_blocks() + system_blocks);
        let mut hs = Vec::with_capacity(blocks as usize);
        let shares_system = others.is_multiple_of(2) && blocks > system_blocks;
        let (own, parent) = if shares_system {
            hs.extend_from_slice(&prompt[..system_blocks as usize]);
            (blocks - system_blocks, system_end)
        } else {
            (blocks, BlockHash::ROOT)
        };
        chain(args.seed, "other", id << 32, own, parent, &mut hs);
        now += 1;
        cache_prompt(&mut kv, now, &hs);
        cached.push(hs);
        others += 1;
    }
    for hs in [history, regenerated] {
        now += 1;
        cache_prompt(&mut kv, now, &hs);
        cached.push(hs);
    }
    cached.push(prompt.clone());
    let mut probe = SeqKv::default();
    let prompt_cached_blocks = kv.match_more(Time(now), &mut probe, &prompt, u32::MAX);
    kv.release(Time(now), &mut probe);
    kv.check_invariants(0);
    Setup { kv, prompt, cached, prompt_cached_blocks, others, now: now + 1 }
}

/// Prefills `hs` as one request and releases it, leaving its blocks cached.
fn cache_prompt(kv: &mut KvCache, now: u64, hs: &[BlockHash]) {
    let mut s = SeqKv::default();
    let hit = kv.match_more(Time(now), &mut s, hs, u32::MAX);
    let ok = kv.allocate(&mut s, hs.len() as u32 - hit);
    assert!(ok, "setup: the cache holds every prompt while it is prefilled");
    kv.commit(Time(now), &mut s, hs, hs.len() as u32);
    kv.release(Time(now), &mut s);
}

/// One prefill of the prompt under `strategy`; pushes each chunk's time into `chunk_times`
/// and returns the sequence and the blocks it touched.
fn prefill(
    kv: &mut KvCache,
    strategy: Strategy,
    setup: &Setup,
    args: &Args,
    flush: &mut [u8],
    chunk_times: &mut Vec<Duration>,
) -> anyhow::Result<(SeqKv, u64)> {
    let hashes = &setup.prompt[..];
    let mut seq = SeqKv::default();
    let mut private: Vec<BlockId> = Vec::new();
    let mut touched = 0u64;
    let mut start = 0;
    while start < args.prompt_tokens {
        let end = args.prompt_tokens.min(start + args.chunk_tokens);
        let now = Time(setup.now + u64::from(start / args.chunk_tokens));
        // Full blocks once this chunk is computed: the most it can match or insert.
        let full = end / args.block_size;
        flush_caches(flush);
        let started = Instant::now();
        if strategy != Strategy::Cursor {
            // Chunks end on block boundaries, so the sequence holds no private block here.
            kv.release(now, &mut seq);
        }
        touched += u64::from(kv.match_more(now, &mut seq, hashes, full));
        let need = kv.blocks_for(end) - seq.blocks.len() as u32;
        if !kv.allocate(&mut seq, need) {
            return Err(anyhow!("no room for {need} blocks at token {start} ({} strategy)", strategy.name()));
        }
        if strategy == Strategy::Rescan {
            // Insertion from the root: the computed blocks are set aside, the prefix is
            // walked again, and the new blocks go in where the walk ends.
            let prefix = seq.tree_blocks;
            private.clear();
            private.extend(seq.blocks.drain(prefix as usize..));
            kv.release(now, &mut seq);
            touched += u64::from(kv.match_more(now, &mut seq, hashes, prefix));
            assert_eq!(seq.tree_blocks, prefix, "nothing changed between the two walks");
            seq.blocks.extend_from_slice(&private);
        }
        let before = seq.tree_blocks;
        kv.commit(now, &mut seq, hashes, full);
        touched += u64::from(seq.tree_blocks - before);
        chunk_times.push(started.elapsed());
        black_box(&seq);
        start = end;
    }
    Ok((seq, touched))
}

/// Writes every cache line of `buf`, evicting the tree from the core's private caches.
fn flush_caches(buf: &mut [u8]) {
    for line in buf.chunks_mut(64) {
        line[0] = line[0].wrapping_add(1);
    }
    black_box(buf);
}

/// Releases the prefilled sequence and records what the cache holds.
fn end_state(kv: &mut KvCache, seq: &mut SeqKv, setup: &Setup) -> EndState {
    let table = seq.blocks.clone();
    let (cached_blocks, available_blocks) = (kv.cached_blocks(), kv.available_blocks());
    let now = Time(setup.now + 1_000_000);
    kv.release(now, seq);
    kv.check_invariants(0);
    let probes = setup
        .cached
        .iter()
        .map(|hs| {
            let mut probe = SeqKv::default();
            kv.match_more(now, &mut probe, hs, u32::MAX);
            let blocks = probe.blocks.clone();
            kv.release(now, &mut probe);
            blocks
        })
        .collect();
    EndState { table, cached_blocks, available_blocks, probes }
}

fn median(xs: &mut [Duration]) -> Duration {
    xs.sort_unstable();
    xs[xs.len() / 2]
}

fn print_table(measured: &mut [Measured], prompt_blocks: u32, chunk_gpu_ms: f64) {
    let base_touched = measured[0].blocks_touched as f64;
    let base_prefill = median(&mut measured[0].prefill).as_secs_f64();
    println!(
        "| strategy | blocks touched | per prompt block | time per prefill (median) | max chunk time (median) \
         | work vs cursor | time vs cursor | max chunk / {chunk_gpu_ms:.0} ms GPU chunk |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for m in measured.iter_mut() {
        let prefill_s = median(&mut m.prefill).as_secs_f64();
        let chunk_s = median(&mut m.max_chunk).as_secs_f64();
        println!(
            "| {} | {} | {:.2} | {:.1} µs | {:.1} µs | {:.2}× | {:.2}× | {:.4}% |",
            m.strategy.name(),
            m.blocks_touched,
            m.blocks_touched as f64 / f64::from(prompt_blocks),
            prefill_s * 1e6,
            chunk_s * 1e6,
            m.blocks_touched as f64 / base_touched,
            prefill_s / base_prefill,
            chunk_s * 1e3 / chunk_gpu_ms * 100.0,
        );
    }
}
