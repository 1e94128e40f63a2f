//! `fleetplane profile-vllm`: a running vLLM server's step times, measured through its own
//! OpenAI API, written as the step profile that `simulate --profile` calibrates the cost
//! model on (as `fleetplane profile` does for our CUDA engine).
//!
//! The API shows requests, not steps, so each sample is a request shape whose time is one
//! kind of step, as the server itself timed it (its Prometheus histograms' sums and counts
//! before and after; a client's reads arrive in bursts on a busy machine, the server's
//! clock does not):
//! - **prefill**: one request of L prompt tokens and one output token, alone on the server:
//!   `vllm:request_prefill_time_seconds`;
//! - **decode**: N streams of the same prompt length sent together: the mean of
//!   `vllm:inter_token_latency_seconds` over their output is one step of N sequences;
//! - **mixed**: a prompt of L tokens arriving while N streams decode: its prefill time is
//!   the step that computes it beside their decodes (what a loaded server runs).
//!
//! Prompts are token ids (from the server's `/tokenize` of random words) so their lengths
//! are exact, each drawn afresh so that nothing of one is in the prefix cache.

use crate::serve::vllm::{self, metrics};
use crate::Failure;
use anyhow::{anyhow, bail, Context};
use clap::Args as ClapArgs;
use cost::{gpu_by_name, model_by_name};
use engine::{StepProfile, StepSample, PROFILE_FORMAT};
use futures_util::StreamExt;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

#[derive(ClapArgs, Debug)]
pub struct Args {
    /// The server's OpenAI API, `http://host:port`.
    #[arg(long)]
    pub url: String,

    /// The cost model's name of the model's shape (e.g. `vllm-tiny`, `llama-3.1-8b`).
    #[arg(long)]
    pub model: String,

    /// The cost model's name of the device (e.g. `cpu-2core`, `h100`).
    #[arg(long)]
    pub gpu: String,

    /// JSON file to write.
    #[arg(long, value_name = "FILE.json")]
    pub out: PathBuf,

    /// Prompt lengths of the prefill samples, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "32,64,128,256,384")]
    pub prompt_tokens: Vec<u32>,

    /// Batch sizes of the decode samples, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    pub batches: Vec<u32>,

    /// Prompt tokens of each decoding stream.
    #[arg(long, default_value_t = 64)]
    pub decode_context: u32,

    /// Output tokens of each decoding stream.
    #[arg(long, default_value_t = 48)]
    pub decode_tokens: u32,

    /// Repetitions of each shape (the sample is their median).
    #[arg(long, default_value_t = 3)]
    pub repeat: u32,

    /// Seed of the prompts' words.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Prompt lengths of the samples of a prefill beside decoding streams, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,384")]
    pub mixed_prompt_tokens: Vec<u32>,

    /// Decoding streams beside those prefills, comma-separated (none: no such samples).
    #[arg(long, value_delimiter = ',', default_value = "4,16")]
    pub mixed_batches: Vec<u32>,

    /// Seconds of traffic (prefills and decode batches of the shapes above, not measured)
    /// before the samples: a fresh vLLM-CPU server's steps were ~20% slower in its first
    /// minute than after it (docs/BENCHMARKS.md, "Simulator fidelity against vLLM").
    #[arg(long, default_value_t = 20.0)]
    pub warmup_s: f64,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let model = model_by_name(&args.model).map_err(|e| Failure::Input(anyhow!("--model: {e}")))?;
    let gpu = gpu_by_name(&args.gpu).map_err(|e| Failure::Input(anyhow!("--gpu: {e}")))?;
    if args.prompt_tokens.contains(&0)
        || args.batches.contains(&0)
        || args.mixed_prompt_tokens.contains(&0)
        || args.mixed_batches.contains(&0)
        || args.repeat == 0
        || args.decode_tokens < 8
    {
        return Err(Failure::Input(anyhow!(
            "--prompt-tokens, --batches and the --mixed-* lists must be positive, --repeat at least 1, \
             --decode-tokens at least 8"
        )));
    }
    if !(args.warmup_s.is_finite() && args.warmup_s >= 0.0) {
        return Err(Failure::Input(anyhow!("--warmup-s {} is not a number of seconds >= 0", args.warmup_s)));
    }
    let runtime = crate::runtime()?;
    let profile = runtime.block_on(measure(&args, model.name, gpu.name)).map_err(Failure::Run)?;
    let text = serde_json::to_string_pretty(&profile).map_err(|e| Failure::Run(e.into()))?;
    std::fs::write(&args.out, text + "\n")
        .with_context(|| format!("cannot write {}", args.out.display()))
        .map_err(Failure::Run)?;
    println!("{:>8} {:>8} {:>12} {:>10}", "prefill", "decode", "context", "step ms");
    for s in &profile.samples {
        println!(
            "{:>8} {:>8} {:>12} {:>10.2}",
            s.prefill_tokens,
            s.decode_seqs,
            s.decode_context_tokens,
            s.seconds * 1e3
        );
    }
    println!("wrote {} ({} samples)", args.out.display(), profile.samples.len());
    Ok(())
}

