//! The discrete-event fleet simulator.
//!
//! It drives the real [`engine::Instance`] (scheduler, KV cache) and the real
//! [`policies::Controller`] in virtual time; only the executor (a roofline cost model) and the
//! fleet backend are simulated.

pub mod cost;
pub mod metrics;
pub mod plot;
pub mod report;
pub mod workload;
