//! The element types and reductions of the emulated NCCL. NCCL's own reduction order depends
//! on its algorithm (ring, tree) and is not specified; here it is defined: ascending rank,
//! `((part 0 op part 1) op part 2) ...`, each step rounded in the element type; `ncclAvg`
//! is that sum divided by the rank count (floats only). Half-precision and fp8 elements are
//! moved but not reduced (the call fails with `ncclInvalidArgument`).

/// Bytes per element of an `ncclDataType_t` (as a C int), or `None` for an unknown type.
pub fn size_of(dtype: i32) -> Option<usize> {
    Some(match dtype {
        0 | 1 | 10 | 11 => 1, // int8, uint8, fp8 e4m3, fp8 e5m2
        6 | 9 => 2,           // float16, bfloat16
        2 | 3 | 7 => 4,       // int32, uint32, float32
        4 | 5 | 8 => 8,       // int64, uint64, float64
        _ => return None,
    })
}

/// The type's name as nccl.h spells it.
pub fn type_name(dtype: i32) -> &'static str {
    const NAMES: [&str; 12] = [
        "ncclInt8",
        "ncclUint8",
        "ncclInt32",
        "ncclUint32",
        "ncclInt64",
        "ncclUint64",
        "ncclFloat16",
        "ncclFloat32",
        "ncclFloat64",
        "ncclBfloat16",
        "ncclFloat8e4m3",
        "ncclFloat8e5m2",
    ];
    usize::try_from(dtype)
        .ok()
        .and_then(|i| NAMES.get(i))
        .copied()
        .unwrap_or("an unknown type")
}

/// Whether `op` (`ncclSum` 0, `ncclProd` 1, `ncclMax` 2, `ncclMin` 3, `ncclAvg` 4) on `dtype`
/// is reduced here; the reason when not.
pub fn check(dtype: i32, op: i32) -> Result<(), String> {
    if !(0..=4).contains(&op) {
        return Err(format!("reduction operator {op} is not one of nccl.h's"));
    }
    match dtype {
        0..=5 if op == 4 => Err("ncclAvg of integers is not emulated".into()),
        0..=5 | 7 | 8 => Ok(()),
        _ => Err(format!(
            "the emulated NCCL moves {} but does not reduce it",
            type_name(dtype)
        )),
    }
}

/// Element by element over the ranks' parts of `$t`: `acc = $combine(acc, v)` from the
/// first rank's value, in rank order.
macro_rules! fold_with {
    ($t:ty, $parts:expr, $combine:expr) => {{
        let w = std::mem::size_of::<$t>();
        let get =
            |p: &[u8], i: usize| <$t>::from_le_bytes(p[i * w..(i + 1) * w].try_into().unwrap());
        let len = $parts[0].len() / w;
        let mut out = Vec::with_capacity(len * w);
        for i in 0..len {
            let mut acc = get(&$parts[0], i);
            for p in &$parts[1..] {
                acc = $combine(acc, get(p, i));
            }
            out.extend_from_slice(&acc.to_le_bytes());
        }
        out
    }};
}

macro_rules! fold {
    ($t:ty, $parts:expr, $op:expr) => {
        fold_with!($t, $parts, |acc: $t, v: $t| match $op {
            1 => acc * v,
            2 => {
                if v > acc {
                    v
                } else {
                    acc
                }
            }
            3 => {
                if v < acc {
                    v
                } else {
                    acc
                }
            }
            _ => acc + v,
        })
    };
}

macro_rules! fold_int {
    ($t:ty, $parts:expr, $op:expr) => {
        // Integers wrap, as on the GPU.
        fold_with!($t, $parts, |acc: $t, v: $t| match $op {
            1 => acc.wrapping_mul(v),
            2 => acc.max(v),
            3 => acc.min(v),
            _ => acc.wrapping_add(v),
        })
    };
}

macro_rules! fold_float {
    ($t:ty, $parts:expr, $op:expr, $n:expr) => {{
        let v = fold!($t, $parts, $op);
        if $op != 4 {
            return v;
        }
        // The average (op 4): the sum over the `$n` ranks, divided by them.
        v.chunks_exact(std::mem::size_of::<$t>())
            .flat_map(|c| (<$t>::from_le_bytes(c.try_into().unwrap()) / $n as $t).to_le_bytes())
            .collect()
    }};
}

/// Reduces the ranks' parts (in rank order, each the same length), after `check` passed.
pub fn reduce(dtype: i32, op: i32, parts: &[Vec<u8>]) -> Vec<u8> {
    let n = parts.len();
    match dtype {
        0 => fold_int!(i8, parts, op),
        1 => fold_int!(u8, parts, op),
        2 => fold_int!(i32, parts, op),
        3 => fold_int!(u32, parts, op),
        4 => fold_int!(i64, parts, op),
        5 => fold_int!(u64, parts, op),
        7 => fold_float!(f32, parts, op, n),
        _ => fold_float!(f64, parts, op, n),
    }
}
