//! Helpers shared by the integration tests in `tests/all`.
