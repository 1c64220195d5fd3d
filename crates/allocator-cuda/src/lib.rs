//! allocator-cuda: filled by later issues.
