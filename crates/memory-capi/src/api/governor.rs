//! The governor: device limits, accounts and quotas, the admission policy, and reclaim
//! holders written in C. A governor handle may also name a recorder
//! (`mc_recorder_trace_governor`, in `recorder`): mechanisms registered through it are
//! recorded.

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use memory_governor::{
    AccountConfig, AdmissionPolicy, DeviceKey, Governor, HardLimit, HolderId, ReclaimHolder, ReclaimRequest,
    ReclaimThenFail,
};
use memory_plugin::abi_device;
use memory_plugin_abi::MpDevice;

use super::registry::AUTHORITIES;
use super::{UserPointer, borrow, check_out, device_key, fill, text, text_or, vacancy, write};
use crate::handles::Scheme;
use crate::status::{Failure, MC_ERR_INVALID_ARGUMENT, McStatus, guard};
use crate::types::*;

pub(crate) const KIND_GOVERNOR: u8 = 0xa2;
pub(crate) const KIND_HOLDER: u8 = 0xab;

/// A registered C reclaim holder: the governor it is registered with and its id there.
pub(crate) struct HolderEntry {
    governor: Governor,
    id: HolderId,
}

/// What a governor handle names: the governor's books (shared by every handle made from
/// them) and, for a handle made by `mc_recorder_trace_governor`, the recording that the
/// mechanisms registered through this handle write to.
pub(crate) struct GovernorEntry {
    pub(crate) governor: Governor,
    pub(crate) recording: Option<Arc<super::recorder::Recording>>,
}

impl std::ops::Deref for GovernorEntry {
    type Target = Governor;

    fn deref(&self) -> &Governor {
        &self.governor
    }
}

tables! {
    GOVERNORS in GOVERNOR_CELLS: GovernorEntry = (KIND_GOVERNOR, Scheme::Hazard, "governor", FREE_GOVERNORS);
    HOLDERS in HOLDER_CELLS: HolderEntry = (KIND_HOLDER, Scheme::Hazard, "reclaim holder", FREE_HOLDERS);
}

/// Creates a governor (no limits until set).
///
/// # Safety
/// `out` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_governor_create(out: *mut *mut McGovernor) -> McStatus {
    guard("mc_governor_create", || {
        check_out(out, "out")?;
        let handle = fill(vacancy(&GOVERNORS)?, GovernorEntry { governor: Governor::new(), recording: None });
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    })
}

/// Destroys a governor handle (governed mechanisms and registered reclaim holders keep
/// the books they use, and other handles of the same books, made by
/// `mc_recorder_trace_governor`, stay valid).
#[unsafe(no_mangle)]
pub extern "C" fn mc_governor_destroy(governor: *mut McGovernor) -> McStatus {
    guard("mc_governor_destroy", || super::remove(&GOVERNORS, governor))
}

/// Sets the byte limit of `device` (`UINT64_MAX`: unlimited).
#[unsafe(no_mangle)]
pub extern "C" fn mc_governor_set_device_limit(governor: *mut McGovernor, device: MpDevice, bytes: u64) -> McStatus {
    guard("mc_governor_set_device_limit", || {
        let governor = borrow(&GOVERNORS, governor)?;
        let device = device_key(device)?;
        governor.set_device_limit(device, bytes)?;
        Ok(())
    })
}

/// Opens the account of `authority` with a quota (`UINT64_MAX`: unlimited) and a label
/// (may be null). Needed before a governed mechanism is registered for the authority.
///
/// # Safety
/// `label` is null or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_governor_open_account(
    governor: *mut McGovernor,
    authority: *mut McAuthority,
    quota: u64,
    label: *const c_char,
) -> McStatus {
    guard("mc_governor_open_account", || {
        let governor = borrow(&GOVERNORS, governor)?;
        let authority = borrow(&AUTHORITIES, authority)?;
        let mut config = AccountConfig::new(authority.device, authority.identity).with_quota(quota);
        if !label.is_null() {
            // SAFETY: non-null and NUL-terminated (the caller's contract).
            config = config.with_label(unsafe { text(label, "label") }?);
        }
        governor.open_account(config).map_err(|error| Failure::new(MC_ERR_INVALID_ARGUMENT, error.to_string()))?;
        Ok(())
    })
}

/// Sets the quota of `authority`'s account (`UINT64_MAX`: unlimited).
#[unsafe(no_mangle)]
pub extern "C" fn mc_governor_set_quota(
    governor: *mut McGovernor,
    authority: *mut McAuthority,
    bytes: u64,
) -> McStatus {
    guard("mc_governor_set_quota", || {
        let governor = borrow(&GOVERNORS, governor)?;
        let authority = borrow(&AUTHORITIES, authority)?;
        governor.set_quota(authority.identity, bytes)?;
        Ok(())
    })
}

