//! memory-governor: filled by later issues.
