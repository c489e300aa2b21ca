//! The last step of the pipeline: the finished graph written out as the plan, its ops in
//! execution order with their kernels, buffers, stages and owners, named inputs, outputs and
//! parameters, and what tensor parallelism and the files' layouts need.

use super::Options;
use crate::dsl::Source;
use crate::ir::{Graph, KernelKind, Op};
use crate::plan::*;
use std::collections::HashMap;

/// The parameters (and their optimizer state) that tensor parallelism slices.
fn tensor_parallel(g: &Graph, options: &Options) -> Option<TensorParallel> {
    let degree = options.tensor_parallel.filter(|&t| t > 1)?;
    let mut splits = Vec::new();
    for &(n, axis) in &g.param_splits {
        if let Op::Param { name, .. } = &g.g[n].op {
            splits.push((name.clone(), axis));
        }
    }
    for n in g.g.node_indices() {
        if let Op::State { name, .. } = &g.g[n].op {
            let of = splits
                .iter()
                .find(|(p, _)| {
                    name.strip_prefix(p.as_str())
                        .is_some_and(|r| r.starts_with('.'))
                })
                .map(|s| s.1);
            if let Some(axis) = of {
                splits.push((name.clone(), axis));
            }
        }
    }
    Some(TensorParallel { degree, splits })
}

/// The file shapes of the parameters the lowering recorded (`Graph::file_shapes`), and of
/// the optimizer state of each (`{param}.momentum`, `{param}.adam_m`, ...: the parameter's
/// shape).
fn file_shapes(g: &Graph) -> Vec<(String, Vec<u64>)> {
    let mut out: Vec<(String, Vec<u64>)> = Vec::new();
    let mut params = Vec::new();
    for (n, shape) in &g.file_shapes {
        if let Some(Op::Param { name, ty, .. }) = g.g.node_weight(*n).map(|w| &w.op) {
            params.push((name.clone(), ty.clone()));
            out.push((name.clone(), shape.clone()));
        }
    }
    for n in g.g.node_indices() {
        if let Op::State { name, ty, .. } = &g.g[n].op {
            let of = params.iter().position(|(p, pty)| {
                pty == ty
                    && name
                        .strip_prefix(p.as_str())
                        .is_some_and(|r| r.starts_with('.'))
            });
            if let Some(i) = of {
                out.push((name.clone(), out[i].1.clone()));
            }
        }
    }
    out
}

impl Plan {
    pub fn single_device(g: &Graph, source: &Source, options: &Options) -> Plan {
        // A graph that skipped the fuse and schedule passes runs one op per kernel.
        let unfused;
        let g = if g.kernels.is_empty() {
            let mut c = g.clone();
            c.kernels = c
                .topo_order()
                .unwrap_or_default()
                .into_iter()
                .filter(|&n| !c.g[n].op.is_source())
                .map(|n| crate::ir::Kernel {
                    kind: KernelKind::Single,
                    nodes: vec![n],
                })
                .collect();
            c.schedule = None;
            unfused = c;
            &unfused
        } else {
            g
        };
        let e = &source.experiment;
        let batch_size = options.plan_batch(source);
        let order = g.topo_order().unwrap_or_default();
        let ids: HashMap<_, _> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let mut params = Vec::new();
        let mut inputs = Vec::new();
        let mut steps = Vec::new();
        let schedule = g
            .schedule
            .clone()
            .unwrap_or_else(|| crate::passes::schedule::plan_buffers(g, batch_size));
        for &n in &order {
            let node = &g.g[n];
            match &node.op {
                Op::Param { name, init, ty } => {
                    params.push(ParamInfo {
                        name: name.clone(),
                        shape: ty.shape.iter().map(|d| d.factor).collect(),
                        init: init.show(),
                    });
                }
                Op::Input { name, .. } => inputs.push(TensorInfo::of(g, name, n)),
                _ => {}
            }
            steps.push(Step {
                id: ids[&n],
                op: node.op.clone(),
                operands: g.operands(n).iter().map(|o| ids[o]).collect(),
                ty: node.ty.clone(),
                layer: node.layer.clone(),
                phase: node.phase,
                buffer: schedule.buffer_of.get(&n).copied(),
                stage: g
                    .stages
                    .as_ref()
                    .and_then(|s| s.get(&n).copied())
                    .unwrap_or(0),
                owner: g.owners.get(&n).copied(),
            });
        }
        let outputs = g
            .outputs
            .iter()
            .map(|(k, n)| TensorInfo::of(g, k, *n))
            .collect();
        let mut plan = Plan {
            format: PLAN_FORMAT,
            name: e.name.clone(),
            gpus_requested: options.gpus.unwrap_or(e.devices.gpus),
            device_kind: e.devices.kind.clone(),
            strategy: options.strategy(),
            batch_size,
            sharding: options.shards,
            tensor_parallel: tensor_parallel(g, options),
            pipeline_stages: options.pipeline_stages.unwrap_or(1).max(1),
            optimizer_shards: options.optimizer_shards.unwrap_or(1).max(1),
            zero_stage: match options.optimizer_shards {
                Some(n) if n > 1 => options.zero_stage,
                _ => 0,
            },
            schedule: None,
            device_memory_bytes: None,
            experiment: None,
            parameters: sat(g.parameter_count()),
            layers: g.layers,
            flops_per_sample: sat(g.flops(1, crate::ir::Phase::Forward)),
            memory: schedule.memory.clone(),
            ops: order.iter().filter(|&&n| !g.g[n].op.is_source()).count(),
            kernels: g
                .kernels
                .iter()
                .zip(crate::passes::fuse::stored(g))
                .map(|(k, stored)| PlanKernel {
                    kind: k.kind,
                    steps: k.nodes.iter().map(|n| ids[n]).collect(),
                    stored: stored.iter().map(|n| ids[n]).collect(),
                })
                .collect(),
            buffers: schedule.buffers.clone(),
            inputs,
            outputs,
            params,
            symbols: g
                .symbols
                .iter()
                .map(|s| (s.name.clone(), s.nominal))
                .collect(),
            steps,
            output_steps: g
                .outputs
                .iter()
                .map(|(k, n)| Named {
                    name: k.clone(),
                    step: ids[n],
                })
                .collect(),
            grads: g.grads.iter().map(|(p, d)| (ids[p], ids[d])).collect(),
            updates: g.updates.iter().map(|(p, u)| (ids[p], ids[u])).collect(),
            file_shapes: file_shapes(g),
            views: Default::default(),
        };
        plan.views = crate::plan::views::find(&plan);
        plan
    }
}
