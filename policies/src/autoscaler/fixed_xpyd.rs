//! `fixed-xpyd`: the baseline of fixed service groups. The fleet grows and shrinks by whole
//! groups of `x` prefill and `y` decode instances, as deployments of xPyD units do: the
//! ratio of prefill to decode never changes.
//!
//! At every tick, with `load = max(Load_P, Load_D)`:
//!
//! - **Grow** by the groups that bring the load to `target_load` (at least one) when the
//!   load has stayed above `up_load` for `up_hold` and no growth happened within
//!   `up_cooldown` (the start-up time, about ten minutes for such groups, plus settling).
//! - **Shrink** by one group when both loads have stayed below `down_load` for `down_hold`,
//!   no change happened within `down_cooldown`, and both pools would stay below
//!   `shrink_util` utilization without it.

use super::{can_shrink, cooled, growth, Autoscaler, Held, Knobs, Scale, ScaleInput};
use engine::Time;

pub struct FixedXpyd {
    x: u32,
    y: u32,
    knobs: Knobs,
    above: Held,
    below: Held,
    last_up: Option<Time>,
    last_change: Option<Time>,
}

impl FixedXpyd {
    pub fn new(x: u32, y: u32, knobs: Knobs) -> FixedXpyd {
        assert!(x > 0 && y > 0, "an xPyD group has at least one instance of each");
        FixedXpyd { x, y, knobs, above: Held::default(), below: Held::default(), last_up: None, last_change: None }
    }
}

impl Autoscaler for FixedXpyd {
    fn name(&self) -> &'static str {
        "fixed-xpyd"
    }

    fn decide(&mut self, input: &ScaleInput) -> Scale {
        let (k, l, now) = (self.knobs, input.loads, input.now);
        let load = l.load_p.max(l.load_d);
        let up = self.above.check(now, load > k.up_load, k.up_hold);
        let down = self.below.check(now, load < k.down_load, k.down_hold);
        // Groups planned: the smaller count, so a fleet started off the ratio still adds whole groups.
        let groups = (input.prefill.planned() / self.x).min(input.decode.planned() / self.y).max(1);
        if up && cooled(now, self.last_up, k.up_cooldown) {
            let add = growth(groups, load, k.target_load);
            // Only whole groups: as many as the budget holds.
            let add = add.min(input.headroom / (self.x + self.y));
            if add == 0 {
                return Scale::default();
            }
            self.last_up = Some(now);
            self.last_change = Some(now);
            self.below = Held::default();
            let (x, y) = ((add * self.x) as i32, (add * self.y) as i32);
            return Scale { prefill: x, decode: y, reason: "load above the band: add a group" };
        }
        let starting = input.prefill.starting + input.decode.starting;
        if down
            && starting == 0
            && cooled(now, self.last_change, k.down_cooldown)
            && can_shrink(input.prefill.serving, self.x, input.min_per_pool, l.util_p, k.shrink_util)
            && can_shrink(input.decode.serving, self.y, input.min_per_pool, l.util_d, k.shrink_util)
        {
            self.last_change = Some(now);
            self.below = Held::default();
            let (x, y) = (self.x as i32, self.y as i32);
            return Scale { prefill: -x, decode: -y, reason: "load below the band: remove a group" };
        }
        Scale::default()
    }
}
