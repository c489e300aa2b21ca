//! Shape inference: every node's type from its operands by the op table, in topological
//! order. Lowering sizes parameters with the same rules as it builds; this pass re-derives
//! every type so that any pass may rewrite ops and leave the types to it.

use super::Ctx;
use crate::diag::Diagnostic;
use crate::ir::Graph;
use crate::Error;

pub fn run(g: &mut Graph, _: &Ctx) -> Result<(), Error> {
    let order = g
        .topo_order()
        .ok_or_else(|| Error::Model(Diagnostic::new("the model's graph has a cycle", None)))?;
    for n in order {
        let operands = g.operands(n);
        let tys: Vec<_> = operands.iter().map(|&o| &g.g[o].ty).collect();
        let node = &g.g[n];
        let ty = node.op.infer(&tys, g.names()).map_err(|msg| {
            Error::Model(Diagnostic::new(
                format!("in layer `{}`: {msg}", node.layer),
                node.span,
            ))
        })?;
        g.g[n].ty = ty;
    }
    Ok(())
}
