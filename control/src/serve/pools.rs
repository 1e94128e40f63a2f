//! `serve`'s pool settings: a colocated fleet, or prefill and decode pools sized by an
//! autoscaler, and what they resolve to: the controller's [`PdConfig`] (with the cost model's
//! rates for the engines the fleet runs, in the engines' time scale) and the spec of the
//! engines an actuator starts.

use anyhow::{anyhow, bail, Context};
use clap::{Args as ClapArgs, ValueEnum};
use cost::{calibrated_cost, gpu_by_name, model_by_name, CostModel, CostParams, Deployment};
use engine::{Dur, InstanceConfig};
use policies::{AutoscalerConfig, CostHints, DecodeModel, Knobs, PdConfig};
use simulator::pools::{check, PdRun};
use simulator::slo::Slo;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Every engine serves whole requests.
    Colocated,
    /// Prefill and decode pools: each request's KV moves from a prefill engine to a decode
    /// engine after its first token.
    Pd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ActuatorKind {
    /// Engines are started by hand (or by the demo); the pools are not sized.
    None,
    /// The leader starts and stops `fleetplane engine --executor sim` child processes.
    Local,
}

#[derive(ClapArgs, Debug, Clone)]
pub struct PoolArgs {
    #[arg(long, value_enum, default_value = "colocated")]
    pub mode: Mode,

    /// What starts and stops engines for the autoscaler.
    #[arg(long, value_enum, default_value = "none")]
    pub actuator: ActuatorKind,

    /// Pool sizing of a P/D fleet: none, fixed-xpyd (groups of 1 prefill + 1 decode) or
    /// slo-load.
    #[arg(long, default_value = "none")]
    pub autoscaler: String,

    /// GPUs the fleet may hold at once (engines starting, serving and draining).
    #[arg(long, default_value_t = 8)]
    pub gpu_budget: u32,

    /// Fewest engines per pool; a pool below it is refilled (through the actuator).
    #[arg(long, default_value_t = 1)]
    pub min_per_pool: u32,

    /// Seconds an engine takes from start to serving: growth waits this plus 10 s before
    /// growing again.
    #[arg(long, default_value_t = 2.0)]
    pub startup_s: f64,

    /// Period of the scaling decisions, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub scale_tick_ms: u64,

    /// Overrides of the autoscaler's hysteresis: how long a load stays above (below) the band
    /// before growing (shrinking), and the waits after growing and after any change.
    #[arg(long)]
    pub up_hold_ms: Option<u64>,
    #[arg(long)]
    pub down_hold_ms: Option<u64>,
    #[arg(long)]
    pub up_cooldown_ms: Option<u64>,
    #[arg(long)]
    pub down_cooldown_ms: Option<u64>,

    /// Sliding window of the SLO load's actual latencies, in seconds.
    #[arg(long, default_value_t = 10.0)]
    pub slo_window_s: f64,

    /// Link between prefill and decode engines, GB/s (the modelled transfer time).
    #[arg(long, default_value_t = 50.0)]
    pub transfer_gb_s: f64,

    /// Model of the fleet's engines (a cost-model name): the controller's rates, and what
    /// the actuator starts.
    #[arg(long, default_value = "llama-3.1-8b")]
    pub engine_model: String,

    /// GPU the engines' cost model stands for.
    #[arg(long, default_value = "h100")]
    pub engine_gpu: String,

    /// A step profile of the engines (`fleetplane profile` of our CUDA engine, `fleetplane
    /// profile-vllm` of a vLLM server): the controller's rates are calibrated on it, and the
    /// engines the actuator starts of ours get it as their `--profile`.
    #[arg(long, value_name = "FILE.json")]
    pub engine_profile: Option<std::path::PathBuf>,

    /// The engines' `--time-scale` (0.1: ten times faster than the GPU would be).
    #[arg(long, default_value_t = 1.0)]
    pub engine_time_scale: f64,

    /// The engines' `--kv-blocks` [default: as many as the GPU holds].
    #[arg(long)]
    pub engine_kv_blocks: Option<u32>,

