//! The corridor command.
fn main() {}
