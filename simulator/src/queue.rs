//! The event queue in virtual time.

use engine::Time;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A min-heap of events by time; events at the same time come out in the order they were
/// pushed (a sequence number breaks ties), so runs are deterministic.
#[derive(Debug)]
pub struct EventQueue<E> {
    heap: BinaryHeap<Reverse<(Time, u64, Slot<E>)>>,
    seq: u64,
}

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
    pub fn push(&mut self, at: Time, event: E) {
        self.heap.push(Reverse((at, self.seq, Slot(event))));
        self.seq += 1;
    }

    pub fn peek_time(&self) -> Option<Time> {
        self.heap.peek().map(|Reverse((t, _, _))| *t)
    }

    pub fn pop(&mut self) -> Option<(Time, E)> {
        self.heap.pop().map(|Reverse((t, _, Slot(e)))| (t, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_at_the_same_time_leave_in_push_order() {
        let mut q = EventQueue::default();
        q.push(Time(5), "b");
        q.push(Time(1), "a");
        q.push(Time(5), "c");
        let out: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(out, [(Time(1), "a"), (Time(5), "b"), (Time(5), "c")]);
    }
}
