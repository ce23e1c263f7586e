//! Packets from outside the node to its NodePorts, LoadBalancer and external IPs, on the
//! interfaces that carry the node's addresses. The decision ([`decide`]) is shared by the XDP
//! program (xdp.rs: the fast path) and the tc programs here, which handle what XDP leaves to
//! the stack: packets with IP options, rejects, and forwarding where XDP cannot transmit or
//! the next hop's address is not resolved yet (`bpf_redirect_neigh` resolves it).
//!
//! externalTrafficPolicy Cluster: a local endpoint gets the packet with the client's address
//! (the stack delivers it to the pod; its replies are translated on their way out, by
//! [`try_external_egress`]); another node's endpoint gets it from this node's address and a
//! port picked in conntrack, so that its replies come back here and are translated back
//! (forwarded by a route lookup: the stack would refuse a packet with its own source).
//! externalTrafficPolicy Local: only local endpoints, the client's address kept.
//!
//! Both families take the same path (generic over the address); IPv6 packets come to it through
//! programs of their own (main.rs), XDP's for established flows only (xdp.rs).
use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        TC_ACT_UNSPEC, bpf_fib_lookup,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_ktime_get_ns, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};
use proxy_common::{
    BACKEND_LOCAL, Backend, Be16, CT_EXTERNAL, CtKey, DROP_NO_LOCAL_ENDPOINTS, DROP_NO_ROUTE,
    DROP_SNAT_PORTS_EXHAUSTED, DROP_SOURCE_RANGE, SERVICE_DRAINING, SERVICE_LOCAL_ONLY,
    SERVICE_TWO_SCOPES,
};

use crate::{
    conntrack,
    family::Family,
    frontend, icmp,
    ingress::Action,
    lb,
    maps::EXTERNAL_IFACES,
    packet::{Drop, End, FAILED, Flow},
    source,
};

/// What to do with a packet that came from outside.
pub enum Verdict<A> {
    /// Not for a frontend (or a removed one): on to the stack untouched.
    Pass,
    /// Rewrite the source to `src` and the destination to `dst` (either may be unchanged).
    /// `forward`: send it out by a route lookup (its source is now a node address, or it is a
    /// reply going back to the client); otherwise hand it to the stack (a local endpoint).
    Nat {
        src: (A, Be16),
        dst: (A, Be16),
        forward: bool,
    },
    /// A packet that would start a flow, left to the caller (only without `new_flows`, see
    /// [`decide`]).
    NewFlow,
    /// No usable endpoint: answer with an ICMP port unreachable (tc only).
    Reject,
}

/// The decision for `flow`, a packet that arrived on the external interface `ingress`. Records
/// new flows in conntrack; without `new_flows`, a packet that would start one is
/// [`Verdict::NewFlow`] (XDP's IPv6 path: its stack does not hold the new-flow path beside the
/// rewrite, so a program of its own starts the flow, xdp.rs).
#[inline(always)]
pub fn decide<C: EbpfContext, A: Family>(
    ctx: &C,
    flow: &Flow<A>,
    ingress: u32,
    new_flows: bool,
) -> Result<Verdict<A>, Drop> {
    // Borrowed: a copy of an IPv6 key is 40 bytes more of stack, which 5.10's and 6.1's
    // verifiers refuse here (ARCHITECTURE.md).
    let key = &flow.key;
    let (node_addr, to_node) = frontend::node_addr(key.daddr);
    if node_addr && let Some((service, client)) = conntrack::snat_reply(flow) {
        return Ok(Verdict::Nat {
            src: service,
            dst: client,
            forward: true,
        });
    }
    let Some((svc_key, svc)) = frontend::external(key.daddr, key.dport, key.proto, to_node) else {
        if flow.syn_only() {
            // A connection straight to a pod (or to anything else): a reply entry left on its
            // reverse 5-tuple by an earlier flow through a frontend (the client reusing its
            // port) must not rewrite its replies.
            conntrack::forget_finished_reply(key, unsafe { bpf_ktime_get_ns() }, true);
        }
        return Ok(Verdict::Pass);
    };
    if frontend::source_refused(&svc_key, &svc, key.saddr) {
        return Err(Drop(DROP_SOURCE_RANGE));
    }
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(live) = conntrack::established_flow(flow, now) {
        if live.netfilter {
            return Ok(Verdict::Pass); // netfilter's to the end, as in ingress.rs
        }
        return Ok(nat(key, &live.backend, live.snat));
    }
    if flow.later_fragment() {
        return Ok(Verdict::Pass); // its first fragment started no flow
    }
    if !new_flows {
        return Ok(Verdict::NewFlow);
    }
    let Some((backend_id, backend)) = lb::new_flow_backend(key, &svc_key, &svc, now, lb::random())?
    else {
        if svc.flags & SERVICE_LOCAL_ONLY != 0 {
            return Err(Drop(DROP_NO_LOCAL_ENDPOINTS));
        }
        if svc.flags & SERVICE_DRAINING != 0 {
            return Ok(Verdict::Pass);
        }
        return Ok(Verdict::Reject);
    };
    if svc.flags & SERVICE_TWO_SCOPES != 0 || backend.flags & BACKEND_LOCAL != 0 {
        conntrack::record_flow(flow, backend_id, &backend, now, true);
        return Ok(nat(key, &backend, conntrack::no_snat()));
    }
    let node = snat_source(ctx, key, &backend, ingress, to_node);
    if node == A::default() {
        return Err(Drop(DROP_NO_ROUTE));
    }
    let port = conntrack::record_snat_flow(flow, backend_id, &backend, node, now)
        .ok_or(Drop(DROP_SNAT_PORTS_EXHAUSTED))?;
    Ok(nat(key, &backend, (node, port)))
}

