//! Slab slots: items kept in a `Vec` and named by their index, with the indices of removed
//! items kept for reuse so that the vector does not grow with churn.

/// Stores `item` in a freed slot of `items` if `free` has one, else at the end; returns its
/// index.
pub fn place<T>(items: &mut Vec<T>, free: &mut Vec<u32>, item: T) -> u32 {
    match free.pop() {
        Some(s) => {
            items[s as usize] = item;
            s
        }
        None => {
            items.push(item);
            items.len() as u32 - 1
        }
    }
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
}
