//! Tunable parameters: each policy's config type lists its own, with a range and a one-line
//! doc, and is their one validator.
//!
//! A config implements [`Params`] through [`params!`]: the macro writes the table
//! ([`Params::PARAMS`]) and reads and writes each field by name, so a parameter is named in
//! one place. Scenarios, policy files and the live policy API set parameters by name with
//! [`Params::set`], which refuses an unknown name or a value outside the range with an error
//! naming the parameter ([`ParamError::param`]); [`catalog`] lists them all (`fleetplane tune
//! --list-params` prints it).
//!
//! Values travel as `f64`: integers must be whole, durations are seconds.

use engine::Dur;
use std::collections::BTreeMap;
use std::fmt;

/// What a parameter's value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Float,
    Integer,
    /// A duration, given in seconds.
    Seconds,
}

/// One parameter: its name in files and APIs, its range and what it does.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Param {
    pub name: &'static str,
    pub kind: Kind,
    pub min: f64,
    /// Whether `min` itself is refused: the range is `(min, max]`.
    pub min_open: bool,
    pub max: f64,
    pub doc: &'static str,
}

impl Param {
    /// `value` checked against the range and kind.
    pub fn check(&self, policy: &'static str, value: f64) -> Result<f64, ParamError> {
        let above_min = if self.min_open { value > self.min } else { value >= self.min };
        let whole = self.kind != Kind::Integer || value.fract() == 0.0;
        if value.is_finite() && above_min && value <= self.max && whole {
            return Ok(value);
        }
        Err(ParamError::OutOfRange { policy, param: self.name, value, range: self.range() })
    }

    /// The range as written in docs and errors: `[0, 10]`, `(0, 1]`, integers `0..=1024`.
    pub fn range(&self) -> String {
        let open = if self.min_open { "(" } else { "[" };
        match self.kind {
            Kind::Integer => format!("integer in {open}{}, {}]", self.min, self.max),
            Kind::Float => format!("{open}{}, {}]", self.min, self.max),
            Kind::Seconds => format!("seconds in {open}{}, {}]", self.min, self.max),
        }
    }
}

/// A parameter refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParamError {
    #[error("{policy} has no parameter `{param}` (valid: {valid})")]
    Unknown { policy: &'static str, param: String, valid: String },
    #[error("{policy}'s `{param}` is {value}, outside its range {range}")]
    OutOfRange { policy: &'static str, param: &'static str, value: f64, range: String },
}

impl ParamError {
    /// The parameter at fault, as given.
    pub fn param(&self) -> &str {
        match self {
            ParamError::Unknown { param, .. } => param,
            ParamError::OutOfRange { param, .. } => param,
        }
    }
}

/// A field that holds a parameter's value.
pub trait ParamField: Copy {
    fn to_value(self) -> f64;
    /// From a value [`Param::check`] accepted.
    fn from_value(v: f64) -> Self;
}

impl ParamField for f64 {
    fn to_value(self) -> f64 {
        self
    }
    fn from_value(v: f64) -> Self {
        v
    }
}

impl ParamField for u32 {
    fn to_value(self) -> f64 {
        f64::from(self)
    }
    fn from_value(v: f64) -> Self {
        v as u32
    }
}

impl ParamField for Dur {
    fn to_value(self) -> f64 {
        self.as_secs_f64()
    }
    fn from_value(v: f64) -> Self {
        Dur::from_secs_f64(v)
    }
}

/// A config whose fields are parameters.
pub trait Params: Sized {
    /// The policy's name, as errors and listings call it.
    const POLICY: &'static str;
    const PARAMS: &'static [Param];

    /// The value of the parameter `name`, if the config has one.
    fn get(&self, name: &str) -> Option<f64>;

    /// Sets a parameter known to exist, to a value already checked.
    fn put(&mut self, name: &str, value: f64);

    /// Sets the parameter `name` to `value`, refusing an unknown name or a value outside its
    /// range.
    fn set(&mut self, name: &str, value: f64) -> Result<(), ParamError> {
        let Some(p) = Self::PARAMS.iter().find(|p| p.name == name) else {
            return Err(ParamError::Unknown { policy: Self::POLICY, param: name.to_string(), valid: valid::<Self>() });
        };
        self.put(name, p.check(Self::POLICY, value)?);
        Ok(())
    }

