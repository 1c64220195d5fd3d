//! The JSON snapshot of a registry (and of a governor's books).

use std::ffi::c_char;

use memory_governor::BindingRegistry;

use super::governor::GOVERNORS;
use super::registry::REGISTRIES;
use super::{borrow, borrow_optional, check_out, write};
use crate::status::{Failure, MC_ERR_BACKEND, MC_ERR_BUFFER_TOO_SMALL, McStatus, guard};
use crate::types::*;

fn registry_json(registry: &BindingRegistry) -> serde_json::Value {
    use serde_json::json;
    let snapshot = registry.snapshots();
    json!({
        "registry": snapshot.registry.to_string(),
        "contexts": snapshot.contexts.iter().map(|c| json!({
            "identity": c.identity.to_string(),
            "device": c.device.to_string(),
            "state": c.state.to_string(),
        })).collect::<Vec<_>>(),
        "authorities": snapshot.authorities.iter().map(|a| json!({
            "identity": a.identity.to_string(),
            "device": a.device.to_string(),
        })).collect::<Vec<_>>(),
        "mechanisms": snapshot.mechanisms.iter().map(|m| json!({
            "identity": m.identity.to_string(),
            "device": m.device.to_string(),
            "context": m.context.to_string(),
            "authority": m.authority.to_string(),
            "state": m.state.to_string(),
            "allocator": m.allocator,
            "selected": m.selected,
            "live_allocations": m.live_allocations,
            "live_bytes": m.live_bytes,
            "in_flight": m.in_flight,
            "quarantined_bytes": m.quarantined_bytes(),
            "quarantined": m.quarantined.iter().map(|q| json!({
                "generation": q.generation.to_string(),
                "binding": q.binding.to_string(),
                "bytes": q.bytes,
                "unmapped_bytes": q.unmapped_bytes,
                "residual_bytes": q.residual_bytes,
                "reason": q.reason,
            })).collect::<Vec<_>>(),
            "lost_reason": m.lost_reason,
        })).collect::<Vec<_>>(),
    })
}

/// Writes a JSON snapshot of the registry (and of the governor's books when `governor`
/// is not null) to `buffer`, NUL-terminated, and its length without the NUL to `length`.
/// With a null or too small buffer: `MC_ERR_BUFFER_TOO_SMALL` and the length needed.
///
/// # Safety
/// `buffer` is null or writable for `capacity` bytes; `length` is null or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mc_snapshot_json(
    registry: *mut McRegistry,
    governor: *mut McGovernor,
    buffer: *mut c_char,
    capacity: usize,
    length: *mut usize,
) -> McStatus {
    guard("mc_snapshot_json", || {
        check_out(length, "length")?;
        let registry = borrow(&REGISTRIES, registry)?;
        let governor = borrow_optional(&GOVERNORS, governor)?;
        let governor_json = if let Some(governor) = governor {
            let snapshot = governor.snapshot();
            serde_json::to_value(&snapshot)
                .map_err(|error| Failure::new(MC_ERR_BACKEND, format!("serialising the governor snapshot: {error}")))?
        } else {
            serde_json::Value::Null
        };
        let text = serde_json::json!({ "registry": registry_json(&registry), "governor": governor_json }).to_string();
        // SAFETY: checked above.
        unsafe { write(length, text.len()) };
        if buffer.is_null() || capacity <= text.len() {
            // A null buffer holds nothing, whatever `capacity` says.
            let given = if buffer.is_null() {
                format!("no buffer was given (buffer is null, capacity {capacity})")
            } else {
                format!("the buffer holds {capacity}")
            };
            return Err(Failure::new(
                MC_ERR_BUFFER_TOO_SMALL,
                format!(
                    "the snapshot is {} bytes (plus a NUL) and {given}; pass a buffer of at least {} bytes",
                    text.len(),
                    text.len() + 1
                ),
            ));
        }
        // SAFETY: `buffer` is writable for `capacity` bytes (the caller's contract) and
        // `text.len() + 1 <= capacity` (checked); the source is our own string.
        unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), buffer.cast::<u8>(), text.len()) };
        // SAFETY: `text.len() < capacity`, so this byte is inside the buffer.
        unsafe { buffer.wrapping_add(text.len()).write(0) };
        Ok(())
    })
}
