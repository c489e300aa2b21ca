//! Each sanitizer check fires on a small kernel with the bug planted, in the code
//! generator's style, and the correct kernel is clean.

use parallax_emulator::{
    launch, EmuError, FindingKind, Launch, Memory, Module, Options, ParamValue, Report,
};

const HEAD: &str = ".version 8.0\n.target sm_80\n.address_size 64\n\n";

fn module(decls: &str, body: &str) -> Module {
    let ptx = format!(
        "{HEAD}.visible .entry k(\n\t.param .u64 k_p0,\n\t.param .u64 k_p1\n)\n{{\n\t.reg .pred %p<20>;\n\
         \t.reg .b32 %r<40>;\n\t.reg .f32 %f<40>;\n\t.reg .b64 %rd<40>;\n{decls}\n{body}\n}}\n"
    );
    Module::parse(&ptx).unwrap_or_else(|e| panic!("{e}\n{ptx}"))
}

fn go(m: &Module, block: u32, mem: &mut Memory, a: u64, b: u64) -> Result<Report, EmuError> {
    let l = Launch {
        entry: "k",
        grid: [1, 1, 1],
        block: [block, 1, 1],
        dynamic_shared: 0,
        params: vec![ParamValue::U64(a), ParamValue::U64(b)],
    };
    launch(m, &l, mem, &Options::default())
}

fn kinds(r: &Report) -> Vec<FindingKind> {
    r.findings.iter().map(|f| f.kind).collect()
}

/// A tree reduction of 128 floats in shared memory; `barrier` is the loop's `bar.sync`.
fn reduction(barrier: &str) -> Module {
    let body = format!(
        "\tld.param.u64 %rd1, [k_p0];\n\tld.param.u64 %rd2, [k_p1];\n\tmov.u32 %r1, %tid.x;\n\
         \tmul.wide.u32 %rd3, %r1, 4;\n\tadd.u64 %rd4, %rd1, %rd3;\n\tld.global.f32 %f1, [%rd4];\n\
         \tmov.u64 %rd5, k_s0;\n\tadd.u64 %rd6, %rd5, %rd3;\n\tst.shared.f32 [%rd6], %f1;\n\tbar.sync 0;\n\
         \tmov.u32 %r2, 64;\n$L1:\n\tsetp.eq.u32 %p1, %r2, 0;\n\t@%p1 bra $L3;\n\tsetp.lt.u32 %p2, %r1, %r2;\n\
         \t@!%p2 bra $L2;\n\tmul.wide.u32 %rd7, %r2, 4;\n\tadd.u64 %rd8, %rd6, %rd7;\n\tld.shared.f32 %f2, [%rd8];\n\
         \tld.shared.f32 %f3, [%rd6];\n\tadd.rn.f32 %f3, %f3, %f2;\n\tst.shared.f32 [%rd6], %f3;\n$L2:\n\
         {barrier}\n\tshr.u32 %r2, %r2, 1;\n\tbra.uni $L1;\n$L3:\n\tsetp.eq.u32 %p3, %r1, 0;\n\t@!%p3 bra $L4;\n\
         \tld.shared.f32 %f4, [%rd5];\n\tst.global.f32 [%rd2], %f4;\n$L4:\n\tret;"
    );
    module("\t.shared .align 4 .f32 k_s0[128];", &body)
}

fn inputs(mem: &mut Memory) -> (u64, u64, Vec<f32>) {
    let a = mem.alloc(512, "in");
    let b = mem.alloc(4, "out");
    let v: Vec<f32> = (0..128).map(|i| (i % 7) as f32 - 2.5).collect();
    mem.write_f32(a, &v).unwrap();
    (a, b, v)
}

#[test]
fn shared_reduction_is_clean_and_right() {
    let mut mem = Memory::new();
    let (a, b, v) = inputs(&mut mem);
    let r = go(&reduction("\tbar.sync 0;"), 128, &mut mem, a, b).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    assert_eq!(mem.read_f32(b, 1).unwrap()[0], v.iter().sum::<f32>());
}

#[test]
fn missing_barrier_is_a_shared_race() {
    let mut mem = Memory::new();
    let (a, b, _) = inputs(&mut mem);
    let r = go(&reduction(""), 128, &mut mem, a, b).unwrap();
    assert!(
        kinds(&r).contains(&FindingKind::SharedRace),
        "{:?}",
        r.findings
    );
    let f = &r.findings[0];
    assert_eq!(f.entry, "k");
    assert!(f.line > 0 && f.address.is_some(), "{f}");
}

