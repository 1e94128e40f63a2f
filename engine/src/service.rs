//! What service a request asks for: its priority class, the tenant it is billed to, an
//! optional deadline and the program (agent session) it belongs to.
//!
//! The classes are bands of priority, highest first. The controller's flow control orders
//! and sheds by them (`policies::flow`), an instance with class priority on admits and
//! preempts by them (see [`crate::scheduler`]), and the metrics report each apart.

use crate::time::Time;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A request's priority band.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Class {
    /// A person is waiting on the answer: served first, never shed.
    Interactive,
    /// The default: served after interactive work, never shed.
    #[default]
    Standard,
    /// Offline work (evaluations, bulk generation): served last, and the work shed first
    /// when the fleet is saturated.
    Batch,
}

impl Class {
    /// Every class, highest priority first (also the order of [`Class::index`]).
    pub const ALL: [Class; 3] = [Class::Interactive, Class::Standard, Class::Batch];
    pub const NAMES: [&'static str; 3] = ["interactive", "standard", "batch"];

    pub fn name(self) -> &'static str {
        Class::NAMES[self.index()]
    }

    /// 0 for the highest band.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether flow control may refuse it under saturation rather than queue it.
    pub fn sheddable(self) -> bool {
        self == Class::Batch
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown request class `{0}` (valid: interactive, standard, batch)")]
pub struct UnknownClass(pub String);

impl FromStr for Class {
    type Err = UnknownClass;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "interactive" => Ok(Class::Interactive),
            "standard" => Ok(Class::Standard),
            "batch" => Ok(Class::Batch),
            _ => Err(UnknownClass(s.to_string())),
        }
    }
}

/// Who a request is served for: fair shares are per tenant. Numbered by the driver (a
/// scenario's tenant list, the gateway's table of tenant names); 0 is the default tenant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TenantId(pub u32);

/// The program a request is one turn of (an agent session or a conversation). Never 0, so
/// that an absent session costs no space in every request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SessionId(pub std::num::NonZeroU64);

impl SessionId {
    /// The session numbered `n`, if `n` is not 0.
    pub fn new(n: u64) -> Option<SessionId> {
        std::num::NonZeroU64::new(n).map(SessionId)
    }
}

/// What a request asks of the fleet besides its tokens. Small (every request carries one):
/// the deadline is milliseconds after arrival.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Service {
    pub class: Class,
    pub tenant: TenantId,
    /// Milliseconds after its arrival by which its first token is due at the latest; past
    /// it the answer is worthless (a sheddable request is shed once the deadline cannot be
    /// met). See [`Service::deadline`].
    pub deadline_ms: Option<std::num::NonZeroU32>,
    pub session: Option<SessionId>,
    /// Set by flow control for a request of a tenant under an equal share of the recent
    /// service: an engine with class priority serves it as one class higher (metrics still
    /// count it in its own class).
    pub lift: bool,
}

impl Service {
    /// The class an engine with class priority serves it in: its own, or one higher when
    /// lifted.
    pub fn engine_class(&self) -> Class {
        match (self.lift, self.class) {
            (true, Class::Batch) => Class::Standard,
            (true, _) => Class::Interactive,
            (false, class) => class,
        }
    }

    /// When its first token is due at the latest, for a request that arrived at `arrival`.
    pub fn deadline(&self, arrival: Time) -> Option<Time> {
        self.deadline_ms.map(|ms| arrival + crate::Dur::from_millis(u64::from(ms.get())))
    }
}
