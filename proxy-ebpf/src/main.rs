//! tc programs for pod-facing interfaces: ClusterIP DNAT with conntrack (ingress, packets leaving a
//! pod) and reverse NAT of the replies (egress, packets going to a pod); XDP and tc programs for
//! the node's external interfaces: NodePort, LoadBalancer and external IP traffic from outside
//! (external.rs, xdp.rs); cgroup socket programs for host-network clients (sock.rs: translated
//! at connect(), their packets untouched).
#![no_std]
#![no_main]

mod conntrack;
mod egress;
mod external;
mod family;
mod frontend;
mod icmp;
mod ingress;
mod ipv6;
mod lb;
mod maps;
mod packet;
mod reject;
mod sock;
mod source;
mod xdp;

use aya_ebpf::{
    EbpfContext,
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC, xdp_action},
    helpers::bpf_ktime_get_ns,
    macros::{cgroup_sock_addr, classifier, xdp},
    programs::{SockAddrContext, TcContext, XdpContext},
};
use aya_log_ebpf::error;
use proxy_common::{
    Be32, Be128, DROP_FRAG_NEEDED, DROPS_LAST_LOG, FAMILY_PROG_EGRESS6, FAMILY_PROG_EXT_EGRESS6,
    FAMILY_PROG_EXT_INGRESS6, FAMILY_PROG_INGRESS6, XDP_PROG_IPV6, XDP_PROG_NEW_FLOW6,
};

use crate::{
    ingress::Action,
    maps::{DROPS, FAMILY_PROGS, XDP_FAMILY_PROGS},
    packet::ETH_P_IPV6,
    sock::AddrField,
};

/// A packet from a pod, seen on the host side of its interface. IPv6 goes on in a program of
/// its own ([`tc_ingress6`], a tail call): its larger keys would not fit one 512-byte stack
/// beside IPv4's, and IPv4 pays nothing for it.
#[classifier]
#[inline(always)]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    if packet::eth_proto(&ctx) == Some(ETH_P_IPV6) {
        return tail_call(&ctx, FAMILY_PROG_INGRESS6);
    }
    verdict(&ctx, answer4(&ctx, ingress::try_ingress::<Be32>(&ctx)))
}

/// The IPv4 programs' verdict: `action`'s, or its answer's. (IPv4's path answers a packet too
/// big and translates an ICMP error from outside at once, family.rs: the last two arms are
/// IPv6's way, taken here only for completeness.)
#[inline(always)]
fn answer4(
    ctx: &TcContext,
    action: Result<Action<Be32>, packet::Drop>,
) -> Result<i32, packet::Drop> {
    match action? {
        Action::Verdict(v) => Ok(v),
        Action::Reject(flow) => reject::reject(ctx, &flow),
        Action::TooBig(flow, mtu) => reject::frag_needed(ctx, &flow, mtu),
        Action::IcmpFromOutside => icmp::from_outside::<Be32>(ctx),
    }
}

/// [`tc_ingress`] of an IPv6 packet.
#[classifier]
pub fn tc_ingress6(ctx: TcContext) -> i32 {
    verdict(&ctx, answer6(&ctx, ingress6(&ctx)))
}

/// The flow's part of [`tc_ingress6`]. A function of its own, so that the answer's buffers get
/// a frame beside the lookups' rather than below them.
#[inline(never)]
fn ingress6(ctx: &TcContext) -> Result<Answer, packet::Drop> {
    ingress::try_ingress::<Be128>(ctx).map(Answer::from)
}

/// A packet about to be delivered to a pod (IPv6 in [`tc_egress6`], as in [`tc_ingress`]).
#[classifier]
#[inline(always)]
pub fn tc_egress(ctx: TcContext) -> i32 {
    if packet::eth_proto(&ctx) == Some(ETH_P_IPV6) {
        return tail_call(&ctx, FAMILY_PROG_EGRESS6);
    }
    // IPv4 (any other frame passes there untouched).
    verdict(&ctx, egress::try_egress::<Be32>(&ctx))
}

/// [`tc_egress`] of an IPv6 packet.
#[classifier]
pub fn tc_egress6(ctx: TcContext) -> i32 {
    verdict(&ctx, egress::try_egress::<Be128>(&ctx))
}

/// Goes on in the program at `index` of FAMILY_PROGS. Should that fail (the agent fills the
/// array before it attaches anything, so it does not), the packet passes untouched. Only a
/// program's own body may tail-call (the kernel refuses a tail call in a BPF-to-BPF function
/// of an object without BTF function info): the programs that call this are `#[inline(always)]`
/// into the macro's entry point.
#[inline(always)]
fn tail_call(ctx: &TcContext, index: u32) -> i32 {
    // SAFETY: on success the call does not return; the context is the program's own.
    unsafe { FAMILY_PROGS.tail_call(ctx, index) };
    TC_ACT_UNSPEC
}

