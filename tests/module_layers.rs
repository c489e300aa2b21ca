//! Layers point one way: no module of either library crate reaches back to a module that
//! depends on it (the references are the `crate::module` paths in its source, comments left
//! out), and the compiler's pipeline order holds: scalar -> dsl -> ir -> passes -> plan, with
//! codegen and partition after the plan.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each top-level module of the crate in `src` and the other top-level modules it names.
fn references(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files: BTreeMap<String, Vec<std::path::PathBuf>> = BTreeMap::new();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        let p = e.path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        if name == "lib" || name == "main" {
            continue;
        }
        let mut list = Vec::new();
        let mut stack = vec![p];
        while let Some(p) = stack.pop() {
            if p.is_dir() {
                stack.extend(std::fs::read_dir(&p).unwrap().flatten().map(|e| e.path()));
            } else if p.extension().is_some_and(|x| x == "rs") {
                list.push(p);
            }
        }
        files.entry(name).or_default().extend(list);
    }
    let modules: BTreeSet<String> = files.keys().cloned().collect();
    files
        .into_iter()
        .map(|(name, paths)| {
            let mut named = BTreeSet::new();
            for p in paths {
                for line in std::fs::read_to_string(p).unwrap().lines() {
                    let code = line.split("//").next().unwrap_or("");
                    for (i, _) in code.match_indices("crate::") {
                        let rest = &code[i + "crate::".len()..];
                        let m: String = rest
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        if m != name && modules.contains(&m) {
                            named.insert(m);
                        }
                    }
                }
            }
            (name, named)
        })
        .collect()
}

/// A path from `from` back to `to`, if there is one.
fn path(
    refs: &BTreeMap<String, BTreeSet<String>>,
    from: &str,
    to: &str,
    seen: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if from == to {
        return Some(vec![to.to_string()]);
    }
    if !seen.insert(from.to_string()) {
        return None;
    }
    for next in refs.get(from).into_iter().flatten() {
        if let Some(mut rest) = path(refs, next, to, seen) {
            rest.insert(0, from.to_string());
            return Some(rest);
        }
    }
    None
}

fn assert_acyclic(crate_src: &str) -> BTreeMap<String, BTreeSet<String>> {
    let refs = references(&Path::new(env!("CARGO_MANIFEST_DIR")).join(crate_src));
    for (m, named) in &refs {
        for n in named {
            if let Some(back) = path(&refs, n, m, &mut BTreeSet::new()) {
                panic!("{crate_src}: a module cycle: {m} -> {}", back.join(" -> "));
            }
        }
    }
    refs
}

#[test]
fn no_module_cycle_in_either_library() {
    let compiler = assert_acyclic("compiler/src");
    assert_acyclic("runtime/src");
    // The pipeline's order: each layer names none after it.
    let after = |m: &str| -> &[&str] {
        match m {
            "scalar" => &[
                "diag",
                "dsl",
                "ir",
                "passes",
                "plan",
                "codegen",
                "partition",
            ],
            "diag" => &["dsl", "ir", "passes", "plan", "codegen", "partition"],
            "dsl" => &["passes", "plan", "codegen", "partition"],
            "ir" => &["dsl", "passes", "plan", "codegen", "partition"],
            "passes" => &["codegen", "partition"],
            "plan" => &["passes", "codegen", "partition"],
            _ => &[],
        }
    };
    for (m, named) in &compiler {
        for later in after(m) {
            assert!(
                !named.contains(*later),
                "compiler/src: `{m}` names `{later}`, which comes after it"
            );
        }
    }
}
