//! Finding the frontend a packet (or a socket's destination) is for: a service address
//! (ClusterIP, LoadBalancer, external IP) exactly, else a NodePort when the address is one of
//! the node's. Clients inside the cluster and clients outside it may see different endpoints
//! (externalTrafficPolicy Local): the scope says which.
use aya_ebpf::maps::lpm_trie::Key;
use proxy_common::{
    Be16, NODE_ADDR_SNAT_ONLY, SCOPE_INTERNAL, SERVICE_SOURCE_RANGES, SERVICE_TWO_SCOPES,
    ServiceKey, ServiceValue, SourceRangeKey,
};

use crate::family::Family;

/// Whether `addr` is one the node's NodePorts answer on.
#[inline(always)]
pub fn is_node_addr<A: Family>(addr: A) -> bool {
    node_addr(addr).1
}

/// Whether `addr` is the node's: one it sends flows to other nodes' endpoints from (their
/// replies come to it), and one its NodePorts answer on (most are both).
#[inline(always)]
pub fn node_addr<A: Family>(addr: A) -> (bool, bool) {
    match unsafe { A::node_addrs().get(addr) } {
        Some(flags) => (true, flags & NODE_ADDR_SNAT_ONLY == 0),
        None => (false, false),
    }
}

/// The frontend at `addr`:`port` as a client inside the cluster (a pod, a host-network process)
/// reaches it: any service address, and the NodePorts of this node's addresses, with the
/// endpoints kube-proxy gives such clients.
#[inline(always)]
pub fn internal<A: Family>(
    addr: A,
    port: Be16,
    proto: u8,
) -> Option<(ServiceKey<A>, ServiceValue)> {
    let (key, svc) = lookup(addr, port, proto, || is_node_addr(addr))?;
    if svc.flags & SERVICE_TWO_SCOPES == 0 {
        return Some((key, svc));
    }
    let internal = key.with_scope(SCOPE_INTERNAL);
    // SAFETY: services values are plain data; the agent replaces them whole.
    match unsafe { A::services().get(internal) } {
        Some(internal_svc) => Some((internal, *internal_svc)),
        // The agent writes it first; should it be missing (a full map), the external scope
        // serves rather than the packet passing untranslated.
        None => Some((key, svc)),
    }
}

/// The frontend at `addr`:`port` as a client outside the node reaches it: a NodePort, a
/// LoadBalancer or external IP, and as with kube-proxy a ClusterIP (where the network routes
/// the service range to the nodes: BGP-advertised, or a static route).
/// `to_node`: whether `addr` is a node address (the caller has looked it up already).
#[inline(always)]
pub fn external<A: Family>(
    addr: A,
    port: Be16,
    proto: u8,
    to_node: bool,
) -> Option<(ServiceKey<A>, ServiceValue)> {
    lookup(addr, port, proto, || to_node)
}

/// The frontend at `addr` exactly, else the NodePort `port` if `is_node_addr()` (asked only
/// then: most packets are for an exact address, or for none).
#[inline(always)]
fn lookup<A: Family>(
    addr: A,
    port: Be16,
    proto: u8,
    is_node_addr: impl FnOnce() -> bool,
) -> Option<(ServiceKey<A>, ServiceValue)> {
    let key = ServiceKey::new(addr, port, proto, 0);
    // SAFETY: as above.
    if let Some(svc) = unsafe { A::services().get(key) } {
        return Some((key, *svc));
    }
    if !is_node_addr() {
        return None;
    }
    let key = ServiceKey::new(A::NODE_PORT, port, proto, 0);
    let svc = unsafe { A::services().get(key) }.copied()?;
    Some((key, svc))
}

/// loadBalancerSourceRanges: whether the frontend `svc_key` (`svc`) is restricted and
/// `source` outside its ranges. Both scopes of a frontend share its ranges.
#[inline(always)]
pub fn source_refused<A: Family>(svc_key: &ServiceKey<A>, svc: &ServiceValue, source: A) -> bool {
    if svc.flags & SERVICE_SOURCE_RANGES == 0 {
        return false;
    }
    let key = Key::new(
        SourceRangeKey::<A>::FRONTEND_BITS + size_of::<A>() as u32 * 8,
        SourceRangeKey {
            addr: svc_key.addr,
            port: svc_key.port,
            proto: svc_key.proto,
            pad: 0,
            source,
        },
    );
    A::source_ranges().get(key).is_none()
}
