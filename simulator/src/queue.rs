//! The event queue in virtual time.

use engine::Time;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A min-heap of events by time, then by a tie key the caller gives (the simulated fleet's:
/// the instance, then the kind of event), then by push order, so runs are deterministic.
/// Ties go by what the event is, not by when it was pushed: an instance that queues one
/// event for several steps ([`crate::fleet`]'s coasting) pushes it at another moment than
/// step by step would, and must not change the order of events at the same time.
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Reverse<(Key, Slot<E>)>>,
    seq: u64,
}

/// Where an event stands among those at the same time: (time, tie, push order).
pub type Key = (Time, u64, u64);

/// Wrapper that keeps `E` out of the ordering.
#[derive(Debug)]
struct Slot<E>(E);

impl<E> PartialEq for Slot<E> {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}
impl<E> Eq for Slot<E> {}
impl<E> PartialOrd for Slot<E> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<E> Ord for Slot<E> {
    fn cmp(&self, _: &Self) -> std::cmp::Ordering {
        std::cmp::Ordering::Equal
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        EventQueue { heap: BinaryHeap::new(), seq: 0 }
    }
}

impl<E> EventQueue<E> {
    pub fn push(&mut self, at: Time, tie: u64, event: E) {
        self.heap.push(Reverse(((at, tie, self.seq), Slot(event))));
        self.seq += 1;
    }

    pub fn peek(&self) -> Option<(Key, &E)> {
        self.heap.peek().map(|Reverse((k, Slot(e)))| (*k, e))
    }

    pub fn peek_time(&self) -> Option<Time> {
        self.heap.peek().map(|Reverse(((t, _, _), _))| *t)
    }

    pub fn pop(&mut self) -> Option<(Key, E)> {
        self.heap.pop().map(|Reverse((k, Slot(e)))| (k, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_at_the_same_time_leave_by_tie_key_then_in_push_order() {
        let mut q = EventQueue::default();
        q.push(Time(5), 2, "c");
        q.push(Time(5), 1, "b");
        q.push(Time(1), 9, "a");
        q.push(Time(5), 2, "d");
        let out: Vec<_> = std::iter::from_fn(|| q.pop()).map(|((t, _, _), e)| (t, e)).collect();
        assert_eq!(out, [(Time(1), "a"), (Time(5), "b"), (Time(5), "c"), (Time(5), "d")]);
    }
}
