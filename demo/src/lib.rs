//! `memory-demo`: an LLM server's device memory, simulated over the `BindingRegistry`
//! and the governor (`cargo xtask demo`).
//!
//! Two devices (host-backed simulated devices by default, CUDA devices with `--gpu`),
//! each with a governor budget, a platform authority that loads the weights once and
//! two tenants with quotas. Worker threads serve requests: KV-cache pages grow with
//! each sequence, activations and workspace come and go per step, and finished
//! sequences stay cached until reclaim evicts them. Mid-run the mechanism switches
//! (system to pooled) and a device is lost: its requests fail cleanly, its context is
//! confirmed terminated once callbacks drain, and a fresh context takes over. Pools
//! take their memory through the governor's cache backing, so the device limit bounds
//! what the process holds (`reserved`: tenants' blocks plus what pools keep idle), and a
//! shortfall runs the recovery ladder (trim the pools, reclaim idle sequences, refuse).
//! The report gives allocated and reserved per device and tenant with their peaks, one
//! refusal's message, and ends with the check that every allocation is accounted for
//! and the footprint's books balance.
//!
//! `--processes N` ([`processes`]) runs N engine processes instead, each with its own
//! registry and governor, sharing the two devices' budgets and the tenants' quotas
//! through node books (`memory-node`); one is killed two thirds in, and the report ends
//! with the nothing-lost check across processes.
#![forbid(unsafe_code)]

pub mod config;
// Node books are a Unix facility (see memory-node).
#[cfg(unix)]
pub mod processes;
pub mod real_models;
pub mod report;
mod sim;

pub use config::{Config, FlagError, Invocation, parse};
pub use report::{Check, RESERVED_PEAK_TARGET, Report, footprint_violations, recorded_line, reserved_ratio};
pub use sim::{SimError, run};