/// Installs an admission policy (`MC_POLICY_*`) on `device`. The default,
/// `MC_POLICY_HARD_LIMIT`, refuses what does not fit; `MC_POLICY_RECLAIM_THEN_FAIL`
/// first asks the device's reclaim holders (`mc_governor_register_holder`), then
/// retries once.
#[unsafe(no_mangle)]
pub extern "C" fn mc_governor_set_policy(governor: *mut McGovernor, device: MpDevice, policy: McPolicy) -> McStatus {
    guard("mc_governor_set_policy", || {
        let governor = borrow(&GOVERNORS, governor)?;
        let device = device_key(device)?;
        let policy: Arc<dyn AdmissionPolicy> = match policy {
            MC_POLICY_HARD_LIMIT => Arc::new(HardLimit),
            MC_POLICY_RECLAIM_THEN_FAIL => Arc::new(ReclaimThenFail),
            other => {
                return Err(Failure::new(
                    MC_ERR_INVALID_ARGUMENT,
                    format!("policy {other} is unknown; use MC_POLICY_HARD_LIMIT or MC_POLICY_RECLAIM_THEN_FAIL"),
                ));
            }
        };
        // Neither built-in policy reserves anything, so installing one always fits.
        governor
            .set_policy(device, policy)
            .map_err(|error| Failure::new(MC_ERR_INVALID_ARGUMENT, error.to_string()))?;
        Ok(())
    })
}

/// A reclaim holder written in C.
struct CHolder {
    name: String,
    reclaim: unsafe extern "C" fn(user: *mut c_void, request: *const McReclaimRequest) -> u64,
    reclaimable: McReclaimableFn,
    user: Arc<UserPointer>,
}

impl ReclaimHolder for CHolder {
    fn name(&self) -> &str {
        &self.name
    }

    fn reclaimable(&self, device: DeviceKey) -> u64 {
        match self.reclaimable {
            // SAFETY: the caller registered this callback for this pointer and declared
            // it callable from any thread, with no lock of the library held (the
            // governor asks holders outside its locks).
            Some(reclaimable) => unsafe { reclaimable(self.user.user, abi_device(device)) },
            None => 0,
        }
    }

    fn reclaim(&self, request: &ReclaimRequest) -> u64 {
        let asked = McReclaimRequest {
            device: abi_device(request.device),
            bytes: request.bytes,
            role: request.role.ordinal() as u32,
            reserved: 0,
        };
        // SAFETY: as for `reclaimable`; the request lives for the call.
        unsafe { (self.reclaim)(self.user.user, &asked) }
    }
}

/// The longest holder name kept (longer names are cut at a character boundary).
const MAX_HOLDER_NAME: usize = 128;

/// Registers a reclaim holder written in C on `device`: when an admission on `device`
/// does not fit and the device's policy reclaims (`mc_governor_set_policy` with
/// `MC_POLICY_RECLAIM_THEN_FAIL`), the governor calls `reclaim(user, request)` for the
/// bytes still missing, holders in ascending `order` (ties in registration order), and
/// retries once. `reclaim` returns the bytes it freed (by releasing allocations, which
/// it may do through this API: no lock of the library is held while it runs).
/// `reclaimable(user, device)` (may be null: 0) estimates what it could free, for
/// messages and snapshots. `name` (may be null: "c-holder") names it in messages.
/// `destroy(user)` (may be null) runs once, after the holder was unregistered and no
/// call of it is in progress; on any error it is not called and `user` stays yours.
///
/// # Safety
/// `name` is null or NUL-terminated; `out` is null or writable; `reclaim`,
/// `reclaimable` and `destroy` may be called with `user` from any thread.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn mc_governor_register_holder(
    governor: *mut McGovernor,
    device: MpDevice,
    order: u32,
    name: *const c_char,
    reclaim: McReclaimFn,
    reclaimable: McReclaimableFn,
    user: *mut c_void,
    destroy: McDestroyFn,
    out: *mut *mut McReclaimHolder,
) -> McStatus {
    // Made outside the guard, so that a failure of any kind (a panic included) disarms it.
    let pointer = Arc::new(UserPointer::new(user, destroy));
    let status = guard("mc_governor_register_holder", || {
        check_out(out, "out")?;
        let Some(reclaim) = reclaim else { return Err(Failure::null("reclaim")) };
        // SAFETY: null or NUL-terminated (the caller's contract).
        let mut name = unsafe { text_or(name, "name", "c-holder") }?.to_owned();
        if name.len() > MAX_HOLDER_NAME {
            let mut end = MAX_HOLDER_NAME;
            while !name.is_char_boundary(end) {
                end -= 1;
            }
            name.truncate(end);
        }
        let governor_entry = borrow(&GOVERNORS, governor)?;
        let device = device_key(device)?;
        let cell = vacancy(&HOLDERS)?;
        let made = Arc::new(CHolder { name, reclaim, reclaimable, user: Arc::clone(&pointer) });
        let id = governor_entry.register_holder(device, order, made);
        let handle = fill(cell, HolderEntry { governor: governor_entry.governor.clone(), id });
        // SAFETY: checked above.
        unsafe { write(out, handle) };
        Ok(())
    });
    if status != crate::status::MC_OK {
        pointer.disarm();
    }
    status
}

/// Unregisters a reclaim holder and frees its handle. The governor asks it nothing from
/// now on; its `destroy(user)` runs once a call of it in progress (if any) returned.
#[unsafe(no_mangle)]
pub extern "C" fn mc_governor_unregister_holder(holder: *mut McReclaimHolder) -> McStatus {
    guard("mc_governor_unregister_holder", || {
        let released = {
            let entry = borrow(&HOLDERS, holder)?;
            entry.governor.unregister_holder(entry.id)
        };
        super::remove(&HOLDERS, holder)?;
        // Dropped here, outside every lock: the last reference runs `destroy`.
        drop(released);
        Ok(())
    })
}
