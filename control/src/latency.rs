//! `fleetplane latency`: what a live fleet's path adds to each request beyond its engines'
//! steps — the simulator's `dispatch_ms`.
//!
//! Requests go through the gateway one at a time, so each finds its engine idle, with cold
//! prompts of the lengths the engine's profile measured as a lone prefill, and one output
//! token each. A request's time to first token is then the path (HTTP, routing, gRPC to the
//! engine, the engine taking it in, the token streamed back) plus one prefill step of exactly
//! a profiled shape; the difference is the path's latency. Several lengths show whether it
//! is a constant (what the simulator models) or grows with the prompt.

use crate::replay::{one, prompt_tokens, GatewayArgs};
use crate::Failure;
use anyhow::anyhow;
use control::quantile;
use engine::StepProfile;
use serde_json::{json, Value};
use simulator::report::write_json;
use std::path::PathBuf;
use std::time::Duration;

/// `fleetplane latency`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The engines' step profile (`fleetplane profile`): its lone cold prompts are the probes.
    #[arg(long, value_name = "FILE.json")]
    pub profile: PathBuf,

    #[command(flatten)]
    pub gateway: GatewayArgs,

    /// Requests per prompt length (after two to warm the path up).
    #[arg(long, default_value_t = 10)]
    pub requests: u32,

    /// Longest probe prompt: longer prefills add their run-to-run noise to the difference.
    #[arg(long, value_name = "TOKENS", default_value_t = 2048)]
    pub max_prompt_tokens: u64,

    /// Write the measurement as JSON.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

/// Prompt lengths the profile measured alone and cold (no cached prefix, no decodes beside),
/// with their step time in ms, shortest first.
pub fn lone_prompts(profile: &StepProfile, max_tokens: u64) -> Vec<(u64, f64)> {
    let mut v: Vec<(u64, f64)> = profile
        .samples
        .iter()
        .filter(|s| s.prefill_seqs == 1 && s.decode_seqs == 0 && s.prefill_tokens <= max_tokens)
        .filter(|s| s.prefill_attention_pairs == s.prefill_tokens * (s.prefill_tokens + 1) / 2)
        .map(|s| (s.prefill_tokens, s.seconds * 1e3))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
    v.dedup_by_key(|s| s.0);
    v
}

/// One prompt length's probes.
struct Probe {
    prompt_tokens: u64,
    step_ms: f64,
    ttft_ms: Vec<f64>,
}

pub fn run(args: Args) -> Result<(), Failure> {
    let profile = cost::load_profile(&args.profile).map_err(|e| Failure::Input(e.into()))?;
    let lengths = lone_prompts(&profile, args.max_prompt_tokens);
    if lengths.is_empty() {
        return Err(Failure::Input(anyhow!(
            "{} has no lone cold prompt of at most {} tokens to probe with",
            args.profile.display(),
            args.max_prompt_tokens
        )));
    }
    if args.requests == 0 {
        return Err(Failure::Input(anyhow!("--requests must be at least 1")));
    }
    let model = args.gateway.model(&profile.model);
    let probes =
        crate::runtime()?.block_on(probe(&args, &model, profile.block_size, &lengths)).map_err(Failure::Run)?;

    let mut all: Vec<f64> = probes.iter().flat_map(|p| p.ttft_ms.iter().map(move |t| t - p.step_ms)).collect();
    let dispatch_ms = quantile(&mut all, 0.5);
    println!("{:>13}  {:>8}  {:>11}  {:>11}  {:>12}", "prompt tokens", "requests", "TTFT p50", "step", "path p50");
    let mut rows = Vec::new();
    for p in probes {
        let mut ttft = p.ttft_ms;
        let (t50, n) = (quantile(&mut ttft, 0.5), ttft.len());
        println!("{:>13}  {n:>8}  {t50:>8.2} ms  {:>8.2} ms  {:>9.2} ms", p.prompt_tokens, p.step_ms, t50 - p.step_ms);
        rows.push(json!({"prompt_tokens": p.prompt_tokens, "requests": n, "ttft_ms_p50": t50,
            "step_ms": p.step_ms, "path_ms_p50": t50 - p.step_ms}));
    }
    println!(
        "dispatch_ms = {dispatch_ms:.2}   (median over {} requests; `[fleet] dispatch_ms` or `--dispatch-ms`)",
        all.len()
    );
    if let Some(path) = &args.json {
        let gateway = &args.gateway.gateway;
        let v: Value =
            json!({"profile": profile.source, "gateway": gateway, "lengths": rows, "dispatch_ms": dispatch_ms});
        write_json(path, &v).map_err(|e| Failure::Output(e.into()))?;
    }
    Ok(())
}

