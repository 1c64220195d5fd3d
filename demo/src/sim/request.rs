//! Serving one request: prefill, then decode steps, each step with activations and
//! workspace, the KV cache growing a page every 16 tokens.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use memory_governor::{AllocateError, AllocationRequest, BoundAllocation, MemoryBinding, MemoryRole};

use super::kv::Sequence;
use super::ledger::Refusal;
use super::world::{Device, PLATFORM, TENANTS, World};

/// Tokens per KV page.
const TOKENS_PER_PAGE: u64 = 16;
/// Bytes of one KV page (16 tokens of a small model's keys and values).
const PAGE_BYTES: usize = 64 << 10;
/// Activations and workspace of one step (one chunk of 16 tokens).
const ACTIVATIONS: usize = 1 << 20;
const WORKSPACE: usize = 512 << 10;

/// One request's shape, drawn from its own seed so runs are reproducible whatever the
/// thread interleaving.
pub(crate) struct Shape {
    pub(crate) device: usize,
    pub(crate) tenant: usize,
    pub(crate) prompt: u64,
    pub(crate) output: u64,
    pub(crate) keep_idle: bool,
}

impl Shape {
    pub(crate) fn draw(seed: u64, id: u64, devices: usize) -> Shape {
        let mut rng = SmallRng::seed_from_u64(seed ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        Shape {
            device: rng.random_range(0..devices),
            tenant: rng.random_range(0..TENANTS.len()),
            prompt: rng.random_range(64..=768),
            output: rng.random_range(32..=384),
            keep_idle: rng.random_bool(0.6),
        }
    }
}

/// Serves one request; returns why it failed, if it did.
pub(crate) fn serve(world: &World, shape: &Shape) -> Result<(), Refusal> {
    let device = &world.devices[shape.device];
    let authority = PLATFORM + 1 + shape.tenant;
    let mut binding = bind(world, device, authority)?;
    let mut sequence = Sequence { authority: device.authorities[authority], pages: Vec::new() };
    let total = shape.prompt + shape.output;
    let mut tokens = 0;
    let result = loop {
        if tokens >= total {
            break Ok(());
        }
        tokens = (tokens + TOKENS_PER_PAGE).min(total);
        match step(world, device, authority, &mut binding, &mut sequence) {
            Ok(()) => {}
            Err(refusal) => break Err(refusal),
        }
    };
    match result {
        Ok(()) if shape.keep_idle => device.kv.park(sequence),
        _ => {
            sequence.release(&world.ledger);
        }
    }
    result
}

/// One step: a KV page for the next 16 tokens, activations and workspace for the step.
/// Each block is released through the binding that made it: a rebind after a switch
/// mid-step must not send an old block to the new binding (the registry refuses that).
fn step(
    world: &World,
    device: &Device,
    authority: usize,
    binding: &mut MemoryBinding,
    sequence: &mut Sequence,
) -> Result<(), Refusal> {
    let page = allocate(world, device, authority, binding, PAGE_BYTES, MemoryRole::KvCache)?;
    sequence.pages.push(page);
    let (activations_binding, activations) =
        allocate(world, device, authority, binding, ACTIVATIONS, MemoryRole::Activations)?;
    let workspace = allocate(world, device, authority, binding, WORKSPACE, MemoryRole::Workspace);
    let result = match workspace {
        Ok((workspace_binding, workspace)) => {
            world.ledger.release(&workspace_binding, workspace);
            Ok(())
        }
        Err(refusal) => Err(refusal),
    };
    world.ledger.release(&activations_binding, activations);
    result
}

/// Allocates through `binding`; when its mechanism was retired by a switch, rebinds to
/// the device's current mechanism and tries once more (old pages keep their binding).
fn allocate(
    world: &World,
    device: &Device,
    authority: usize,
    binding: &mut MemoryBinding,
    bytes: usize,
    role: MemoryRole,
) -> Result<(MemoryBinding, BoundAllocation), Refusal> {
    let request = AllocationRequest::new(bytes, 256).map_err(|_| Refusal::Allocator)?.with_role(role);
    let block = match world.ledger.allocate(binding, request) {
        Ok(block) => block,
        Err(AllocateError::Inactive { .. }) => {
            *binding = bind(world, device, authority)?;
            world.ledger.allocate(binding, request).map_err(|e| world.ledger.classify(&e))?
        }
        Err(error) => return Err(world.ledger.classify(&error)),
    };
    Ok((binding.clone(), block))
}

/// Binds the authority's current mechanism; a route replaced between the read and the
/// bind (a switch or a loss in progress) is read again once.
fn bind(world: &World, device: &Device, authority: usize) -> Result<MemoryBinding, Refusal> {
    world
        .registry
        .bind_registered(&device.route(authority))
        .or_else(|_| world.registry.bind_registered(&device.route(authority)))
        .map_err(|_| Refusal::DeviceLost)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_shapes_depend_only_on_seed_and_id() {
        let shape = |seed, id| {
            let s = Shape::draw(seed, id, 2);
            (s.device, s.tenant, s.prompt, s.output, s.keep_idle)
        };
        assert_eq!(shape(42, 7), shape(42, 7));
        let one: Vec<_> = (0..64).map(|id| shape(1, id)).collect();
        let other: Vec<_> = (0..64).map(|id| shape(2, id)).collect();
        assert_ne!(one, other, "another seed draws other requests");
        assert!(one.iter().all(|s| s.0 < 2 && s.1 < TENANTS.len() && (64..=768).contains(&s.2)));
    }
}
