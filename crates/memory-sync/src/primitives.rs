//! Atomics, locks, thread-locals and the scheduler hint: `std`'s in normal builds,
//! loom's under `--cfg memory_loom` (with `Arc` and `PoisonError` from `std` in both;
//! see the crate docs). Code that takes them from here is model-checked unchanged.
//!
//! `thread_local!` is [`crate::thread_local!`], which takes `const { ... }` initialisers in
//! both builds.
//!
//! `compiler_fence` exists in normal builds only (loom has none); code that needs it
//! outside [`crate::light_barrier`] should not.

#[cfg(not(memory_loom))]
pub use std::sync::atomic::compiler_fence;
#[cfg(not(memory_loom))]
pub use std::sync::{
    Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard,
    atomic::{
        AtomicBool, AtomicI64, AtomicIsize, AtomicPtr, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
    },
};
#[cfg(not(memory_loom))]
pub use std::thread::{LocalKey, yield_now};

#[cfg(memory_loom)]
pub use loom::sync::{
    Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
    atomic::{
        AtomicBool, AtomicI64, AtomicIsize, AtomicPtr, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering, fence,
    },
};
#[cfg(memory_loom)]
pub use loom::thread::{LocalKey, yield_now};
#[cfg(memory_loom)]
pub use std::sync::{Arc, PoisonError};

pub use crate::thread_local;
