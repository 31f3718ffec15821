//! The C ABI of tutti (being built).
