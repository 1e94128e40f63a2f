//! Instances kept in order of a key a router computes for each (its predicted queue), for a
//! router that scores the instances in that order and stops once no later one can win,
//! instead of scoring every instance of a large fleet for every request.
//!
//! The keys are checked against the view at every pick (one pass of integer compares over
//! the fleet, far cheaper than scoring it) and only the instances whose key changed move:
//! the order is always the view's, whatever events the router did or did not hear.

use crate::view::InstanceView;
use std::collections::BTreeSet;

#[derive(Clone, Debug, Default)]
pub(super) struct QueueOrder {
    /// Each instance's key as last synced, by position in the view.
    keys: Vec<u64>,
    /// (key, position), ascending: ties in position order.
    order: BTreeSet<(u64, u32)>,
}

impl QueueOrder {
    /// Brings the order up to date with `key` of every instance of `views`.
    pub(super) fn sync(&mut self, views: &[InstanceView], key: impl Fn(&InstanceView) -> u64) {
        for (i, v) in views.iter().enumerate() {
            let k = key(v);
            let at = i as u32;
            match self.keys.get_mut(i) {
                Some(old) if *old == k => {}
                Some(old) => {
                    self.order.remove(&(*old, at));
                    self.order.insert((k, at));
                    *old = k;
                }
                None => {
                    self.keys.push(k);
                    self.order.insert((k, at));
                }
            }
        }
    }

    /// (key, position in the view) of every instance synced, lowest key first.
    pub(super) fn iter(&self) -> impl Iterator<Item = (u64, usize)> + '_ {
        self.order.iter().map(|&(k, i)| (k, i as usize))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::FleetView;
    use engine::InstanceId;

    #[test]
    fn the_order_follows_the_keys_as_they_change_and_ties_go_by_position() {
        let mut view = FleetView::default();
        for i in 0..4 {
            view.up(InstanceId(i), 1_000);
        }
        let mut order = QueueOrder::default();
        let keys = std::cell::Cell::new([5u64, 3, 5, 1]);
        let sync = |order: &mut QueueOrder| order.sync(view.all(), |v| keys.get()[v.id.0 as usize]);
        sync(&mut order);
        assert_eq!(order.iter().map(|(_, i)| i).collect::<Vec<_>>(), [3, 1, 0, 2]);
        keys.set([0, 3, 5, 9]);
        sync(&mut order);
        assert_eq!(order.iter().collect::<Vec<_>>(), [(0, 0), (3, 1), (5, 2), (9, 3)]);
    }
}
