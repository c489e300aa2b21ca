//! The decode step's kernels (the cache writes, the cached attention and the rest of a tiny
//! GPT) on the PTX interpreter against the CPU oracle, position by position: the logits and
//! both caches of every layer, within the attention family's 1e-5, with the sanitizer on.

use super::device::Device;
use super::rel_diff;
use crate::backend::Backend;
use crate::cpu::Executor;
use crate::cuda::Precision;
use crate::data::Values;
use crate::exec::Mode;
use parallax_compiler::plan::POSITION;

#[test]
fn the_decode_steps_kernels_follow_the_oracle_position_by_position() {
    let text = parallax_compiler::fixtures::tiny_gpt(", causal: true", "");
    let source = parallax_compiler::parse(&text).expect("the tiny GPT parses");
    let batch = 2;
    let plan = parallax_compiler::compile_decode(&source, batch as u64, true).unwrap();
    let mut cpu = Executor::new(plan.clone(), batch, 3);
    let mut dev = Device::new(&plan, batch, 3, Precision::Fp32, None).unwrap();
    let names = plan.names();
    // The oracle's initial parameters; the caches, zero on both, fill as the steps run.
    for (name, id) in names.params.iter().chain(&names.states) {
        let t = cpu.value(*id).unwrap_or_else(|| panic!("{name}"));
        dev.write(*id, t.f32()).unwrap();
    }
    let input = |n: &str| names.inputs.iter().find(|(x, _)| x == n).unwrap().1;
    let (tokens, pos) = (input("tokens"), input(POSITION));
    let output = plan.output_steps[0].name.clone();
    let out_step = names.outputs.iter().find(|(n, _)| *n == output).unwrap().1;
    let caches: Vec<(String, usize)> = names
        .states
        .iter()
        .filter(|(n, _)| n.ends_with("_cache"))
        .cloned()
        .collect();
    assert_eq!(caches.len(), 4, "{:?}", names.states);
    // Sample 0 reads eight tokens a position at a time; sample 1 rewrites position 0.
    for at in 0..8i32 {
        let ids = vec![(at * 7 + 1) % 32, (at * 3) % 32];
        let at_pos = vec![at, 0];
        cpu.set_input("tokens", batch, &Values::I32(ids.clone()))
            .unwrap();
        cpu.set_input(POSITION, batch, &Values::I32(at_pos.clone()))
            .unwrap();
        cpu.run(batch, Mode::Eval, 0, 0).unwrap();
        dev.write_i32(tokens, &ids).unwrap();
        dev.write_i32(pos, &at_pos).unwrap();
        dev.begin(Mode::Eval).unwrap();
        for k in (0..plan.kernels.len()).filter(|&k| cpu.wanted(k, Mode::Eval)) {
            dev.run_kernel(k, Mode::Eval, 0, 0)
                .unwrap_or_else(|e| panic!("position {at}, kernel {k}: {e}"));
        }
        assert!(dev.findings.is_empty(), "{:?}", dev.findings);
        for (what, id) in caches.iter().chain([&(output.clone(), out_step)]) {
            let want = cpu.value(*id).unwrap().f32().to_vec();
            let (got, _) = dev.read(*id).unwrap();
            let d = rel_diff(&want, &got);
            assert!(d < 1e-5, "position {at}: `{what}` differs by {d:e}");
        }
    }
}
