//! Each op's attributes, borrowed from it: one struct per entry of `op.rs`'s list, named as
//! its variant and made from the entry (`attrs::Conv2d { stride, padding, groups }`, each
//! field a reference into the op; a unit struct for an op without attributes). The table
//! (`ops.rs`) destructures an op once, in its row, and hands the row's shape, cost and VJP
//! rules this struct: a rule binds by name the attributes it reads, and a rule that several
//! ops share and that reads none of their attributes takes any `impl Attrs`.

use super::dim::Dim;
use super::op::{AttentionInput, Group, Init, Op};
use super::types::TensorType;

/// What every op's attribute struct gives a rule that several ops share.
pub trait Attrs: Copy {
    /// The op's name, as `Op::name` gives it.
    const NAME: &'static str;
}

/// The entries of `op.rs` made into attribute structs.
macro_rules! attr_structs {
    ($($doc:tt $op:ident $fields:tt $name:literal $arity:tt $class:tt $shape:tt $flops:tt
        $vjp:tt $map:tt $example:tt $attrs:tt;)*) => {
        $(attr_structs!(@one $op $name $fields);)*
    };
    (@one $op:ident $name:literal []) => {
        #[doc = concat!("`Op::", stringify!($op), "`, which has no attributes.")]
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub struct $op;

        impl $op {
            /// `Some` if `op` is this op.
            pub fn of(op: &Op) -> Option<Self> {
                matches!(op, Op::$op).then_some($op)
            }
        }

        impl Attrs for $op {
            const NAME: &'static str = $name;
        }
    };
    (@one $op:ident $name:literal [{ $($field:ident : $ty:ty),* }]) => {
        #[doc = concat!("The attributes of `Op::", stringify!($op), "`.")]
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub struct $op<'a> {
            $(pub $field: &'a $ty,)*
        }

        impl<'a> $op<'a> {
            /// Its attributes if `op` is this op.
            pub fn of(op: &'a Op) -> Option<Self> {
                match op {
                    Op::$op { $($field),* } => Some($op { $($field),* }),
                    _ => None,
                }
            }
        }

        impl Attrs for $op<'_> {
            const NAME: &'static str = $name;
        }
    };
}

crate::__parallax_ops!(attr_structs);
