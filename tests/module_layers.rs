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

// The files of one folder point one way too: no file reaches, through its siblings, back to
// itself. A file names a sibling through `super::name`, `self::name` or `crate::<folder>::name`
// (in `use` groups too), a module it declares by its bare name, and a name a sibling
// re-exports through that sibling's `use` (so `super::Name` that `mod.rs` re-exports from
// `exec.rs` is a reference to `exec.rs`). Comments, strings and `#[cfg(test)]` items are left
// out, and so are test files (`*_tests.rs`, and files declared under `#[cfg(test)]`); `mod.rs`
// is a file like the others, except that its `pub use` re-exports are no references of its
// own. A subfolder counts as one file, `name/`, holding everything under it.

/// `text` without comments, string and character literals, and `#[cfg(test)]` items.
fn code_of(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < c.len() {
        let at = |k: usize| c.get(k).copied().unwrap_or('\0');
        if c[i] == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if c[i] == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c[i] == 'r'
            && (at(i + 1) == '"' || at(i + 1) == '#')
            && !ident(at(i.wrapping_sub(1)))
        {
            // A raw string: r"..." or r#"..."# (any number of #).
            let mut j = i + 1;
            while at(j) == '#' {
                j += 1;
            }
            if at(j) != '"' {
                out.push(c[i]);
                i += 1;
                continue;
            }
            let hashes = j - i - 1;
            j += 1;
            while j < c.len() && !(c[j] == '"' && (1..=hashes).all(|h| at(j + h) == '#')) {
                j += 1;
            }
            i = j + 1 + hashes;
            out.push_str("\"\"");
        } else if c[i] == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c[i] == '\'' && at(i + 1) == '\\' {
            i += 2;
            while i < c.len() && c[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else if c[i] == '\'' && at(i + 2) == '\'' {
            i += 3;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    without_test_items(&out)
}

fn ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `code` without the items under `#[cfg(test)]`.
fn without_test_items(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let b = &rest.as_bytes()[at..];
        let mut i = 0;
        let mut depth = 0;
        // To the item's `;` or the end of its block, past any attributes.
        while i < b.len() {
            match b[i] {
                b'[' | b'(' => depth += 1,
                b']' | b')' => depth -= 1,
                b';' if depth == 0 => break,
                b'{' if depth == 0 => {
                    let mut braces = 0;
                    while i < b.len() {
                        match b[i] {
                            b'{' => braces += 1,
                            b'}' => {
                                braces -= 1;
                                if braces == 0 {
                                    break;
                                }
                            }
                            _ => {}
                        }
                        i += 1;
                    }
                    break;
                }
                _ => {}
            }
            i += 1;
        }
        rest = &rest[(at + i + 1).min(rest.len())..];
    }
    out.push_str(rest);
    out
}

/// The paths of the path tree at `s[*i..]` (`a::b`, `a::{b, c::d, self}`, `a::*`), each
/// with the name it binds (an `as` rename, or its last segment).
fn path_tree(s: &[u8], i: &mut usize) -> Vec<(Vec<String>, String)> {
    let skip = |i: &mut usize| {
        while *i < s.len() && s[*i].is_ascii_whitespace() {
            *i += 1;
        }
    };
    skip(i);
    if *i < s.len() && s[*i] == b'{' {
        *i += 1;
        let mut all = Vec::new();
        loop {
            skip(i);
            match s.get(*i) {
                None => return all,
                Some(b'}') => {
                    *i += 1;
                    return all;
                }
                Some(b',') => *i += 1,
                _ => {
                    let before = *i;
                    all.extend(path_tree(s, i));
                    if *i == before {
                        *i += 1;
                    }
                }
            }
        }
    }
    let start = *i;
    while *i < s.len() && (ident(s[*i] as char) || s[*i] == b'*') {
        *i += 1;
    }
    let segment = String::from_utf8_lossy(&s[start..*i]).into_owned();
    if segment.is_empty() {
        return Vec::new();
    }
    let mut j = *i;
    skip(&mut j);
    if s[j..].starts_with(b"::") {
        *i = j + 2;
        return path_tree(s, i)
            .into_iter()
            .map(|(mut p, name)| {
                if p == ["self"] {
                    p.clear();
                    return (vec![segment.clone()], segment.clone());
                }
                p.insert(0, segment.clone());
                (p, name)
            })
            .collect();
    }
    let mut name = segment.clone();
    if s[j..].starts_with(b"as") && s.get(j + 2).is_some_and(|c| c.is_ascii_whitespace()) {
        let mut k = j + 2;
        skip(&mut k);
        let from = k;
        while k < s.len() && ident(s[k] as char) {
            k += 1;
        }
        name = String::from_utf8_lossy(&s[from..k]).into_owned();
        *i = k;
    }
    vec![(vec![segment], name)]
}

/// One non-test file of the tree under a folder.
struct Source {
    /// The file or subfolder of the folder it belongs to (`exec.rs`, `nccl/`).
    node: String,
    /// Its module path in the crate.
    module: Vec<String>,
    code: String,
    /// The modules it declares (`mod x;`).
    children: BTreeSet<String>,
}

impl Source {
    /// The crate path `path` means in this file (`crate::`, `super::`, `self::` or a module
    /// it declares first), if it is one of this crate's.
    fn absolute(&self, path: &[String]) -> Option<Vec<String>> {
        let first = path.first()?;
        let mut base = match first.as_str() {
            "crate" => Vec::new(),
            "self" => self.module.clone(),
            "super" => self.module[..self.module.len().saturating_sub(1)].to_vec(),
            c if self.children.contains(c) => {
                let mut m = self.module.clone();
                m.push(c.to_string());
                return Some(m.into_iter().chain(path[1..].iter().cloned()).collect());
            }
            _ => return None,
        };
        let mut rest = &path[1..];
        while rest.first().is_some_and(|s| s == "super") {
            base.pop();
            rest = &rest[1..];
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }
}

/// The non-test sources under `dir` (the crate's folder `module`), each file given to `node`.
fn sources(dir: &Path, module: &[String], node: Option<&str>, out: &mut Vec<Source>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    entries.sort();
    // Declarations first: which files are test modules, and which modules `#[path]` names.
    let mut declared: BTreeMap<String, (Vec<String>, bool)> = BTreeMap::new();
    for p in &entries {
        if p.extension().is_some_and(|x| x == "rs") {
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            let mut m = module.to_vec();
            if stem != "mod" {
                m.push(stem);
            }
            for (file, name, test) in declarations(&std::fs::read_to_string(p).unwrap()) {
                let mut child = m.clone();
                child.push(name);
                declared.insert(file, (child, test));
            }
        }
    }
    for p in entries {
        let file = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            if p.join("mod.rs").exists() {
                let mut m = module.to_vec();
                m.push(file.clone());
                let own = format!("{file}/");
                sources(&p, &m, Some(node.unwrap_or(&own)), out);
            }
            continue;
        }
        if !file.ends_with(".rs") || file.ends_with("_tests.rs") {
            continue;
        }
        let stem = file.trim_end_matches(".rs").to_string();
        let (m, test) = declared.get(&file).cloned().unwrap_or_else(|| {
            let mut m = module.to_vec();
            if stem != "mod" {
                m.push(stem.clone());
            }
            (m, false)
        });
        if test {
            continue;
        }
        let text = std::fs::read_to_string(&p).unwrap();
        let code = code_of(&text);
        let children = declarations(&code).into_iter().map(|d| d.1).collect();
        out.push(Source {
            node: node.map_or(file, str::to_string),
            module: m,
            code,
            children,
        });
    }
}

/// The modules `text` declares without a body: `(file, name, under #[cfg(test)])`, the file
/// as its `#[path]` names it or `name.rs`.
fn declarations(text: &str) -> Vec<(String, String, bool)> {
    let code = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = Vec::new();
    let words: Vec<&str> = code.split_whitespace().collect();
    for (k, w) in words.iter().enumerate() {
        if *w != "mod" {
            continue;
        }
        let Some(name) = words.get(k + 1).and_then(|n| n.strip_suffix(';')) else {
            continue;
        };
        // The attributes before it: back over visibility and `#[...]` words.
        let mut attrs = String::new();
        let mut b = k;
        while b > 0 {
            let prev = words[b - 1];
            let attribute = prev.starts_with("#[") || prev == "=" || prev.ends_with(']');
            if prev.starts_with("pub") || attribute {
                attrs = format!("{prev} {attrs}");
                b -= 1;
            } else {
                break;
            }
        }
        let test = attrs.contains("cfg(test)");
        let file = attrs
            .split("path = \"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .map_or_else(|| format!("{name}.rs"), str::to_string);
        found.push((file, name.to_string(), test));
    }
    found
}

/// Which files of the folder `folder` of the crate in `crate_src` each file names (see above).
fn file_references(crate_src: &str, folder: &str) -> BTreeMap<String, BTreeSet<String>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(crate_src);
    let base: Vec<String> = folder.split('/').map(str::to_string).collect();
    let mut all = Vec::new();
    sources(&root.join(folder), &base, None, &mut all);
    // Where each module's file is, and what each file's `use`s bind.
    let by_module: BTreeMap<Vec<String>, usize> = all
        .iter()
        .enumerate()
        .map(|(k, s)| (s.module.clone(), k))
        .collect();
    let mut binds: Vec<BTreeMap<String, Vec<String>>> = Vec::new();
    let mut uses: Vec<Vec<(bool, Vec<Vec<String>>)>> = Vec::new();
    for s in &all {
        let (mut bound, mut listed) = (BTreeMap::new(), Vec::new());
        let b = s.code.as_bytes();
        for (at, _) in s.code.match_indices("use ") {
            if at > 0 && ident(b[at - 1] as char) {
                continue;
            }
            let head = s.code[..at].trim_end();
            // `pub use` and `pub(crate) use` re-export.
            let public = head.ends_with("pub")
                || head.ends_with(')')
                    && head
                        .rsplit("pub")
                        .next()
                        .is_some_and(|r| r.starts_with('('));
            let mut i = at + 4;
            let mut paths = Vec::new();
            for (p, name) in path_tree(b, &mut i) {
                if let Some(abs) = s.absolute(&p) {
                    if name != "*" {
                        bound.insert(name, abs.clone());
                    }
                    paths.push(abs);
                }
            }
            listed.push((public, paths));
        }
        binds.push(bound);
        uses.push(listed);
    }
    // The file a crate path lands in, following re-exports.
    let land = |path: &[String]| -> Option<usize> {
        let mut path = path.to_vec();
        for _ in 0..8 {
            let k = (base.len()..=path.len())
                .rev()
                .find_map(|n| by_module.get(&path[..n]).map(|&k| (k, n)))?;
            let (file, n) = k;
            match path.get(n).and_then(|name| binds[file].get(name)) {
                // A name brought in from outside the folder: no sibling's.
                Some(target) if !target.starts_with(&base) => return None,
                Some(target) if target != &path => {
                    path = target.iter().chain(&path[n + 1..]).cloned().collect();
                }
                _ => return Some(file),
            }
        }
        None
    };
    let mut refs: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (k, s) in all.iter().enumerate() {
        let named = refs.entry(s.node.clone()).or_default();
        let mut targets: Vec<Vec<String>> = Vec::new();
        // Paths in code (a `pub use` re-exports, and names nothing itself).
        let mut code = s.code.clone();
        for (public, paths) in &uses[k] {
            if !*public {
                targets.extend(paths.iter().cloned());
            }
        }
        for (at, _) in s.code.match_indices("use ") {
            if at == 0 || !ident(s.code.as_bytes()[at - 1] as char) {
                let end = s.code[at..].find(';').map_or(s.code.len(), |e| at + e);
                code.replace_range(at..end, &" ".repeat(end - at));
            }
        }
        let b = code.as_bytes();
        for start in 0..b.len() {
            if start > 0 && (ident(b[start - 1] as char) || b[start - 1] == b':') {
                continue;
            }
            let word: String = code[start..].chars().take_while(|&c| ident(c)).collect();
            let is_path =
                ["crate", "super", "self"].contains(&word.as_str()) || s.children.contains(&word);
            if !is_path || !code[start + word.len()..].starts_with("::") {
                continue;
            }
            let mut i = start;
            for (p, _) in path_tree(b, &mut i) {
                targets.extend(s.absolute(&p));
            }
        }
        for t in targets {
            if let Some(to) = land(&t) {
                if all[to].node != s.node {
                    named.insert(all[to].node.clone());
                }
            }
        }
    }
    refs
}

/// Panics naming the circle when the files of `folder` (in the crate at `crate_src`) reference
/// each other in one.
fn assert_files_acyclic(crate_src: &str, folder: &str) {
    let refs = file_references(crate_src, folder);
    for (m, named) in &refs {
        for n in named {
            if let Some(back) = path(&refs, n, m, &mut BTreeSet::new()) {
                panic!(
                    "{crate_src}/{folder}: a file cycle: {m} -> {}",
                    back.join(" -> ")
                );
            }
        }
    }
}

/// Each of these folders of the runtime is acyclic file by file. Not yet: `comm` (`tcp.rs`
/// and its `tcp_meet.rs`), `cpu`, `cpu/kernels`, `cpu/kernels/gemm` and `data` (their
/// `mod.rs` dispatches to the files that use its types), `train` (`mod.rs` and `open.rs`).
#[test]
fn no_file_cycle_in_the_runtimes_folders() {
    for folder in [
        "checks",
        "checks/kernels",
        "cuda",
        "cuda/nccl",
        "exec",
        "ranks",
        "run",
        "trained",
    ] {
        assert_files_acyclic("runtime/src", folder);
    }
}

/// The IR is acyclic file by file: the op type (`ir/op.rs`) is a leaf the rules name, and the
/// table (`ir/ops.rs`) names the rules.
#[test]
fn no_file_cycle_in_the_ir() {
    assert_files_acyclic("compiler/src", "ir");
}
