//! The socket programs for host-network clients (proxy-ebpf's sock.rs), attached to a cgroup v2
//! directory (`--bpf-cgroup-path`, Cilium's cgroup-root): they see every socket of the
//! processes in it and below it. They translate the sockets of the agent's own network
//! namespace, whose cookie the agent writes into HOST_NETNS, and with `--bpf-socket-lb all`
//! pods' TCP connections too; the rest of pods' traffic is left to the tc programs.
//!
//! The same life cycle as the tc programs: the bpf links are pinned in
//! `<pin dir>/cgroup-links/`, so they outlive the agent. A restarted agent attaches its programs
//! and moves the new link's pin over the old one, whose link the kernel then detaches; for that
//! moment both programs run, which is harmless (the second sees a backend address, not a
//! service). `agent --cleanup` removes the pins, which detaches the programs.
use std::{
    ffi::CString,
    fs, io,
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

use anyhow::{Context, bail};
use aya::{
    Ebpf,
    maps::Array,
    programs::{CgroupAttachMode, CgroupSockAddr, links::FdLink},
};
use proxy_common::{HOST_NETNS_COOKIE, HOST_NETNS_PODS_TOO, MAP_HOST_NETNS};

pub const PROG_CONNECT4: &str = "sock_connect4";
pub const PROG_SENDMSG4: &str = "sock_sendmsg4";
pub const PROG_RECVMSG4: &str = "sock_recvmsg4";
pub const PROG_GETPEERNAME4: &str = "sock_getpeername4";
/// IPv6 sockets' calls: IPv6 service addresses, and IPv4-mapped ones of IPv4 services (their
/// datagrams sent without connect() go through the kernel's IPv4 path, and so through sendmsg4).
pub const PROG_CONNECT6: &str = "sock_connect6";
pub const PROG_SENDMSG6: &str = "sock_sendmsg6";
pub const PROG_RECVMSG6: &str = "sock_recvmsg6";
pub const PROG_GETPEERNAME6: &str = "sock_getpeername6";
pub const SOCK_PROGRAMS: [&str; 8] = [
    PROG_CONNECT4,
    PROG_SENDMSG4,
    PROG_RECVMSG4,
    PROG_GETPEERNAME4,
    PROG_CONNECT6,
    PROG_SENDMSG6,
    PROG_RECVMSG6,
    PROG_GETPEERNAME6,
];

/// Whose connections the socket programs translate at connect() (`--bpf-socket-lb`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SocketLb {
    /// Host-network clients only (the node's own network namespace: host-network pods, the
    /// kubelet, node daemons); pods' packets are translated by the tc programs, as kube-proxy's
    /// rules translate them, where a service mesh's sidecar still sees the Service address.
    HostNetwork,
    /// Pods' TCP connections too (Cilium's socket LB): sent to an endpoint at connect(), so
    /// that their packets need no NAT; their UDP, and Services with session affinity or
    /// loadBalancerSourceRanges, stay with the tc programs. A pod's sidecar proxy sees the
    /// endpoint's address, not the Service's.
    All,
}

/// Where the links are pinned, under the pin directory.
pub const LINKS_DIR: &str = "cgroup-links";

const CGROUP2_SUPER_MAGIC: i64 = 0x63677270;

/// Loads the socket programs into the kernel (the verifier checks them here), those not loaded
/// yet. Only [`attach`] needs them: with `--bpf-cgroup-path ''` or where the kernel cannot run
/// them, they are never loaded.
pub fn load_programs(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    for name in SOCK_PROGRAMS {
        let prog: &mut CgroupSockAddr = ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the BPF object"))?
            .try_into()?;
        if prog.fd().is_ok() {
            continue;
        }
        super::load_retrying(name, || prog.load())?;
    }
    Ok(())
}

