//! `slo-load`: the prefill and decode pools scale independently, each from its own SLO load.
//!
//! Per pool, at every tick:
//!
//! - **Grow** when its load (`Load_P` or `Load_D`) has stayed above `up_load` for `up_hold`
//!   and no growth happened within `up_cooldown` (the start-up time plus a settling time):
//!   by enough instances to bring the load to `target_load` if it scales with the pool,
//!   `ceil(n × load / target) − n`, at least 1. Predicted latency is part of the load, so a
//!   queue building up triggers growth before requests miss the SLO.
//! - **Shrink** by one instance when its load has stayed below `down_load` for `down_hold`,
//!   no change happened within `down_cooldown`, and the pool's utilization with one instance
//!   fewer would stay below `shrink_util` (latency alone says nothing about how much spare
//!   capacity there is: an idle pool and a busy one both have a low TTFT).
//!
//! Between `down_load` and `up_load` nothing changes: that band, the holds and the cooldowns
//! keep a pool from flapping.
//!
//! The prefill pool does not grow while finished prefills wait for decode room: its queue is
//! then the decode pool's back-pressure, and more prefill would only queue more. When the
//! decode pool must grow and the budget is spent, the controller takes instances from the
//! prefill pool if that pool can spare them by the shrink rule (and the other way round).

use super::{can_shrink, cooled, growth, Autoscaler, Held, Knobs, PoolSize, Scale, ScaleInput};
use crate::view::Role;
use engine::Time;

#[derive(Clone, Copy, Debug, Default)]
struct PoolState {
    above: Held,
    below: Held,
    last_up: Option<Time>,
    last_change: Option<Time>,
}

pub struct SloLoadScaler {
    knobs: Knobs,
    prefill: PoolState,
    decode: PoolState,
}

impl SloLoadScaler {
    pub fn new(knobs: Knobs) -> SloLoadScaler {
        SloLoadScaler { knobs, prefill: PoolState::default(), decode: PoolState::default() }
    }
}

/// The change one pool wants, given its load and its utilization.
fn decide_pool(k: &Knobs, s: &mut PoolState, now: Time, size: PoolSize, load: f64, util: f64, min: u32) -> i32 {
    let up = s.above.check(now, load > k.up_load, k.up_hold);
    let down = s.below.check(now, load < k.down_load, k.down_hold);
    if up && cooled(now, s.last_up, k.up_cooldown) {
        s.last_up = Some(now);
        s.last_change = Some(now);
        s.below = Held::default();
        return growth(size.planned(), load, k.target_load) as i32;
    }
    if down
        && size.starting == 0
        && cooled(now, s.last_change, k.down_cooldown)
        && can_shrink(size.serving, 1, min, util, k.shrink_util)
    {
        s.last_change = Some(now);
        s.below = Held::default();
        return -1;
    }
    0
}

impl Autoscaler for SloLoadScaler {
    fn name(&self) -> &'static str {
        "slo-load"
    }

    fn decide(&mut self, input: &ScaleInput) -> Scale {
        let (k, l) = (self.knobs, input.loads);
        let load_p = if input.waiting_handoffs > 0 { l.load_p.min(k.up_load) } else { l.load_p };
        let prefill =
            decide_pool(&k, &mut self.prefill, input.now, input.prefill, load_p, l.util_p, input.min_per_pool);
        let decode = decide_pool(&k, &mut self.decode, input.now, input.decode, l.load_d, l.util_d, input.min_per_pool);
        let reason = match (prefill.signum(), decode.signum()) {
            (0, 0) => "",
            (1, _) | (_, 1) => "load above the band",
            _ => "load below the band with room to spare",
        };
        Scale { prefill, decode, reason }
    }

    fn can_spare(&self, input: &ScaleInput, role: Role, n: u32) -> bool {
        let (size, util) = match role {
            Role::Prefill => (input.prefill, input.loads.util_p),
            Role::Decode => (input.decode, input.loads.util_d),
            Role::Colocated => return false,
        };
        can_shrink(size.serving, n, input.min_per_pool, util, self.knobs.shrink_util)
    }
}
