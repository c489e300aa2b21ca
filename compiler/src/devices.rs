//! Device profiles: what the cost model and the memory check know of each device kind. The
//! figures are the vendors' datasheet numbers (dense, no sparsity), cited per profile;
//! link figures are per direction.

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Link {
    /// Bytes per second, one direction.
    pub bandwidth: f64,
    /// Seconds for a small message (what a ring step pays besides the bytes).
    pub latency: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Profile {
    pub kind: &'static str,
    pub name: &'static str,
    /// Device memory in bytes.
    pub memory: u64,
    /// Peak FLOP/s by precision (dense).
    pub fp32: f64,
    pub tf32: f64,
    pub bf16: f64,
    /// Memory bandwidth, bytes per second.
    pub memory_bandwidth: f64,
    /// Between devices of one node (NVLink or PCIe).
    pub intra_node: Link,
    /// Between nodes (the node's network, per device).
    pub inter_node: Link,
    /// Where the figures come from.
    pub source: &'static str,
}

const GB: u64 = 1_000_000_000;
const T: f64 = 1e12;

/// NVLink 4 (900 GB/s total, 450 GB/s each way); NDR InfiniBand, 400 Gb/s per GPU in a
/// DGX/HGX H100 node. Latencies are typical NCCL small-message figures.
const NVLINK4: Link = Link {
    bandwidth: 450e9,
    latency: 3e-6,
};
const NDR: Link = Link {
    bandwidth: 50e9,
    latency: 6e-6,
};
/// NVLink 3 (600 GB/s total); HDR InfiniBand, 200 Gb/s per GPU in a DGX A100.
const NVLINK3: Link = Link {
    bandwidth: 300e9,
    latency: 3e-6,
};
const HDR: Link = Link {
    bandwidth: 25e9,
    latency: 6e-6,
};
/// PCIe 4.0 x16 (32 GB/s each way) and 100 Gb Ethernet between nodes.
const PCIE4: Link = Link {
    bandwidth: 32e9,
    latency: 8e-6,
};
const ETH100: Link = Link {
    bandwidth: 12.5e9,
    latency: 20e-6,
};

pub const PROFILES: &[Profile] = &[
    Profile {
        kind: "h100",
        name: "NVIDIA H100 SXM5 80GB",
        memory: 80 * GB,
        fp32: 67.0 * T,
        tf32: 494.7 * T,
        bf16: 989.4 * T,
        memory_bandwidth: 3.35e12,
        intra_node: NVLINK4,
        inter_node: NDR,
        source: "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s, FP32 67 TFLOPS, TF32 494.7 / BF16 989.4 TFLOPS dense, NVLink 900 GB/s",
    },
    Profile {
        kind: "h200",
        name: "NVIDIA H200 SXM 141GB",
        memory: 141 * GB,
        fp32: 67.0 * T,
        tf32: 494.7 * T,
        bf16: 989.4 * T,
        memory_bandwidth: 4.8e12,
        intra_node: NVLINK4,
        inter_node: NDR,
        source: "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, FP32 67 TFLOPS, TF32 494.7 / BF16 989.4 TFLOPS dense, NVLink 900 GB/s",
    },
    Profile {
        kind: "a100-80gb",
        name: "NVIDIA A100 SXM4 80GB",
        memory: 80 * GB,
        fp32: 19.5 * T,
        tf32: 156.0 * T,
        bf16: 312.0 * T,
        memory_bandwidth: 2.039e12,
        intra_node: NVLINK3,
        inter_node: HDR,
        source: "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 80 GB HBM2e, 2,039 GB/s, FP32 19.5 TFLOPS, TF32 156 / BF16 312 TFLOPS dense, NVLink 600 GB/s",
    },
    Profile {
        kind: "a100-40gb",
        name: "NVIDIA A100 SXM4 40GB",
        memory: 40 * GB,
        fp32: 19.5 * T,
        tf32: 156.0 * T,
        bf16: 312.0 * T,
        memory_bandwidth: 1.555e12,
        intra_node: NVLINK3,
        inter_node: HDR,
        source: "NVIDIA A100 Tensor Core GPU datasheet (40GB SXM): 40 GB HBM2, 1,555 GB/s, FP32 19.5 TFLOPS, TF32 156 / BF16 312 TFLOPS dense, NVLink 600 GB/s",
    },
    Profile {
        kind: "l4",
        name: "NVIDIA L4 24GB",
        memory: 24 * GB,
        fp32: 30.3 * T,
        tf32: 60.0 * T,
        bf16: 121.0 * T,
        memory_bandwidth: 300e9,
        intra_node: PCIE4,
        inter_node: ETH100,
        source: "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s, FP32 30.3 TFLOPS, TF32 60 / BF16 121 TFLOPS dense (120 / 242 with sparsity), PCIe Gen4 x16",
    },
    Profile {
        kind: "cpu",
        name: "CPU (simulated devices)",
        memory: 24 * (1 << 30),
        fp32: 0.1 * T,
        tf32: 0.1 * T,
        bf16: 0.1 * T,
        memory_bandwidth: 20e9,
        intra_node: Link {
            bandwidth: 10e9,
            latency: 1e-6,
        },
        inter_node: Link {
            bandwidth: 10e9,
            latency: 1e-6,
        },
        source: "the 2-core development machine: about 100 GFLOP/s fp32 (AVX2 GEMM, measured), 24 GiB",
    },
];

/// The profile of a device kind (`h100`, `a100-80gb`, ...).
pub fn profile(kind: &str) -> Option<&'static Profile> {
    PROFILES.iter().find(|p| p.kind == kind)
}

