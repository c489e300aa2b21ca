use parallax_compiler::{compile, parse_bytes, Options};
const MLP: &str = include_str!("../models/mlp.ron");
const TR: &str = include_str!("../models/transformer.ron");

fn show(label: &str, bytes: &[u8]) {
    let text = String::from_utf8_lossy(bytes).into_owned();
    let r = parse_bytes(bytes).and_then(|s| compile(&s, &Options::default(), &mut |_, _| {}).map(|_| ()));
    match r {
        Ok(()) => println!("=== {label}: OK"),
        Err(e) => {
            println!("=== {label}:");
            for d in e.diagnostics() {
                print!("{}", d.render("f.ron", &text));
            }
        }
    }
}

#[test]
fn explore() {
    let cases: Vec<(String, Vec<u8>)> = std::fs::read_to_string("/tmp/explore/cases.txt").unwrap()
        .split("\n%%\n").filter(|c| !c.trim().is_empty()).map(|c| {
            let (label, rest) = c.split_once('\n').unwrap();
            // rest: either "MLP|from|to" lines or inline
            let (base, muts) = rest.split_once('\n').unwrap_or((rest, ""));
            let mut s = match base { "MLP" => MLP.to_string(), "TR" => TR.to_string(), other => other.to_string() };
            for m in muts.split("\n").filter(|m| !m.is_empty()) {
                let (a, b) = m.split_once(" => ").unwrap();
                let b = b.replace("\\n", "\n").replace("\\t", "\t");
                assert!(s.contains(a), "{label}: {a}");
                s = s.replacen(a, &b, 1);
            }
            (label.to_string(), s.into_bytes())
        }).collect();
    for (l, b) in cases { show(&l, &b); }
}
#[test]
fn extra() {
    let mlp = MLP;
    let i = mlp.find("    loss: CrossEntropy,").unwrap();
    show("truncated-real", &mlp.as_bytes()[..i]);
    let mut b = mlp.as_bytes().to_vec();
    let j = mlp.find("mlp-digits").unwrap();
    b[j + 3] = 0xff;
    show("non-utf8", &b);
    let mut b = mlp.as_bytes().to_vec();
    b.splice(j..j, [0xe2, 0x82].iter().copied());
    show("non-utf8-trunc-seq", &b);
    show("empty", b"");
    show("bom", format!("\u{feff}{mlp}").as_bytes());
    show("nul", b"\0\0\0");
}
#[test]
fn timing() {
    for f in ["mlp", "cnn", "transformer", "gpt-large"] {
        let b = std::fs::read(format!("models/{f}.ron")).unwrap();
        let t = std::time::Instant::now();
        let s = parse_bytes(&b).unwrap();
        let t1 = t.elapsed();
        let c = compile(&s, &Options::default(), &mut |_, _| {}).unwrap();
        println!("{f}: parse {:?} total {:?} ops {}", t1, t.elapsed(), c.graph.g.node_count());
    }
}