    /// Sets every parameter of `values` (in name order, so that the first error is always the
    /// same one).
    fn set_all(&mut self, values: &BTreeMap<String, f64>) -> Result<(), ParamError> {
        values.iter().try_for_each(|(name, v)| self.set(name, *v))
    }

    /// Every parameter with its value.
    fn values(&self) -> BTreeMap<String, f64> {
        Self::PARAMS.iter().filter_map(|p| Some((p.name.to_string(), self.get(p.name)?))).collect()
    }
}

/// The entries of `values` that differ from `defaults`: the parameters a file or a label
/// needs to name.
pub fn changed(values: BTreeMap<String, f64>, defaults: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    values.into_iter().filter(|(k, v)| defaults.get(k) != Some(v)).collect()
}

fn valid<P: Params>() -> String {
    match P::PARAMS {
        [] => "none".to_string(),
        params => params.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
    }
}

/// Implements [`Params`] for a config struct: each line is `field: kind from|above MIN ..= MAX,
/// "doc"`, with kind `float` (an `f64` field), `integer` (`u32`) or `seconds` (`Dur`), and
/// `above` for a range that excludes its minimum.
#[macro_export]
macro_rules! params {
    ($ty:ty, $policy:literal, { $($field:ident: $kind:ident $bound:ident $min:literal ..= $max:literal, $doc:literal;)* }) => {
        impl $crate::params::Params for $ty {
            const POLICY: &'static str = $policy;
            const PARAMS: &'static [$crate::params::Param] = &[$($crate::params::Param {
                name: stringify!($field),
                kind: $crate::params!(@kind $kind),
                min: $min as f64,
                min_open: $crate::params!(@open $bound),
                max: $max as f64,
                doc: $doc,
            }),*];

            fn get(&self, name: &str) -> Option<f64> {
                match name {
                    $(stringify!($field) => Some($crate::params::ParamField::to_value(self.$field)),)*
                    _ => None,
                }
            }

            #[allow(unused_variables)]
            fn put(&mut self, name: &str, value: f64) {
                match name {
                    $(stringify!($field) => self.$field = $crate::params::ParamField::from_value(value),)*
                    _ => unreachable!("{} has no parameter `{name}`", $policy),
                }
            }
        }
    };
    (@kind float) => { $crate::params::Kind::Float };
    (@kind integer) => { $crate::params::Kind::Integer };
    (@kind seconds) => { $crate::params::Kind::Seconds };
    (@open from) => { false };
    (@open above) => { true };
}

/// One policy's parameters with their defaults, for listings.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PolicyParams {
    /// What the policy is: `router`, `prefill-scheduler` or `autoscaler`.
    pub role: &'static str,
    pub policy: &'static str,
    pub params: Vec<ParamDefault>,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ParamDefault {
    #[serde(flatten)]
    pub param: Param,
    pub default: f64,
    pub range: String,
}

impl PolicyParams {
    /// `P`'s parameters with their values in `defaults`.
    pub fn of<P: Params>(role: &'static str, policy: &'static str, defaults: &P) -> PolicyParams {
        let params = P::PARAMS
            .iter()
            .map(|p| ParamDefault { param: *p, default: defaults.get(p.name).unwrap_or(f64::NAN), range: p.range() })
            .collect();
        PolicyParams { role, policy, params }
    }
}

impl fmt::Display for PolicyParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} {}", self.role, self.policy)?;
        if self.params.is_empty() {
            return writeln!(f, "  (no parameters)");
        }
        for p in &self.params {
            writeln!(f, "  {:<24} {:>10}  {:<28} {}", p.param.name, p.default, p.range, p.param.doc)?;
        }
        Ok(())
    }
}

params!(engine::FairPrefill, "fair", {
    chunk_tokens: integer from 1 ..= 1_048_576, "prompts with at most this many tokens left to compute are short";
    quota_kv_share: float above 0.0 ..= 1.0, "a long prompt's first quota, as a share of the instance's KV tokens";
    quota_growth: float from 1.0 ..= 16.0, "each yield multiplies the next quota by this";
    long_min_tokens: integer from 1 ..= 1_048_576, "tokens of each iteration short prompts leave to long ones";
});