/// Makes the programs of `ebpf` (loaded) translate the sockets of the network namespace whose
/// cookie is `netns_cookie` (and pods' TCP connections with [`SocketLb::All`]), and attaches
/// them to the cgroup `cgroup` (cgroup2 is mounted there if needed, see [`ensure`]), in place
/// of those a previous agent left.
pub fn attach(
    ebpf: &mut Ebpf,
    cgroup: &Path,
    pin_dir: &Path,
    netns_cookie: u64,
    scope: SocketLb,
) -> anyhow::Result<()> {
    ensure(cgroup)?;
    load_programs(ebpf)?;
    // Before the programs are attached: with no cookie they translate nothing.
    let mut host: Array<_, u64> = ebpf
        .map_mut(MAP_HOST_NETNS)
        .context("map HOST_NETNS missing")?
        .try_into()?;
    host.set(HOST_NETNS_PODS_TOO, u64::from(scope == SocketLb::All), 0)?;
    host.set(HOST_NETNS_COOKIE, netns_cookie, 0)?;
    let dir = fs::File::open(cgroup).with_context(|| format!("opening {}", cgroup.display()))?;
    let links = pin_dir.join(LINKS_DIR);
    fs::create_dir_all(&links).with_context(|| format!("creating {}", links.display()))?;
    for name in SOCK_PROGRAMS {
        let prog: &mut CgroupSockAddr = ebpf
            .program_mut(name)
            .context("program missing")?
            .try_into()?;
        // A bpf link (no flags: links always let other programs of the cgroup run too).
        let id = prog
            .attach(&dir, CgroupAttachMode::Single)
            .with_context(|| format!("attaching {name} to the cgroup {}", cgroup.display()))?;
        let link: FdLink = prog.take_link(id)?.try_into()?;
        // Pinned beside the old link, then renamed over it: there is always a pin, so a
        // crash halfway leaves some program attached. (bpffs refuses dots in names.)
        let (pin, new) = (links.join(name), links.join(format!("{name}_new")));
        let _ = fs::remove_file(&new);
        link.pin(&new)
            .with_context(|| format!("pinning the link at {}", new.display()))?;
        fs::rename(&new, &pin).with_context(|| format!("renaming {}", new.display()))?;
    }
    let clients = match scope {
        SocketLb::HostNetwork => "host-network clients",
        SocketLb::All => "host-network clients and pods' TCP connections",
    };
    tracing::info!(cgroup = %cgroup.display(), "attached socket programs ({clients})");
    Ok(())
}

/// Detaches the socket programs (removes their link pins): `agent --cleanup`. The number of
/// links removed.
pub fn detach_all(pin_dir: &Path) -> anyhow::Result<usize> {
    let links = pin_dir.join(LINKS_DIR);
    if !links.exists() {
        return Ok(0);
    }
    let detached = super::attach::unpin_links(&links)?;
    fs::remove_dir(&links).with_context(|| format!("removing {}", links.display()))?;
    Ok(detached)
}

/// The cookie of the calling thread's network namespace (SO_NETNS_COOKIE, Linux 5.14+).
pub fn own_netns_cookie() -> io::Result<u64> {
    // SAFETY: socket(2) with constant arguments; the fd is owned from here on.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cookie`.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!("getsockopt SO_NETNS_COOKIE (Linux 5.14 or later): {e}"),
        ));
    }
    Ok(cookie)
}

/// Whether `path` (which must exist) is on a cgroup2 filesystem.
pub fn is_cgroup2(path: &Path) -> io::Result<bool> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid C string, st a valid out pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64 == CGROUP2_SUPER_MAGIC)
}

/// Makes sure `path` is a cgroup2 directory: created if missing, and cgroup2 mounted on it when
/// it is an empty directory of another filesystem (`ip netns exec`, for one, gives a process a
/// fresh /sys with nothing on /sys/fs/cgroup). Nothing is ever mounted over a non-empty
/// directory: on a cgroup v1 or hybrid host, /sys/fs/cgroup holds the v1 hierarchies.
pub fn ensure(path: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))?;
    if is_cgroup2(path).with_context(|| format!("statfs {}", path.display()))? {
        return Ok(());
    }
    if fs::read_dir(path)?.next().is_some() {
        bail!(
            "--bpf-cgroup-path {} is not a cgroup2 directory, and not empty, so cgroup2 is not \
             mounted over it (a cgroup v1 or hybrid host?): pass a cgroup2 directory (on a \
             hybrid host often /sys/fs/cgroup/unified), or an empty directory to mount it on",
            path.display()
        );
    }
    mount_cgroup2(path)?;
    tracing::info!(path = %path.display(), "mounted cgroup2");
    Ok(())
}

/// Mounts cgroup2 on `at` with the options of the cgroup2 mount already there, if any: the
/// hierarchy is one for the whole system, and a mount with other options (nsdelegate,
/// memory_recursiveprot, ...) would change them for everyone.
fn mount_cgroup2(at: &Path) -> anyhow::Result<()> {
    let target = CString::new(at.as_os_str().as_bytes())?;
    let options = CString::new(existing_cgroup2_options().unwrap_or_default())?;
    let fstype = c"cgroup2";
    // SAFETY: valid C strings.
    let rc = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            options.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error()).with_context(|| {
            format!("mounting cgroup2 on {} (needs CAP_SYS_ADMIN)", at.display())
        });
    }
    Ok(())
}

/// The filesystem options of a cgroup2 mount this process sees (from /proc/self/mountinfo),
/// without the generic rw/ro.
fn existing_cgroup2_options() -> Option<String> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        // "<id> <parent> <dev> <root> <mount point> <options> [tags] - <type> <source> <super options>"
        let (_, fs_part) = line.split_once(" - ")?;
        let mut fields = fs_part.split(' ');
        if fields.next()? != "cgroup2" {
            return None;
        }
        let options = fields.nth(1)?;
        Some(
            options
                .split(',')
                .filter(|o| *o != "rw" && *o != "ro")
                .collect::<Vec<_>>()
                .join(","),
        )
    })
}
