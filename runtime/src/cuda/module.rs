//! The plan's kernels as loaded modules, one per batch size: loading one (and finding the
//! kernel the driver rejects), opting kernels into more than 48 KB of dynamic shared memory,
//! and what codegen is asked for at a precision.

use super::gemm::Precision;
use super::CudaError;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaModule};
use parallax_compiler::codegen::{self, Launch, Module};
use std::collections::HashMap;
use std::sync::Arc;

/// A module loaded for one batch size.
pub(super) struct Loaded {
    pub(super) code: Module,
    _module: Arc<CudaModule>,
    pub(super) functions: HashMap<String, CudaFunction>,
}

/// What codegen is asked for at a precision: bf16 plans take the tensor-core attention
/// forward (its operands rounded to bf16, as their matmuls' are). `compile --emit ptx` asks
/// the same, so it writes the kernels `train` runs.
pub fn codegen_options(precision: Precision) -> codegen::CodegenOptions {
    codegen::CodegenOptions {
        bf16_attention: precision == Precision::Bf16,
    }
}

/// Loads a module; on failure, finds the kernel the driver rejects.
pub(super) fn load(ctx: &Arc<CudaContext>, code: Module) -> Result<Loaded, CudaError> {
    let text = code.text();
    let module = match ctx.load_module(cudarc::nvrtc::Ptx::from_src(text)) {
        Ok(m) => m,
        Err(e) => {
            for (name, _) in &code.entries {
                let one = code.entry_text(name).unwrap_or_default();
                if let Err(e) = ctx.load_module(cudarc::nvrtc::Ptx::from_src(one)) {
                    return Err(CudaError::PtxLoad {
                        kernel: name.clone(),
                        message: format!("{e:?}"),
                    });
                }
            }
            return Err(CudaError::PtxLoad {
                kernel: "(the whole module)".into(),
                message: format!("{e:?}"),
            });
        }
    };
    let mut functions = HashMap::new();
    for (name, _) in &code.entries {
        let f = module.load_function(name).map_err(|e| CudaError::PtxLoad {
            kernel: name.clone(),
            message: format!("{e:?}"),
        })?;
        functions.insert(name.clone(), f);
    }
    prepare_dynamic_shared(ctx, &code, &functions)?;
    Ok(Loaded {
        code,
        _module: module,
        functions,
    })
}

/// What a block gets without opting in (and the ceiling of static shared memory).
const SHARED_DEFAULT: u32 = 48 * 1024;

/// Whether a kernel `bytes` of dynamic shared memory per block needs the opt-in attribute;
/// an error naming it when the device's opt-in limit `optin` is below that.
pub(super) fn dynamic_shared_opt_in(
    kernel: &str,
    bytes: u32,
    optin: u32,
) -> Result<bool, CudaError> {
    if bytes > optin {
        return Err(CudaError::PtxLoad {
            kernel: kernel.to_string(),
            message: format!(
                "it needs {bytes} bytes of shared memory per block, this GPU allows {optin}"
            ),
        });
    }
    Ok(bytes > SHARED_DEFAULT)
}

/// Lets each function of a loaded module that launches with more than 48 KB of dynamic shared
/// memory have it (`CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`), before its first launch;
/// refuses sizes past the device's opt-in limit (read once, if any launch needs dynamic memory).
pub(super) fn prepare_dynamic_shared(
    ctx: &CudaContext,
    code: &Module,
    functions: &HashMap<String, CudaFunction>,
) -> Result<(), CudaError> {
    let mut optin = None;
    for l in code.kernels.iter().flat_map(|k| &k.launches) {
        let Launch::Kernel { entry, shared, .. } = l else {
            continue;
        };
        if *shared == 0 {
            continue;
        }
        let limit = match optin {
            Some(n) => n,
            None => {
                let a =
                    sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
                let n = ctx.attribute(a)?.max(0) as u32;
                *optin.insert(n)
            }
        };
        if dynamic_shared_opt_in(entry, *shared, limit)? {
            let f = functions
                .get(entry)
                .ok_or_else(|| CudaError::Exec(format!("no kernel `{entry}` in the module")))?;
            let a = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(a, *shared as i32)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_shared_sizes() {
        let h100 = 227 * 1024;
        // Up to 48 KB needs nothing; above, the attribute; past the opt-in, an error.
        assert!(!dynamic_shared_opt_in("k", 0, h100).unwrap());
        assert!(!dynamic_shared_opt_in("k", 48 * 1024, h100).unwrap());
        assert!(dynamic_shared_opt_in("k", 69_632, h100).unwrap());
        assert!(dynamic_shared_opt_in("k", h100, h100).unwrap());
        let e = dynamic_shared_opt_in("attn_fwd", 200 * 1024, 163 * 1024).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("`attn_fwd`") && text.contains("204800"),
            "{text}"
        );
    }
}