/// Sends the probes one at a time; a request that fails stops the measurement (a path that
/// fails is not one to calibrate on).
async fn probe(args: &Args, model: &str, block_size: u32, lengths: &[(u64, f64)]) -> anyhow::Result<Vec<Probe>> {
    let client = reqwest::Client::new();
    let gateway = args.gateway.base_url();
    let mut salt = 1u64 << 40;
    let mut send = |tokens: u64| {
        salt += 1;
        // A fresh salt per request: no prompt shares a block with another, so every one is cold.
        let prompt = prompt_tokens(&[], tokens as u32, block_size, salt, args.gateway.vocab);
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 1, "ignore_eos": true, "stream": true});
        one(client.post(format!("{gateway}/v1/completions")).bearer_auth(&args.gateway.token).json(&body))
    };
    for _ in 0..2 {
        send(lengths[0].0).await;
    }
    let mut probes = Vec::new();
    for &(prompt_tokens, step_ms) in lengths {
        let mut ttft_ms = Vec::new();
        for _ in 0..args.requests {
            let o = send(prompt_tokens).await;
            match (o.ok, o.ttft) {
                (true, Some(t)) => ttft_ms.push(t.as_secs_f64() * 1e3),
                (true, None) => return Err(anyhow!("a {prompt_tokens}-token probe streamed no token")),
                (false, _) => {
                    let why = o.error.unwrap_or_default();
                    return Err(anyhow!("a {prompt_tokens}-token probe failed: {why}"));
                }
            }
            // Let the engine go idle and report before the next one.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        probes.push(Probe { prompt_tokens, step_ms, ttft_ms });
    }
    Ok(probes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::{StepSample, PROFILE_FORMAT};

    fn sample(prefill_seqs: u32, tokens: u64, pairs: u64, decode_seqs: u32, ms: f64) -> StepSample {
        StepSample {
            prefill_seqs,
            prefill_tokens: tokens,
            prefill_attention_pairs: pairs,
            decode_seqs,
            decode_context_tokens: u64::from(decode_seqs) * 128,
            seconds: ms / 1e3,
        }
    }

    #[test]
    fn probes_are_the_lone_cold_prompts() {
        let cold = |n: u64| n * (n + 1) / 2;
        let profile = StepProfile {
            format: PROFILE_FORMAT,
            model: "llama-3.1-8b".into(),
            gpu: "h200".into(),
            tp: 1,
            block_size: 16,
            source: "test".into(),
            samples: vec![
                sample(1, 512, cold(512), 0, 20.0),
                sample(1, 64, cold(64), 0, 5.0),
                sample(1, 512, cold(512) + 512 * 2048, 0, 30.0), // after a cached prefix
                sample(1, 256, cold(256), 8, 12.0),              // beside decodes
                sample(4, 512, 4 * cold(128), 0, 9.0),           // packed prompts
                sample(1, 8192, cold(8192), 0, 280.0),           // past the limit
            ],
        };
        assert_eq!(lone_prompts(&profile, 2048), vec![(64, 5.0), (512, 20.0)]);
        assert!(lone_prompts(&profile, 32).is_empty());
    }
}
