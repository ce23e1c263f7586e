//! Making sure the pin directory is on a BPF filesystem.
use std::{ffi::CString, fs, io, os::unix::ffi::OsStrExt, path::Path};

use anyhow::Context;

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// Whether `path` (which must exist) is on a BPF filesystem.
pub fn is_bpffs(path: &Path) -> io::Result<bool> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid C string, st a valid out pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64 == BPF_FS_MAGIC)
}

/// Creates `pin_dir` on a BPF filesystem. When the nearest existing ancestor is not on one, a
/// bpffs is mounted: on /sys/fs/bpf for paths below it (it is often not mounted, e.g. under
/// `ip netns exec`), otherwise on `pin_dir` itself. A mount made here lives in this process's
/// mount namespace: for pins that outlive the agent (the maps, and the tcx links that keep the
/// programs attached), mount bpffs outside it (the DaemonSet mounts the host's /sys/fs/bpf).
pub fn ensure(pin_dir: &Path) -> anyhow::Result<()> {
    let existing = pin_dir
        .ancestors()
        .find(|p| p.exists())
        .context("no existing ancestor of the pin directory")?;
    if !is_bpffs(existing).with_context(|| format!("statfs {}", existing.display()))? {
        let mount_point = if pin_dir.starts_with("/sys/fs/bpf") {
            Path::new("/sys/fs/bpf")
        } else {
            pin_dir
        };
        fs::create_dir_all(mount_point)
            .with_context(|| format!("creating {}", mount_point.display()))?;
        if !is_bpffs(mount_point)? {
            mount_bpffs(mount_point)?;
            tracing::info!(path = %mount_point.display(), "mounted a BPF filesystem");
        }
    }
    fs::create_dir_all(pin_dir).with_context(|| format!("creating {}", pin_dir.display()))
}

fn mount_bpffs(at: &Path) -> anyhow::Result<()> {
    let target = CString::new(at.as_os_str().as_bytes())?;
    let bpf = c"bpf";
    // SAFETY: valid C strings; no data argument.
    let rc = unsafe {
        libc::mount(
            bpf.as_ptr(),
            target.as_ptr(),
            bpf.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error()).with_context(|| {
            format!(
                "mounting a BPF filesystem on {} (needs CAP_SYS_ADMIN)",
                at.display()
            )
        });
    }
    Ok(())
}

/// Unmounts a bpffs mounted by a test or the sandbox.
pub fn unmount(at: &Path) -> io::Result<()> {
    let target = CString::new(at.as_os_str().as_bytes())?;
    // SAFETY: valid C string. MNT_DETACH: succeed even if a pin is still open.
    if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Mounts a fresh, private bpffs on `at` (created if needed): tests and the sandbox use one
/// each, so their pinned maps never meet.
pub fn mount_private(at: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(at).with_context(|| format!("creating {}", at.display()))?;
    mount_bpffs(at)
}

/// An exclusive lock on a pin directory, held for as long as this lives: two agents writing the
/// same maps would undo each other's work.
pub struct PinDirLock {
    _dir: fs::File,
}

impl PinDirLock {
    /// Locks `pin_dir` (which must exist, on bpffs: call [`ensure`] first), or says which
    /// process is in the way.
    pub fn acquire(pin_dir: &Path) -> anyhow::Result<Self> {
        use std::os::fd::AsRawFd;
        let dir =
            fs::File::open(pin_dir).with_context(|| format!("opening {}", pin_dir.display()))?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                anyhow::bail!(
                    "another agent is using {} (it holds the lock on that directory): stop it \
                     first, or give this one another --bpf-pin-dir",
                    pin_dir.display()
                );
            }
            return Err(e).with_context(|| format!("locking {}", pin_dir.display()));
        }
        Ok(Self { _dir: dir })
    }
}