/// A device kind no profile has, with the nearest kinds that exist.
#[derive(Debug, thiserror::Error)]
#[error("unknown device kind `{kind}`; {suggestion}")]
pub struct UnknownKind {
    pub kind: String,
    suggestion: String,
}

/// [`profile`], or why there is none.
pub fn find(kind: &str) -> Result<&'static Profile, UnknownKind> {
    profile(kind).ok_or_else(|| UnknownKind {
        kind: kind.to_string(),
        suggestion: crate::diag::suggest(kind, "device kinds", PROFILES.iter().map(|p| p.kind)),
    })
}

/// The profile for a GPU as the driver names it (`NVIDIA H200`, `NVIDIA A100-SXM4-40GB`).
pub fn for_gpu_name(name: &str) -> Option<&'static Profile> {
    let n = name.to_lowercase();
    let kind = if n.contains("h200") {
        "h200"
    } else if n.contains("h100") {
        "h100"
    } else if n.contains("a100") && n.contains("40") {
        "a100-40gb"
    } else if n.contains("a100") {
        "a100-80gb"
    } else if n.contains("l4") {
        "l4"
    } else {
        return None;
    };
    profile(kind)
}

/// Reads a memory size: `24GiB`, `80GB`, `512MiB`, `1.5TiB`, or bytes.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}`: expected a size such as 24GiB or 80GB"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        other => {
            return Err(format!(
                "`{s}`: unknown unit `{other}` (use B, GB, GiB, ...)"
            ))
        }
    };
    let bytes = value * scale;
    if !(bytes.is_finite() && (1.0..1.8e19).contains(&bytes)) {
        return Err(format!("`{s}`: not a usable memory size"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_the_language_accepts_has_a_profile() {
        for k in crate::dsl::ast::DEVICE_KINDS {
            let p = profile(k).unwrap_or_else(|| panic!("no profile for {k}"));
            assert!(p.memory > 0 && p.fp32 > 0.0 && p.bf16 >= p.fp32, "{k}");
            assert!(p.intra_node.bandwidth >= p.inter_node.bandwidth, "{k}");
        }
        assert_eq!(PROFILES.len(), crate::dsl::ast::DEVICE_KINDS.len());
    }

    #[test]
    fn gpu_names_map_to_profiles() {
        assert_eq!(for_gpu_name("NVIDIA H200").unwrap().kind, "h200");
        assert_eq!(
            for_gpu_name("NVIDIA A100-SXM4-40GB").unwrap().kind,
            "a100-40gb"
        );
        assert_eq!(
            for_gpu_name("NVIDIA A100 80GB PCIe").unwrap().kind,
            "a100-80gb"
        );
        assert!(for_gpu_name("Tesla T4").is_none());
    }

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_bytes("24GiB"), Ok(24 << 30));
        assert_eq!(parse_bytes("80GB"), Ok(80_000_000_000));
        assert_eq!(parse_bytes("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
        assert!(parse_bytes("0GB").is_err());
    }
}
