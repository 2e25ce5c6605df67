//! Shared code of the runnable examples.
