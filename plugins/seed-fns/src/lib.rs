//! The seed suites' user functions, written with the guest SDK.
