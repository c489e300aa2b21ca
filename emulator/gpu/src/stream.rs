//! Streams and events (the driver API's "Stream Management" and "Event Management" groups).
//! A created stream's work waits in its queue until a synchronisation, an event wait or
//! legacy-stream work (for a blocking stream) runs it; the legacy stream runs work as it
//! comes. A missing synchronisation so shows up as stale data, as it would on a GPU.

use crate::ops::Op;
use crate::state::{guard, put, state, Event};
use cudarc::driver::sys::{CUevent, CUresult, CUstream};
use std::ffi::c_uint;

/// `CU_STREAM_NON_BLOCKING`, the only stream flag besides `CU_STREAM_DEFAULT`.
const NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DEFAULT | BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS`.
const EVENT_FLAGS: c_uint = 0x7;
const DISABLE_TIMING: c_uint = 0x2;

#[no_mangle]
pub(crate) unsafe extern "C" fn cuStreamCreate(ph: *mut CUstream, flags: c_uint) -> CUresult {
    guard("cuStreamCreate", || {
        let mut s = state();
        s.current()?;
        if flags & !NON_BLOCKING != 0 || ph.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let h = s.handle();
        s.streams.insert(h, flags);
        put(ph, h as CUstream)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuStreamDestroy_v2(stream: CUstream) -> CUresult {
    guard("cuStreamDestroy_v2", || {
        let mut s = state();
        s.current()?;
        // Work queued before the destruction still runs.
        s.flush(stream as usize)?;
        s.streams
            .remove(&(stream as usize))
            .map(|_| ())
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuStreamSynchronize(stream: CUstream) -> CUresult {
    guard("cuStreamSynchronize", || {
        let mut s = state();
        s.current()?;
        s.stream(stream as usize)?;
        s.no_capture(stream as usize, "cuStreamSynchronize")?;
        if stream as usize <= 1 {
            s.flush_blocking()
        } else {
            s.flush(stream as usize)
        }
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuStreamQuery(stream: CUstream) -> CUresult {
    cuStreamSynchronize(stream)
}

#[no_mangle]
pub(crate) extern "C" fn cuStreamWaitEvent(
    stream: CUstream,
    event: CUevent,
    flags: c_uint,
) -> CUresult {
    guard("cuStreamWaitEvent", || {
        let mut s = state();
        s.current()?;
        s.stream(stream as usize)?;
        // Flags: CU_EVENT_WAIT_DEFAULT (0) or CU_EVENT_WAIT_EXTERNAL (1).
        if flags > 1 {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let e = s
            .events
            .get(&(event as usize))
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        // The wait is modelled by running the recording stream's work now.
        match e.pending {
            Some(from) if !s.captures.contains_key(&from) => s.flush(from),
            _ => Ok(()),
        }
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuEventCreate(ph: *mut CUevent, flags: c_uint) -> CUresult {
    guard("cuEventCreate", || {
        let mut s = state();
        s.current()?;
        if flags & !EVENT_FLAGS != 0 || ph.is_null() {
            return Err(CUresult::CUDA_ERROR_INVALID_VALUE);
        }
        let h = s.handle();
        s.events.insert(
            h,
            Event {
                flags,
                recorded: None,
                pending: None,
            },
        );
        put(ph, h as CUevent)
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuEventRecord(event: CUevent, stream: CUstream) -> CUresult {
    guard("cuEventRecord", || {
        let mut s = state();
        s.current()?;
        s.stream(stream as usize)?;
        let e = s
            .events
            .get_mut(&(event as usize))
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)?;
        e.pending = Some(stream as usize);
        s.submit(
            stream as usize,
            Op::Record {
                event: event as usize,
            },
        )
    })
}

/// The stream whose queued work `event`'s last record waits on (`None`: complete).
fn event_pending(s: &crate::state::State, event: CUevent) -> Result<Option<usize>, CUresult> {
    s.current()?;
    s.events
        .get(&(event as usize))
        .map(|e| e.pending)
        .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
}

#[no_mangle]
pub(crate) extern "C" fn cuEventSynchronize(event: CUevent) -> CUresult {
    guard("cuEventSynchronize", || {
        let mut s = state();
        match event_pending(&s, event)? {
            Some(from) => {
                s.no_capture(from, "cuEventSynchronize")?;
                s.flush(from)
            }
            None => Ok(()),
        }
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuEventQuery(event: CUevent) -> CUresult {
    guard("cuEventQuery", || match event_pending(&state(), event)? {
        Some(_) => Err(CUresult::CUDA_ERROR_NOT_READY),
        None => Ok(()),
    })
}

#[no_mangle]
pub(crate) extern "C" fn cuEventDestroy_v2(event: CUevent) -> CUresult {
    guard("cuEventDestroy_v2", || {
        let mut s = state();
        s.current()?;
        s.events
            .remove(&(event as usize))
            .map(|_| ())
            .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    guard("cuEventElapsedTime", || {
        let s = state();
        s.current()?;
        let get = |e: CUevent| {
            s.events
                .get(&(e as usize))
                .ok_or(CUresult::CUDA_ERROR_INVALID_HANDLE)
        };
        let (a, b) = (get(start)?, get(end)?);
        // "If either event was created with the CU_EVENT_DISABLE_TIMING flag, then this
        // function will return CUDA_ERROR_INVALID_HANDLE"; likewise if never recorded.
        if (a.flags | b.flags) & DISABLE_TIMING != 0 {
            return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
        }
        // "If either event has not been completed yet, CUDA_ERROR_NOT_READY is returned."
        if a.pending.is_some() || b.pending.is_some() {
            return Err(CUresult::CUDA_ERROR_NOT_READY);
        }
        let (Some(t0), Some(t1)) = (a.recorded, b.recorded) else {
            return Err(CUresult::CUDA_ERROR_INVALID_HANDLE);
        };
        let d = if t1 >= t0 {
            t1.duration_since(t0).as_secs_f32()
        } else {
            -t0.duration_since(t1).as_secs_f32()
        };
        put(ms, d * 1e3)
    })
}

#[no_mangle]
pub(crate) unsafe extern "C" fn cuEventElapsedTime(
    ms: *mut f32,
    start: CUevent,
    end: CUevent,
) -> CUresult {
    cuEventElapsedTime_v2(ms, start, end)
}
