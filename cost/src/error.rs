//! Errors of the cost model: bad names from a config and deployments that cannot run.
//!
//! These are operating errors (a user typed a name or a TP degree), so they are returned,
//! never panicked on, and each message names what was wrong and what would have been valid.

/// A catalog lookup (`model_by_name`, `gpu_by_name`) that found nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} `{name}` (valid: {})", .valid.join(", "))]
pub struct UnknownName {
    /// What was looked up: "model" or "gpu".
    pub kind: &'static str,
    /// The name as given.
    pub name: String,
    /// Every name the catalog knows, in catalog order.
    pub valid: Vec<&'static str>,
}

impl UnknownName {
    /// Finds the entry of `catalog` called `name`, or says which names there are.
    pub(crate) fn lookup<T>(
        catalog: &'static [T],
        kind: &'static str,
        name: &str,
        name_of: fn(&T) -> &'static str,
    ) -> Result<&'static T, UnknownName> {
        catalog.iter().find(|e| name_of(e) == name).ok_or_else(|| UnknownName {
            kind,
            name: name.to_string(),
            valid: catalog.iter().map(name_of).collect(),
        })
    }
}

/// Why a [`crate::CostModel`] cannot be built.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CostError {
    #[error("tensor parallelism {tp} is not supported (valid: 1, 2, 4, 8)")]
    UnsupportedTp { tp: u32 },

    /// Query heads must split evenly; KV heads must either split evenly or be replicated
    /// evenly (tp a multiple of the KV head count).
    #[error("model `{model}`: {heads} {what} cannot be split over tp {tp}")]
    HeadsNotDivisible { model: &'static str, what: &'static str, heads: u32, tp: u32 },

    /// A deployment degree out of range or inconsistent with the others or with the model.
    #[error("invalid deployment: {field} = {value}: {reason}")]
    InvalidLayout { field: &'static str, value: u32, reason: String },

    #[error(
        "model `{model}` does not fit on gpu `{gpu}` with {deployment}: weights need {} per GPU, \
         {} available ({} x {memory_utilization} memory utilization - {} activation reserve)",
        gb(*.needed_bytes), gb(*.available_bytes), gb(*.memory_bytes), gb(*.activation_reserve_bytes)
    )]
    WeightsDoNotFit {
        model: &'static str,
        gpu: &'static str,
        /// The deployment as written (`Deployment`'s display).
        deployment: String,
        /// Weight bytes on the most loaded GPU under the deployment.
        needed_bytes: u64,
        /// Memory per GPU the engine may use, less the activation reserve.
        available_bytes: u64,
        memory_bytes: u64,
        memory_utilization: f64,
        activation_reserve_bytes: u64,
    },

    #[error("cost parameter `{field}` = {value} is out of range: {expected}")]
    InvalidParam { field: &'static str, value: f64, expected: &'static str },
}

/// Bytes as decimal gigabytes with one decimal, for messages.
fn gb(bytes: u64) -> String {
    format!("{:.1} GB", bytes as f64 / 1e9)
}
