//! The interpreter's results against values computed in Rust, on small kernels written in
//! the code generator's style.

use parallax_emulator::{launch, Launch, Memory, Module, Options, ParamValue, Report};

const HEAD: &str = ".version 8.0\n.target sm_80\n.address_size 64\n\n";

/// Parses `body` as the body of entry `k` with `params` (`.param` lines) and runs it.
pub fn run(
    params: &[&str],
    body: &str,
    grid: u32,
    block: u32,
    mem: &mut Memory,
    args: Vec<ParamValue>,
) -> Report {
    let ptx = format!(
        "{HEAD}.visible .entry k(\n{}\n)\n{{\n\t.reg .pred %p<20>;\n\t.reg .b32 %r<40>;\n\t.reg .f32 %f<40>;\n\t.reg .b64 %rd<40>;\n{body}\n}}\n",
        params.join(",\n")
    );
    let m = Module::parse(&ptx).unwrap_or_else(|e| panic!("{e}\n{ptx}"));
    let l = Launch {
        entry: "k",
        grid: [grid, 1, 1],
        block: [block, 1, 1],
        dynamic_shared: 0,
        params: args,
    };
    launch(&m, &l, mem, &Options::default()).unwrap_or_else(|e| panic!("{e}"))
}

/// A kernel that writes `n` 32-bit results of one instruction form over two inputs.
fn binop(ins: &str, a: &[u32], b: &[u32]) -> Vec<u32> {
    let n = a.len();
    let mut mem = Memory::new();
    let (pa, pb, pc) = (
        mem.alloc(4 * n as u64, "a"),
        mem.alloc(4 * n as u64, "b"),
        mem.alloc(4 * n as u64, "c"),
    );
    let bytes = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    mem.write(pa, &bytes(a)).unwrap();
    mem.write(pb, &bytes(b)).unwrap();
    let body = format!(
        "\tld.param.u64 %rd1, [k_p0];\n\tld.param.u64 %rd2, [k_p1];\n\tld.param.u64 %rd3, [k_p2];\n\
         \tmov.u32 %r1, %tid.x;\n\tmul.wide.u32 %rd4, %r1, 4;\n\tadd.u64 %rd5, %rd1, %rd4;\n\
         \tadd.u64 %rd6, %rd2, %rd4;\n\tadd.u64 %rd7, %rd3, %rd4;\n\tld.global.b32 %r2, [%rd5];\n\
         \tld.global.b32 %r3, [%rd6];\n\t{ins}\n\tst.global.b32 [%rd7], %r4;\n\tret;"
    );
    let p = [
        "\t.param .u64 k_p0",
        "\t.param .u64 k_p1",
        "\t.param .u64 k_p2",
    ];
    let r = run(
        &p,
        &body,
        1,
        n as u32,
        &mut mem,
        vec![
            ParamValue::U64(pa),
            ParamValue::U64(pb),
            ParamValue::U64(pc),
        ],
    );
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let mut out = vec![0u8; 4 * n];
    mem.read(pc, &mut out).unwrap();
    out.chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn grid_stride_add() {
    let n = 1000u64;
    let mut mem = Memory::new();
    let (a, b, c) = (
        mem.alloc(4 * n, "a"),
        mem.alloc(4 * n, "b"),
        mem.alloc(4 * n, "c"),
    );
    let av: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let bv: Vec<f32> = (0..n).map(|i| 3.0 - i as f32).collect();
    mem.write_f32(a, &av).unwrap();
    mem.write_f32(b, &bv).unwrap();
    let body = "\tld.param.u64 %rd1, [k_p0];\n\tcvta.to.global.u64 %rd2, %rd1;\n\tld.param.u64 %rd3, [k_p1];\n\
        \tcvta.to.global.u64 %rd4, %rd3;\n\tld.param.u64 %rd5, [k_p2];\n\tcvta.to.global.u64 %rd6, %rd5;\n\
        \tmov.u32 %r1, %tid.x;\n\tmov.u32 %r2, %ctaid.x;\n\tmov.u32 %r3, %ntid.x;\n\tmov.u32 %r4, %nctaid.x;\n\
        \tmul.wide.u32 %rd7, %r2, %r3;\n\tcvt.u64.u32 %rd8, %r1;\n\tadd.u64 %rd9, %rd7, %rd8;\n\
        \tmul.wide.u32 %rd10, %r3, %r4;\n$L1:\n\tsetp.ge.u64 %p1, %rd9, 1000;\n\t@%p1 bra $L2;\n\
        \tmad.lo.u64 %rd11, %rd9, 4, %rd2;\n\tld.global.f32 %f1, [%rd11];\n\tmad.lo.u64 %rd12, %rd9, 4, %rd4;\n\
        \tld.global.f32 %f2, [%rd12];\n\tadd.rn.f32 %f3, %f1, %f2;\n\tmad.lo.u64 %rd13, %rd9, 4, %rd6;\n\
        \tst.global.f32 [%rd13], %f3;\n\tadd.u64 %rd9, %rd9, %rd10;\n\tbra.uni $L1;\n$L2:\n\tret;";
    let p = [
        "\t.param .u64 k_p0",
        "\t.param .u64 k_p1",
        "\t.param .u64 k_p2",
    ];
    let r = run(
        &p,
        body,
        3,
        128,
        &mut mem,
        vec![ParamValue::U64(a), ParamValue::U64(b), ParamValue::U64(c)],
    );
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let cv = mem.read_f32(c, n as usize).unwrap();
    for i in 0..n as usize {
        assert_eq!(cv[i], av[i] + bv[i]);
    }
    assert!(r.instructions > 10 * n);
}

#[test]
fn integer_division_and_bfind() {
    let a = [7u32, 100, 0xffff_fff9, 5, 0, 1, 0x8000_0000, 12345];
    let b = [2u32, 7, 2, 0, 3, 1, 3, 10];
    let d = binop("div.u32 %r4, %r2, %r3;", &a, &b);
    for i in 0..a.len() {
        let want = a[i].checked_div(b[i]).unwrap_or(u32::MAX);
        assert_eq!(d[i], want, "{} / {}", a[i], b[i]);
    }
    let r = binop("rem.u32 %r4, %r2, %r3;", &a, &b);
    assert_eq!(r[0], 1);
    assert_eq!(r[1], 2);
    let s = binop("div.s32 %r4, %r2, %r3;", &a, &b);
    assert_eq!(s[2] as i32, -3, "-7 / 2 truncates toward zero");
    let sr = binop("rem.s32 %r4, %r2, %r3;", &a, &b);
    assert_eq!(sr[2] as i32, -1, "the remainder takes the dividend's sign");
    let f = binop("bfind.u32 %r4, %r2;", &a, &b);
    assert_eq!(f, vec![2, 6, 31, 2, 0xffff_ffff, 0, 31, 13]);
    let fs = binop("bfind.s32 %r4, %r2;", &a, &b);
    assert_eq!(
        fs[2], 2,
        "-7 = ...11111001: the highest non-sign bit is bit 2"
    );
    assert_eq!(fs[6], 30);
    let fa = binop("bfind.shiftamt.u32 %r4, %r2;", &a, &b);
    assert_eq!(fa[0], 29);
}

#[test]
fn unordered_compares_and_max_nan() {
    let nan = f32::NAN.to_bits();
    let a = [
        1.0f32.to_bits(),
        nan,
        2.0f32.to_bits(),
        nan,
        (-0.0f32).to_bits(),
    ];
    let b = [
        2.0f32.to_bits(),
        1.0f32.to_bits(),
        1.0f32.to_bits(),
        nan,
        0.0f32.to_bits(),
    ];
    let gtu = binop(
        "setp.gtu.f32 %p1, %r2, %r3;\n\tselp.u32 %r4, 1, 0, %p1;",
        &a,
        &b,
    );
    assert_eq!(gtu, vec![0, 1, 1, 1, 0]);
    let gt = binop(
        "setp.gt.f32 %p1, %r2, %r3;\n\tselp.u32 %r4, 1, 0, %p1;",
        &a,
        &b,
    );
    assert_eq!(gt, vec![0, 0, 1, 0, 0]);
    let num = binop(
        "setp.num.f32 %p1, %r2, %r3;\n\tselp.u32 %r4, 1, 0, %p1;",
        &a,
        &b,
    );
    assert_eq!(num, vec![1, 0, 1, 0, 1]);
    let and = binop("setp.gt.u32 %p2, %r2, 0;\n\tsetp.gtu.and.f32 %p1, %r2, %r3, %p2;\n\tselp.u32 %r4, 1, 0, %p1;", &a, &b);
    assert_eq!(and, vec![0, 1, 1, 1, 0]);
    let m = binop("max.NaN.f32 %r4, %r2, %r3;", &a, &b);
    assert_eq!(m[0], 2.0f32.to_bits());
    assert_eq!(m[1], 0x7fff_ffff, "max.NaN gives the canonical NaN");
    let m = binop("max.f32 %r4, %r2, %r3;", &a, &b);
    assert_eq!(
        m[1],
        1.0f32.to_bits(),
        "max without .NaN drops a NaN operand"
    );
    assert_eq!(m[4], 0.0f32.to_bits(), "+0 is above -0");
    let c = binop(
        "copysign.f32 %r4, %r2, %r3;",
        &[(-1.0f32).to_bits()],
        &[2.5f32.to_bits()],
    );
    assert_eq!(
        f32::from_bits(c[0]),
        -2.5,
        "copysign d, a, b: b's magnitude, a's sign"
    );
}

#[test]
fn warp_shuffle_reduction() {
    let mut mem = Memory::new();
    let out = mem.alloc(4 * 64, "out");
    let body = "\tld.param.u64 %rd1, [k_p0];\n\tmov.u32 %r1, %tid.x;\n\tcvt.rn.f32.u32 %f1, %r1;\n\
        \tshfl.sync.bfly.b32 %f2, %f1, 16, 31, -1;\n\tadd.rn.f32 %f1, %f1, %f2;\n\
        \tshfl.sync.bfly.b32 %f2, %f1, 8, 31, -1;\n\tadd.rn.f32 %f1, %f1, %f2;\n\
        \tshfl.sync.bfly.b32 %f2, %f1, 4, 31, -1;\n\tadd.rn.f32 %f1, %f1, %f2;\n\
        \tshfl.sync.bfly.b32 %f2, %f1, 2, 31, -1;\n\tadd.rn.f32 %f1, %f1, %f2;\n\
        \tshfl.sync.bfly.b32 %f2, %f1, 1, 31, -1;\n\tadd.rn.f32 %f1, %f1, %f2;\n\
        \tmov.u32 %r2, 3;\n\tshfl.sync.idx.b32 %r3, %r1, %r2, 31, -1;\n\tshfl.sync.down.b32 %r4, %r1, 1, 31, -1;\n\
        \tmul.wide.u32 %rd2, %r1, 4;\n\tadd.u64 %rd3, %rd1, %rd2;\n\tst.global.f32 [%rd3], %f1;\n\
        \tadd.u64 %rd4, %rd3, 128;\n\tadd.u32 %r5, %r3, %r4;\n\tst.global.u32 [%rd4], %r5;\n\tret;";
    let r = run(
        &["\t.param .u64 k_p0"],
        body,
        1,
        32,
        &mut mem,
        vec![ParamValue::U64(out)],
    );
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let v = mem.read_f32(out, 32).unwrap();
    assert!(v.iter().all(|&x| x == 496.0), "{v:?}");
    let mut b = [0u8; 128];
    mem.read(out + 128, &mut b).unwrap();
    for l in 0..32u32 {
        let got = u32::from_le_bytes(b[4 * l as usize..][..4].try_into().unwrap());
        // idx 3 from every lane; down 1 clamps lane 31 to itself.
        assert_eq!(got, 3 + if l == 31 { 31 } else { l + 1 }, "lane {l}");
    }
}

fn xorshift(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

fn words(mem: &Memory, at: u64, n: usize) -> Vec<u32> {
    let mut b = vec![0u8; 4 * n];
    mem.read(at, &mut b).unwrap();
    b.chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn put(mem: &mut Memory, v: &[u32], label: &str) -> u64 {
    let p = mem.alloc(4 * v.len() as u64, label);
    mem.write(
        p,
        &v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
    )
    .unwrap();
    p
}

/// mma.sync through the instruction path (fragments loaded per lane, as the ISA lays them
/// out) against a plain matrix product summed in the oracle's order.
#[test]
fn mma_against_a_plain_matrix_product() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let bf = |s: &mut u64| -> u16 {
        (((xorshift(s) % 2000) as f32 / 250.0 - 4.0).to_bits() >> 16) as u16
    };
    let a: Vec<Vec<u16>> = (0..16)
        .map(|_| (0..16).map(|_| bf(&mut seed)).collect())
        .collect();
    let b: Vec<Vec<u16>> = (0..16)
        .map(|_| (0..8).map(|_| bf(&mut seed)).collect())
        .collect();
    let c: Vec<f32> = (0..128).map(|i| i as f32 * 0.25 - 3.0).collect();
    let (mut fa, mut fb, mut fc) = (vec![0u32; 128], vec![0u32; 64], vec![0u32; 128]);
    for l in 0..32 {
        let (g, t) = (l / 4, l % 4);
        for i in 0..8 {
            let row = if i < 2 || (4..6).contains(&i) {
                g
            } else {
                g + 8
            };
            let col = t * 2 + (i & 1) + if i >= 4 { 8 } else { 0 };
            fa[l * 4 + i / 2] |= (a[row][col] as u32) << (16 * (i % 2));
        }
        for i in 0..4 {
            let row = t * 2 + (i & 1) + if i >= 2 { 8 } else { 0 };
            fb[l * 2 + i / 2] |= (b[row][g] as u32) << (16 * (i % 2));
        }
        for i in 0..4 {
            let row = if i < 2 { g } else { g + 8 };
            fc[l * 4 + i] = c[row * 8 + t * 2 + (i & 1)].to_bits();
        }
    }
    let mut mem = Memory::new();
    let (pa, pb, pc) = (
        put(&mut mem, &fa, "a"),
        put(&mut mem, &fb, "b"),
        put(&mut mem, &fc, "c"),
    );
    let pd = mem.alloc(512, "d");
    let body = "\tld.param.u64 %rd1, [k_p0];\n\tld.param.u64 %rd2, [k_p1];\n\tld.param.u64 %rd3, [k_p2];\n\
        \tld.param.u64 %rd9, [k_p3];\n\tmov.u32 %r1, %tid.x;\n\tmul.wide.u32 %rd4, %r1, 16;\n\
        \tadd.u64 %rd5, %rd1, %rd4;\n\tld.global.v4.b32 {%r2, %r3, %r4, %r5}, [%rd5];\n\
        \tmul.wide.u32 %rd6, %r1, 8;\n\tadd.u64 %rd7, %rd2, %rd6;\n\tld.global.v2.b32 {%r6, %r7}, [%rd7];\n\
        \tadd.u64 %rd8, %rd3, %rd4;\n\tld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd8];\n\
        \tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f5, %f6, %f7, %f8}, {%r2, %r3, %r4, %r5}, {%r6, %r7}, {%f1, %f2, %f3, %f4};\n\
        \tadd.u64 %rd10, %rd9, %rd4;\n\tst.global.v4.f32 [%rd10], {%f5, %f6, %f7, %f8};\n\tret;";
    let p = [
        "\t.param .u64 k_p0",
        "\t.param .u64 k_p1",
        "\t.param .u64 k_p2",
        "\t.param .u64 k_p3",
    ];
    let args = [pa, pb, pc, pd].map(ParamValue::U64).to_vec();
    let r = run(&p, body, 1, 32, &mut mem, args);
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let d = words(&mem, pd, 128);
    let f = |x: u16| f32::from_bits((x as u32) << 16);
    for l in 0..32 {
        let (g, t) = (l / 4, l % 4);
        for i in 0..4 {
            let (row, col) = (if i < 2 { g } else { g + 8 }, t * 2 + (i & 1));
            let mut acc = c[row * 8 + col];
            for k in 0..16 {
                acc = f(a[row][k]).mul_add(f(b[k][col]), acc);
            }
            assert_eq!(
                f32::from_bits(d[l * 4 + i]),
                acc,
                "lane {l} c{i} (row {row}, col {col})"
            );
        }
    }
}

/// ldmatrix .x4 and .x4.trans from shared memory a block filled, against the ISA's maps.
#[test]
fn ldmatrix_from_shared() {
    let vals: Vec<u32> = (0..128u32).map(|i| (2 * i) | ((2 * i + 1) << 16)).collect();
    for trans in [false, true] {
        let mut mem = Memory::new();
        let src = put(&mut mem, &vals, "src");
        let out = mem.alloc(512, "out");
        let t = if trans { ".trans" } else { "" };
        let body = format!(
            "\t.shared .align 16 .b16 k_s0[256];\n\tld.param.u64 %rd1, [k_p0];\n\tld.param.u64 %rd2, [k_p1];\n\
             \tmov.u32 %r1, %tid.x;\n\tmul.wide.u32 %rd3, %r1, 16;\n\tadd.u64 %rd4, %rd1, %rd3;\n\
             \tld.global.v4.b32 {{%r2, %r3, %r4, %r5}}, [%rd4];\n\tmov.u64 %rd5, k_s0;\n\tadd.u64 %rd6, %rd5, %rd3;\n\
             \tst.shared.v4.b32 [%rd6], {{%r2, %r3, %r4, %r5}};\n\tbar.sync 0;\n\
             \tldmatrix.sync.aligned.m8n8.x4{t}.shared.b16 {{%r6, %r7, %r8, %r9}}, [%rd6];\n\
             \tadd.u64 %rd7, %rd2, %rd3;\n\tst.global.v4.b32 [%rd7], {{%r6, %r7, %r8, %r9}};\n\tret;"
        );
        let p = ["\t.param .u64 k_p0", "\t.param .u64 k_p1"];
        let r = run(
            &p,
            &body,
            1,
            32,
            &mut mem,
            vec![ParamValue::U64(src), ParamValue::U64(out)],
        );
        assert!(r.findings.is_empty(), "{:?}", r.findings);
        let d = words(&mem, out, 128);
        for l in 0..32u32 {
            for j in 0..4u32 {
                // Element index (matrix j, row, col) is j*64 + row*8 + col; its value is that.
                let (lo, hi) = if trans {
                    (
                        j * 64 + (2 * (l % 4)) * 8 + l / 4,
                        j * 64 + (2 * (l % 4) + 1) * 8 + l / 4,
                    )
                } else {
                    (
                        j * 64 + (l / 4) * 8 + 2 * (l % 4),
                        j * 64 + (l / 4) * 8 + 2 * (l % 4) + 1,
                    )
                };
                assert_eq!(
                    d[(l * 4 + j) as usize],
                    lo | (hi << 16),
                    "trans {trans} lane {l} reg {j}"
                );
            }
        }
    }
}

/// The "last block finishes" pattern: each block stores its partial to a `.global` array,
/// `membar.gl`, then counts itself in with `atom.global.add`; the block that sees the count
/// reach `nctaid - 1` sums the partials and resets the counter. Blocks run in order, and
/// `.global` variables persist between launches.
#[test]
fn last_block_sums_partials_through_global_variables() {
    let body = "\t.global .align 4 .f32 k_part[8];\n\t.global .align 4 .u32 k_done;\n\
        \t.shared .align 4 .u32 k_last;\n\tld.param.u64 %rd1, [k_p0];\n\tmov.u32 %r1, %tid.x;\n\
        \tmov.u32 %r2, %ctaid.x;\n\tmov.u32 %r3, %nctaid.x;\n\tsetp.ne.u32 %p1, %r1, 0;\n\t@%p1 bra $L1;\n\
        \tcvt.rn.f32.u32 %f1, %r2;\n\tadd.rn.f32 %f1, %f1, 0f3F000000;\n\tmov.u64 %rd2, k_part;\n\
        \tmul.wide.u32 %rd3, %r2, 4;\n\tadd.u64 %rd4, %rd2, %rd3;\n\tst.global.f32 [%rd4], %f1;\n\tmembar.gl;\n\
        \tatom.global.add.u32 %r4, [k_done], 1;\n\tsub.u32 %r5, %r3, 1;\n\tsetp.eq.u32 %p2, %r4, %r5;\n\
        \tselp.u32 %r6, 1, 0, %p2;\n\tst.shared.u32 [k_last], %r6;\n$L1:\n\tbar.sync 0;\n\
        \tld.shared.u32 %r7, [k_last];\n\tsetp.eq.u32 %p3, %r7, 0;\n\t@%p3 bra $L3;\n\t@%p1 bra $L3;\n\
        \tmov.f32 %f2, 0f00000000;\n\tmov.u32 %r8, 0;\n$L2:\n\tsetp.ge.u32 %p4, %r8, %r3;\n\t@%p4 bra $L4;\n\
        \tmul.wide.u32 %rd5, %r8, 4;\n\tadd.u64 %rd6, %rd2, %rd5;\n\tld.global.f32 %f3, [%rd6];\n\
        \tadd.rn.f32 %f2, %f2, %f3;\n\tadd.u32 %r8, %r8, 1;\n\tbra.uni $L2;\n$L4:\n\tst.global.f32 [%rd1], %f2;\n\
        \tst.global.u32 [k_done], 0;\n$L3:\n\tret;";
    let mut mem = Memory::new();
    let out = mem.alloc(4, "out");
    for _ in 0..2 {
        let r = run(
            &["\t.param .u64 k_p0"],
            body,
            8,
            64,
            &mut mem,
            vec![ParamValue::U64(out)],
        );
        assert!(r.findings.is_empty(), "{:?}", r.findings);
        assert_eq!(
            mem.read_f32(out, 1).unwrap()[0],
            (0..8).map(|i| i as f32 + 0.5).sum::<f32>()
        );
    }
}
