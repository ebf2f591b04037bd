//! The few CUDA driver API functions the helper needs, looked up at run time in
//! `libcuda.so.1` (the library the NVIDIA driver installs; no CUDA toolkit needed), and a
//! [`Gpu`] over them.
//!
//! The prototypes are those of `cuda.h` (CUDA 12; the `_v2` entry points are the ones
//! the header maps the plain names to since CUDA 3.2, 6.5 and 11.0). Only this module
//! may use `unsafe`: calling into a C library through pointers looked up by name
//! cannot be checked by the compiler, and each call below says why its arguments are
//! valid.

use crate::zero::{DevPtr, Gpu};
use libloading::Library;
use passage_model::PciAddress;
use std::ffi::{CStr, CString, OsStr, c_char, c_int, c_uint, c_void};

/// `CUresult`: a C enum, `int`-sized.
type CuResult = c_int;
/// `CUdevice`: an `int` ordinal.
type CuDevice = c_int;
/// `CUcontext`: an opaque pointer.
type CuContext = *mut c_void;
/// `CUdeviceptr`: `unsigned long long` on 64-bit hosts.
type CuDevicePtr = u64;

const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;

/// Why the driver library could not be used.
#[derive(Debug)]
pub enum LoadError {
    /// The library is not installed (the dynamic loader found no file by that name).
    NotFound,
    /// It is there but cannot be loaded, or lacks a function: a broken installation.
    Broken(String),
}

/// The driver API entry points, valid for as long as `_lib` is loaded (it is never
/// unloaded before them: it is the last field and they are plain pointers).
pub struct Api {
    init: unsafe extern "C" fn(c_uint) -> CuResult,
    device_get_by_pci_bus_id: unsafe extern "C" fn(*mut CuDevice, *const c_char) -> CuResult,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult,
    device_total_mem: unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, CuDevice) -> CuResult,
    primary_ctx_release: unsafe extern "C" fn(CuDevice) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    ctx_synchronize: unsafe extern "C" fn() -> CuResult,
    mem_alloc: unsafe extern "C" fn(*mut CuDevicePtr, usize) -> CuResult,
    mem_free: unsafe extern "C" fn(CuDevicePtr) -> CuResult,
    memset_d32: unsafe extern "C" fn(CuDevicePtr, c_uint, usize) -> CuResult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize) -> CuResult,
    mem_host_register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CuResult,
    mem_host_unregister: unsafe extern "C" fn(*mut c_void) -> CuResult,
    get_error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    get_error_string: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    _lib: Library,
}

/// Looks up `name` in `lib` as a value of type `T`.
///
/// # Safety
///
/// `T` must be the type of the symbol: for a function, a pointer to a function with
/// its exact C prototype.
unsafe fn symbol<T: Copy>(lib: &Library, lib_name: &str, names: &[&str]) -> Result<T, LoadError> {
    for name in names {
        // SAFETY: the caller guarantees `T` is the symbol's type.
        if let Ok(s) = unsafe { lib.get::<T>(*name) } {
            return Ok(*s);
        }
    }
    Err(LoadError::Broken(format!(
        "{lib_name} has no {}: not the CUDA driver library, or one too old",
        names.join(" or ")
    )))
}

