//! `none`: the pools keep the sizes they started with.

use super::{Autoscaler, Scale, ScaleInput};

pub struct NoScaling;

impl Autoscaler for NoScaling {
    fn name(&self) -> &'static str {
        "none"
    }

    fn decide(&mut self, _input: &ScaleInput) -> Scale {
        Scale::default()
    }
}
