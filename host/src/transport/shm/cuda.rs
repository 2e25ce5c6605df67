//! CUDA segments: the link's device memory, through the CUDA driver's
//! inter-process memory handles (SHM-6, SHM-7).
//!
//! A CUDA storage between two workers on one host crosses as a host one
//! does (TR-9), with device memory in place of a memfd: the sender copies
//! it into a segment it allocated for the link, the receiver copies it out
//! into its own tensor, and the segment goes back to the sender for reuse.
//! A segment's IPC handle travels once, on the link, when the segment is
//! made; the receiver opens it the first time a frame names it, in the
//! context of the device the storage lands on, and keeps it open until the
//! sender gives the segment up. Two workers of one process (the in-process
//! harness; the kernel says so for the link's socket) cannot open each
//! other's handles, which the driver refuses within a process; they copy
//! from the segment's own address instead, which is valid in both.
//!
//! This module owns the driver calls and nothing else: which storages use
//! a segment is `frame`'s business, and the bookkeeping of segments (lent,
//! given back, given up) is the link's. The driver (`libcuda`) is loaded
//! only when a CUDA storage first crosses, so a worker that never sends
//! one never loads it; a machine without it gets an error, and the link's
//! user then sends the storage through host memory instead.
//!
//! Streams: libtorch runs a worker's CUDA ops on the current stream of
//! their device, which may be any stream, so both sides wait for all of the
//! device's queued work around their copy (`cuCtxSynchronize`): the sender
//! before it reads the tensor (its producer may still be running) and the
//! receiver before it writes into memory the caching allocator just handed
//! out (a kernel on another stream may still be reading the block's
//! previous tensor). The copies themselves run on the context's legacy
//! default stream and are waited for before the frame is queued (sender)
//! or the segment is given back (receiver).

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys as cu;

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`).
pub(crate) const HANDLE_LEN: usize = 64;

/// An IPC memory handle as it travels on the link.
pub(crate) type Handle = [u8; HANDLE_LEN];

fn check(result: cu::CUresult, what: &str) -> Result<(), String> {
    if result == cu::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `cuGetErrorString` stores a pointer to a static string (or
    // fails and leaves `text` null).
    let known = unsafe { cu::cuGetErrorString(result, &mut text) } == cu::CUresult::CUDA_SUCCESS;
    let name = if known && !text.is_null() {
        // SAFETY: a NUL-terminated static string from the driver.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{result:?}")
    };
    Err(format!("{what} failed: {name}"))
}

/// Loads and initialises the driver, once per process.
///
/// # Errors
/// Fails on a machine without `libcuda` or where `cuInit` fails.
fn driver() -> Result<(), String> {
    static READY: OnceLock<Result<(), String>> = OnceLock::new();
    READY
        .get_or_init(|| {
            // SAFETY: only tries to open the library.
            if !unsafe { cu::is_culib_present() } {
                return Err("no CUDA driver (libcuda) on this machine".into());
            }
            // SAFETY: `cuInit` may be called any number of times, from any
            // thread; libtorch calls it too.
            check(unsafe { cu::cuInit(0) }, "cuInit")
        })
        .clone()
}

/// The primary context of each device this process entered, as an address:
/// the one libtorch's runtime calls use, retained once and kept for the
/// process's life (as libtorch keeps it).
fn primary_context(device: u32) -> Result<cu::CUcontext, String> {
    static CONTEXTS: OnceLock<Mutex<HashMap<u32, usize>>> = OnceLock::new();
    driver()?;
    let mut contexts = CONTEXTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(&ctx) = contexts.get(&device) {
        return Ok(ctx as cu::CUcontext);
    }
    let ordinal =
        i32::try_from(device).map_err(|_| format!("CUDA device index {device} out of range"))?;
    let mut dev: cu::CUdevice = 0;
    // SAFETY: out-pointers to locals; the driver is initialised.
    check(
        unsafe { cu::cuDeviceGet(&mut dev, ordinal) },
        &format!("cuDeviceGet(cuda:{device})"),
    )?;
    let mut ctx: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: as above; the retained context is never released.
    check(
        unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
        &format!("cuDevicePrimaryCtxRetain(cuda:{device})"),
    )?;
    contexts.insert(device, ctx as usize);
    Ok(ctx)
}

/// `device`'s primary context made current on this thread until dropped,
/// when the thread's previous context is current again (so libtorch's idea
/// of this thread's current device is left as it was).
struct Entered {
    previous: cu::CUcontext,
}

fn enter(device: u32) -> Result<Entered, String> {
    let ctx = primary_context(device)?;
    let mut previous: cu::CUcontext = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local; then a context retained above.
    check(
        unsafe { cu::cuCtxGetCurrent(&mut previous) },
        "cuCtxGetCurrent",
    )?;
    check(unsafe { cu::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
    Ok(Entered { previous })
}

impl Drop for Entered {
    fn drop(&mut self) {
        // SAFETY: the context that was current before (or null: none).
        let _ = unsafe { cu::cuCtxSetCurrent(self.previous) };
    }
}

/// Waits for all work queued on the current context's device.
fn synchronize(what: &str) -> Result<(), String> {
    // SAFETY: a context is current (`enter`).
    check(unsafe { cu::cuCtxSynchronize() }, what)
}

/// Device memory this side allocated for a link and exported (SHM-6): the
/// only device memory a peer is ever given a handle to.
pub(crate) struct DeviceSegment {
    device: u32,
    ptr: cu::CUdeviceptr,
    len: usize,
    handle: Handle,
}

impl DeviceSegment {
    /// Allocates `len` bytes on `device` and exports them.
    ///
    /// # Errors
    /// Fails without a driver, for a device this process cannot use, or
    /// when the device is out of memory.
    pub(crate) fn new(device: u32, len: usize) -> Result<Self, String> {
        let _entered = enter(device)?;
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: an out-pointer to a local, in the device's context.
        check(
            unsafe { cu::cuMemAlloc_v2(&mut ptr, len) },
            &format!("allocating a CUDA segment of {len} bytes on cuda:{device}"),
        )?;
        let mut raw = cu::CUipcMemHandle {
            reserved: [0; HANDLE_LEN],
        };
        // SAFETY: `ptr` is the start of the allocation just made.
        let exported = check(
            unsafe { cu::cuIpcGetMemHandle(&mut raw, ptr) },
            "cuIpcGetMemHandle",
        );
        if let Err(e) = exported {
            // SAFETY: the allocation just made, not shared with anyone.
            let _ = unsafe { cu::cuMemFree_v2(ptr) };
            return Err(e);
        }
        Ok(DeviceSegment {
            device,
            ptr,
            len,
            handle: raw.reserved.map(|b| b as u8),
        })
    }

    /// The device the segment is on.
    pub(crate) fn device(&self) -> u32 {
        self.device
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Its IPC handle, for the peer.
    pub(crate) fn handle(&self) -> Handle {
        self.handle
    }

    /// Its device address (meaningful to this process only).
    pub(crate) fn address(&self) -> u64 {
        self.ptr
    }

    /// Copies `len` bytes of device memory at `src` (on the segment's
    /// device) into the segment, after the device's queued work, and waits
    /// for the copy.
    ///
    /// # Errors
    /// Fails for more bytes than the segment holds, or when the driver
    /// does.
    ///
    /// # Safety
    /// `src .. src + len` must be device memory of this process, alive for
    /// the call.
    pub(crate) unsafe fn fill(&self, src: u64, len: usize) -> Result<(), String> {
        if len > self.len {
            return Err(format!(
                "a storage of {len} bytes in a CUDA segment of {} bytes",
                self.len
            ));
        }
        let _entered = enter(self.device)?;
        synchronize("waiting for the device's work before a CUDA segment's fill")?;
        // SAFETY: the segment holds `len` bytes (checked); the caller
        // vouches for the source.
        check(
            unsafe { cu::cuMemcpyDtoD_v2(self.ptr, src, len) },
            "copying a storage into a CUDA segment",
        )?;
        synchronize("waiting for a CUDA segment's fill")
    }
}

impl Drop for DeviceSegment {
    fn drop(&mut self) {
        if let Ok(_entered) = enter(self.device) {
            // SAFETY: the allocation made in `new`, freed once. The peer has
            // given it back (or is gone), so nothing copies out of it.
            let _ = unsafe { cu::cuMemFree_v2(self.ptr) };
        }
    }
}

// SAFETY: a device address and plain data; the driver's calls on it are
// thread-safe, and each call makes the right context current first.
unsafe impl Send for DeviceSegment {}
// SAFETY: as for `Send`; `fill` is only called by the side that holds the
// segment lent (SHM-3).
unsafe impl Sync for DeviceSegment {}

/// A peer's CUDA segment, as its record announced it: opened on first use,
/// once per device it is copied to, and closed when dropped.
pub(crate) struct PeerDeviceSegment {
    handle: Handle,
    len: u64,
    /// The segment's address when the peer is this very process.
    local: Option<u64>,
    /// Device index -> where the segment is mapped in that device's context
    /// (or its `local` address, which is not closed).
    opened: Mutex<HashMap<u32, cu::CUdeviceptr>>,
}

impl PeerDeviceSegment {
    /// A segment of `len` bytes the peer exported under `handle`, or, for
    /// a peer that is this process, at `local`; nothing is opened yet (a
    /// worker that never receives a CUDA storage never loads the driver).
    pub(crate) fn new(handle: Handle, len: u64, local: Option<u64>) -> Self {
        PeerDeviceSegment {
            handle,
            len,
            local,
            opened: Mutex::default(),
        }
    }

    /// Copies the segment's first `len` bytes to device memory at `dst` on
    /// `device` (SHM-1: the receiver's own memory), and waits for the copy.
    ///
    /// # Errors
    /// Fails for more bytes than the segment was announced with, when the
    /// handle does not open (another host's, a forged one) or opens onto
    /// less memory than announced, and when the driver fails.
    ///
    /// # Safety
    /// `dst .. dst + len` must be device memory of this process on
    /// `device`, alive and not read by anyone during the call.
    pub(crate) unsafe fn copy_to(&self, device: u32, dst: u64, len: usize) -> Result<(), String> {
        if len as u64 > self.len {
            return Err(format!(
                "a storage of {len} bytes in a CUDA segment of {} bytes",
                self.len
            ));
        }
        let _entered = enter(device)?;
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        let src = match opened.get(&device) {
            Some(&ptr) => ptr,
            None => {
                let ptr = self.open()?;
                opened.insert(device, ptr);
                ptr
            }
        };
        synchronize("waiting for the device's work before copying out of a CUDA segment")?;
        // SAFETY: `src` maps at least `self.len >= len` bytes (checked when
        // opened); the caller vouches for the destination.
        check(
            unsafe { cu::cuMemcpyDtoD_v2(dst, src, len) },
            "copying a storage out of a CUDA segment",
        )?;
        synchronize("waiting for a copy out of a CUDA segment")
    }

    /// Opens the handle in the current context (or takes the local
    /// address), checking that it maps at least the announced length
    /// (SHM-7).
    fn open(&self) -> Result<cu::CUdeviceptr, String> {
        if let Some(address) = self.local {
            self.check_whole(address, "a CUDA segment of this process")?;
            return Ok(address);
        }
        let raw = cu::CUipcMemHandle {
            reserved: self.handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: cu::CUdeviceptr = 0;
        let flags = cu::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: an out-pointer to a local; the handle is only bytes to
        // the driver, which refuses ones it did not issue.
        check(
            unsafe { cu::cuIpcOpenMemHandle_v2(&mut ptr, raw, flags) },
            "opening a peer's CUDA segment (cuIpcOpenMemHandle)",
        )?;
        if let Err(e) = self.check_whole(ptr, "a peer's CUDA segment") {
            // SAFETY: the mapping just opened, closed once.
            let _ = unsafe { cu::cuIpcCloseMemHandle(ptr) };
            return Err(e);
        }
        Ok(ptr)
    }

    /// Checks that `ptr` starts an allocation (or mapping) of at least the
    /// announced length (SHM-7).
    fn check_whole(&self, ptr: cu::CUdeviceptr, what: &str) -> Result<(), String> {
        let (mut base, mut size): (cu::CUdeviceptr, usize) = (0, 0);
        // SAFETY: out-pointers to locals; the driver only looks the address
        // up.
        check(
            unsafe { cu::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) },
            &format!("looking up {what}"),
        )?;
        if base != ptr || (size as u64) < self.len {
            return Err(format!(
                "{what} announced as {} bytes at {ptr:#x} maps {size} bytes from {base:#x}",
                self.len
            ));
        }
        Ok(())
    }
}

impl Drop for PeerDeviceSegment {
    fn drop(&mut self) {
        if self.local.is_some() {
            return;
        }
        let opened = self.opened.get_mut().unwrap_or_else(|p| p.into_inner());
        for (&device, &ptr) in opened.iter() {
            if let Ok(_entered) = enter(device) {
                // SAFETY: a mapping opened in `open` in this device's
                // context, closed once.
                let _ = unsafe { cu::cuIpcCloseMemHandle(ptr) };
            }
        }
    }
}

// SAFETY: device addresses and plain data behind a mutex; each driver call
// makes the right context current first.
unsafe impl Send for PeerDeviceSegment {}
// SAFETY: as for `Send`.
unsafe impl Sync for PeerDeviceSegment {}
