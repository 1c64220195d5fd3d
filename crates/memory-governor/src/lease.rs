//! Leases: RAII charges that grow and shrink in place and are refunded exactly once.

use std::borrow::Borrow;
use std::fmt;

use memory_api::MemoryRole;

use crate::account::Account;
use crate::error::{AdmissionError, ShrinkError};

/// A charge of `bytes` of one role to one account, refunded when dropped.
///
/// `A` is how the lease reaches its account: `&Account` from [`Account::lease`] (no
/// reference count touched, the cheapest) or `Account` from [`Account::lease_owned`]
/// (`'static`). The refund happens exactly once: in `Drop`, for whatever the lease
/// holds then. Growing and shrinking change the charge in place; a failed growth
/// changes nothing.
#[must_use = "dropping a lease refunds it at once"]
pub struct Lease<A: Borrow<Account>> {
    account: A,
    role: MemoryRole,
    bytes: u64,
}

/// A lease borrowing its account.
pub type BorrowedLease<'a> = Lease<&'a Account>;

/// A lease owning a handle to its account.
pub type OwnedLease = Lease<Account>;

impl<A: Borrow<Account>> Lease<A> {
    /// Wraps a charge that was just admitted.
    pub(crate) fn new(account: A, role: MemoryRole, bytes: u64) -> Lease<A> {
        Lease { account, role, bytes }
    }

    /// Bytes charged.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The role charged.
    pub fn role(&self) -> MemoryRole {
        self.role
    }

    /// The account charged.
    pub fn account(&self) -> &Account {
        self.account.borrow()
    }

    /// Charges `extra` more bytes, in place.
    ///
    /// # Errors
    /// [`AdmissionError`] when the budget cannot hold it (after the policy had its say)
    /// or the total would exceed [`MAX_CHARGE`](crate::MAX_CHARGE); the lease is
    /// unchanged then.
    pub fn grow(&mut self, extra: u64) -> Result<(), AdmissionError> {
        if extra == 0 {
            return Ok(());
        }
        self.account.borrow().grow(self.role, self.bytes, extra)?;
        self.bytes += extra;
        Ok(())
    }

    /// Refunds `less` bytes now, keeping the rest charged.
    ///
    /// # Errors
    /// [`ShrinkError`] when `less` exceeds what the lease holds; nothing changes then.
    pub fn shrink(&mut self, less: u64) -> Result<(), ShrinkError> {
        if less > self.bytes {
            return Err(ShrinkError { role: self.role, held: self.bytes, requested: less });
        }
        if less > 0 {
            self.account.borrow().refund(self.role, less, false);
            self.bytes -= less;
        }
        Ok(())
    }

    /// Grows or shrinks to exactly `bytes`.
    ///
    /// # Errors
    /// As for [`Lease::grow`] when growing; shrinking cannot fail.
    pub fn resize(&mut self, bytes: u64) -> Result<(), AdmissionError> {
        if bytes >= self.bytes {
            self.grow(bytes - self.bytes)
        } else {
            self.account.borrow().refund(self.role, self.bytes - bytes, false);
            self.bytes = bytes;
            Ok(())
        }
    }
}

impl<A: Borrow<Account>> Drop for Lease<A> {
    fn drop(&mut self) {
        self.account.borrow().refund(self.role, self.bytes, true);
    }
}

impl<A: Borrow<Account>> fmt::Debug for Lease<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("authority", &self.account().authority())
            .field("role", &self.role)
            .field("bytes", &self.bytes)
            .finish()
    }
}
