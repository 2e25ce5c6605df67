//! One test binary for every ported seed suite, so libtorch is linked once.
