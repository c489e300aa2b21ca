//! The communicator's checks that need no GPU and no libnccl: refusals, id bytes, error
//! texts, NCCL's codes and its config initializer.

use super::*;
use crate::cuda::nccl::assert_names;

fn nccl_absent() -> bool {
    // SAFETY: only tries to open the library.
    !unsafe { sys::is_culib_present() }
}

#[test]
fn nccl_id_bytes_round_trip() {
    let bytes: [u8; 128] = std::array::from_fn(|i| (i * 7 + 3) as u8);
    let id = NcclId::from_bytes(bytes);
    assert_eq!(id.to_bytes(), bytes);
    assert_eq!(NcclId::from_bytes(id.to_bytes()), id);
}

#[test]
fn nccl_missing_library_is_an_error_not_a_panic() {
    if !nccl_absent() {
        return; // a machine with libnccl: the GPU checks cover it
    }
    assert!(matches!(NcclId::new(), Err(NcclCommError::MissingLibrary)));
    let id = NcclId::from_bytes([0; 128]);
    // SAFETY: the library check fails before the stream is used.
    let r = unsafe { NcclComm::init(&id, 0, 2, std::ptr::null_mut(), Duration::from_secs(1)) };
    assert!(matches!(r, Err(NcclCommError::MissingLibrary)));
    let e: CudaError = NcclCommError::MissingLibrary.into();
    assert!(matches!(e, CudaError::MissingLibrary { .. }));
}

#[test]
fn nccl_rank_outside_world_is_rejected_first() {
    let id = NcclId::from_bytes([0; 128]);
    for (rank, world) in [(2, 2), (0, 0)] {
        // SAFETY: rejected before any NCCL or CUDA call.
        let r = unsafe { NcclComm::init(&id, rank, world, std::ptr::null_mut(), Duration::ZERO) };
        assert!(matches!(r, Err(NcclCommError::Invalid(_))));
    }
}

#[test]
fn nccl_error_text_names_rank_world_operation_and_code() {
    let r = sys::ncclResult_t::ncclRemoteError;
    let e = NcclCommError::Failed {
        rank: 1,
        world: 4,
        what: "all_gather of 8 f32 per rank".into(),
        code: r as u32,
        name: code_name(r),
        text: "remote process exited or there was a network error".into(),
    };
    let parts = [
        "rank 1 of 4 ranks",
        "all_gather of 8 f32",
        "ncclRemoteError (6)",
        "network error",
        "aborted",
    ];
    assert_names(&e.to_string(), &parts);
    let r = sys::ncclResult_t::ncclInProgress;
    let t = NcclCommError::TimedOut {
        rank: 0,
        world: 2,
        what: "send of 4 f32 to rank 1".into(),
        timeout: Duration::from_secs(30),
        code: r as u32,
        name: code_name(r),
        text: "NCCL operation in progress".into(),
    };
    let parts = [
        "rank 0 of 2 ranks",
        "send of 4 f32 to rank 1",
        "30s",
        "ncclInProgress (7)",
    ];
    assert_names(&t.to_string(), &parts);
}

#[test]
fn nccl_code_names_match_the_header() {
    use sys::ncclResult_t::*;
    let expected = [
        (ncclSuccess, 0, "ncclSuccess"),
        (ncclUnhandledCudaError, 1, "ncclUnhandledCudaError"),
        (ncclSystemError, 2, "ncclSystemError"),
        (ncclInternalError, 3, "ncclInternalError"),
        (ncclInvalidArgument, 4, "ncclInvalidArgument"),
        (ncclInvalidUsage, 5, "ncclInvalidUsage"),
        (ncclRemoteError, 6, "ncclRemoteError"),
        (ncclInProgress, 7, "ncclInProgress"),
        (ncclTimeout, 8, "ncclTimeout"),
    ];
    for (r, code, name) in expected {
        assert_eq!((r as u32, code_name(r)), (code, name));
    }
}

/// Compared with NVIDIA/nccl src/nccl.h.in: `NCCL_CONFIG_INITIALIZER` is
/// `{ sizeof(ncclConfig_t), NCCL_API_MAGIC = 0xcafebeef, NCCL_VERSION_CODE,
/// NCCL_CONFIG_UNDEF_INT = INT_MIN for every int, NCCL_CONFIG_UNDEF_PTR = NULL for
/// netName and commName }`, and `NCCL_VERSION(X,Y,Z)` is `X*10000 + Y*100 + Z` past 2.8.
#[test]
fn nccl_config_matches_the_initializer_with_blocking_off() {
    let c = nonblocking_config();
    assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
    #[cfg(target_pointer_width = "64")]
    assert_eq!(
        c.size, 96,
        "2.30's ncclConfig_t: 3 header fields, 2 pointers, 17 ints"
    );
    assert_eq!(c.magic, 0xcafe_beef);
    assert_eq!(c.version, 23000);
    assert_eq!(nccl_version(2, 27, 3), 22703);
    assert_eq!(nccl_version(2, 8, 4), 2804);
    assert_eq!(c.blocking, 0);
    let ints = [
        c.cgaClusterSize,
        c.minCTAs,
        c.maxCTAs,
        c.splitShare,
        c.trafficClass,
        c.collnetEnable,
        c.CTAPolicy,
        c.shrinkShare,
        c.nvlsCTAs,
        c.nChannelsPerNetPeer,
        c.nvlinkCentricSched,
        c.graphUsageMode,
        c.numRmaCtx,
        c.maxP2pPeers,
    ];
    assert!(ints.iter().all(|&v| v == i32::MIN));
    assert!(c.netName.is_null() && c.commName.is_null());
}
