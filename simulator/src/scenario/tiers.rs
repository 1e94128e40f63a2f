//! The KV tiers of a simulated fleet: which are on, how big, how fast, and how late the
//! router hears of their changes. A scenario's `[kv]` section, resolved against the model.
//!
//! ```toml
//! [kv]
//! tiers = "l1,l2,l3"     # l1 | l1,l2 | l1,l3 | l1,l2,l3
//! l2_gib = 128           # host memory for KV, per instance
//! l3_gib = 4096          # the shared store, for the whole fleet
//! l2_gbps = 50           # host to GPU, GB/s per GPU (PCIe Gen5 x16)
//! l3_gbps = 25           # store to GPU, GB/s per GPU (200 Gb/s RDMA)
//! l3_latency_us = 100
//! event_delay_ms = 5     # KV events reach the router this much later
//! offload_chunk_tokens = 256  # L2 and L3 keep chunks of 256 tokens [default: one block]
//! ```
//!
//! `offload_chunk_tokens`: the unit L2 and L3 keep, as vLLM's offloading connector (its
//! offloaded block size) and LMCache (256-token chunks) do; a multiple of the block size that
//! divides a page of 32 blocks. A chunk is copied down when its last block leaves GPU memory,
//! a prompt's tail past its last whole chunk is not kept below L1, and the prefix index and
//! the stores do their work a chunk at a time (see `engine::kv::KvCache::offload_chunks`).

use super::ScenarioError;
use cost::{CostModel, TierLinks};
use engine::kv::{offload_chunk_fits, Tier, PAGE_BLOCKS};
use engine::Dur;
use serde::{Deserialize, Serialize};

pub const DEFAULT_L2_GIB: f64 = 128.0;
pub const DEFAULT_L3_GIB: f64 = 4096.0;
pub const DEFAULT_EVENT_DELAY_MS: f64 = 5.0;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvSection {
    pub tiers: Option<String>,
    pub l2_gib: Option<f64>,
    pub l3_gib: Option<f64>,
    pub l2_gbps: Option<f64>,
    pub l3_gbps: Option<f64>,
    pub l3_latency_us: Option<f64>,
    pub event_delay_ms: Option<f64>,
    pub offload_chunk_tokens: Option<u32>,
}

impl KvSection {
    /// `over`'s values win.
    pub fn overlay(self, over: KvSection) -> KvSection {
        KvSection {
            tiers: over.tiers.or(self.tiers),
            l2_gib: over.l2_gib.or(self.l2_gib),
            l3_gib: over.l3_gib.or(self.l3_gib),
            l2_gbps: over.l2_gbps.or(self.l2_gbps),
            l3_gbps: over.l3_gbps.or(self.l3_gbps),
            l3_latency_us: over.l3_latency_us.or(self.l3_latency_us),
            event_delay_ms: over.event_delay_ms.or(self.event_delay_ms),
            offload_chunk_tokens: over.offload_chunk_tokens.or(self.offload_chunk_tokens),
        }
    }
}

/// Resolved tiers: capacities in blocks of the fleet's block size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvTiers {
    /// Per instance; 0 when L2 is off.
    pub l2_blocks: u32,
    /// For the whole fleet; `None` when L3 is off.
    pub l3_blocks: Option<u32>,
    pub links: TierLinks,
    /// Delay between a KV change on an instance and the router hearing of it.
    pub event_delay: Dur,
    /// Blocks of one entry of L2 and L3 (an offload chunk); 1: single blocks.
    pub chunk_blocks: u32,
}

impl Default for KvTiers {
    fn default() -> Self {
        KvTiers { l2_blocks: 0, l3_blocks: None, links: TierLinks::default(), event_delay: Dur::ZERO, chunk_blocks: 1 }
    }
}

fn invalid(key: &'static str, reason: impl Into<String>) -> ScenarioError {
    ScenarioError::Invalid { key, reason: reason.into() }
}

/// Parses `l1`, `l1,l2`, `l1,l2,l3`, ...: L1 must be there; every name once.
pub fn parse_tiers(s: &str) -> Result<Vec<Tier>, ScenarioError> {
    let mut tiers = Vec::new();
    for name in s.split(',').map(str::trim) {
        let tier = Tier::ALL.into_iter().find(|t| t.name() == name).ok_or_else(|| {
            invalid("kv.tiers", format!("unknown tier `{name}` in `{s}` (valid: l1, l2, l3, comma-separated)"))
        })?;
        if tiers.contains(&tier) {
            return Err(invalid("kv.tiers", format!("`{name}` named twice in `{s}`")));
        }
        tiers.push(tier);
    }
    if !tiers.contains(&Tier::L1) {
        return Err(invalid("kv.tiers", format!("`{s}` lacks l1: GPU memory is always a tier")));
    }
    Ok(tiers)
}

