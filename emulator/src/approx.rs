//! The approximate functions (`ex2.approx`, `lg2.approx`, `rcp.approx`, `tanh.approx`, ...),
//! modelled as correctly rounded results, with the PTX ISA's documented error bounds.
//! (To be written.)
