//! tc programs for pod-facing interfaces: ClusterIP DNAT with conntrack (ingress, packets leaving a
//! pod) and reverse NAT of the replies (egress, packets going to a pod).
#![no_std]
#![no_main]

mod conntrack;
mod egress;
mod ingress;
mod maps;
mod packet;

use aya_ebpf::{bindings::TC_ACT_SHOT, macros::classifier, programs::TcContext};
use aya_log_ebpf::error;

/// A packet from a pod, seen on the host side of its interface.
#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    verdict(&ctx, ingress::try_ingress(&ctx))
}

/// A packet about to be delivered to a pod.
#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    verdict(&ctx, egress::try_egress(&ctx))
}

/// One decision for errors: a packet whose rewrite failed halfway must not be forwarded. Every
/// other packet goes on with TC_ACT_UNSPEC (tcx: TCX_NEXT), so that tc programs after ours (a
/// CNI's bandwidth shaping, say) still see it.
#[inline(always)]
fn verdict(ctx: &TcContext, r: Result<i32, packet::Error>) -> i32 {
    match r {
        Ok(action) => action,
        Err(_) => {
            error!(ctx, "packet rewrite failed; dropped");
            TC_ACT_SHOT
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
