//! `memory-demo`: an LLM server's device memory, simulated over the `BindingRegistry`
//! and the governor (`cargo xtask demo`).
//!
//! Two devices (host-backed simulated devices by default, CUDA devices with `--gpu`),
//! each with a governor budget, a platform authority that loads the weights once and
//! two tenants with quotas. Worker threads serve requests: KV-cache pages grow with
//! each sequence, activations and workspace come and go per step, and finished
//! sequences stay cached until reclaim evicts them. Mid-run the mechanism switches
//! (system to pooled) and a device is lost: its requests fail cleanly, its context is
//! confirmed terminated once callbacks drain, and a fresh context takes over. The
//! report ends with the check that every allocation is accounted for.
#![forbid(unsafe_code)]

pub mod config;
pub mod real_models;
pub mod report;
mod sim;

pub use config::{Config, FlagError, Invocation, parse};
pub use report::{Check, Report};
pub use sim::{SimError, run};