/// A packet from outside arriving on an external interface (XDP): NodePort, LoadBalancer and
/// external IP traffic translated before the stack sees it. IPv6 goes on in
/// [`xdp_external6`] (a tail call, as in [`tc_ingress`]).
#[xdp]
#[inline(always)]
pub fn xdp_external(ctx: XdpContext) -> u32 {
    if xdp::is_ipv6(&ctx) {
        return xdp_tail_call(&ctx, XDP_PROG_IPV6);
    }
    xdp_verdict(&ctx, xdp::try_xdp(&ctx))
}

/// [`xdp_external`] of an IPv6 packet; one that starts a flow goes on to [`xdp_new_flow6`].
#[xdp]
#[inline(always)]
pub fn xdp_external6(ctx: XdpContext) -> u32 {
    match xdp::try_xdp6(&ctx) {
        Ok(xdp::Xdp6::NewFlow) => xdp_tail_call(&ctx, XDP_PROG_NEW_FLOW6),
        Ok(xdp::Xdp6::Action(action)) => action,
        Err(e) => xdp_verdict(&ctx, Err(e)),
    }
}

/// Starts the flow of an IPv6 packet [`xdp_external6`] found none for, and hands the packet
/// back to it, which now does.
#[xdp]
#[inline(always)]
pub fn xdp_new_flow6(ctx: XdpContext) -> u32 {
    match xdp::start_flow6(&ctx) {
        Ok(true) => xdp_tail_call(&ctx, XDP_PROG_IPV6),
        Ok(false) => xdp_action::XDP_PASS,
        Err(e) => xdp_verdict(&ctx, Err(e)),
    }
}

/// Goes on in the XDP program at `index` of XDP_FAMILY_PROGS; should that fail (the agent
/// fills the array at load, and a packet goes round at most twice), the packet goes to tc.
#[inline(always)]
fn xdp_tail_call(ctx: &XdpContext, index: u32) -> u32 {
    // SAFETY: on success the call does not return; the context is the program's own.
    unsafe { XDP_FAMILY_PROGS.tail_call(ctx, index) };
    xdp_action::XDP_PASS
}

/// [`verdict`] of the XDP programs.
#[inline(always)]
fn xdp_verdict(ctx: &XdpContext, r: Result<u32, packet::Drop>) -> u32 {
    match r {
        Ok(action) => action,
        Err(packet::Drop(reason)) => {
            count_drop(ctx, reason);
            xdp_action::XDP_DROP
        }
    }
}

/// The same as [`xdp_external`] on tc: what XDP left to the stack (IPv6 among it), or
/// everything with `--xdp-mode tc`. IPv6 goes on in [`tc_external_ingress6`], as in
/// [`tc_ingress`].
#[classifier]
#[inline(always)]
pub fn tc_external_ingress(ctx: TcContext) -> i32 {
    if packet::eth_proto(&ctx) == Some(ETH_P_IPV6) {
        return tail_call(&ctx, FAMILY_PROG_EXT_INGRESS6);
    }
    verdict(
        &ctx,
        answer4(&ctx, external::try_external_ingress::<Be32>(&ctx)),
    )
}

/// [`tc_external_ingress`] of an IPv6 packet.
#[classifier]
pub fn tc_external_ingress6(ctx: TcContext) -> i32 {
    verdict(&ctx, answer6(&ctx, external6(&ctx)))
}

/// The IPv6 programs' verdict: `answer`'s, or the ICMPv6 error it asks for.
#[inline(always)]
fn answer6(ctx: &TcContext, answer: Result<Answer, packet::Drop>) -> Result<i32, packet::Drop> {
    match answer? {
        Answer::Verdict(v) => Ok(v),
        Answer::Reject => ipv6::reject(ctx),
        Answer::TooBig(mtu) => {
            count_drop(ctx, DROP_FRAG_NEEDED);
            ipv6::too_big(ctx, mtu)
        }
        Answer::IcmpFromOutside => icmp_from_outside6(ctx),
    }
}

/// An ICMPv6 error from outside (see [`Answer`]), in a frame of its own.
#[inline(never)]
fn icmp_from_outside6(ctx: &TcContext) -> Result<i32, packet::Drop> {
    icmp::from_outside::<Be128>(ctx)
}

/// What [`tc_ingress6`] and [`tc_external_ingress6`] do with a packet: the flow's part done,
/// the answer's (in a frame of its own) still to come.
enum Answer {
    Verdict(i32),
    Reject,
    TooBig(u16),
    IcmpFromOutside,
}

impl<A> From<Action<A>> for Answer {
    #[inline(always)]
    fn from(action: Action<A>) -> Self {
        match action {
            Action::Verdict(v) => Answer::Verdict(v),
            Action::Reject(_) => Answer::Reject,
            Action::TooBig(_, mtu) => Answer::TooBig(mtu),
            Action::IcmpFromOutside => Answer::IcmpFromOutside,
        }
    }
}

/// The flow's part of [`tc_external_ingress6`], as [`ingress6`].
#[inline(never)]
fn external6(ctx: &TcContext) -> Result<Answer, packet::Drop> {
    external::try_external_ingress::<Be128>(ctx).map(Answer::from)
}

