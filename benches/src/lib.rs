//! Criterion benches across the workspace (see `benches/`).