/// Loads element tid + `shift` of a 32-float buffer and stores it.
fn copy(shift: u32) -> Module {
    let body = format!(
        "\tld.param.u64 %rd1, [k_p0];\n\tld.param.u64 %rd2, [k_p1];\n\tmov.u32 %r1, %tid.x;\n\
         \tadd.u32 %r2, %r1, {shift};\n\tmul.wide.u32 %rd3, %r2, 4;\n\tadd.u64 %rd4, %rd1, %rd3;\n\
         \tld.global.f32 %f1, [%rd4];\n\tmul.wide.u32 %rd5, %r1, 4;\n\tadd.u64 %rd6, %rd2, %rd5;\n\
         \tst.global.f32 [%rd6], %f1;\n\tret;"
    );
    module("", &body)
}

#[test]
fn index_shifted_by_one_is_out_of_bounds() {
    let mut mem = Memory::new();
    let (a, b) = (mem.alloc(128, "a"), mem.alloc(128, "b"));
    mem.write_f32(a, &[1.0; 32]).unwrap();
    let r = go(&copy(0), 32, &mut mem, a, b).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let r = go(&copy(1), 32, &mut mem, a, b).unwrap();
    assert_eq!(kinds(&r), vec![FindingKind::GlobalOutOfBounds]);
    assert_eq!(r.findings[0].thread, [31, 0, 0]);
    assert_eq!(r.findings[0].address, Some(a + 128));
}

#[test]
fn unwritten_buffer_is_an_uninitialized_read() {
    let mut mem = Memory::new();
    let (a, b) = (mem.alloc(128, "a"), mem.alloc(128, "b"));
    let r = go(&copy(0), 32, &mut mem, a, b).unwrap();
    assert_eq!(kinds(&r), vec![FindingKind::UninitializedRead]);
}

#[test]
fn misaligned_vector_load() {
    let body = |off: u32| {
        format!(
            "\tld.param.u64 %rd1, [k_p0];\n\tld.param.u64 %rd2, [k_p1];\n\
             \tld.global.v4.f32 {{%f1, %f2, %f3, %f4}}, [%rd1+{off}];\n\tst.global.f32 [%rd2], %f4;\n\tret;"
        )
    };
    let mut mem = Memory::new();
    let (a, b) = (mem.alloc(64, "a"), mem.alloc(4, "b"));
    mem.write_f32(a, &[2.0; 16]).unwrap();
    let r = go(&module("", &body(16)), 1, &mut mem, a, b).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let r = go(&module("", &body(8)), 1, &mut mem, a, b).unwrap();
    assert_eq!(kinds(&r), vec![FindingKind::Misaligned]);
}

/// 32 threads each cp.async 16 bytes to shared, then read them back (before or after
/// the wait).
fn staged(read_before_wait: bool) -> Module {
    let (early, late) = if read_before_wait {
        ("\tld.shared.f32 %f1, [%rd5];\n", "")
    } else {
        ("", "\tld.shared.f32 %f1, [%rd5];\n")
    };
    let body = format!(
        "\tld.param.u64 %rd1, [k_p0];\n\tld.param.u64 %rd2, [k_p1];\n\tmov.u32 %r1, %tid.x;\n\
         \tmul.wide.u32 %rd3, %r1, 16;\n\tadd.u64 %rd4, %rd1, %rd3;\n\tmov.u64 %rd6, k_s0;\n\
         \tadd.u64 %rd5, %rd6, %rd3;\n\tmov.u32 %r2, 12;\n\
         \tcp.async.cg.shared.global [%rd5+0], [%rd4+0], 16, %r2;\n\tcp.async.commit_group;\n{early}\
         \tcp.async.wait_all;\n\tbar.sync 0;\n{late}\tld.shared.f32 %f2, [%rd5+12];\n\
         \tadd.rn.f32 %f3, %f1, %f2;\n\tmul.wide.u32 %rd7, %r1, 4;\n\tadd.u64 %rd8, %rd2, %rd7;\n\
         \tst.global.f32 [%rd8], %f3;\n\tret;"
    );
    module("\t.shared .align 16 .f32 k_s0[128];", &body)
}

