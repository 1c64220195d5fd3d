//! `thread_local!`, std's or loom's.
//!
//! std's macro takes `const { ... }` initialisers (no lazy-initialisation check on each
//! access, the cheapest thread-local there is); loom's does not, and needs its own
//! thread-locals so that each model thread gets fresh values. This macro accepts both
//! forms and forwards to the right one.

/// Declares thread-locals like `std::thread_local!`; under `--cfg memory_loom`, loom's
/// (a `const { ... }` initialiser then runs like a plain one).
#[cfg(not(memory_loom))]
#[macro_export]
macro_rules! thread_local {
    () => {};
    ($(#[$attr:meta])* $vis:vis static $name:ident: $t:ty = const { $init:expr } $(; $($rest:tt)*)?) => {
        ::std::thread_local!($(#[$attr])* $vis static $name: $t = const { $init });
        $($crate::thread_local!($($rest)*);)?
    };
    ($(#[$attr:meta])* $vis:vis static $name:ident: $t:ty = $init:expr $(; $($rest:tt)*)?) => {
        ::std::thread_local!($(#[$attr])* $vis static $name: $t = $init);
        $($crate::thread_local!($($rest)*);)?
    };
}

/// Declares thread-locals like `std::thread_local!`; under `--cfg memory_loom`, loom's
/// (a `const { ... }` initialiser then runs like a plain one).
#[cfg(memory_loom)]
#[macro_export]
macro_rules! thread_local {
    () => {};
    ($(#[$attr:meta])* $vis:vis static $name:ident: $t:ty = const { $init:expr } $(; $($rest:tt)*)?) => {
        $crate::__loom::thread_local!($(#[$attr])* $vis static $name: $t = $init);
        $($crate::thread_local!($($rest)*);)?
    };
    ($(#[$attr:meta])* $vis:vis static $name:ident: $t:ty = $init:expr $(; $($rest:tt)*)?) => {
        $crate::__loom::thread_local!($(#[$attr])* $vis static $name: $t = $init);
        $($crate::thread_local!($($rest)*);)?
    };
}

#[cfg(all(test, not(memory_loom)))]
mod tests {
    use std::cell::Cell;

    crate::thread_local! {
        static CONST: Cell<u32> = const { Cell::new(1) };
        static LAZY: Cell<u32> = Cell::new(2);
        pub(crate) static LAST: u8 = const { 3 }
    }

    #[test]
    fn both_initialiser_forms_declare_thread_locals() {
        assert_eq!(CONST.with(Cell::get) + LAZY.with(Cell::get) + u32::from(LAST.with(|last| *last)), 6);
        std::thread::spawn(|| CONST.with(|value| value.set(9))).join().unwrap();
        assert_eq!(CONST.with(Cell::get), 1, "one value per thread");
    }
}
