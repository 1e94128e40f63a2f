//! The discrete-event fleet simulator.
//!
//! It drives the real [`engine::Instance`] (scheduler, KV cache) and the real
//! [`policies::Controller`] in virtual time; only the executor (a roofline cost model) and the
//! fleet backend are simulated. The cost model is the `cost` crate's.
//!
//! | module | purpose |
//! | --- | --- |
//! | `sim` | the driver loop: arrivals, fleet events, controller deadlines |
//! | `phases` | benchmarks only: the driver loop's wall-clock time by phase |
//! | `fleet` | [`fleet::SimFleet`]: engine instances stepped in virtual time |
//! | `queue` | the event queue |
//! | `workload` | Mooncake and Azure trace readers, synthetic generators (streamed) |
//! | `metrics` | fixed-size histograms and the run summary |
//! | `infinite_cache` | the hit-rate bound of an infinite shared cache, over a trie of the prompts seen |
//! | `report`, `plot` | terminal tables, JSON, CDF charts |
//! | `pools` | disaggregated and autoscaled runs: settings, controller config, report |
//! | `scenario` | scenario files, flag overlay, resolved settings |
//! | `policy_file` | policy files: a router with its parameters, scheduling, autoscaler |
//! | `search_space` | what `tune` searches: named parameters in ranges, a unit cube, the policy of a point |
//! | `tiers` | the `[kv]` section: tiers on, their sizes and links, KV event delay |
//! | `timeline` | per-window time series: pools, GPUs, SLO loads and attainment; restore times |

pub mod fleet;
pub mod infinite_cache;
pub mod metrics;
pub mod phases;
pub mod plot;
pub mod policy_file;
pub mod pools;
mod queue;
pub mod report;
pub mod scenario;
pub mod search_space;
pub mod sim;
pub mod slo;
pub mod timeline;
pub mod workload;
