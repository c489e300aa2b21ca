//! Matmuls as GEMM library calls: the call's shape and strides (row-major, batched over the
//! leading axes), its element types in bf16-storage plans (with the staging kernel that
//! rounds an f32 operand first), and the bias a `gemm+bias` kernel leaves to the GEMM's
//! epilogue.

use super::{grid_for, Arg, CodegenError, GemmBias, Gen, Launch, Operand, BLOCK};
use crate::ir::{KernelKind, Op};
use crate::plan::Plan;

/// A matmul as a GEMM call (row-major, batched over the leading axes). When any of its values
/// is stored in bf16, the GEMM multiplies bf16 (cuBLAS takes no mixed operands): an f32
/// operand is first rounded to bf16 into the staging buffer (`staging`: the elements used).
pub(super) fn gemm(
    g: &mut Gen,
    name: &str,
    op: &Op,
    ins: &[Operand],
    out: &Operand,
    staging: &mut u64,
) -> Result<Vec<Launch>, CodegenError> {
    let c_bf16 = g.arg_is_bf16(out.arg);
    let bf16 = c_bf16 || ins.iter().take(2).any(|o| g.arg_is_bf16(o.arg));
    let mut launches = Vec::new();
    let mut ins = ins.to_vec();
    let mut used = 0u64;
    for (j, o) in ins.iter_mut().take(2).enumerate() {
        if bf16 && !g.arg_is_bf16(o.arg) {
            let at = Arg::Staging { at: used };
            launches.push(to_bf16(g, &format!("{name}b{j}"), o, at));
            // Each operand 256-byte aligned, as the GEMM library prefers.
            used += o.numel().next_multiple_of(128);
            o.arg = at;
        }
    }
    *staging = (*staging).max(used);
    let mut l = gemm_launch(op, &ins, out)?;
    if let Launch::Gemm { bf16: types, .. } = &mut l {
        *types = [bf16, bf16, c_bf16];
    }
    launches.push(l);
    Ok(launches)
}

/// A kernel rounding the f32 operand `o` to bf16 at `at` (in the staging buffer).
fn to_bf16(g: &mut Gen, name: &str, o: &Operand, at: Arg) -> Launch {
    let n = o.numel();
    let mut k = g.kernel(name);
    let src = k.param_ptr(o.arg);
    let dst = k.param_ptr(at);
    let dst = k.mark_bf16(dst, true);
    k.grid_stride(n, |k, i| {
        let v = k.load(src, i);
        k.store(dst, i, v)
    });
    g.launch(k, grid_for(n, BLOCK), BLOCK)
}

/// The GEMM call of a matmul (f32 operands).
pub(super) fn gemm_launch(op: &Op, ins: &[Operand], out: &Operand) -> Result<Launch, CodegenError> {
    let Op::MatMul { trans_a, trans_b } = *op else {
        return Err(CodegenError::Unsupported { op: op.name() });
    };
    let (a, b) = (&ins[0], &ins[1]);
    let r = out.shape.len();
    if r < 2 || a.shape.len() < 2 || b.shape.len() < 2 {
        return Err(CodegenError::Bad {
            op: "matmul",
            message: "operands of rank below 2".into(),
        });
    }
    let (m, n) = (out.shape[r - 2], out.shape[r - 1]);
    let ar = a.shape.len();
    let k = if trans_a {
        a.shape[ar - 2]
    } else {
        a.shape[ar - 1]
    };
    let batch: u64 = out.shape[..r - 2].iter().product();
    let per = |o: &Operand| {
        let l = o.shape.len();
        if l == 2 {
            0
        } else {
            o.shape[l - 2] * o.shape[l - 1]
        }
    };
    Ok(Launch::Gemm {
        a: a.arg,
        b: b.arg,
        c: out.arg,
        m,
        n,
        k,
        batch,
        trans_a,
        trans_b,
        stride_a: per(a),
        stride_b: per(b),
        stride_c: m * n,
        bf16: [false; 3],
        bias: None,
    })
}

/// The bias of a `gemm+bias` kernel whose product only its epilogue reads (`c` is the
/// scratch), for the GEMM's own epilogue.
pub(super) fn gemm_bias(
    plan: &Plan,
    kind: KernelKind,
    steps: &[usize],
    c: Arg,
) -> Option<GemmBias> {
    let KernelKind::Gemm {
        bias: true,
        activation: None,
    } = kind
    else {
        return None;
    };
    let [mm, add] = *steps else {
        return None;
    };
    let ops = &plan.steps[add].operands;
    let vector = *ops.get(1)?;
    let n = plan.steps[mm].ty.shape.last()?;
    let along_last = plan.steps[add].op == Op::Add
        && ops[0] == mm
        && plan.steps[vector].ty.shape.len() == 1
        && plan.steps[vector].ty.shape[0] == *n;
    (c == Arg::Scratch && along_last).then_some(GemmBias {
        vector: Arg::Value(vector),
        out: Arg::Value(add),
        out_bf16: plan.stored_in_bf16(add),
    })
}