    /// With `--actuator local`: start vLLM servers with this command line instead of
    /// `fleetplane engine` (run by `sh -c 'exec LINE'`; `{port}`, `{kv_port}`,
    /// `{replay_port}`, `{side_port}`, `{role}`, `{name}` filled in). Each is registered as a
    /// vLLM engine of its role once it answers at `http://127.0.0.1:{port}`.
    #[arg(long)]
    pub engine_command: Option<String>,

    /// gRPC addresses of every replica, comma-separated: the engines the actuator starts
    /// register with all of them [default: this replica's].
    #[arg(long, value_delimiter = ',')]
    pub engine_control: Vec<String>,
}

fn millis(ms: u64) -> Dur {
    Dur::from_millis(ms)
}

impl PoolArgs {
    /// The controller's pool settings (`None` for a colocated fleet), for SLO targets `slo`.
    pub fn pd_config(&self, slo: Slo) -> anyhow::Result<Option<PdConfig>> {
        if self.mode == Mode::Colocated {
            if self.actuator != ActuatorKind::None || self.autoscaler != "none" || self.engine_command.is_some() {
                bail!("--actuator, --autoscaler and --engine-command size the pools of --mode pd");
            }
            return Ok(None);
        }
        let scale = self.engine_time_scale;
        if !(scale.is_finite() && scale > 0.0) {
            bail!("--engine-time-scale {scale} must be a positive number with --mode pd");
        }
        let startup = check::seconds(self.startup_s).map_err(|e| anyhow!("--startup-s: {e}"))?;
        let slo_window = check::positive_seconds(self.slo_window_s).map_err(|e| anyhow!("--slo-window-s: {e}"))?;
        let transfer_bytes_per_s =
            check::bandwidth_gb_s(self.transfer_gb_s).map_err(|e| anyhow!("--transfer-gb-s: {e}"))?;
        let tick = check::positive_seconds(self.scale_tick_ms as f64 / 1e3)
            .map_err(|e| anyhow!("--scale-tick-ms: {} ms: {e}", self.scale_tick_ms))?;
        if let Some(template) = &self.engine_command {
            if self.actuator != ActuatorKind::Local {
                bail!("--engine-command is what --actuator local starts: give --actuator local");
            }
            super::actuator::EngineCommand::check(template).map_err(|e| anyhow!(e))?;
        }
        let min_per_pool = self.min_per_pool.max(1);
        check::gpu_budget(self.gpu_budget, 2 * min_per_pool, 1, "engines the pools' minimums need")
            .map_err(|e| anyhow!("--gpu-budget: {e}"))?;
        let autoscaler = self.autoscaler(&self.autoscaler)?;
        let cost = self.cost_model()?;
        let instance = self.instance_config(&cost);
        let hints = self.hints(&cost, &instance);
        let run = PdRun {
            prefill: 0,
            decode: 0,
            autoscaler,
            startup,
            gpu_budget: self.gpu_budget,
            min_per_pool,
            tick,
            slo_window,
            transfer_bytes_per_s,
            transfer_latency: Dur::from_millis(1),
        };
        let mut pd = run.pd_config(&cost, slo, instance.block_size, hints.prefill_tokens_per_s);
        // The cost model's times are a GPU's; the engines run them `scale` times as long.
        let d = &mut pd.slo.decode;
        (d.base_us, d.per_seq_us, d.per_kv_token_us) =
            (d.base_us * scale, d.per_seq_us * scale, d.per_kv_token_us * scale);
        pd.transfer.bytes_per_s /= scale;
        pd.transfer.latency = Dur::from_secs_f64(pd.transfer.latency.as_secs_f64() * scale);
        Ok(Some(pd))
    }

    /// The autoscaler `name` with the hysteresis these flags give (`--autoscaler`'s, or a
    /// stored policy's); the error names the valid ones.
    pub fn autoscaler(&self, name: &str) -> Result<AutoscalerConfig, policies::UnknownAutoscaler> {
        let startup = Dur::from_secs_f64(self.startup_s);
        let mut autoscaler = AutoscalerConfig::by_name(name, startup, (1, 1))?;
        if let AutoscalerConfig::FixedXpyd { knobs, .. } | AutoscalerConfig::SloLoad { knobs } = &mut autoscaler {
            self.override_knobs(knobs);
        }
        Ok(autoscaler)
    }

