//! The `snapserve` command line: wiring only, the work lives in the crates.

fn main() {}