impl Api {
    /// Loads the driver library `name` (`libcuda.so.1`, found the way the dynamic
    /// loader finds libraries) and its entry points.
    pub fn load(name: &OsStr) -> Result<Api, LoadError> {
        let shown = name.to_string_lossy().into_owned();
        // SAFETY: loading a library runs its initialisers. This is the NVIDIA driver's
        // user-space library (or what the operator installed under that name), whose
        // initialisers are made to run in any process that loads it.
        let lib = unsafe { Library::new(name) }.map_err(|e| {
            let detail = std::error::Error::source(&e)
                .map(ToString::to_string)
                .unwrap_or_else(|| e.to_string());
            // glibc and musl say "<file>: ... No such file or directory" for the file
            // they could not find; a missing *dependency* of an installed libcuda names
            // the dependency, and is a broken installation, not an absent one.
            if detail.starts_with(&format!("{shown}:"))
                && detail.contains("No such file or directory")
            {
                LoadError::NotFound
            } else {
                LoadError::Broken(format!("cannot load {shown}: {detail}"))
            }
        })?;
        let l = &lib;
        let n = shown.as_str();
        // SAFETY: for every `symbol` call below, the field's type is the prototype of
        // the named function in cuda.h, with CUresult and CUdevice as int, CUcontext as
        // a pointer, CUdeviceptr as unsigned long long and size_t as usize.
        unsafe {
            Ok(Api {
                init: symbol(l, n, &["cuInit"])?,
                device_get_by_pci_bus_id: symbol(l, n, &["cuDeviceGetByPCIBusId"])?,
                device_get_name: symbol(l, n, &["cuDeviceGetName"])?,
                device_total_mem: symbol(l, n, &["cuDeviceTotalMem_v2"])?,
                primary_ctx_retain: symbol(l, n, &["cuDevicePrimaryCtxRetain"])?,
                primary_ctx_release: symbol(
                    l,
                    n,
                    &["cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"],
                )?,
                ctx_set_current: symbol(l, n, &["cuCtxSetCurrent"])?,
                ctx_synchronize: symbol(l, n, &["cuCtxSynchronize"])?,
                mem_alloc: symbol(l, n, &["cuMemAlloc_v2"])?,
                mem_free: symbol(l, n, &["cuMemFree_v2"])?,
                memset_d32: symbol(l, n, &["cuMemsetD32_v2"])?,
                memcpy_dtoh: symbol(l, n, &["cuMemcpyDtoH_v2"])?,
                mem_host_register: symbol(l, n, &["cuMemHostRegister_v2"])?,
                mem_host_unregister: symbol(l, n, &["cuMemHostUnregister"])?,
                get_error_name: symbol(l, n, &["cuGetErrorName"])?,
                get_error_string: symbol(l, n, &["cuGetErrorString"])?,
                _lib: lib,
            })
        }
    }

    /// `CUDA_ERROR_INVALID_DEVICE (invalid device ordinal)`.
    fn describe(&self, r: CuResult) -> String {
        let text = |f: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult| {
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: `p` is a valid place for the pointer the driver writes; the
            // driver accepts any code and returns an error for unknown ones.
            let ok = unsafe { f(r, &mut p) } == CUDA_SUCCESS && !p.is_null();
            // SAFETY: on success the driver points `p` at a static NUL-terminated string.
            ok.then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        match (text(self.get_error_name), text(self.get_error_string)) {
            (Some(n), Some(s)) => format!("{n} ({s})"),
            (Some(n), None) => n,
            _ => format!("CUDA error {r}"),
        }
    }

    fn check(&self, what: &str, r: CuResult) -> Result<(), String> {
        if r == CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{what}: {}", self.describe(r)))
        }
    }
}

/// One GPU, with its primary context current on this thread. Use it from the thread
/// that opened it.
pub struct CudaGpu {
    api: Api,
    device: CuDevice,
    name: Option<String>,
    /// Host buffers registered with [`Gpu::pin`].
    pinned: Vec<*mut c_void>,
}

impl CudaGpu {
    /// Initialises the driver and makes the primary context of the GPU at `bdf` current.
    pub fn open(api: Api, bdf: PciAddress) -> Result<CudaGpu, String> {
        // SAFETY: cuInit takes a flags word, which must be 0.
        api.check("cuInit", unsafe { (api.init)(0) })?;
        let bus_id = CString::new(bdf.to_string()).map_err(|e| e.to_string())?;
        let mut device: CuDevice = 0;
        // SAFETY: `device` is a valid place for the ordinal and `bus_id` a
        // NUL-terminated string that outlives the call.
        let r = unsafe { (api.device_get_by_pci_bus_id)(&mut device, bus_id.as_ptr()) };
        api.check(
            &format!("no CUDA device at {bdf} (cuDeviceGetByPCIBusId)"),
            r,
        )?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL included, into `buf`.
        let r = unsafe { (api.device_get_name)(buf.as_mut_ptr(), 256, device) };
        let name = (r == CUDA_SUCCESS)
            .then(|| {
                let bytes: Vec<u8> = buf
                    .iter()
                    .take_while(|c| **c != 0)
                    .map(|c| *c as u8)
                    .collect();
                String::from_utf8_lossy(&bytes).trim().to_string()
            })
            .filter(|n| !n.is_empty());
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: `ctx` is a valid place for the context handle; `device` came from the
        // driver.
        let r = unsafe { (api.primary_ctx_retain)(&mut ctx, device) };
        api.check("cuDevicePrimaryCtxRetain", r)?;
        // From here on, dropping the value releases the context.
        let gpu = CudaGpu {
            api,
            device,
            name,
            pinned: Vec::new(),
        };
        // SAFETY: `ctx` is the retained primary context, alive until it is released.
        let r = unsafe { (gpu.api.ctx_set_current)(ctx) };
        gpu.api.check("cuCtxSetCurrent", r)?;
        Ok(gpu)
    }

