//! corridor-bench.
