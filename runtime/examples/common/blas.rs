//! The system's BLAS libraries, loaded at run time for `gemm_speed blas`: OpenBLAS
//! (`libopenblas.so.0`) and BLIS (`libblis.so.4`), Debian's `libopenblas0-pthread` and
//! `libblis4-pthread`. Loaded rather than linked so that a build needs neither, and one run
//! compares both with Parallax's products on the same data.

use libloading::Library;

/// `cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)`.
type Sgemm = unsafe extern "C" fn(
    i32,
    i32,
    i32,
    i32,
    i32,
    i32,
    f32,
    *const f32,
    i32,
    *const f32,
    i32,
    f32,
    *mut f32,
    i32,
);
type SetThreads = unsafe extern "C" fn(i32);

const ROW_MAJOR: i32 = 101;
const NO_TRANS: i32 = 111;
const TRANS: i32 = 112;

/// One library's `cblas_sgemm`, set to run on `threads` threads of its own.
pub struct Blas {
    pub name: String,
    sgemm: Sgemm,
    _library: Library,
}

impl Blas {
    /// The libraries that load here, each with its threads set; what did not load is said on
    /// stderr.
    pub fn available(threads: usize) -> Vec<Blas> {
        [
            (
                "OpenBLAS",
                "libopenblas.so.0",
                &b"openblas_set_num_threads"[..],
            ),
            ("BLIS", "libblis.so.4", &b"bli_thread_set_num_threads"[..]),
        ]
        .into_iter()
        .filter_map(|(name, file, set_threads)| {
            match Self::load(name, file, set_threads, threads) {
                Ok(blas) => Some(blas),
                Err(e) => {
                    eprintln!("{name} not compared: {e}");
                    None
                }
            }
        })
        .collect()
    }

    fn load(
        name: &str,
        file: &str,
        set_threads: &[u8],
        threads: usize,
    ) -> Result<Blas, libloading::Error> {
        // SAFETY: the libraries' initialisers only detect the CPU and read their environment.
        let library = unsafe { Library::new(file)? };
        // SAFETY: the signatures are CBLAS's and the libraries' own documented ones.
        let (sgemm, set) = unsafe {
            (
                *library.get::<Sgemm>(b"cblas_sgemm")?,
                *library.get::<SetThreads>(set_threads)?,
            )
        };
        // SAFETY: as above.
        unsafe { set(threads as i32) };
        let mut name = name.to_string();
        if let Ok(corename) = unsafe {
            library
                .get::<unsafe extern "C" fn() -> *const std::ffi::c_char>(b"openblas_get_corename")
        } {
            // SAFETY: OpenBLAS returns a static NUL-terminated string.
            let core = unsafe { std::ffi::CStr::from_ptr(corename()) };
            name += &format!(" ({})", core.to_string_lossy());
        }
        Ok(Blas {
            name,
            sgemm,
            _library: library,
        })
    }

    /// `out = a b` for row-major `[m, k]` (or `[k, m]` if `ta`) and `[k, n]` (or `[n, k]` if
    /// `tb`) operands.
    #[allow(clippy::too_many_arguments)]
    pub fn product(
        &self,
        (m, k, n): (usize, usize, usize),
        a: &[f32],
        ta: bool,
        b: &[f32],
        tb: bool,
        out: &mut [f32],
    ) {
        assert!(a.len() >= m * k && b.len() >= k * n && out.len() >= m * n);
        let lda = if ta { m } else { k };
        let ldb = if tb { k } else { n };
        let op = |t: bool| if t { TRANS } else { NO_TRANS };
        // SAFETY: the slices hold the operands' m*k, k*n and m*n elements (asserted).
        unsafe {
            (self.sgemm)(
                ROW_MAJOR,
                op(ta),
                op(tb),
                m as i32,
                n as i32,
                k as i32,
                1.0,
                a.as_ptr(),
                lda as i32,
                b.as_ptr(),
                ldb as i32,
                0.0,
                out.as_mut_ptr(),
                n as i32,
            )
        }
    }
}
