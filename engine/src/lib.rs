//! One inference instance, independent of how its forward pass runs.
//!
//! The [`Instance`] owns the request queues, the paged [`kv::KvCache`] with its prefix tree,
//! and the iteration scheduler. Each iteration it forms a [`Batch`] and hands it to an
//! [`Executor`]: the simulator's cost model or a GPU. Nothing here reads a clock, a socket
//! or a random source: `now` is always an argument.

pub mod batch;
pub mod block_map;
mod coast;
pub mod executor;
mod handoff;
pub mod ids;
pub mod instance;
pub mod kv;
pub mod profile;
pub mod programs;
pub mod request;
mod scheduler;
mod sequence;
pub mod service;
pub mod slots;
pub mod time;

pub use batch::{Batch, BatchEntry, BatchStats};
pub use executor::{Executor, ExecutorError, StepOutput};
pub use ids::{block_hashes, BlockHash, BlockId, InstanceId, ModelId, RequestId};
pub use instance::{FairPrefill, Instance, InstanceConfig, KvProtection, Load, PrefillPolicy, Rejected, RunawayAction};
pub use profile::{StepProfile, StepSample, PROFILE_FORMAT};
pub use programs::ProgramHold;
pub use request::{CutShort, Evicted, Finished, Handoff, Request, Resume};
pub use service::{Class, Service, SessionId, TenantId};
pub use time::{Dur, Time};

#[cfg(test)]
mod tests;
