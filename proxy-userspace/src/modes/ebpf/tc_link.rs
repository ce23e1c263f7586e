//! Attaching a tc program to an interface by its index: a tcx link (kernels 6.6 and later) or
//! a cls_bpf filter through netlink (older ones). aya attaches by name, and CNI plugins rename
//! interfaces: a pod's veth is often made under a temporary name, moved here and renamed. By
//! name, an attach begun at the temporary name failed halfway when the rename came, and the
//! pod's first packets went untranslated until the rename's own notification was handled. The
//! index stays the interface's through a rename.
use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::Path,
};

use aya::programs::TcAttachType;

use super::link_events::{self, NLMSG_HDRLEN, align4, u16_at, u32_at};

/// Where our cls_bpf filters sit: a fixed place, so that a restarted agent replaces them
/// instead of adding more.
const FILTER_PRIORITY: u16 = 0x4b50;
const FILTER_HANDLE: u32 = 1;

/// `struct tcmsg`.
const TCMSG_LEN: usize = 20;
/// The clsact qdisc's handle and parent (`TC_H_CLSACT`, `TC_H_INGRESS`), and the parents of
/// its two hooks (`TC_H_MIN_INGRESS`, `TC_H_MIN_EGRESS`).
const CLSACT_HANDLE: u32 = 0xffff_0000;
const CLSACT_PARENT: u32 = 0xffff_fff1;
const INGRESS_PARENT: u32 = 0xffff_fff2;
const EGRESS_PARENT: u32 = 0xffff_fff3;
/// Attributes (linux/rtnetlink.h, linux/pkt_cls.h).
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;
const TCA_BPF_FD: u16 = 6;
const TCA_BPF_NAME: u16 = 7;
const TCA_BPF_FLAGS: u16 = 8;
const TCA_BPF_FLAG_ACT_DIRECT: u32 = 1;

/// bpf() commands and tcx attach types (linux/bpf.h).
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
/// With no program named relative to it: after every other program of the hook.
const BPF_F_AFTER: u32 = 16;

/// Puts `prog` (named `name`) in our cls_bpf filter on the `attach_type` hook of interface
/// `index`: adds the clsact qdisc if the interface has none, then creates the filter or
/// replaces its program (packets in flight see the old program or the new one).
pub(super) fn set_filter(
    index: u32,
    attach_type: TcAttachType,
    prog: BorrowedFd<'_>,
    name: &str,
) -> io::Result<()> {
    let clsact = request(
        libc::RTM_NEWQDISC,
        libc::NLM_F_CREATE | libc::NLM_F_EXCL,
        tcmsg(index, CLSACT_HANDLE, CLSACT_PARENT, 0),
        &[attribute(TCA_KIND, b"clsact\0")],
    );
    match talk(&clsact) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
        result => result?,
    }
    let (parent, _) = hook(attach_type)?;
    // The priority in the upper half, the protocol (ETH_P_ALL, in network order) in the lower.
    let info = (u32::from(FILTER_PRIORITY) << 16) | u32::from((libc::ETH_P_ALL as u16).to_be());
    let mut bpf_name = name.as_bytes().to_vec();
    bpf_name.push(0);
    let options = [
        attribute(TCA_BPF_FD, &(prog.as_raw_fd() as u32).to_ne_bytes()),
        attribute(TCA_BPF_NAME, &bpf_name),
        attribute(TCA_BPF_FLAGS, &TCA_BPF_FLAG_ACT_DIRECT.to_ne_bytes()),
    ]
    .concat();
    // NLM_F_CREATE without NLM_F_EXCL: the filter is made, or its program replaced.
    let filter = request(
        libc::RTM_NEWTFILTER,
        libc::NLM_F_CREATE,
        tcmsg(index, FILTER_HANDLE, parent, info),
        &[
            attribute(TCA_KIND, b"bpf\0"),
            attribute(TCA_OPTIONS | NLA_F_NESTED, &options),
        ],
    );
    talk(&filter)
}

