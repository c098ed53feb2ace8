//! corridor-vram.
