//! Locking the control plane's shared state.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, also after a panic while it was held: every state change under the control
/// plane's locks is complete before it is stored.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
