//! memory-testkit: filled by later issues.