    fn override_knobs(&self, k: &mut Knobs) {
        let set = |field: &mut Dur, ms: Option<u64>| {
            if let Some(ms) = ms {
                *field = millis(ms);
            }
        };
        set(&mut k.up_hold, self.up_hold_ms);
        set(&mut k.down_hold, self.down_hold_ms);
        set(&mut k.up_cooldown, self.up_cooldown_ms);
        set(&mut k.down_cooldown, self.down_cooldown_ms);
    }

    fn cost_model(&self) -> anyhow::Result<CostModel> {
        let model = model_by_name(&self.engine_model).context("--engine-model")?;
        let gpu = gpu_by_name(&self.engine_gpu).context("--engine-gpu")?;
        let (cost, _) = calibrated_cost(
            model,
            gpu,
            Deployment::tensor_parallel(1),
            CostParams::default(),
            self.engine_profile.as_deref(),
        )
        .map_err(|e| anyhow!("--engine-model on --engine-gpu (--engine-profile): {e}"))?;
        Ok(cost)
    }

    /// The engines' instance settings, as `fleetplane engine` resolves its defaults.
    fn instance_config(&self, cost: &CostModel) -> InstanceConfig {
        let block_size = 16;
        InstanceConfig {
            block_size,
            total_blocks: self.engine_kv_blocks.unwrap_or_else(|| cost.kv_blocks(block_size)),
            max_batch_tokens: 8192,
            ..InstanceConfig::default()
        }
    }

    /// What the routers may assume of the engines' speed, in the engines' time.
    fn hints(&self, cost: &CostModel, instance: &InstanceConfig) -> CostHints {
        in_engine_time(cost::cost_hints(cost, instance), self.engine_time_scale)
    }

    /// The routers' cost hints: the engines' for a P/D fleet; for a colocated one the defaults,
    /// until engines register with their own (`registry::price_as`).
    pub fn cost_hints(&self) -> anyhow::Result<CostHints> {
        if self.mode == Mode::Colocated {
            return Ok(CostHints::default());
        }
        let cost = self.cost_model()?;
        Ok(self.hints(&cost, &self.instance_config(&cost)))
    }
}

/// What the routers may assume of the speed of an engine of `shape` with blocks of
/// `block_size` tokens, in its own time (an engine without one, `--time-scale 0`, is priced
/// as its GPU).
pub fn engine_hints(shape: &crate::proto::CostShape, block_size: u32) -> anyhow::Result<CostHints> {
    let model = model_by_name(&shape.model)?;
    let gpu = gpu_by_name(&shape.gpu)?;
    if shape.max_batch_tokens == 0 {
        bail!("a token budget of 0 per step");
    }
    let cost = CostModel::new(model, gpu, Deployment::tensor_parallel(shape.tp), CostParams::default())?;
    let instance = InstanceConfig { block_size, max_batch_tokens: shape.max_batch_tokens, ..InstanceConfig::default() };
    let scale = if shape.time_scale.is_finite() && shape.time_scale > 0.0 { shape.time_scale } else { 1.0 };
    Ok(in_engine_time(cost::cost_hints(&cost, &instance), scale))
}