/// The server under measurement.
struct Server {
    http: reqwest::Client,
    url: String,
    model: String,
    block_size: u32,
    rng: rand::rngs::StdRng,
}

const WORDS: [&str; 24] = [
    "fleet", "routes", "every", "request", "engine", "holds", "prefix", "cache", "long", "prompts", "decode",
    "prefill", "tier", "block", "token", "batch", "queue", "step", "model", "serve", "share", "load", "state", "time",
];

impl Server {
    async fn post(&self, path: &str, body: &Value) -> anyhow::Result<reqwest::Response> {
        let url = format!("{}{path}", self.url);
        let r = self.http.post(&url).json(body).send().await.with_context(|| format!("cannot reach {url}"))?;
        if !r.status().is_success() {
            let status = r.status();
            bail!("{url} answered {status}: {}", r.text().await.unwrap_or_default());
        }
        Ok(r)
    }

    /// `n` token ids of random words, none shared with an earlier prompt's first block.
    async fn prompt(&mut self, n: u32) -> anyhow::Result<Vec<u64>> {
        let words: Vec<&str> = (0..n * 2).map(|_| WORDS[self.rng.random_range(0..WORDS.len())]).collect();
        let v: Value = self
            .post("/tokenize", &json!({"model": self.model, "prompt": words.join(" "), "add_special_tokens": false}))
            .await?
            .json()
            .await?;
        let ids: Vec<u64> =
            v["tokens"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default();
        if ids.len() < n as usize {
            bail!("{}/tokenize gave {} tokens for {} words", self.url, ids.len(), words.len());
        }
        Ok(ids[..n as usize].to_vec())
    }

    /// The sum and count of one of the server's histograms.
    async fn histogram(&self, name: &str) -> anyhow::Result<(f64, f64)> {
        let url = format!("{}/metrics", self.url);
        let page = self.http.get(&url).send().await.with_context(|| format!("cannot reach {url}"))?.text().await?;
        let total = |suffix: &str| metrics::total(&page, &format!("{name}{suffix}"));
        Ok((total("_sum"), total("_count")))
    }

    /// The mean of `name` over what `work` made the server do.
    async fn timed(&self, name: &str, before: (f64, f64)) -> anyhow::Result<Option<f64>> {
        let after = self.histogram(name).await?;
        let count = after.1 - before.1;
        Ok((count > 0.0).then(|| (after.0 - before.0) / count))
    }

    /// One prefill of `n` tokens, alone: the server's prefill time.
    async fn prefill(&mut self, n: u32) -> anyhow::Result<Option<f64>> {
        let prompt = self.prompt(n).await?;
        let body = json!({"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0});
        let before = self.histogram(PREFILL_TIME).await?;
        let v: Value = self.post("/v1/completions", &body).await?.json().await?;
        if v["usage"]["prompt_tokens"].as_u64() != Some(u64::from(n)) {
            bail!("the server counted {} prompt tokens, not {n}", v["usage"]["prompt_tokens"]);
        }
        self.timed(PREFILL_TIME, before).await
    }

    /// `batch` streams of `context` prompt tokens and `tokens` output tokens, sent at once so
    /// that they decode together for most of their output; `started` hears each first chunk.
    async fn streams(
        &mut self,
        batch: u32,
        context: u32,
        tokens: u32,
        started: Option<&tokio::sync::mpsc::UnboundedSender<()>>,
    ) -> anyhow::Result<Vec<tokio::task::JoinHandle<anyhow::Result<()>>>> {
        let mut prompts = Vec::new();
        for _ in 0..batch {
            prompts.push(self.prompt(context).await?);
        }
        let mut streams = Vec::new();
        for prompt in prompts {
            let body = json!({"model": self.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                "ignore_eos": true, "stream": true});
            let (http, url, started) = (self.http.clone(), format!("{}/v1/completions", self.url), started.cloned());
            streams.push(tokio::spawn(async move { read_stream(http, url, body, started).await }));
        }
        Ok(streams)
    }

    /// `batch` streams decoding together: the server's mean time between their tokens.
    async fn decode(&mut self, batch: u32, context: u32, tokens: u32) -> anyhow::Result<Option<f64>> {
        let before = self.histogram(INTER_TOKEN).await?;
        for s in self.streams(batch, context, tokens, None).await? {
            s.await.map_err(|e| anyhow!("a stream's task failed: {e}"))??;
        }
        self.timed(INTER_TOKEN, before).await
    }

    /// A prefill of `n` tokens arriving while `batch` streams decode (every one past its
    /// first token, so that the prefill histogram's one new sample is this prompt's): the
    /// step that computes a prompt beside decodes, as the server timed it.
    async fn mixed(&mut self, n: u32, batch: u32, context: u32, tokens: u32) -> anyhow::Result<Option<f64>> {
        let prompt = self.prompt(n).await?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let streams = self.streams(batch, context, tokens, Some(&tx)).await?;
        drop(tx);
        for _ in 0..batch {
            if rx.recv().await.is_none() {
                break; // a stream failed before its first chunk: its task says why below
            }
        }
        let before = self.histogram(PREFILL_TIME).await?;
        let body = json!({"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0});
        self.post("/v1/completions", &body).await?;
        let after = self.histogram(PREFILL_TIME).await?;
        for s in streams {
            s.await.map_err(|e| anyhow!("a stream's task failed: {e}"))??;
        }
        // Another sample in the window (a stream that had not started after all): no sample.
        Ok((after.1 - before.1 == 1.0).then_some(after.0 - before.0))
    }
}

/// Reads a streamed completion to its end; `started` hears when its first chunk arrived.
async fn read_stream(
    http: reqwest::Client,
    url: String,
    body: Value,
    started: Option<tokio::sync::mpsc::UnboundedSender<()>>,
) -> anyhow::Result<()> {
    let r = http.post(&url).json(&body).send().await.with_context(|| format!("cannot reach {url}"))?;
    if !r.status().is_success() {
        bail!("{url} answered {}", r.status());
    }
    let mut stream = r.bytes_stream();
    let mut started = started;
    while let Some(bytes) = stream.next().await {
        bytes.with_context(|| format!("{url} broke the stream"))?;
        if let Some(tx) = started.take() {
            let _ = tx.send(());
        }
    }
    Ok(())
}

/// The server's histograms the samples are read from.
const PREFILL_TIME: &str = "vllm:request_prefill_time_seconds";
const INTER_TOKEN: &str = "vllm:inter_token_latency_seconds";

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

async fn measure(args: &Args, model: &str, gpu: &str) -> anyhow::Result<StepProfile> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(300)).build()?;
    let spec: vllm::EngineSpec = format!("vllm={}", args.url).parse().map_err(|e: String| anyhow!("--url {e}"))?;
    let probed = vllm::probe(&http, &spec).await.map_err(|e| anyhow!(e))?;
    let (url, served, block_size) = (spec.url, probed.model, probed.block_size);
    let mut server = Server {
        http,
        url: url.clone(),
        model: served.clone(),
        block_size,
        rng: rand::rngs::StdRng::seed_from_u64(args.seed),
    };
    let mut samples = Vec::new();
    // A first request warms the server (lazy allocations, the first step's compile), then
    // the shapes to measure run unmeasured until the warm-up time is spent.
    server.prefill(*args.prompt_tokens.first().unwrap_or(&32)).await?;
    let warm = std::time::Instant::now();
    while warm.elapsed().as_secs_f64() < args.warmup_s {
        for &n in &args.prompt_tokens {
            server.prefill(n).await?;
        }
        for &batch in &args.batches {
            server.decode(batch, args.decode_context, args.decode_tokens).await?;
        }
    }
    for &n in &args.prompt_tokens {
        let mut took = Vec::new();
        for _ in 0..args.repeat {
            took.extend(server.prefill(n).await?);
        }
        if let Some(seconds) = median(took) {
            let n64 = u64::from(n);
            samples.push(StepSample {
                prefill_seqs: 1,
                prefill_tokens: n64,
                prefill_attention_pairs: n64 * (n64 + 1) / 2,
                decode_seqs: 0,
                decode_context_tokens: 0,
                seconds,
            });
        }
    }
    for &batch in &args.batches {
        let mut took = Vec::new();
        for _ in 0..args.repeat {
            if let Some(s) = server.decode(batch, args.decode_context, args.decode_tokens).await? {
                took.push(s);
            }
        }
        let Some(seconds) = median(took) else {
            tracing::warn!(batch, "the server timed no token between two others");
            continue;
        };
        // The streams' context midway through their output.
        let context = u64::from(args.decode_context + args.decode_tokens / 2);
        samples.push(StepSample {
            prefill_seqs: 0,
            prefill_tokens: 0,
            prefill_attention_pairs: 0,
            decode_seqs: batch,
            decode_context_tokens: u64::from(batch) * context,
            seconds,
        });
    }
    // Streams long enough to be decoding still when the prompt arrives (after the histogram
    // read that comes first).
    let mixed_tokens = 4 * args.decode_tokens;
    for &n in &args.mixed_prompt_tokens {
        for &batch in &args.mixed_batches {
            let mut took = Vec::new();
            for _ in 0..args.repeat {
                took.extend(server.mixed(n, batch, args.decode_context, mixed_tokens).await?);
            }
            let Some(seconds) = median(took) else {
                tracing::warn!(n, batch, "no prefill beside {batch} streams was timed alone");
                continue;
            };
            let n64 = u64::from(n);
            // The streams' context: their prompt and about a quarter of their output by then.
            let context = u64::from(args.decode_context + mixed_tokens / 4);
            samples.push(StepSample {
                prefill_seqs: 1,
                prefill_tokens: n64,
                prefill_attention_pairs: n64 * (n64 + 1) / 2,
                decode_seqs: batch,
                decode_context_tokens: u64::from(batch) * context,
                seconds,
            });
        }
    }
    Ok(StepProfile {
        format: PROFILE_FORMAT,
        model: model.to_string(),
        gpu: gpu.to_string(),
        tp: 1,
        block_size: server.block_size,
        source: format!("fleetplane profile-vllm of {url} (model {served}), medians of {} runs", args.repeat),
        samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sample_is_the_median() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(Vec::new()), None);
    }
}
