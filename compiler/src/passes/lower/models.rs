//! Models: the experiment's inputs, symbols, `Sequential` and `Graph` models and repeated
//! blocks, in dependency order.

use super::*;

impl Lowerer<'_> {
    pub(super) fn input(
        &mut self,
        name: &str,
        spec: &InputSpec,
        p: &Path,
    ) -> Result<NodeIndex, Error> {
        let mut shape = vec![Dim::batch()];
        for (i, d) in spec.shape.iter().enumerate() {
            shape.push(self.size(d, &p.join("shape").join(i), "an input dimension")?);
        }
        if self.decode.is_some() {
            shape = self.decode_input(name, shape, spec, p)?;
        }
        let ty = TensorType::new(spec.dtype, shape);
        self.add(
            Op::Input {
                name: name.to_string(),
                ty,
            },
            &[],
            "",
            self.head(p),
        )
    }

    pub(super) fn symbols(&mut self, symbols: &Params, base: &Path) -> Result<(), Error> {
        for (name, nominal) in &symbols.0 {
            let p = base.join(name.as_str());
            if self.lookup(name).is_some() {
                return Err(self.err(&p, format!("`{name}` is both a parameter and a symbol")));
            }
            let n = self.known(nominal, &p, &format!("the nominal size of `{name}`"))?;
            let s = self.g.add_symbol(name, n);
            self.scopes
                .last_mut()
                .expect("a scope")
                .push((name.clone(), Dim::sym(s)));
        }
        Ok(())
    }

    pub(super) fn experiment(&mut self) -> Result<(), Error> {
        let e = &self.src.experiment;
        self.scopes.push(Vec::new());
        self.bind(&e.params, &path!["params"])?;
        let (model_params, symbols) = match &e.model {
            Model::Sequential {
                params, symbols, ..
            }
            | Model::Graph {
                params, symbols, ..
            } => (params, symbols),
        };
        for (name, _) in &model_params.0 {
            if e.params.get(name).is_some() {
                return Err(self.err(
                    &path!["model", "params", name.as_str()],
                    format!("the parameter `{name}` is defined both in the file's and the model's `params`"),
                ));
            }
        }
        self.bind(model_params, &path!["model", "params"])?;
        self.symbols(symbols, &path!["model", "symbols"])?;
        let outputs = match &e.model {
            Model::Sequential { input, layers, .. } => {
                let mut x = self.input("x", input, &path!["model", "input"])?;
                for (i, layer) in layers.iter().enumerate() {
                    x = self.layer(layer, &[x], &i.to_string(), &path!["model", "layers", i])?;
                }
                if layers.is_empty() {
                    return Err(self.err(&path!["model", "layers"], "the model has no layers"));
                }
                vec![("output".to_string(), x)]
            }
            Model::Graph {
                inputs,
                blocks,
                nodes,
                outputs,
                ..
            } => {
                let mut env = Vec::new();
                for (name, spec) in &inputs.0 {
                    let n = self.input(name, spec, &path!["model", "inputs", name.as_str()])?;
                    env.push((name.clone(), n));
                }
                if inputs.0.is_empty() {
                    return Err(self.err(&path!["model", "inputs"], "the model has no inputs"));
                }
                if nodes.is_empty() {
                    return Err(self.err(&path!["model", "nodes"], "the model has no nodes"));
                }
                let values = self.nodes(nodes, &path!["model", "nodes"], env, "", blocks)?;
                match outputs {
                    None => vec![values.last().cloned().expect("nodes are not empty")],
                    Some(names) => {
                        if names.is_empty() {
                            return Err(self.err(&path!["model", "outputs"], "`outputs` is empty"));
                        }
                        let mut outs = Vec::new();
                        for (i, o) in names.iter().enumerate() {
                            let Some((_, n)) = values.iter().find(|(k, _)| k == o) else {
                                return Err(model_err(
                                    format!("unknown output `{o}`"),
                                    self.span(&path!["model", "outputs", i]),
                                )
                                .with_hint_model(suggest(
                                    o,
                                    "nodes",
                                    values.iter().map(|(k, _)| k.as_str()),
                                )));
                            };
                            if outs.iter().any(|(k, _)| k == o) {
                                return Err(model_err(
                                    format!("`{o}` is listed twice in `outputs`"),
                                    self.span(&path!["model", "outputs", i]),
                                ));
                            }
                            outs.push((o.clone(), *n));
                        }
                        outs
                    }
                }
            }
        };
        self.g.outputs = outputs;
        // The decode step computes the logits only: no labels, no loss.
        if self.decode.is_some() {
            return Ok(());
        }
        self.loss()?;
        self.data_contract()
    }

    /// Lowers a list of named nodes in dependency order; `env` holds the names already bound.
    /// Returns every binding, the declared nodes in file order last.
    pub(super) fn nodes(
        &mut self,
        decls: &[NodeDecl],
        base: &Path,
        env: Vec<(String, NodeIndex)>,
        prefix: &str,
        blocks: &crate::dsl::ast::UniqueMap<Vec<NodeDecl>>,
    ) -> Result<Vec<(String, NodeIndex)>, Error> {
        // Names: unique, not shadowing an input.
        let mut index: HashMap<&str, usize> = HashMap::new();
        for (i, (name, _, _)) in decls.iter().enumerate() {
            let np = base.join(i).join(0);
            if name.is_empty() {
                return Err(model_err("a node needs a name", self.span(&np)));
            }
            if env.iter().any(|(k, _)| k == name) {
                return Err(model_err(
                    format!("the node `{name}` has the name of an input"),
                    self.span(&np),
                ));
            }
            if index.insert(name.as_str(), i).is_some() {
                return Err(
                    model_err(format!("two nodes are named `{name}`"), self.span(&np))
                        .with_hint_model("node names must be unique; rename one"),
                );
            }
        }
        // Every input must name an earlier binding or a node; order by dependencies.
        let mut deps: Vec<Vec<usize>> = vec![Vec::new(); decls.len()];
        for (i, (_, _, ins)) in decls.iter().enumerate() {
            for (j, input) in ins.iter().enumerate() {
                if let Some(&k) = index.get(input.as_str()) {
                    deps[i].push(k);
                } else if !env.iter().any(|(k, _)| k == input) {
                    let known: Vec<&str> = env
                        .iter()
                        .map(|(k, _)| k.as_str())
                        .chain(decls.iter().map(|d| d.0.as_str()))
                        .collect();
                    return Err(model_err(
                        format!("unknown input `{input}` of node `{}`", decls[i].0),
                        self.span(&base.join(i).join(2).join(j)),
                    )
                    .with_hint_model(suggest(
                        input,
                        "names",
                        known.iter().copied(),
                    )));
                }
            }
        }
        let order = dependency_order(&deps).map_err(|cycle| {
            let names: Vec<&str> = cycle.iter().map(|&i| decls[i].0.as_str()).collect();
            model_err(
                format!(
                    "the nodes form a cycle: {} -> {}",
                    names.join(" -> "),
                    names[0]
                ),
                self.span(&base.join(cycle[0])),
            )
            .with_hint_model("a node may only use inputs and nodes that do not depend on it")
        })?;
        let mut values: HashMap<String, NodeIndex> = env.iter().cloned().collect();
        for i in order {
            let (name, layer, ins) = &decls[i];
            let p = base.join(i).join(1);
            let args: Vec<NodeIndex> = ins.iter().map(|n| values[n.as_str()]).collect();
            let full = if prefix.is_empty() {
                name.clone()
            } else {
                format!("{prefix}.{name}")
            };
            let out = match layer {
                Layer::Repeat {
                    block,
                    times,
                    args: block_args,
                } => self.repeat(block, times, block_args, &args, &full, &p, blocks)?,
                _ => self.layer(layer, &args, &full, &p)?,
            };
            values.insert(name.clone(), out);
        }
        let mut out = env;
        for (name, _, _) in decls {
            out.push((name.clone(), values[name.as_str()]));
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn repeat(
        &mut self,
        block: &str,
        times: &DimExpr,
        args: &Params,
        ins: &[NodeIndex],
        name: &str,
        p: &Path,
        blocks: &crate::dsl::ast::UniqueMap<Vec<NodeDecl>>,
    ) -> Result<NodeIndex, Error> {
        let span = self.head(p);
        let Some(decls) = blocks.get(block) else {
            return Err(model_err(
                format!("unknown block `{block}`"),
                self.span(&p.join("block")),
            )
            .with_hint_model(suggest(block, "blocks", blocks.keys())));
        };
        if ins.len() != 1 {
            return Err(model_err(
                format!(
                    "Repeat `{name}` takes 1 input (the block's `x`), got {}",
                    ins.len()
                ),
                span,
            ));
        }
        if decls.is_empty() {
            return Err(model_err(format!("the block `{block}` has no nodes"), span));
        }
        if let Some(i) = self.block_stack.iter().position(|b| b == block) {
            let chain = self.block_stack[i..].join(" -> ");
            return Err(model_err(
                format!("the block `{block}` repeats itself: {chain} -> {block}"),
                self.span(&p.join("block")),
            ));
        }
        if self.block_stack.len() >= MAX_BLOCK_DEPTH {
            return Err(model_err(
                format!("blocks nest more than {MAX_BLOCK_DEPTH} deep"),
                span,
            ));
        }
        let n = self.known(times, &p.join("times"), "`times`")?;
        self.scopes.push(Vec::new());
        self.bind(args, &p.join("args"))?;
        // Refuse a model too large to build before building any of it, counting the layers
        // of blocks that this block repeats in turn.
        let mut visiting = self.block_stack.clone();
        let per_copy = self.block_layers(block, blocks, &mut visiting);
        let made = n.saturating_mul(per_copy);
        let total = made.saturating_add(self.g.layers as u64);
        if total > MAX_LAYERS as u64 {
            let detail = if made > MAX_LAYERS as u64 {
                String::new()
            } else {
                format!(" ({total} in the model)")
            };
            return Err(model_err(
                format!(
                    "Repeat `{name}` would make {made} layers{detail}; Parallax builds at most {MAX_LAYERS}"
                ),
                self.span(&p.join("times")),
            ));
        }
        self.block_stack.push(block.to_string());
        let base = path!["model", "blocks", block];
        let mut x = ins[0];
        for i in 0..n {
            let values = self.nodes(
                decls,
                &base,
                vec![("x".to_string(), x)],
                &format!("{name}.{i}"),
                blocks,
            )?;
            x = values.last().expect("a block has nodes").1;
        }
        self.block_stack.pop();
        self.scopes.pop();
        Ok(x)
    }

    /// The layers one copy of `block` expands to, nested repeats included (saturating, and
    /// stopping once past [`MAX_LAYERS`]). Anything that does not resolve (an unknown block, a
    /// cycle, a bad `times`) counts as one layer: building the block reports it.
    pub(super) fn block_layers(
        &mut self,
        block: &str,
        blocks: &crate::dsl::ast::UniqueMap<Vec<NodeDecl>>,
        visiting: &mut Vec<String>,
    ) -> u64 {
        let Some(decls) = blocks.get(block) else {
            return 1;
        };
        if decls.is_empty()
            || visiting.len() >= MAX_BLOCK_DEPTH
            || visiting.iter().any(|b| b == block)
        {
            return 1;
        }
        visiting.push(block.to_string());
        let mut total = 0u64;
        for (_, layer, _) in decls {
            let n = match layer {
                Layer::Repeat {
                    block: inner,
                    times,
                    args,
                } => {
                    let t = self.known(times, &Path::root(), "`times`").unwrap_or(1);
                    self.scopes.push(Vec::new());
                    let per = match self.bind(args, &Path::root()) {
                        Ok(()) => self.block_layers(inner, blocks, visiting),
                        Err(_) => 1,
                    };
                    self.scopes.pop();
                    t.saturating_mul(per)
                }
                _ => 1,
            };
            total = total.saturating_add(n);
            if total > MAX_LAYERS as u64 {
                break;
            }
        }
        visiting.pop();
        total
    }
}

/// A topological order of declarations (ties in file order), or one cycle.
fn dependency_order(deps: &[Vec<usize>]) -> Result<Vec<usize>, Vec<usize>> {
    let n = deps.len();
    let mut state = vec![0u8; n]; // 0 new, 1 on the stack, 2 done
    let mut order = Vec::with_capacity(n);
    for root in 0..n {
        if state[root] != 0 {
            continue;
        }
        // Iterative DFS: (node, next dependency to visit).
        let mut stack = vec![(root, 0usize)];
        state[root] = 1;
        while let Some(&mut (v, ref mut next)) = stack.last_mut() {
            if *next < deps[v].len() {
                let w = deps[v][*next];
                *next += 1;
                match state[w] {
                    0 => {
                        state[w] = 1;
                        stack.push((w, 0));
                    }
                    1 => {
                        let start = stack.iter().position(|&(u, _)| u == w).unwrap_or(0);
                        let mut cycle: Vec<usize> =
                            stack[start..].iter().map(|&(u, _)| u).collect();
                        cycle.reverse();
                        return Err(cycle);
                    }
                    _ => {}
                }
            } else {
                state[v] = 2;
                order.push(v);
                stack.pop();
            }
        }
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::dependency_order;

    #[test]
    fn orders_dependencies_and_finds_cycles() {
        assert_eq!(
            dependency_order(&[vec![1], vec![], vec![0]]).unwrap(),
            vec![1, 0, 2]
        );
        let cycle = dependency_order(&[vec![1], vec![2], vec![0]]).unwrap_err();
        assert_eq!(cycle.len(), 3);
        assert!(dependency_order(&[vec![0]]).is_err());
    }
}
