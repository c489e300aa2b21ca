//! The tree all-reduce's schedule against `collective::total` (bit for bit, through the host
//! interpreter that adds chunk by chunk as the device does), its refusals, and the add
//! kernel's PTX through ptxas. The device exchange itself needs a GPU and libnccl: it is run
//! by `parallax comm-check --backend cuda` (scripts/gpu-check.sh), not here.

// Layouts are lists of shard ranges, many of one range each.
#![allow(clippy::single_range_in_vec_init)]

use super::device::GATHER;
use super::*;
use crate::comm::collective::{partials, total, tree_sum, Partial};
use crate::cuda::nccl::assert_names;
use crate::cuda::nccl::comm::NcclCommError;
use parallax_compiler::shards::assign;
use std::time::Duration;

/// A small deterministic generator for layouts (SplitMix64).
struct Gen64(u64);

impl Gen64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::rng::mix(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Contiguous shard runs for `n` members: `assign`'s even split, or random cut points
/// (members may hold nothing).
fn layout(g: &mut Gen64, leaves: usize, n: usize) -> Vec<Range<usize>> {
    if g.below(2) == 0 {
        return assign(leaves, n);
    }
    let mut cuts: Vec<usize> = (0..n - 1).map(|_| g.below(leaves + 1)).collect();
    cuts.sort_unstable();
    let mut bounds = vec![0];
    bounds.extend(cuts);
    bounds.push(leaves);
    bounds.windows(2).map(|w| w[0]..w[1]).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Everything one random case needs: the schedule's inputs, every member's partials, and
/// `total`'s answer.
struct Case {
    leaves: usize,
    members: Vec<usize>,
    ranges: Vec<Vec<Range<usize>>>,
    values: Vec<Vec<Vec<f32>>>,
    len: usize,
}

fn case(g: &mut Gen64, seed: u64) -> Case {
    let leaves = 1 + g.below(40);
    let n = 1 + g.below(8);
    let len = g.below(700);
    // World ranks in an arbitrary order: the group need not be the world, nor sorted.
    let mut members: Vec<usize> = Vec::new();
    while members.len() < n {
        let r = g.below(12);
        if !members.contains(&r) {
            members.push(r);
        }
    }
    let leaf = |i: usize| {
        (0..len)
            .map(|j| check_value(seed, i, j))
            .collect::<Vec<f32>>()
    };
    let (mut ranges, mut values) = (Vec::new(), Vec::new());
    for own in layout(g, leaves, n) {
        let ps = partials(leaves, own, &leaf);
        ranges.push(ps.iter().map(|p| p.range.clone()).collect());
        values.push(ps.into_iter().map(|p| p.values).collect());
    }
    Case {
        leaves,
        members,
        ranges,
        values,
        len,
    }
}

fn reference(c: &Case) -> Vec<f32> {
    let ps = c
        .members
        .iter()
        .zip(c.ranges.iter().zip(&c.values))
        .flat_map(|(&rank, (rs, vs))| {
            rs.iter().zip(vs).map(move |(r, v)| {
                (
                    rank,
                    Partial {
                        range: r.clone(),
                        values: v.clone(),
                    },
                )
            })
        })
        .collect();
    total(c.leaves, ps).unwrap()
}

#[test]
fn the_schedule_gives_the_bits_of_total_for_random_layouts() {
    let mut g = Gen64(7);
    let mut differed = 0;
    for k in 0..600 {
        let c = case(&mut g, k);
        let s = Schedule::new(c.leaves, &c.members, &c.ranges, c.len).unwrap();
        let got = s.run_host(&c.values).unwrap();
        let want = reference(&c);
        assert_eq!(
            bits(&got),
            bits(&want),
            "case {k}: {} leaves over {:?}, len {}",
            c.leaves,
            c.ranges,
            c.len
        );
        // The order matters for these values: a left-to-right sum differs (else the test
        // could not tell a reordered schedule apart).
        let serial = (1..c.leaves).fold(
            (0..c.len).map(|j| check_value(k, 0, j)).collect::<Vec<_>>(),
            |mut a, i| {
                for (j, x) in a.iter_mut().enumerate() {
                    *x += check_value(k, i, j);
                }
                a
            },
        );
        differed += usize::from(bits(&serial) != bits(&want));
    }
    assert!(
        differed > 300,
        "only {differed} of 600 cases depend on the order"
    );
}

#[test]
fn chunks_are_padded_and_cover_the_vector() {
    let mut g = Gen64(11);
    for k in 0..200 {
        let c = case(&mut g, k);
        let s = Schedule::new(c.leaves, &c.members, &c.ranges, c.len).unwrap();
        assert_eq!(s.chunk % CHUNK_ALIGN, 0);
        assert!(s.chunk * c.members.len() >= c.len);
        let mut next = 0;
        for (m, plan) in s.chunks.iter().enumerate() {
            assert_eq!(plan.range.start, next.min(c.len), "chunk {m}");
            next = plan.range.end.max(next);
            assert!(plan.range.len() <= s.chunk);
            // Receives: every other member's partials, in group then partial order (what
            // the senders issue), each into its own slot.
            let want: Vec<(usize, usize)> = (0..c.members.len())
                .filter(|&f| f != m)
                .flat_map(|f| (0..c.ranges[f].len()).map(move |p| (f, p)))
                .collect();
            let got: Vec<(usize, usize)> = plan.recvs.iter().map(|r| (r.from, r.partial)).collect();
            assert_eq!(got, want);
            assert!(plan.recvs.iter().enumerate().all(|(i, r)| r.slot == i));
            // The program writes scratch or the output, never an input, and ends in Out.
            for (i, op) in plan.program.iter().enumerate() {
                assert!(!matches!(op.dst, Slot::Mine(_)));
                assert_eq!(op.dst == Slot::Out, i + 1 == plan.program.len());
                for s in [op.dst, op.a, op.b] {
                    if let Slot::Scratch(k) = s {
                        assert!(k < plan.scratch_slots);
                    }
                }
            }
            let parts: usize = c.ranges.iter().map(Vec::len).sum();
            assert_eq!(plan.program.len(), parts - 1);
            assert_eq!(plan.result == Slot::Out, parts > 1);
        }
        assert_eq!(next, c.len);
    }
}

#[test]
fn the_program_follows_the_tree_left_first() {
    // 3 leaves on 3 members: ((0 + 1) + 2), the left pair first, as `tree_sum` adds.
    let ranges = vec![vec![0..1], vec![1..2], vec![2..3]];
    let s = Schedule::new(3, &[5, 6, 7], &ranges, 10).unwrap();
    let p = &s.chunks[0];
    assert_eq!(
        p.program,
        vec![
            Add {
                dst: Slot::Scratch(2),
                a: Slot::Mine(0),
                b: Slot::Scratch(0),
            },
            Add {
                dst: Slot::Out,
                a: Slot::Scratch(2),
                b: Slot::Scratch(1),
            },
        ]
    );
    // The owner of the middle leaf adds its received left partial into place.
    assert_eq!(s.chunks[1].program[0].dst, Slot::Scratch(0));
    // Chunks: 10 floats padded to 64 for member 0; the others own nothing.
    assert_eq!(s.chunk, 64);
    assert_eq!(s.chunks[0].range, 0..10);
    assert!(s.chunks[1].range.is_empty() && s.chunks[2].range.is_empty());
    let leaf = |i: usize| (0..10).map(|j| check_value(3, i, j)).collect::<Vec<f32>>();
    let values: Vec<Vec<Vec<f32>>> = (0..3).map(|i| vec![leaf(i)]).collect();
    assert_eq!(
        bits(&s.run_host(&values).unwrap()),
        bits(&tree_sum(0, 3, &leaf))
    );
}

#[test]
fn bad_layouts_are_refused_as_total_refuses_them() {
    let r = |v: &[Range<usize>]| v.to_vec();
    assert_eq!(
        Schedule::new(4, &[0, 1], &[r(&[1..3]), r(&[0..1])], 8),
        Err(TreeError::NotASubtree {
            rank: 0,
            range: 1..3,
            leaves: 4
        })
    );
    assert_eq!(
        Schedule::new(8, &[0, 1], &[r(&[0..4]), r(&[4..6])], 8),
        Err(TreeError::Missing(6..7))
    );
    assert_eq!(
        Schedule::new(4, &[0, 1], &[r(&[0..4]), r(&[2..4])], 8),
        Err(TreeError::Overlap {
            rank: 1,
            range: 2..4
        })
    );
    assert_eq!(
        Schedule::new(2, &[0, 1], &[r(&[0..1]), r(&[0..1, 1..2])], 8),
        Err(TreeError::Overlap {
            rank: 1,
            range: 0..1
        })
    );
    assert!(matches!(
        Schedule::new(2, &[3, 3], &[r(&[0..1]), r(&[1..2])], 8),
        Err(TreeError::DuplicateMember { rank: 3, .. })
    ));
    assert_eq!(Schedule::new(2, &[], &[], 8), Err(TreeError::EmptyGroup));
    assert_eq!(
        Schedule::new(2, &[0, 1], &[r(&[0..2])], 8),
        Err(TreeError::Lists {
            members: 2,
            lists: 1
        })
    );
    assert_eq!(
        Schedule::new(0, &[0], &[vec![]], 8),
        Err(TreeError::Missing(0..0))
    );
    // The host interpreter checks what the device cannot: counts and lengths.
    let s = Schedule::new(2, &[4, 9], &[r(&[0..1]), r(&[1..2])], 3).unwrap();
    assert_eq!(
        s.run_host(&[vec![vec![0.0; 3]], vec![]]),
        Err(TreeError::Count {
            rank: 9,
            got: 0,
            want: 1
        })
    );
    assert_eq!(
        s.run_host(&[vec![vec![0.0; 3]], vec![vec![0.0; 2]]]),
        Err(TreeError::Length {
            rank: 9,
            range: 1..2,
            got: 2,
            want: 3
        })
    );
    let e = TreeError::NotASubtree {
        rank: 2,
        range: 1..3,
        leaves: 4,
    }
    .to_string();
    assert!(
        e.contains("rank 2") && e.contains("1..3") && e.contains("not a subtree"),
        "{e}"
    );
}

#[test]
fn device_errors_name_the_rank_the_phase_and_the_operation() {
    let e = DeviceTreeError::Nccl {
        rank: 1,
        phase: GATHER,
        source: Box::new(NcclCommError::TimedOut {
            rank: 1,
            world: 2,
            what: "recv of 64 f32 from rank 0".into(),
            timeout: Duration::from_secs(5),
            code: 7,
            name: "ncclInProgress",
            text: "NCCL operation in progress".into(),
        }),
    }
    .to_string();
    let parts = [
        "tree all-reduce on rank 1",
        "gathering the summed chunks",
        "recv of 64 f32 from rank 0",
        "5s",
    ];
    assert_names(&e, &parts);
}

/// ptxas: `$PTXAS`, or the copy scripts/test.sh installs under `.tools/`. A missing ptxas
/// fails the test (CI installs it), as the compiler's PTX tests do.
fn ptxas() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("PTXAS") {
        return p.into();
    }
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../.tools/nvcc/nvidia/cu13/bin/ptxas");
    assert!(
        p.exists(),
        "ptxas not found at {}: run scripts/test.sh once (it installs nvidia-cuda-nvcc) or set PTXAS",
        p.display()
    );
    p
}

#[test]
fn the_add_kernel_assembles_for_sm_80_and_sm_90() {
    let dir = std::env::temp_dir().join(format!("parallax-tree-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for target in ["sm_80", "sm_90"] {
        let text = add_kernel_ptx(target);
        assert!(text.contains(&format!(".target {target}")));
        assert!(text.contains(&format!(".entry {ADD_KERNEL}(")));
        // One rounded add per element: nothing the host would not compute.
        assert!(
            text.contains("add.rn.f32") && !text.contains("fma"),
            "{text}"
        );
        let file = dir.join(format!("{target}.ptx"));
        std::fs::write(&file, &text).unwrap();
        let out = std::process::Command::new(ptxas())
            .args(["--gpu-name", target, "-o", "/dev/null"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{target}: {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