/// A GPU's rates `h` in the time of engines whose steps last `scale` times as long.
fn in_engine_time(h: CostHints, scale: f64) -> CostHints {
    CostHints {
        prefill_tokens_per_s: h.prefill_tokens_per_s / scale,
        l2_tokens_per_s: h.l2_tokens_per_s / scale,
        l3_tokens_per_s: h.l3_tokens_per_s / scale,
        decode: DecodeModel {
            base_us: h.decode.base_us * scale,
            per_seq_us: h.decode.per_seq_us * scale,
            per_kv_token_us: h.decode.per_kv_token_us * scale,
        },
        ..h
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        pools: PoolArgs,
    }

    pub(in crate::serve) fn args(flags: &[&str]) -> PoolArgs {
        Cli::try_parse_from(std::iter::once("serve").chain(flags.iter().copied())).expect("flags parse").pools
    }

    const SLO: Slo = Slo { ttft_ms: 2000.0, tpot_ms: 100.0 };

    #[test]
    fn a_colocated_fleet_has_no_pools_and_refuses_pool_flags() {
        assert_eq!(args(&[]).pd_config(SLO).ok(), Some(None));
        let e = args(&["--actuator", "local"]).pd_config(SLO).unwrap_err().to_string();
        assert!(e.contains("--mode pd"), "{e}");
    }

    #[test]
    fn the_engines_time_scale_stretches_the_controllers_rates() {
        let at = |scale: &str| {
            args(&["--mode", "pd", "--autoscaler", "slo-load", "--engine-time-scale", scale])
                .pd_config(SLO)
                .expect("valid")
                .expect("pools")
        };
        let (one, two) = (at("1"), at("2"));
        assert_eq!(two.slo.decode.base_us, 2.0 * one.slo.decode.base_us);
        assert_eq!(two.slo.decode.per_kv_token_us, 2.0 * one.slo.decode.per_kv_token_us);
        assert_eq!(two.slo.nominal_prefill_tokens_per_s, one.slo.nominal_prefill_tokens_per_s / 2.0);
        let (t1, t2) = (one.transfer.time(10_000).0, two.transfer.time(10_000).0);
        assert!(t2.abs_diff(2 * t1) <= 1, "twice as long, to the µs: {t1} µs then {t2} µs");
        assert_eq!((one.slo.ttft_target_ms, one.min_per_pool, one.gpu_budget), (2000.0, 1, 8));
    }

    #[test]
    fn an_engine_profile_calibrates_the_controllers_rates() {
        let profile = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/results/profile-h200-llama-8b.json");
        let on = |gpu: &str, extra: &[&str]| {
            let mut flags = vec!["--mode", "pd", "--autoscaler", "slo-load", "--engine-gpu", gpu];
            flags.extend_from_slice(extra);
            args(&flags).pd_config(SLO)
        };
        let plain = on("h200", &[]).expect("valid").expect("pools");
        let fitted = on("h200", &["--engine-profile", profile]).expect("the profile fits").expect("pools");
        assert_ne!(plain.slo.decode.base_us, fitted.slo.decode.base_us);
        let e = on("h200", &["--engine-profile", "/nonexistent/p.json"]).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/p.json"), "{e}");
        // Measured on an H200, not an H100: named, not fitted anyway.
        let e = on("h100", &["--engine-profile", profile]).unwrap_err().to_string();
        assert!(e.contains("h200"), "{e}");
    }

    #[test]
    fn hysteresis_flags_override_the_autoscalers_defaults() {
        let pd =
            args(&["--mode", "pd", "--autoscaler", "slo-load", "--up-hold-ms", "200", "--down-cooldown-ms", "1500"])
                .pd_config(SLO)
                .expect("valid")
                .expect("pools");
        let AutoscalerConfig::SloLoad { knobs } = pd.autoscaler else { panic!("slo-load: {:?}", pd.autoscaler) };
        let defaults = Knobs::for_startup(Dur::from_secs_f64(2.0));
        assert_eq!((knobs.up_hold, knobs.down_cooldown), (Dur::from_millis(200), Dur::from_millis(1500)));
        assert_eq!((knobs.down_hold, knobs.up_cooldown), (defaults.down_hold, defaults.up_cooldown));
    }

    #[test]
    fn bad_pool_flags_are_named() {
        for (flags, named) in [
            (&["--mode", "pd", "--engine-time-scale", "0"][..], "--engine-time-scale"),
            (&["--mode", "pd", "--gpu-budget", "1"], "--gpu-budget"),
            (&["--mode", "pd", "--transfer-gb-s", "0"], "--transfer-gb-s"),
            (&["--mode", "pd", "--autoscaler", "magic"], "magic"),
            (&["--mode", "pd", "--engine-model", "gpt-9"], "gpt-9"),
            (&["--mode", "pd", "--engine-command", "vllm --port {port}"], "--actuator local"),
            (&["--mode", "pd", "--actuator", "local", "--engine-command", "vllm"], "no {port}"),
        ] {
            let e = format!("{:#}", args(flags).pd_config(SLO).unwrap_err());
            assert!(e.contains(named), "{flags:?}: {e}");
        }
    }
}
