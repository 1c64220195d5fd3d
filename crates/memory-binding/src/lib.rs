//! memory-binding: filled by later issues.
