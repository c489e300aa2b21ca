//! `cvt`'s conversions and rounding modes. (To be written.)