fn positive(key: &'static str, v: f64) -> Result<f64, ScenarioError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(invalid(key, format!("{v} is not a positive number")))
    }
}

impl KvSection {
    /// Checks the section and sizes the tiers in blocks: a tier's GiB over the KV bytes of one
    /// block of the model (every layer and head, as the host or store keeps a whole copy).
    pub fn resolve(&self, cost: &CostModel, block_size: u32) -> Result<KvTiers, ScenarioError> {
        let tiers = parse_tiers(self.tiers.as_deref().unwrap_or("l1"))?;
        let defaults = TierLinks::default();
        let links = TierLinks {
            l2_bytes_per_s: positive("kv.l2_gbps", self.l2_gbps.unwrap_or(defaults.l2_bytes_per_s / 1e9))? * 1e9,
            l3_bytes_per_s: positive("kv.l3_gbps", self.l3_gbps.unwrap_or(defaults.l3_bytes_per_s / 1e9))? * 1e9,
            l3_latency_s: {
                let us = self.l3_latency_us.unwrap_or(defaults.l3_latency_s * 1e6);
                if !(us.is_finite() && us >= 0.0) {
                    return Err(invalid("kv.l3_latency_us", format!("{us} is not a number of microseconds >= 0")));
                }
                us * 1e-6
            },
        };
        let delay_ms = self.event_delay_ms.unwrap_or(DEFAULT_EVENT_DELAY_MS);
        if !(delay_ms.is_finite() && delay_ms >= 0.0) {
            return Err(invalid("kv.event_delay_ms", format!("{delay_ms} is not a number of milliseconds >= 0")));
        }
        let block_bytes = cost.model().kv_bytes_per_token() as f64 * f64::from(block_size);
        let blocks = |key, gib: f64| -> Result<u32, ScenarioError> {
            let b = positive(key, gib)? * f64::from(1u32 << 30) / block_bytes;
            if b < 1.0 || b > f64::from(u32::MAX) {
                return Err(invalid(key, format!("{gib} GiB is {b:.0} blocks of {block_bytes} bytes; need 1 to 2^32")));
            }
            Ok(b as u32)
        };
        let l2_blocks = match tiers.contains(&Tier::L2) {
            true => blocks("kv.l2_gib", self.l2_gib.unwrap_or(DEFAULT_L2_GIB))?,
            false => 0,
        };
        let l3_blocks = match tiers.contains(&Tier::L3) {
            true => Some(blocks("kv.l3_gib", self.l3_gib.unwrap_or(DEFAULT_L3_GIB))?),
            false => None,
        };
        let chunk_blocks = match self.offload_chunk_tokens {
            None => 1,
            Some(t) if t.is_multiple_of(block_size) && offload_chunk_fits(t / block_size) => t / block_size,
            Some(t) => {
                let valid: Vec<String> =
                    (0..=PAGE_BLOCKS.trailing_zeros()).map(|k| ((1u32 << k) * block_size).to_string()).collect();
                let reason = format!(
                    "{t} tokens is not a whole number of {block_size}-token blocks dividing a page of {PAGE_BLOCKS} (valid: {})",
                    valid.join(", ")
                );
                return Err(invalid("kv.offload_chunk_tokens", reason));
            }
        };
        let event_delay = Dur::from_secs_f64(delay_ms / 1e3);
        Ok(KvTiers { l2_blocks, l3_blocks, links, event_delay, chunk_blocks })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_lists_need_l1_and_known_names() {
        assert_eq!(parse_tiers("l1,l2,l3").ok(), Some(vec![Tier::L1, Tier::L2, Tier::L3]));
        assert!(parse_tiers("l2").unwrap_err().to_string().contains("lacks l1"));
        assert!(parse_tiers("l1,l4").unwrap_err().to_string().contains("unknown tier `l4`"));
        assert!(parse_tiers("l1,l1").unwrap_err().to_string().contains("twice"));
    }
}
