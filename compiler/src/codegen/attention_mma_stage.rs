//! Moving tiles of f32 operands into shared memory as bf16 for the tensor-core attention
//! kernels: at once (`stage`, plain loads between two barriers), or streamed (`Stream`,
//! `cp.async` copies of the next tile in flight while the warps compute on this one).

use super::super::super::builder::{Kernel, Rd, F, R};
use super::super::{Problem, Tensor};
use super::{lane_bits, pitch, Ctx, BR, THREADS};

/// Where this thread moves a tile's rows: columns `4 (t % q)..+4` of rows `t / q + u step`
/// (`q = width / 4`), one 16-byte load each, from problem `pb`'s row `first` on.
pub(super) struct Rows {
    /// Global address of the thread's first element, its first row, and its shared offset in a
    /// staged tile.
    g: Rd,
    r0: Rd,
    at: Rd,
    /// The same in an f32 staging tile (unpadded: only this thread reads what it copied).
    f_at: Rd,
    width: u64,
    stride: u64,
    /// The source holds bf16 (`devices.activations: Bf16`): moved as is, 8 bytes a unit.
    bf16: bool,
}

/// One unit of four elements as loaded: f32 values to convert, or bf16 pairs as stored
/// (the lower column in each word's low half, as `cvt.rn.bf16x2.f32` packs them).
pub(super) enum Unit {
    F32(Vec<F>),
    Bf16(R, R),
}

impl Rows {
    pub(super) fn new(k: &mut Kernel, ctx: &Ctx, src: &Tensor, pb: &Problem, first: Rd) -> Rows {
        let width = src.width;
        // Shifts, not a 64-bit division (a call on the GPU): the widths are powers of two.
        let q = width / 4;
        assert!(q.is_power_of_two());
        let r0 = k.op64("shr", ctx.tid, q.trailing_zeros());
        let c0 = lane_bits(k, ctx.tid, 0, q - 1);
        let c0 = k.op64("mul.lo", c0, 4);
        let base = src.offset(k, pb, first);
        let g = k.rd();
        k.ins(format!("mad.lo.u64 {g}, {r0}, {}, {base}", src.stride()));
        let g = k.op64("add", g, c0);
        let g = k.addr(src.ptr, g);
        let bf16 = k.is_bf16(g);
        let s = k.op64("mul.lo", r0, pitch(width));
        let at = k.rd();
        k.ins(format!("mad.lo.u64 {at}, {c0}, 2, {s}"));
        let s = k.op64("mul.lo", r0, 4 * width);
        let f_at = k.rd();
        k.ins(format!("mad.lo.u64 {f_at}, {c0}, 4, {s}"));
        Rows {
            g,
            r0,
            at,
            f_at,
            width,
            stride: src.stride(),
            bf16,
        }
    }

    fn step(&self) -> u64 {
        THREADS / (self.width / 4)
    }

    /// The thread's units of a `tile`-row tile.
    pub(super) fn units(&self, tile: u64) -> Vec<u64> {
        (0..tile / self.step()).collect()
    }

    /// Issues the loads of `units`, zeros at rows past `rows` (padded keys then add nothing,
    /// padded queries stay finite).
    pub(super) fn load(&self, k: &mut Kernel, units: &[u64], rows: Rd) -> Vec<(u64, Unit)> {
        let step = self.step();
        let mut loaded = Vec::new();
        for &u in units {
            let r = k.op64("add", self.r0, u * step);
            let p = k.cmp64("lt", r, rows);
            if self.bf16 {
                let (lo, hi) = (k.u32c(0), k.u32c(0));
                k.ins(format!(
                    "@{p} ld.global.nc.v2.b32 {{{lo}, {hi}}}, [{}+{}]",
                    self.g,
                    2 * u * step * self.stride
                ));
                loaded.push((u, Unit::Bf16(lo, hi)));
                continue;
            }
            let v: Vec<F> = (0..4).map(|_| k.fc(0.0)).collect();
            k.ins(format!(
                "@{p} ld.global.nc.v4.f32 {{{}, {}, {}, {}}}, [{}+{}]",
                v[0],
                v[1],
                v[2],
                v[3],
                self.g,
                4 * u * step * self.stride
            ));
            loaded.push((u, Unit::F32(v)));
        }
        loaded
    }