#[inline(always)]
fn nat<A: Family>(key: &CtKey<A>, backend: &Backend<A>, snat: (A, Be16)) -> Verdict<A> {
    let forward = snat != conntrack::no_snat();
    Verdict::Nat {
        src: if forward {
            snat
        } else {
            (key.saddr, key.sport)
        },
        dst: (backend.addr, backend.port),
        forward,
    }
}

/// The address a flow (now `key`) sent on to another node's `backend` leaves from: that of the
/// interface the route to the backend goes out of, as netfilter's MASQUERADE picks, where the
/// external programs are there to take the replies; else the node address the client used, or
/// for LoadBalancer and external IPs the node's primary address.
#[inline(always)]
fn snat_source<C: EbpfContext, A: Family>(
    ctx: &C,
    key: &CtKey<A>,
    backend: &Backend<A>,
    ingress: u32,
    to_node: bool,
) -> A {
    let towards = CtKey {
        daddr: backend.addr,
        dport: backend.port,
        ..*key
    };
    let (rc, route) = self::route(ctx, &towards, 0, ingress);
    // The lookup names the egress interface whether or not the next hop is resolved or the
    // packet fits (forwarding checks those again).
    let rc = rc as u32;
    if rc == BPF_FIB_LKUP_RET_SUCCESS
        || rc == BPF_FIB_LKUP_RET_NO_NEIGH
        || rc == BPF_FIB_LKUP_RET_FRAG_NEEDED
    {
        let addr =
            unsafe { EXTERNAL_IFACES.get(route.ifindex) }.map_or_else(A::default, A::snat_addr);
        if addr != A::default() {
            return addr;
        }
    }
    if to_node {
        key.daddr
    } else {
        A::primary_addr()
    }
}

/// A route lookup for a translated packet `key` (of `tot_len` bytes) that came in on
/// `ifindex`: the return code, and the egress interface and MAC addresses on success. A
/// `tot_len` of 0 has the kernel check the MTU as its own forwarding does, GSO-aware (a GRO
/// packet's length is that of all its segments).
#[inline(always)]
pub fn route<C: EbpfContext, A: Family>(
    ctx: &C,
    key: &CtKey<A>,
    tot_len: u16,
    ifindex: u32,
) -> (i64, bpf_fib_lookup) {
    // SAFETY: a plain C struct; all zeros is a valid (empty) lookup.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    A::fib_addrs(&mut params, key);
    params.l4_protocol = key.proto;
    params.sport = key.sport.raw();
    params.dport = key.dport.raw();
    params.__bindgen_anon_1.tot_len = tot_len;
    params.ifindex = ifindex;
    // SAFETY: the context and a lookup struct of the size given.
    let rc = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &mut params,
            size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    (rc, params)
}