    /// The device's name (`NVIDIA H100 80GB HBM3`), if the driver gave one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
}

impl Drop for CudaGpu {
    fn drop(&mut self) {
        self.unpin_all();
        // SAFETY: the primary context was retained once in `open`; this is its one
        // release. Allocations were freed before (and die with the context anyway).
        let _ = unsafe { (self.api.primary_ctx_release)(self.device) };
    }
}

fn to_usize(bytes: u64) -> Result<usize, String> {
    usize::try_from(bytes).map_err(|_| format!("{bytes} bytes do not fit this host"))
}

impl Gpu for CudaGpu {
    fn total_memory(&mut self) -> Result<u64, String> {
        let mut total = 0usize;
        // SAFETY: `total` is a valid place for the size.
        let r = unsafe { (self.api.device_total_mem)(&mut total, self.device) };
        self.api.check("cuDeviceTotalMem", r)?;
        Ok(total as u64)
    }

    fn alloc(&mut self, bytes: u64) -> Result<Option<DevPtr>, String> {
        let mut ptr: CuDevicePtr = 0;
        // SAFETY: `ptr` is a valid place for the device address; the context is current.
        let r = unsafe { (self.api.mem_alloc)(&mut ptr, to_usize(bytes)?) };
        match r {
            CUDA_SUCCESS => Ok(Some(ptr)),
            CUDA_ERROR_OUT_OF_MEMORY => Ok(None),
            r => Err(format!(
                "cuMemAlloc of {bytes} bytes: {}",
                self.api.describe(r)
            )),
        }
    }

    fn free(&mut self, ptr: DevPtr) -> Result<(), String> {
        // SAFETY: `ptr` came from `alloc` and is freed once (the caller's contract).
        let r = unsafe { (self.api.mem_free)(ptr) };
        self.api.check("cuMemFree", r)
    }

    fn zero(&mut self, ptr: DevPtr, bytes: u64) -> Result<(), String> {
        // SAFETY: `ptr..ptr + bytes` is one allocation made by `alloc` (the caller's
        // contract); the count is in 32-bit words, `bytes` being a multiple of 4.
        let r = unsafe { (self.api.memset_d32)(ptr, 0, to_usize(bytes / 4)?) };
        self.api.check("cuMemsetD32", r)
    }

    fn synchronize(&mut self) -> Result<(), String> {
        // SAFETY: no arguments; the context is current.
        let r = unsafe { (self.api.ctx_synchronize)() };
        self.api.check("cuCtxSynchronize", r)
    }

    fn read(&mut self, src: DevPtr, dst: &mut [u64]) -> Result<(), String> {
        let bytes = std::mem::size_of_val(dst);
        // SAFETY: `dst` is valid for writes of `bytes` bytes, borrowed exclusively for
        // the call, and any bit pattern is a valid u64; the copy is synchronous, so
        // nothing writes to `dst` after the call returns. `src..src + bytes` lies in
        // one allocation (the caller's contract).
        let r = unsafe { (self.api.memcpy_dtoh)(dst.as_mut_ptr().cast(), src, bytes) };
        self.api.check("cuMemcpyDtoH", r)
    }

    fn pin(&mut self, buf: &[u64]) -> bool {
        let p = buf.as_ptr().cast_mut().cast::<c_void>();
        // SAFETY: registering page-locks the pages of `buf`; it neither reads nor writes
        // them, and the driver writes to them only in `read`, into a `&mut` borrow. The
        // caller keeps `buf` allocated until `unpin_all`.
        let r = unsafe { (self.api.mem_host_register)(p, std::mem::size_of_val(buf), 0) };
        if r == CUDA_SUCCESS {
            self.pinned.push(p);
        }
        r == CUDA_SUCCESS
    }

    fn unpin_all(&mut self) {
        for p in self.pinned.drain(..) {
            // SAFETY: `p` was registered by `pin` and is unregistered once.
            let _ = unsafe { (self.api.mem_host_unregister)(p) };
        }
    }
}