#[test]
fn reading_a_pending_cp_async_destination() {
    let mut mem = Memory::new();
    let (a, b) = (mem.alloc(512, "a"), mem.alloc(128, "b"));
    let v: Vec<f32> = (0..128).map(|i| i as f32).collect();
    mem.write_f32(a, &v).unwrap();
    let r = go(&staged(false), 32, &mut mem, a, b).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    // src-size 12 of 16: the fourth float is zero-filled.
    let out = mem.read_f32(b, 32).unwrap();
    for (t, x) in out.iter().enumerate() {
        assert_eq!(*x, v[4 * t], "thread {t}");
    }
    let r = go(&staged(true), 32, &mut mem, a, b).unwrap();
    assert!(
        kinds(&r).contains(&FindingKind::AsyncCopyPending),
        "{:?}",
        r.findings
    );
}

#[test]
fn barrier_in_a_branch_taken_by_half_a_warp() {
    let body = |bar_inside: bool| {
        let (a, b) = if bar_inside {
            ("\tbar.sync 0;\n", "")
        } else {
            ("", "\tbar.sync 0;\n")
        };
        format!(
            "\tmov.u32 %r1, %tid.x;\n\tsetp.lt.u32 %p1, %r1, 16;\n\t@%p1 bra $L1;\n{a}\
             \tadd.u32 %r2, %r1, 1;\n$L1:\n{b}\tret;"
        )
    };
    let mut mem = Memory::new();
    let r = go(&module("", &body(false)), 64, &mut mem, 0, 0).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let r = go(&module("", &body(true)), 64, &mut mem, 0, 0).unwrap();
    assert_eq!(kinds(&r), vec![FindingKind::BarrierDivergence]);
}

#[test]
fn full_mask_shuffle_under_divergence() {
    let body = |diverge: bool| {
        let guard = if diverge { "\t@%p1 bra $L1;\n" } else { "" };
        format!(
            "\tmov.u32 %r1, %tid.x;\n\tsetp.lt.u32 %p1, %r1, 8;\n{guard}\
             \tshfl.sync.bfly.b32 %r2, %r1, 1, 31, -1;\n$L1:\n\tret;"
        )
    };
    let mut mem = Memory::new();
    let r = go(&module("", &body(false)), 32, &mut mem, 0, 0).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let r = go(&module("", &body(true)), 32, &mut mem, 0, 0).unwrap();
    assert_eq!(kinds(&r), vec![FindingKind::WarpDivergence]);
}

#[test]
fn shared_access_past_the_declared_size() {
    let body = "\tmov.u64 %rd1, k_s0;\n\tmov.u32 %r1, 7;\n\tst.shared.u32 [%rd1+60], %r1;\n\
                \tst.shared.u32 [%rd1+64], %r1;\n\tret;";
    let mut mem = Memory::new();
    let r = go(
        &module("\t.shared .align 4 .u32 k_s0[16];", body),
        1,
        &mut mem,
        0,
        0,
    )
    .unwrap();
    assert_eq!(kinds(&r), vec![FindingKind::SharedOutOfBounds]);
}

#[test]
fn endless_loop_is_aborted() {
    let m = module("", "$L1:\n\tbra.uni $L1;");
    let l = Launch {
        entry: "k",
        grid: [1, 1, 1],
        block: [32, 1, 1],
        dynamic_shared: 0,
        params: vec![ParamValue::U64(0), ParamValue::U64(0)],
    };
    let o = Options {
        max_instructions: 1 << 20,
        ..Options::default()
    };
    let e = launch(&m, &l, &mut Memory::new(), &o).unwrap_err();
    assert!(matches!(e, EmuError::Aborted { .. }), "{e}");
}

#[test]
fn parameters_are_checked() {
    let m = module("", "\tret;");
    let mut l = Launch {
        entry: "k",
        grid: [1, 1, 1],
        block: [32, 1, 1],
        dynamic_shared: 0,
        params: vec![ParamValue::U64(0)],
    };
    let o = Options::default();
    let e = launch(&m, &l, &mut Memory::new(), &o).unwrap_err();
    assert!(
        matches!(
            e,
            EmuError::ParamCount {
                expected: 2,
                got: 1,
                ..
            }
        ),
        "{e}"
    );
    l.params.push(ParamValue::F32(1.0));
    let e = launch(&m, &l, &mut Memory::new(), &o).unwrap_err();
    assert!(
        matches!(&e, EmuError::ParamType { index: 1, name, .. } if name == "k_p1"),
        "{e}"
    );
    l.entry = "nope";
    assert!(matches!(
        launch(&m, &l, &mut Memory::new(), &o),
        Err(EmuError::NoEntry(_))
    ));
}