/// A packet from outside, on the tc ingress of an external interface. Answers (a port
/// unreachable, a fragmentation needed or packet too big) are left to the caller, as in
/// ingress.rs.
#[inline(always)]
pub fn try_external_ingress<A: Family>(ctx: &TcContext) -> Result<Action<A>, Drop> {
    let Some(mut flow) = A::parse_from_outside(ctx) else {
        return A::not_a_flow_from_outside(ctx);
    };
    // SAFETY: reading the context's ifindex.
    let ingress = unsafe { (*ctx.skb.skb).ifindex };
    let (src, dst) = match decide(ctx, &flow, ingress, true)? {
        Verdict::Pass | Verdict::NewFlow => return Ok(Action::Verdict(TC_ACT_UNSPEC)),
        Verdict::Reject => return Ok(Action::Reject(flow)),
        Verdict::Nat {
            src,
            dst,
            forward: false,
        } => {
            flow.rewrite(ctx, End::Destination, dst.0, dst.1)?;
            flow.rewrite(ctx, End::Source, src.0, src.1)?;
            return Ok(Action::Verdict(TC_ACT_UNSPEC));
        }
        Verdict::Nat { src, dst, .. } => (src, dst),
    };
    let translated = CtKey {
        saddr: src.0,
        sport: src.1,
        daddr: dst.0,
        dport: dst.1,
        ..flow.key
    };
    let (rc, route) = self::route(ctx, &translated, 0, ingress);
    if rc as u32 == BPF_FIB_LKUP_RET_FRAG_NEEDED && A::dont_fragment(ctx)? {
        // As the kernel's forwarding answers: the client learns the path's MTU. The MTU comes
        // with the lookup from Linux 5.12; before, 0 has the client take its minimum (552;
        // 1280 for IPv6).
        // SAFETY: the lookup's output member of the union.
        let mtu = unsafe { route.__bindgen_anon_1.mtu_result };
        return A::too_big(ctx, flow, mtu);
    }
    flow.rewrite(ctx, End::Destination, dst.0, dst.1)?;
    flow.rewrite(ctx, End::Source, src.0, src.1)?;
    send::<A>(ctx, rc, &route).map(Action::Verdict)
}

/// Sends a translated packet (now `key`) out by a route lookup, resolving the next hop if need
/// be.
#[inline(always)]
pub fn forward_tc<A: Family>(ctx: &TcContext, key: &CtKey<A>) -> Result<i32, Drop> {
    // SAFETY: reading the context's ifindex.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let (rc, route) = self::route(ctx, key, 0, ifindex);
    send::<A>(ctx, rc, &route)
}

/// Sends a translated packet out as the route lookup `route` (its return code `rc`) says.
/// One too big for the egress interface that may be fragmented goes as it is: a tunnel
/// fragments the packet it is carried in (flannel's and Calico's VXLAN; the kernel's own
/// forwarding would have fragmented it), a plain interface of a smaller MTU drops it.
#[inline(always)]
fn send<A: Family>(ctx: &TcContext, rc: i64, route: &bpf_fib_lookup) -> Result<i32, Drop> {
    let rc = rc as u32;
    let resolved = rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_FRAG_NEEDED;
    if !resolved && rc != BPF_FIB_LKUP_RET_NO_NEIGH {
        return Err(Drop(DROP_NO_ROUTE));
    }
    A::decrement_hops(ctx)?;
    if resolved {
        let mut macs = [0u8; 12];
        macs[..6].copy_from_slice(&route.dmac);
        macs[6..].copy_from_slice(&route.smac);
        ctx.store(0, &macs, 0).map_err(|_| FAILED)?;
        // SAFETY: a helper with plain integer arguments.
        return Ok(unsafe { bpf_redirect(route.ifindex, 0) } as i32);
    }
    // SAFETY: no neighbour parameters (the kernel takes the next hop from its own lookup).
    Ok(unsafe { bpf_redirect_neigh(route.ifindex, core::ptr::null_mut(), 0, 0) } as i32)
}

/// A packet leaving the node on an external interface: a local endpoint's reply to an
/// external client gets the frontend's address back as its source (a SYN, FIN or RST from a
/// spoofed source passes untranslated and changes no flow).
#[inline(always)]
pub fn try_external_egress<A: Family>(ctx: &TcContext) -> Result<i32, Drop> {
    let Some(mut flow) = A::parse(ctx) else {
        icmp::to_client::<A>(ctx, CT_EXTERNAL)?;
        return Ok(TC_ACT_UNSPEC);
    };
    if source::from_spoofed_source(ctx, &flow) {
        return Ok(TC_ACT_UNSPEC);
    }
    let client = flow.key.daddr;
    if let Some((vip, vport)) = conntrack::reply(&flow, client, true) {
        flow.rewrite(ctx, End::Source, vip, vport)?;
    }
    Ok(TC_ACT_UNSPEC)
}
