//! allocator-cpu: filled by later issues.