    /// Converts loaded values to bf16 and stores them in the tile at `buf`.
    pub(super) fn store(&self, k: &mut Kernel, loaded: Vec<(u64, Unit)>, buf: Rd) {
        let sa = k.op64("add", self.at, buf);
        for (u, v) in loaded {
            let (lo, hi) = match v {
                Unit::Bf16(lo, hi) => (lo, hi),
                Unit::F32(v) => {
                    let (lo, hi) = (k.r(), k.r());
                    // The first operand goes to the upper half: the higher column.
                    k.ins(format!("cvt.rn.bf16x2.f32 {lo}, {}, {}", v[1], v[0]));
                    k.ins(format!("cvt.rn.bf16x2.f32 {hi}, {}, {}", v[3], v[2]));
                    (lo, hi)
                }
            };
            k.ins(format!(
                "st.shared.v2.b32 [{sa}+{}], {{{lo}, {hi}}}",
                u * self.step() * pitch(self.width)
            ));
        }
    }
}

impl Rows {
    /// Starts copying a `tile`-row tile as f32 into the staging tile at `fbuf` (`cp.async`:
    /// no registers hold it on the way), zeros past `rows`. Only this thread reads what it
    /// copies (`convert`), after `cp.async.wait_all`: no barrier between.
    pub(super) fn copy(&self, k: &mut Kernel, tile: u64, rows: Rd, fbuf: Rd) {
        let step = self.step();
        let dst = k.op64("add", self.f_at, fbuf);
        for u in self.units(tile) {
            let r = k.op64("add", self.r0, u * step);
            let p = k.cmp64("lt", r, rows);
            let n = k.r();
            // Four f32, or four bf16 into the first half of the unit's staging slot: the
            // bytes copied (0 past the rows), the cache level, the element size in global.
            let (bytes, cache, elem) = if self.bf16 {
                (8, "ca", 2)
            } else {
                (16, "cg", 4)
            };
            k.ins(format!("selp.u32 {n}, {bytes}, 0, {p}"));
            k.ins(format!(
                "cp.async.{cache}.shared.global [{dst}+{}], [{}+{}], {bytes}, {n}",
                4 * u * step * self.width,
                self.g,
                elem * u * step * self.stride
            ));
        }
        k.ins("cp.async.commit_group");
    }

    /// This thread's part of the staged f32 tile at `fbuf` as bf16 into the tile at `buf`.
    pub(super) fn convert(&self, k: &mut Kernel, tile: u64, fbuf: Rd, buf: Rd) {
        let src = k.op64("add", self.f_at, fbuf);
        for group in self.units(tile).chunks(4) {
            let mut loaded = Vec::new();
            for &u in group {
                if self.bf16 {
                    let (lo, hi) = (k.r(), k.r());
                    k.ins(format!(
                        "ld.shared.v2.b32 {{{lo}, {hi}}}, [{src}+{}]",
                        4 * u * self.step() * self.width
                    ));
                    loaded.push((u, Unit::Bf16(lo, hi)));
                    continue;
                }
                let v: Vec<F> = (0..4).map(|_| k.f()).collect();
                k.ins(format!(
                    "ld.shared.v4.f32 {{{}, {}, {}, {}}}, [{src}+{}]",
                    v[0],
                    v[1],
                    v[2],
                    v[3],
                    4 * u * self.step() * self.width
                ));
                loaded.push((u, Unit::F32(v)));
            }
            self.store(k, loaded, buf);
        }
    }
}

