//! The parser: what it accepts, and that anything outside the modelled subset is an error
//! naming the line.

use parallax_emulator::Module;

const HEAD: &str = ".version 8.0\n.target sm_80\n.address_size 64\n";

fn entry(body: &str) -> String {
    format!(
        "{HEAD}\n.visible .entry k(\n\t.param .u64 k_p0,\n\t.param .f32 k_p1,\n\t.param .align 8 .b8 k_p2[24]\n)\n{{\n\
         \t.reg .pred %p<4>;\n\t.reg .b32 %r<8>;\n\t.reg .f32 %f<8>;\n\t.reg .b64 %rd<8>;\n{body}\n}}\n"
    )
}

/// The 1-based line of `body`'s first line in `entry(body)`.
const FIRST: usize = 15;

#[test]
fn parses_entries_declarations_and_labels() {
    let text = entry(
        "\t.shared .align 16 .b16 k_s0[64];\n\tld.param.u64 %rd1, [k_p0];\n\tcvta.to.global.u64 %rd2, %rd1;\n\
         \tld.param.f32 %f1, [k_p1];\n\tmov.u64 %rd3, k_p2;\n\tld.param.u64 %rd4, [%rd3+8];\n\
         \tmov.u32 %r1, %tid.x;\n$L1:\n\tsetp.lt.and.u64 %p1, %rd4, 4, %p2;\n\t@!%p1 bra $L2;\n\
         \tmov.b64 {%r2, %r3}, %rd4;\n\tmov.f32 %f2, 0f3F800000;\n\tmov.f64 %rd5, 0d3FF0000000000000;\n\
         \tbra.uni $L1;\n$L2:\n\tret;",
    );
    let m = Module::parse(&text).unwrap();
    assert_eq!(m.entries(), vec!["k"]);
    let two = format!("{text}\n.visible .entry k2()\n{{\n\tret;\n}}\n");
    assert_eq!(Module::parse(&two).unwrap().entries(), vec!["k", "k2"]);
}

fn error(body: &str) -> (usize, String) {
    let e = Module::parse(&entry(body)).unwrap_err();
    (e.line, e.to_string())
}

#[test]
fn unmodelled_forms_are_errors_naming_line_and_instruction() {
    for bad in [
        "add.sat.s32 %r1, %r2, %r3;",
        "div.approx.f32 %f1, %f2, %f3;",
        "div.full.f32 %f1, %f2, %f3;",
        "cp.async.cg.shared.global [%rd1], [%rd2], 8;",
        "bar.sync 0, 64;",
        "ld.local.f32 %f1, [%rd1];",
        "st.param.f32 [%rd1], %f1;",
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r1, %r2}, {%r3}, {%f1, %f2, %f3, %f4};",
        "tex.1d.v4.f32.s32 {%f1, %f2, %f3, %f4}, [%rd1, {%r1}];",
        "setp.ltu.u32 %p1, %r1, %r2;",
        "cvt.f32.f64 %f1, %rd1;",
        "cvt.rn.u32.f32 %r1, %f1;",
        "shfl.sync.bfly.b64 %rd1, %rd2, 1, 31, -1;",
        "ld.global.v4.f64 {%rd1, %rd2, %rd3, %rd4}, [%rd5];",
    ] {
        let (line, msg) = error(&format!("\tmov.u32 %r1, 1;\n\t{bad}"));
        assert_eq!(line, FIRST + 1, "{bad}: {msg}");
        assert!(msg.contains(bad.split(' ').next().unwrap_or("")), "{bad}: {msg}");
    }
}

#[test]
fn undeclared_names_and_labels_are_errors() {
    assert_eq!(error("\tmov.u32 %r9, 1;").0, FIRST);
    assert_eq!(error("\tmov.u32 %q1, 1;").0, FIRST);
    assert_eq!(error("\tmov.u64 %rd1, nowhere;").0, FIRST);
    assert_eq!(error("\tret;\n\tbra $L9;").0, FIRST + 1);
    assert_eq!(error("\tld.global.f32 %f1, [%rd1+x];").0, FIRST);
    assert!(Module::parse(".version 8.0\n.func f()\n{\n}\n").is_err());
    assert!(Module::parse(&entry("\tret;").replace('}', "")).is_err());
}