/// A new tcx link of `prog` on the `attach_type` hook of interface `index`, pinned at `pin`
/// (the link lives as long as its pin does).
pub(super) fn pin_tcx_link(
    index: u32,
    attach_type: TcAttachType,
    prog: BorrowedFd<'_>,
    pin: &Path,
) -> io::Result<()> {
    /// The `BPF_LINK_CREATE` part of `union bpf_attr`, up to its tcx options (the link goes
    /// after the hook's other programs, as aya puts it).
    #[repr(C)]
    struct LinkCreate {
        prog_fd: u32,
        target_ifindex: u32,
        attach_type: u32,
        flags: u32,
        relative_fd: u32,
        _pad: u32,
        expected_revision: u64,
    }
    /// The `BPF_OBJ_PIN` part of `union bpf_attr`.
    #[repr(C)]
    struct ObjPin {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    let (_, attach_type) = hook(attach_type)?;
    let mut create = LinkCreate {
        prog_fd: prog.as_raw_fd() as u32,
        target_ifindex: index,
        attach_type,
        flags: BPF_F_AFTER,
        relative_fd: 0,
        _pad: 0,
        expected_revision: 0,
    };
    // SAFETY: BPF_LINK_CREATE reads `create`, a prefix of `union bpf_attr` of the size passed.
    let link = unsafe {
        bpf(
            BPF_LINK_CREATE,
            (&raw mut create).cast(),
            size_of_val(&create),
        )
    }?;
    // SAFETY: a successful BPF_LINK_CREATE returns a new descriptor, ours alone.
    let link = unsafe { OwnedFd::from_raw_fd(link as i32) };
    let path = CString::new(pin.as_os_str().as_bytes())
        .map_err(|_| io::Error::other("a NUL in the pin's path"))?;
    let mut obj_pin = ObjPin {
        pathname: path.as_ptr() as u64,
        bpf_fd: link.as_raw_fd() as u32,
        file_flags: 0,
    };
    // SAFETY: BPF_OBJ_PIN reads `obj_pin` and the NUL-terminated path it points to, which
    // lives until after the call.
    unsafe {
        bpf(
            BPF_OBJ_PIN,
            (&raw mut obj_pin).cast(),
            size_of_val(&obj_pin),
        )
    }?;
    Ok(())
}

/// The cls_bpf parent and the tcx attach type of `attach_type`'s hook (clsact has two).
fn hook(attach_type: TcAttachType) -> io::Result<(u32, u32)> {
    match attach_type {
        TcAttachType::Ingress => Ok((INGRESS_PARENT, BPF_TCX_INGRESS)),
        TcAttachType::Egress => Ok((EGRESS_PARENT, BPF_TCX_EGRESS)),
        TcAttachType::Custom(_) => Err(io::Error::other("only clsact's two hooks are used")),
    }
}

/// The bpf() system call `command` with the attribute at `attr` of `size` bytes: what it
/// returns (a new descriptor, for some commands).
///
/// # Safety
/// `attr` must be a valid `union bpf_attr` prefix of `size` bytes for `command`.
unsafe fn bpf(command: libc::c_long, attr: *mut libc::c_void, size: usize) -> io::Result<i64> {
    // SAFETY: as the caller vouches.
    let r = unsafe { libc::syscall(libc::SYS_bpf, command, attr, size) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// `struct tcmsg` for interface `index`.
fn tcmsg(index: u32, handle: u32, parent: u32, info: u32) -> [u8; TCMSG_LEN] {
    let mut msg = [0u8; TCMSG_LEN];
    // tcm_family (AF_UNSPEC) and padding stay zero.
    msg[4..8].copy_from_slice(&index.to_ne_bytes());
    msg[8..12].copy_from_slice(&handle.to_ne_bytes());
    msg[12..16].copy_from_slice(&parent.to_ne_bytes());
    msg[16..20].copy_from_slice(&info.to_ne_bytes());
    msg
}

/// A netlink attribute: its length, its type, its value, padded to 4 bytes.
fn attribute(kind: u16, value: &[u8]) -> Vec<u8> {
    let len = 4 + value.len();
    let mut attr = Vec::with_capacity(align4(len));
    attr.extend_from_slice(&(len as u16).to_ne_bytes());
    attr.extend_from_slice(&kind.to_ne_bytes());
    attr.extend_from_slice(value);
    attr.resize(align4(len), 0);
    attr
}

/// A netlink request of `kind` with `flags` (acknowledged), the header `tcmsg`, then `attrs`.
fn request(kind: u16, flags: libc::c_int, tcmsg: [u8; TCMSG_LEN], attrs: &[Vec<u8>]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + TCMSG_LEN + attrs.iter().map(Vec::len).sum::<usize>();
    let mut msg = Vec::with_capacity(len);
    msg.extend_from_slice(&(len as u32).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK | flags) as u16).to_ne_bytes());
    msg.extend_from_slice(&[0; 8]); // sequence number and port id: one request a socket
    msg.extend_from_slice(&tcmsg);
    for attr in attrs {
        msg.extend_from_slice(attr);
    }
    msg
}

/// Sends `request` to the kernel on a socket of its own: Ok once acknowledged, else its error.
fn talk(request: &[u8]) -> io::Result<()> {
    let fd = link_events::netlink_socket(libc::NETLINK_ROUTE)?;
    link_events::send(&fd, request)?;
    let mut buf = [0u8; 8192];
    loop {
        let mut reply = link_events::receive(&fd, &mut buf)?;
        if reply.is_empty() {
            return Err(io::Error::other("the kernel closed the netlink socket"));
        }
        while reply.len() >= NLMSG_HDRLEN {
            let len = (u32_at(reply, 0) as usize).clamp(NLMSG_HDRLEN, reply.len());
            if u16_at(reply, 4) == libc::NLMSG_ERROR as u16 {
                return link_events::error_of(&reply[NLMSG_HDRLEN..len]);
            }
            reply = &reply[align4(len).min(reply.len())..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The filter request as the kernel reads it: `struct tcmsg` after the header, each
    /// attribute's length without its padding, the options nested. (The kernel-facing tests
    /// attach through it on 5.10 and 6.1.)
    #[test]
    fn a_filter_request_is_laid_out_as_the_kernel_reads_it() {
        let options = [
            attribute(TCA_BPF_FD, &7u32.to_ne_bytes()),
            attribute(TCA_BPF_NAME, b"tc_ingress\0"),
            attribute(TCA_BPF_FLAGS, &1u32.to_ne_bytes()),
        ]
        .concat();
        let info = (0x4b50 << 16) | u32::from(0x0003u16.to_be());
        let msg = request(
            libc::RTM_NEWTFILTER,
            libc::NLM_F_CREATE,
            tcmsg(5, 1, INGRESS_PARENT, info),
            &[
                attribute(TCA_KIND, b"bpf\0"),
                attribute(TCA_OPTIONS | NLA_F_NESTED, &options),
            ],
        );
        let expected: Vec<u8> = [
            &80u32.to_ne_bytes()[..],
            &44u16.to_ne_bytes(),    // RTM_NEWTFILTER
            &0x405u16.to_ne_bytes(), // NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE
            &[0; 8],                 // sequence, port
            &[0; 4],                 // family, padding
            &5u32.to_ne_bytes(),     // ifindex
            &1u32.to_ne_bytes(),     // handle
            &0xffff_fff2u32.to_ne_bytes(),
            &0x4b50_0300u32.to_ne_bytes(), // priority, ETH_P_ALL in network order
            &8u16.to_ne_bytes(),
            &1u16.to_ne_bytes(),
            b"bpf\0",
            &36u16.to_ne_bytes(),
            &0x8002u16.to_ne_bytes(), // TCA_OPTIONS, nested
            &8u16.to_ne_bytes(),
            &6u16.to_ne_bytes(),
            &7u32.to_ne_bytes(),
            &15u16.to_ne_bytes(),
            &7u16.to_ne_bytes(),
            b"tc_ingress\0\0",
            &8u16.to_ne_bytes(),
            &8u16.to_ne_bytes(),
            &1u32.to_ne_bytes(),
        ]
        .concat();
        assert_eq!(msg, expected);
    }
}
