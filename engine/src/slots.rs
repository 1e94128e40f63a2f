//! Slab slots: items kept in a `Vec` and named by their index, with the indices of removed
//! items kept for reuse so that the vector does not grow with churn.
//!
//! A slab grows by a quarter at a time, not by doubling: slabs live as long as the run and
//! the largest (the KV stores' and the prefix index's pages, hundreds of thousands of records)
//! would otherwise carry up to half their memory as unused capacity.

/// Stores `item` in a freed slot of `items` if `free` has one, else at the end; returns its
/// index.
pub fn place<T>(items: &mut Vec<T>, free: &mut Vec<u32>, item: T) -> u32 {
    match free.pop() {
        Some(s) => {
            items[s as usize] = item;
            s
        }
        None => {
            push(items, item);
            items.len() as u32 - 1
        }
    }
}

/// A freed slot of `items` if `free` has one, its item left as it is (a page keeps its
/// buffer for the next one), else a new default item at the end; returns its index.
pub fn reuse<T: Default>(items: &mut Vec<T>, free: &mut Vec<u32>) -> u32 {
    free.pop().unwrap_or_else(|| {
        push(items, T::default());
        items.len() as u32 - 1
    })
}

/// Appends `item`, growing `items` by a quarter when it is full (amortised O(1) still).
pub fn push<T>(items: &mut Vec<T>, item: T) {
    if items.len() == items.capacity() {
        items.reserve_exact(growth(items.len()));
    }
    items.push(item);
}

/// Room a full slab of `len` items grows by: a quarter (at least 4).
pub fn growth(len: usize) -> usize {
    (len / 4).max(4)
}

#[cfg(test)]
mod tests {
    #[test]
    fn freed_slots_are_reused_before_the_vector_grows() {
        let (mut items, mut free) = (vec!['a', 'b'], vec![0]);
        assert_eq!(super::place(&mut items, &mut free, 'c'), 0);
        assert_eq!(super::place(&mut items, &mut free, 'd'), 2);
        assert_eq!(items, ['c', 'b', 'd']);
    }

    #[test]
    fn a_slab_grows_by_a_quarter() {
        let mut items: Vec<u32> = Vec::with_capacity(100);
        items.extend(0..100);
        super::push(&mut items, 100);
        assert!((125..200).contains(&items.capacity()), "grew to {}, not doubled", items.capacity());
        assert_eq!(items.len(), 101);
    }

    #[test]
    fn a_reused_slot_keeps_its_item() {
        let (mut items, mut free) = (vec![vec![1], vec![2]], vec![0]);
        assert_eq!(super::reuse(&mut items, &mut free), 0);
        assert_eq!(items[0], [1]);
        assert_eq!(super::reuse(&mut items, &mut free), 2);
        assert!(items[2].is_empty());
    }
}
