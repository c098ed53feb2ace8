//! The engine: request lifecycle, the scheduler loop, the KV page pool with
//! its prefix cache, and sampling.
//!
//! Invariant: the engine knows nothing about HTTP or JSON, and nothing about
//! which backend runs the forward pass.

pub mod engine;
pub mod executor;
pub mod flip_policy;
pub mod flips;
pub mod microbatch;
pub mod pages;
pub mod phase;
pub mod ranks;
pub mod sampling;
pub mod scheduler;
pub mod stats;
pub mod step_budget;