/// A packet leaving on an external interface: replies of local endpoints to external clients
/// (IPv6 in [`tc_external_egress6`]).
#[classifier]
#[inline(always)]
pub fn tc_external_egress(ctx: TcContext) -> i32 {
    if packet::eth_proto(&ctx) == Some(ETH_P_IPV6) {
        return tail_call(&ctx, FAMILY_PROG_EXT_EGRESS6);
    }
    verdict(&ctx, external::try_external_egress::<Be32>(&ctx))
}

/// [`tc_external_egress`] of an IPv6 packet.
#[classifier]
pub fn tc_external_egress6(ctx: TcContext) -> i32 {
    verdict(&ctx, external::try_external_egress::<Be128>(&ctx))
}

/// connect() of a socket in the programs' cgroup: a service address of a host-network client
/// becomes a backend's (sock.rs).
#[cgroup_sock_addr(connect4)]
pub fn sock_connect4(ctx: SockAddrContext) -> i32 {
    sock::translate::<Be32>(&ctx, AddrField::Ipv4, false)
}

/// sendmsg() to an address (unconnected UDP): as connect(), one backend per socket.
#[cgroup_sock_addr(sendmsg4)]
pub fn sock_sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::translate::<Be32>(&ctx, AddrField::Ipv4, true)
}

/// recvmsg() of a UDP socket: a reply from the backend shows the service address as its source.
#[cgroup_sock_addr(recvmsg4)]
pub fn sock_recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse::<Be32>(&ctx, AddrField::Ipv4)
}

/// getpeername(): the service address the socket connected to, not the backend's.
#[cgroup_sock_addr(getpeername4)]
pub fn sock_getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse::<Be32>(&ctx, AddrField::Ipv4)
}

/// connect() of an IPv6 socket, as [`sock_connect4`]: an IPv6 service address, or an
/// IPv4-mapped one of an IPv4 service.
#[cgroup_sock_addr(connect6)]
pub fn sock_connect6(ctx: SockAddrContext) -> i32 {
    match sock::ipv4_mapped(&ctx) {
        true => sock::translate::<Be32>(&ctx, AddrField::Ipv6, false),
        false => sock::translate::<Be128>(&ctx, AddrField::Ipv6, false),
    }
}

/// sendmsg() of an unconnected IPv6 UDP socket to an IPv6 service address (to an IPv4-mapped
/// one the kernel goes through sendmsg4).
#[cgroup_sock_addr(sendmsg6)]
pub fn sock_sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::translate::<Be128>(&ctx, AddrField::Ipv6, true)
}

/// recvmsg() of an IPv6 UDP socket, as [`sock_recvmsg4`].
#[cgroup_sock_addr(recvmsg6)]
pub fn sock_recvmsg6(ctx: SockAddrContext) -> i32 {
    match sock::ipv4_mapped(&ctx) {
        true => sock::reverse::<Be32>(&ctx, AddrField::Ipv6),
        false => sock::reverse::<Be128>(&ctx, AddrField::Ipv6),
    }
}

/// getpeername() of an IPv6 socket, as [`sock_getpeername4`].
#[cgroup_sock_addr(getpeername6)]
pub fn sock_getpeername6(ctx: SockAddrContext) -> i32 {
    match sock::ipv4_mapped(&ctx) {
        true => sock::reverse::<Be32>(&ctx, AddrField::Ipv6),
        false => sock::reverse::<Be128>(&ctx, AddrField::Ipv6),
    }
}

/// At most one drop log line per CPU this often: a flood of bad packets must not flood the log
/// (the counters in DROPS, exported as a metric, count every one).
const DROP_LOG_INTERVAL_NS: u64 = 10_000_000_000;

/// One decision for drops: a packet whose rewrite failed halfway must not be forwarded, nor a
/// packet to a service address that could not be translated. Every other packet goes on with
/// TC_ACT_UNSPEC (tcx: TCX_NEXT), so that tc programs after ours (a CNI's bandwidth shaping,
/// say) still see it.
#[inline(always)]
fn verdict(ctx: &TcContext, r: Result<i32, packet::Drop>) -> i32 {
    match r {
        Ok(action) => action,
        Err(packet::Drop(reason)) => {
            count_drop(ctx, reason);
            TC_ACT_SHOT
        }
    }
}

/// Counts a dropped packet, and logs it unless this CPU logged one lately.
#[inline(always)]
pub fn count_drop<C: EbpfContext>(ctx: &C, reason: u32) {
    if let Some(count) = DROPS.get_ptr_mut(reason) {
        // SAFETY: a per-CPU value: no other program touches it while this one runs here.
        unsafe { *count += 1 };
    }
    if let Some(last) = DROPS.get_ptr_mut(DROPS_LAST_LOG) {
        let now = unsafe { bpf_ktime_get_ns() };
        // SAFETY: as above.
        let last = unsafe { &mut *last };
        if *last == 0 || now.saturating_sub(*last) >= DROP_LOG_INTERVAL_NS {
            *last = now;
            error!(
                ctx,
                "dropped a packet (reason {}); further drops are only counted for 10s", reason
            );
        }
    }
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
