//! The kernel's receive stamps (`SO_TIMESTAMPNS`): when the bytes a
//! slept-through wait read had arrived, so that the wait is measured to
//! their arrival and not to the reader's wake-up (BUSY-5). Linux on x86-64
//! and AArch64 only, where the option's value is the generic one; elsewhere
//! no socket is stamped and waits are measured to the wake-up.

#[cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
))]
mod imp {
    use std::io;
    use std::os::fd::{AsRawFd, BorrowedFd};
    use std::time::{Duration, SystemTime};

    use tokio::io::ReadBuf;

    /// `SO_TIMESTAMPNS` where its value is the generic one (`asm-generic`,
    /// which x86-64 and AArch64 use); the `libc` crate does not export it for
    /// Linux.
    const SO_TIMESTAMPNS: libc::c_int = 35;

    /// Asks the kernel to stamp the bytes `socket` receives with the wall
    /// clock time they arrived (`SO_TIMESTAMPNS`, on TCP since Linux 2.6.22);
    /// returns whether it will.
    pub(crate) fn enable(socket: BorrowedFd<'_>) -> bool {
        let on: libc::c_int = 1;
        // SAFETY: a valid socket and an option value of the size given.
        let r = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_TIMESTAMPNS,
                (&raw const on).cast(),
                std::mem::size_of_val(&on) as libc::socklen_t,
            )
        };
        r == 0
    }

    /// One non-blocking `recvmsg` into `buf`, with the kernel's receive stamp
    /// of the last bytes read (`SCM_TIMESTAMPNS`) when it gave one.
    pub(crate) fn recv(
        socket: BorrowedFd<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> io::Result<Option<SystemTime>> {
        // SAFETY: `recvmsg` only writes the bytes it reports, and only those
        // are marked initialized and filled.
        let unfilled = unsafe { buf.unfilled_mut() };
        let mut iov = libc::iovec {
            iov_base: unfilled.as_mut_ptr().cast(),
            iov_len: unfilled.len(),
        };
        // Room for one `cmsghdr` and a `timespec`, aligned for both.
        let mut control = [0u64; 8];
        // SAFETY: all-zero is a valid `msghdr` (null pointers, zero lengths).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        // SAFETY: `msg` points at `iov` and `control`, both alive and writable
        // for the lengths it gives.
        let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &raw mut msg, libc::MSG_DONTWAIT) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        // SAFETY: the kernel wrote `n` bytes at the start of `unfilled`.
        unsafe { buf.assume_init(n) };
        buf.advance(n);
        let mut stamp = None;
        // SAFETY: the control buffer holds what the kernel wrote, walked with
        // the kernel's own macros; a `timespec` is read only from a message of
        // its type, unaligned.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == SO_TIMESTAMPNS {
                    let at: libc::timespec = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
                    stamp = u64::try_from(at.tv_sec).ok().and_then(|secs| {
                        SystemTime::UNIX_EPOCH.checked_add(Duration::new(secs, at.tv_nsec as u32))
                    });
                }
                cmsg = libc::CMSG_NXTHDR(&raw const msg, cmsg);
            }
        }
        Ok(stamp)
    }
}

#[cfg(not(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64")
)))]
mod imp {
    use std::io;
    use std::os::fd::BorrowedFd;
    use std::time::SystemTime;

    use tokio::io::ReadBuf;

    pub(crate) fn enable(_socket: BorrowedFd<'_>) -> bool {
        false
    }

    pub(crate) fn recv(
        _socket: BorrowedFd<'_>,
        _buf: &mut ReadBuf<'_>,
    ) -> io::Result<Option<SystemTime>> {
        unreachable!("stamps are turned on only where they are read")
    }
}

pub(super) use imp::{enable, recv};