/// Copies `rows` rows from problem `pb`'s row `first` of `src` into the `tile`-row buffer at
/// `buf` as bf16, zeros past `rows`. The caller puts a barrier on each side.
pub(crate) fn stage(
    k: &mut Kernel,
    ctx: &Ctx,
    (buf, tile): (Rd, u64),
    src: &Tensor,
    pb: &Problem,
    first: Rd,
    rows: Rd,
) {
    let at = Rows::new(k, ctx, src, pb, first);
    // Four loads in flight before their conversions.
    for group in at.units(tile).chunks(4) {
        let loaded = at.load(k, group, rows);
        at.store(k, loaded, buf);
    }
}

/// Tiles streamed along the rows of their tensors (K and V, or Q and dY), double-buffered:
/// tile j + 1 lands as f32 in a staging area (`cp.async`, no registers hold it) while the
/// warps compute on tile j in bf16. Operands are f32 in global memory and `cp.async` copies
/// bytes, so each thread converts what it copied itself, when the next step begins: four
/// times fewer conversions than converting in every warp's fragments, and `ldmatrix` still
/// reads bf16.
pub(crate) struct Stream<'a> {
    /// Each tensor, its f32 staging tile and its bf16 tile.
    pub(crate) tiles: Vec<(&'a Tensor, Rd, Rd)>,
    /// Rows per tile, and the tensors' length.
    pub(crate) rows: u64,
    pub(crate) len: u64,
}

impl Stream<'_> {
    /// The shared bytes of the staging tiles of `rows` rows of these widths.
    pub(crate) fn staging_bytes(rows: u64, widths: &[u64]) -> u64 {
        widths.iter().map(|w| 4 * rows * w).sum()
    }

    /// Starts copying the tiles from row `first` when `first < end` (a uniform branch; the
    /// last step has no next tile).
    pub(crate) fn copy(&self, k: &mut Kernel, ctx: &Ctx, pb: &Problem, (first, end): (Rd, Rd)) {
        let go = k.cmp64("lt", first, end);
        let skip = k.label();
        k.bra_unless(go, &skip);
        let n = rows_left(k, first, self.len, self.rows);
        for &(t, f, _) in &self.tiles {
            Rows::new(k, ctx, t, pb, first).copy(k, self.rows, n, f);
        }
        k.place(&skip);
    }

    /// Starts copying the first tiles for the block of queries from `i0` (the barrier before:
    /// the previous task's warps may still read the tiles); returns the rows `(0, end)` the
    /// block sees: all, or with `causal` those below `i0 + BR`.
    pub(crate) fn copy_first(
        &self,
        k: &mut Kernel,
        ctx: &Ctx,
        pb: &Problem,
        i0: Rd,
        causal: bool,
    ) -> (Rd, Rd) {
        let zero = k.u64c(0);
        let end = if causal {
            let x = k.op64("add", i0, BR);
            k.op64("min", x, self.len)
        } else {
            k.u64c(self.len)
        };
        k.ins("bar.sync 0");
        self.copy(k, ctx, pb, (zero, end));
        (zero, end)
    }

    /// The step of the tiles from `j0`: waits for their copies, converts them (the barrier
    /// before: the warps may still read the last tiles), runs `more` (other staging), starts
    /// copying the next tiles when `j0 + rows < end`, and puts a barrier after.
    pub(crate) fn step(
        &self,
        k: &mut Kernel,
        ctx: &Ctx,
        pb: &Problem,
        (j0, end): (Rd, Rd),
        more: impl FnOnce(&mut Kernel),
    ) {
        k.ins("cp.async.wait_all");
        k.ins("bar.sync 0");
        for &(t, f, b) in &self.tiles {
            Rows::new(k, ctx, t, pb, j0).convert(k, self.rows, f, b);
        }
        more(k);
        let next = k.op64("add", j0, self.rows);
        self.copy(k, ctx, pb, (next, end));
        k.ins("bar.sync 0");
    }
}

/// The first `min(tile, n - start)` rows from `start` (`start < n`).
pub(crate) fn rows_left(k: &mut Kernel, start: Rd, n: u64, tile: u64) -> Rd {
    let left = k.u64c(n);
    let left = k.op64("sub", left, start);
    k.op64("min", left, tile)
}
