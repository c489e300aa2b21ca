use super::*;
use crate::devices::profile;
use std::sync::OnceLock;

fn compile_model(file: &str) -> (ModelCost, u64) {
    let p = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models")
        .join(file);
    let text = std::fs::read_to_string(&p).expect("models/");
    let source = crate::parse(&text).expect("parses");
    let options = crate::Options {
        verify: false,
        ..crate::Options::default()
    };
    let c = crate::compile(&source, &options, &mut |_, _| {}).expect("compiles");
    let peak = c.graph.schedule.as_ref().map_or(0, |s| s.memory.peak_bytes);
    let m = model_cost(
        &c.graph,
        &source.experiment.name,
        source.experiment.train.batch_size,
    );
    (m, peak)
}

/// Each model compiled once for the whole test binary.
fn model(file: &'static str) -> &'static ModelCost {
    &compiled(file).0
}

/// A model's aggregates and its single-device schedule's exact peak.
fn compiled(file: &'static str) -> &'static (ModelCost, u64) {
    type Cache = std::sync::Mutex<HashMap<&'static str, &'static (ModelCost, u64)>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut c = cache.lock().unwrap_or_else(|e| e.into_inner());
    c.entry(file)
        .or_insert_with(|| Box::leak(Box::new(compile_model(file))))
}

fn target(gpus: u32, kind: &str) -> Target {
    let profile = profile(kind).unwrap();
    Target {
        gpus,
        profile,
        capacity: profile.memory,
        nodes: None,
        strategy: None,
    }
}

const MODELS: [&str; 4] = ["mlp.ron", "cnn.ron", "transformer.ron", "gpt-large.ron"];

#[test]
fn gpt_large_blocks_are_costed_once_and_split_by_megatron_rules() {
    let m = model("gpt-large.ron");
    assert_eq!(m.heads, Some(40));
    assert_eq!(m.blocks, 40);
    let h: Vec<_> = m.groups.iter().filter(|g| g.block.is_some()).collect();
    assert!(
        h.iter().all(|g| g.cost == h[0].cost),
        "one cost for all blocks"
    );
    let b = m.cost(m.groups.iter().position(|g| g.name == "h.7").unwrap());
    // Two all-reduces per block forward (attention out, MLP fc2), of seq x d floats.
    assert_eq!(b.tp_allreduces, 2);
    assert_eq!(b.tp_allreduce_bytes, 2048.0 * 5120.0 * 4.0);
    // All GEMMs of a block are split; its LayerNorm parameters and fc2/out biases are not.
    assert_eq!(b.matmul_flops.replicated, 0.0);
    assert_eq!(
        b.param_bytes.replicated,
        (4.0 * 5120.0 + 2.0 * 5120.0) * 4.0
    );
    // The parameters of all groups add up to the model's.
    let total: f64 = (0..m.groups.len())
        .map(|g| m.cost(g).param_bytes.total())
        .sum();
    assert_eq!(total as u64, m.param_bytes);
}

#[test]
fn mlp_on_four_gpus_is_pure_data_parallel() {
    let p = plan(model("mlp.ron"), &target(4, "h100")).unwrap();
    assert_eq!(strategy_name(&p.strategy), "dp4");
    assert_eq!((p.strategy.dp, p.strategy.tp, p.strategy.pp), (4, 1, 1));
    // Parameters stay whole: gathering them would only add latency.
    assert!(p.zero < 3);
}

#[test]
fn gpt_large_on_eight_h100_needs_model_parallelism_or_sharded_state() {
    let p = plan(model("gpt-large.ron"), &target(8, "h100")).unwrap();
    assert!(p.per_device_peak_bytes <= p.capacity_bytes);
    assert_eq!(p.stages.len() as u32, p.strategy.pp);
    // Every candidate that fits splits the model or shards all of its state: plain data
    // parallelism (and ZeRO-1, ZeRO-2) is rejected with its numbers.
    for c in &p.candidates {
        let splits = c.strategy.tp * c.strategy.pp > 1 || c.zero == 3;
        assert!(!c.fits || splits, "{c:?}");
    }
    let dp8 = p
        .candidates
        .iter()
        .find(|c| strategy_name(&c.strategy) == "dp8" && c.zero == 0)
        .unwrap();
    assert!(!dp8.fits && dp8.rejected.as_deref().unwrap().contains("GiB"));
    assert!(p.not_considered.is_empty(), "tp 1-8 all divide 40 heads");
    // On 3 GPUs, tp3 cannot split 40 heads: said, not silently dropped.
    let p = plan(model("gpt-large.ron"), &target(24, "h100")).unwrap();
    assert!(p
        .not_considered
        .iter()
        .any(|s| s.strategy.tp == 3 && s.why.contains("does not divide the 40")));
}

#[test]
fn gpt_large_on_one_h100_fits_nowhere_and_names_the_smallest_count() {
    let m = model("gpt-large.ron");
    match plan(m, &target(1, "h100")) {
        Err(Error::NoFit {
            smallest: Some(Smallest { gpus: n, candidate }),
            least,
            ..
        }) => {
            assert!(candidate.fits);
            assert!(n > 1);
            assert!(least.memory.total > profile("h100").unwrap().memory);
            assert!(plan(m, &target(n, "h100")).is_ok());
            // Nothing smaller that the search tries fits.
            for k in search_counts().filter(|&k| k < n) {
                assert!(plan(m, &target(k, "h100")).is_err(), "{k}");
            }
        }
        other => panic!("expected NoFit, got {other:?}"),
    }
}

#[test]
fn memory_items_sum_to_the_peak() {
    for f in MODELS {
        for n in [1, 2, 8] {
            let Ok(p) = plan(model(f), &target(n, "h100")) else {
                continue;
            };
            for c in p
                .candidates
                .iter()
                .map(|c| c.memory)
                .chain(p.stages.iter().map(|s| s.memory))
            {
                let sum = c.parameters
                    + c.gradients
                    + c.optimizer_state
                    + c.activations
                    + c.communication_buffers
                    + c.inputs;
                assert_eq!(sum, c.total, "{f} on {n}");
            }
            let worst = p.stages.iter().map(|s| s.memory.total).max().unwrap();
            assert_eq!(worst, p.per_device_peak_bytes, "{f} on {n}");
        }
    }
}

#[test]
fn the_choice_is_never_slower_than_another_fitting_candidate() {
    for f in MODELS {
        for n in [2, 4, 8, 16] {
            for kind in ["h100", "a100-40gb", "l4"] {
                let Ok(p) = plan(model(f), &target(n, kind)) else {
                    continue;
                };
                for c in p.candidates.iter().filter(|c| c.fits) {
                    assert!(
                        significant(p.step_time_s) <= significant(c.step_time_s),
                        "{f} on {n} x {kind}: chose {} at {} s, {} at {} s",
                        strategy_name(&p.strategy),
                        p.step_time_s,
                        c.strategy_name(),
                        c.step_time_s
                    );
                }
                for c in p.candidates.iter().filter(|c| !c.fits) {
                    assert!(c.memory.total > p.capacity_bytes && c.rejected.is_some());
                }
            }
        }
    }
}

#[test]
fn every_model_plans_for_small_gpu_counts() {
    for f in MODELS {
        for n in [1, 2, 3, 4, 8] {
            let m = model(f);
            match plan(m, &target(n, "h100")) {
                Ok(p) => {
                    let s = p.strategy;
                    assert_eq!(s.dp * s.tp * s.pp, n, "{f}");
                    assert!(p.step_time_s > 0.0 && p.step_time_s.is_finite(), "{f}");
                    assert!(!p.candidates.is_empty());
                }
                Err(Error::NoFit { .. }) => assert_eq!(f, "gpt-large.ron", "{f} on {n}"),
                Err(e) => panic!("{f} on {n}: {e}"),
            }
        }
    }
}

#[test]
fn strategies_parse_and_validate() {
    let s = |dp, tp, pp| Strategy { dp, tp, pp };
    assert_eq!(parse_strategy("dp4", 4).unwrap(), s(4, 1, 1));
    assert_eq!(parse_strategy("tp8", 8).unwrap(), s(1, 8, 1));
    assert_eq!(parse_strategy("dp2.tp2.pp2", 8).unwrap(), s(2, 2, 2));
    assert_eq!(parse_strategy("pp2.dp4", 8).unwrap(), s(4, 1, 2));
    assert!(matches!(
        parse_strategy("dp4", 8),
        Err(Error::StrategyProduct { product: 4, .. })
    ));
    for bad in ["", "dp", "dq4", "dp0", "dp2.dp2", "dp-1", "tp2.pp"] {
        assert!(
            matches!(parse_strategy(bad, 4), Err(Error::BadStrategy { .. })),
            "{bad}"
        );
    }
    assert_eq!(strategy_name(&s(1, 1, 1)), "dp1");
    assert_eq!(strategy_name(&s(2, 1, 4)), "dp2.pp4");
}

#[test]
fn forced_strategies_are_planned_or_refused_with_numbers() {
    let m = model("gpt-large.ron");
    let mut t = target(8, "h100");
    t.strategy = Some(parse_strategy("tp8", 8).unwrap());
    let p = plan(m, &t).unwrap();
    assert!(p.forced && p.strategy.tp == 8);
    assert!(p.candidates.iter().all(|c| c.strategy.tp == 8));
    let mut two = target(2, "h100");
    two.strategy = Some(parse_strategy("dp2", 2).unwrap());
    assert!(matches!(plan(m, &two), Err(Error::ForcedNoFit { .. })));
    // 3 does not divide 40 heads.
    let mut t = target(3, "h100");
    t.strategy = Some(parse_strategy("tp3", 3).unwrap());
    assert!(matches!(plan(m, &t), Err(Error::Infeasible { .. })));
    // No attention, no tensor parallelism.
    let mut t = target(2, "h100");
    t.strategy = Some(parse_strategy("tp2", 2).unwrap());
    assert!(matches!(
        plan(model("mlp.ron"), &t),
        Err(Error::Infeasible { .. })
    ));
}

#[test]
fn ring_collectives_follow_the_latency_bandwidth_model() {
    let l = crate::devices::Link {
        bandwidth: 1e9,
        latency: 1e-6,
    };
    assert_eq!(cost::all_reduce_s(1e9, 1, l), 0.0);
    let t = cost::all_reduce_s(1e9, 4, l);
    assert!((t - (1.5 + 6e-6)).abs() < 1e-12);
    assert!((cost::gather_s(1e9, 4, l) - t / 2.0).abs() < 1e-12);
}

#[test]
fn stages_are_contiguous_balanced_and_non_empty() {
    let times = [1.0, 5.0, 5.0, 5.0, 5.0, 1.0, 0.5];
    for pp in 1..=times.len() {
        let s = cost::balance(&times, pp);
        assert_eq!(s.len(), pp);
        assert_eq!(s[0].start, 0);
        assert_eq!(s.last().unwrap().end, times.len());
        assert!(s.windows(2).all(|w| w[0].end == w[1].start));
        assert!(s.iter().all(|r| !r.is_empty()));
    }
    let s = cost::balance(&times, 2);
    let sums: Vec<f64> = s.iter().map(|r| times[r.clone()].iter().sum()).collect();
    assert!(sums.iter().cloned().fold(0.0, f64::max) <= 11.5, "{sums:?}");
}

#[test]
fn pipeline_memory_follows_the_schedule() {
    let m = model("gpt-large.ron");
    let p = plan(m, &target(8, "h100")).unwrap();
    let by = |sched: PipelineSchedule, strat: &str| {
        p.candidates
            .iter()
            .find(|c| c.schedule == sched && c.strategy_name() == strat && c.zero == 0)
            .unwrap()
            .clone()
    };
    // GPipe keeps every micro-batch's activations; 1F1B at most pp of them.
    let (g, f) = (
        by(PipelineSchedule::GPipe, "pp8"),
        by(PipelineSchedule::OneFOneB, "pp8"),
    );
    assert!(g.memory.activations > f.memory.activations);
    // The bubble is (pp-1)/(M+pp-1) of the pipeline.
    let t = f.time;
    let pipeline = t.compute_s + t.bubble_s + t.tensor_parallel_s + t.pipeline_p2p_s;
    let expected = 7.0 / (f.micro_batches as f64 + 7.0);
    assert!((t.bubble_s / pipeline - expected).abs() < 1e-9);
}

#[test]
fn one_device_estimate_is_close_to_the_exact_schedule_peak() {
    for f in MODELS {
        let (m, schedule_peak) = compiled(f);
        let t = target(1, "h100");
        let r = rules(m, &t);
        let cluster = Cluster {
            gpus: 1,
            gpus_per_node: r.gpus_per_node,
            profile: t.profile,
            capacity: t.capacity,
        };
        let stages = cost::stages(m, &cluster, 1, 1);
        let o = Options {
            dp: 1,
            tp: 1,
            pp: 1,
            zero: 0,
            schedule: PipelineSchedule::Sequential,
            micro_batches: 1,
        };
        let e = cost::estimate(m, &cluster, &stages, &o);
        let ratio = e.peak().total as f64 / *schedule_peak as f64;
        // Where activations dominate the per-layer model is above the exact schedule, by 7%
        // (gpt-large) and 15% (transformer): the schedule runs each weight gradient beside
        // its input gradient (the fuse pass's ready order), so a forward value dies as soon
        // as its weight gradient ran; the model frees a group's saved values only once the
        // whole group ran backward. Above is the safe side for a plan's fit. In the
        // small models fixed-size buffers make up more of the peak (mlp's estimate 1.30 of
        // its exact peak, whose logits share a buffer with their gradient).
        let tolerance = if f.contains("mlp") || f.contains("cnn") {
            0.35
        } else if f.contains("transformer") {
            0.17
        } else {
            0.08
        };
        assert!((ratio - 1.0).abs() <= tolerance, "{f}: {ratio}");
    }
}