/// Two cp.async groups; `wait_group 1` lands the older only, so the newer's destination is
/// still pending.
#[test]
fn wait_group_completes_only_older_groups() {
    let body = |second: bool| {
        let off = if second { 512 } else { 0 };
        format!(
            "\tld.param.u64 %rd1, [k_p0];\n\tld.param.u64 %rd2, [k_p1];\n\tmov.u32 %r1, %tid.x;\n\
             \tmul.wide.u32 %rd3, %r1, 16;\n\tadd.u64 %rd4, %rd1, %rd3;\n\tmov.u64 %rd6, k_s0;\n\
             \tadd.u64 %rd5, %rd6, %rd3;\n\tcp.async.ca.shared.global [%rd5+0], [%rd4+0], 16;\n\
             \tcp.async.commit_group;\n\tcp.async.ca.shared.global [%rd5+512], [%rd4+512], 16;\n\
             \tcp.async.commit_group;\n\tcp.async.wait_group 1;\n\tld.shared.f32 %f1, [%rd5+{off}];\n\
             \tcp.async.wait_group 0;\n\tret;"
        )
    };
    let mut mem = Memory::new();
    let a = mem.alloc(1024, "a");
    mem.write_f32(a, &[1.0; 256]).unwrap();
    let decl = "\t.shared .align 16 .f32 k_s0[256];";
    let r = go(&module(decl, &body(false)), 32, &mut mem, a, 0).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let r = go(&module(decl, &body(true)), 32, &mut mem, a, 0).unwrap();
    assert_eq!(kinds(&r), vec![FindingKind::AsyncCopyPending]);
}

/// Racecheck is strict within a warp too: two lanes storing to one shared word in one
/// instruction race (compute-sanitizer reports intra-warp hazards).
#[test]
fn two_lanes_storing_one_word_race() {
    let body = |shift: u32| {
        format!(
            "\tmov.u32 %r1, %tid.x;\n\tshr.u32 %r2, %r1, {shift};\n\tmul.wide.u32 %rd1, %r2, 4;\n\
             \tmov.u64 %rd2, k_s0;\n\tadd.u64 %rd3, %rd2, %rd1;\n\tst.shared.u32 [%rd3], %r1;\n\tret;"
        )
    };
    let decl = "\t.shared .align 4 .u32 k_s0[32];";
    let mut mem = Memory::new();
    let r = go(&module(decl, &body(0)), 32, &mut mem, 0, 0).unwrap();
    assert!(r.findings.is_empty(), "{:?}", r.findings);
    let r = go(&module(decl, &body(1)), 32, &mut mem, 0, 0).unwrap();
    assert_eq!(kinds(&r), vec![FindingKind::SharedRace]);
    assert_eq!(r.findings[0].thread, [1, 0, 0]);
}

/// Findings stop the launch at `max_findings` distinct ones; the launch returns `Ok`.
#[test]
fn findings_stop_the_launch_at_the_limit() {
    let body = "\tld.param.u64 %rd1, [k_p0];\n\tld.global.f32 %f1, [%rd1+4096];\n\
                \tld.global.f32 %f2, [%rd1+8192];\n\tld.global.f32 %f3, [%rd1+2];\n\tret;";
    let m = module("", body);
    let l = Launch {
        entry: "k",
        grid: [4, 1, 1],
        block: [32, 1, 1],
        dynamic_shared: 0,
        params: vec![ParamValue::U64(0x1000), ParamValue::U64(0)],
    };
    let o = Options {
        max_findings: 2,
        ..Options::default()
    };
    let r = launch(&m, &l, &mut Memory::new(), &o).unwrap();
    assert_eq!(kinds(&r), vec![FindingKind::GlobalOutOfBounds; 2]);
    assert_eq!(r.findings[0].block, [0, 0, 0]);
}
