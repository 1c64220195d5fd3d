//! loom models of the record table's take protocol (`cargo xtask loom`). The remote
//! give-back against the owner's take-all is modelled in `owner_slots`.

use std::sync::Arc;

use crate::records::{RecordTable, TakenRecord, Words};

type Table = RecordTable<Words<2>>;

/// Takes the record `tag` names if it holds `value`, and frees it (a release the
/// layer's allocator completed).
fn take_free(table: &Table, tag: u64, value: [u64; 2]) -> Option<[u64; 2]> {
    let taken = table.take(tag, |recorded| *recorded == value)?;
    let recorded = *taken.value();
    taken.free();
    Some(recorded)
}

/// Two threads taking one record while the owner records more: exactly one take wins,
/// it gets the payload as recorded, and the slot is reused only after it.
#[test]
fn loom_racing_takes_one_wins_and_the_owner_reuses_the_slot() {
    loom::model(|| {
        let table = Arc::new(Table::new());
        let first = [0x1000, 256];
        let (tag, _) = table.insert(&first).unwrap();
        let takers: Vec<_> = (0..2)
            .map(|_| {
                let table = Arc::clone(&table);
                loom::thread::spawn(move || take_free(&table, tag, first))
            })
            .collect();
        // The owner records meanwhile: a fresh slot, or the taken one.
        let second = [0x2000, 256];
        let (second_tag, _) = table.insert(&second).unwrap();
        let won: Vec<_> = takers.into_iter().filter_map(|taker| taker.join().unwrap()).collect();
        assert_eq!(won, [first], "exactly one take wins, with the recorded payload");
        assert_ne!(second_tag, tag, "a reused slot is recorded under a new generation");
        assert_eq!(table.get(second_tag, |_| true), Some(second));
        assert_eq!(table.recorded().count(), 1);
    });
}

/// A reader of a stale tag (a get and a take) racing the release of the record and the
/// owner's reuse of its slot for a payload that differs in one word: it gets the old
/// payload whole or nothing, never the new record, and never takes it.
#[test]
fn loom_a_stale_tag_never_reads_or_takes_a_reused_record() {
    loom::model(|| {
        let table = Arc::new(Table::new());
        let first = [0x1000, 7];
        let (tag, _) = table.insert(&first).unwrap();
        let reader = {
            let table = Arc::clone(&table);
            loom::thread::spawn(move || {
                let got = table.get(tag, |_| true);
                let taken = table.take(tag, |_| true).map(|taken| {
                    let value = *taken.value();
                    taken.restore();
                    value
                });
                (got, taken)
            })
        };
        let released = take_free(&table, tag, first);
        let second = [0x1000, 8];
        let (again, _) = table.insert(&second).unwrap();
        let (got, taken) = reader.join().unwrap();
        assert!(got.is_none() || got == Some(first), "read {got:?}");
        assert!(taken.is_none() || taken == Some(first), "took {taken:?}");
        // The owner's release either won, or found the reader's take in progress (a
        // release racing another release of one record loses) and left it live.
        let live = usize::from(released.is_none()) + 1;
        assert_eq!(table.recorded().count(), live);
        assert_eq!(take_free(&table, again, second), Some(second));
    });
}

/// A release refused (take, then restore) racing a second release of the same record
/// (take, then free): the second wins only if it took the record while it was live,
/// and either way the record ends freed exactly once or live under its tag.
#[test]
fn loom_a_restore_racing_another_release_frees_the_record_once_or_leaves_it_live() {
    loom::model(|| {
        let table = Arc::new(Table::new());
        let first = [0x1000, 256];
        let (tag, _) = table.insert(&first).unwrap();
        let refused = {
            let table = Arc::clone(&table);
            loom::thread::spawn(move || table.take(tag, |_| true).map(TakenRecord::restore).is_some())
        };
        let freed = take_free(&table, tag, first).is_some();
        let restored = refused.join().unwrap();
        assert!(freed || restored, "neither release took the record");
        if freed {
            assert_eq!(table.recorded().count(), 0);
            assert!(table.get(tag, |_| true).is_none());
        } else {
            assert_eq!(table.get(tag, |_| true), Some(first), "live again under its tag");
            assert_eq!(take_free(&table, tag, first), Some(first));
        }
    });
}

/// A record restored with a new payload (a quarantine that changed what is still
/// owned) while another thread reads it and then takes it: each sees the old payload
/// whole or the new one whole, never half of each, and the take is exclusive.
#[test]
fn loom_a_rewrite_is_read_whole_or_not_at_all() {
    loom::model(|| {
        let table = Arc::new(Table::new());
        let (old, new) = ([1, 1], [2, 2]);
        let (tag, _) = table.insert(&old).unwrap();
        let reader = {
            let table = Arc::clone(&table);
            loom::thread::spawn(move || {
                let got = table.get(tag, |_| true);
                let taken = table.take(tag, |_| true).map(|taken| {
                    let value = *taken.value();
                    taken.restore();
                    value
                });
                (got, taken)
            })
        };
        let rewritten = table.take(tag, |_| true).map(|taken| taken.restore_with(&new)).is_some();
        let (got, taken) = reader.join().unwrap();
        for seen in [got, taken].into_iter().flatten() {
            assert!(seen == old || seen == new, "read a torn payload {seen:?}");
            assert!(rewritten || seen == old, "read a payload never written {seen:?}");
        }
        assert!(rewritten || taken.is_some(), "neither take won");
        let last = if rewritten { new } else { old };
        assert_eq!(table.get(tag, |_| true), Some(last), "live under its tag, with the last payload");
    });
}
