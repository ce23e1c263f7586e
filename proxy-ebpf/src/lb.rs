//! Backend selection for a new flow to a service frontend, shared by the tc path (ingress) and
//! the socket path (sock): both must choose alike.
use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{
    AffinityKey, AffinityValue, BACKEND_DRAINING, BACKEND_LOCAL, Backend, CONFIG_MAGLEV_TABLE_SIZE,
    CtKey, DROP_NO_BACKEND, MAGLEV_CHUNK, SERVICE_AFFINITY, SERVICE_LOCAL_ONLY, SERVICE_MAGLEV,
    ServiceKey, ServiceValue, flow_hash,
};

use crate::{family::Family, maps::CONFIG, packet::Drop};

/// The backend for a new flow `key` to the frontend `svc_key` (whose slot 0 is `svc`): the
/// client's affinity if the service has one, else by the service's algorithm. `None` when the
/// service has no backend. `choice` picks among the slots where the algorithm is random: a
/// random number, or one of the client's own to give its flows the same backend.
#[inline(always)]
pub fn new_flow_backend<A: Family>(
    key: &CtKey<A>,
    svc_key: &ServiceKey<A>,
    svc: &ServiceValue,
    now: u64,
    choice: u32,
) -> Result<Option<(u32, Backend<A>)>, Drop> {
    if svc.flags & SERVICE_AFFINITY != 0 {
        affinity_backend(key, svc_key, svc, now, choice)
    } else {
        by_algorithm(key, svc_key, svc, choice)
    }
}

/// A random number, for [`new_flow_backend`]'s `choice`.
#[inline(always)]
pub fn random() -> u32 {
    unsafe { bpf_get_prandom_u32() }
}

#[inline(always)]
fn by_algorithm<A: Family>(
    key: &CtKey<A>,
    svc_key: &ServiceKey<A>,
    svc: &ServiceValue,
    choice: u32,
) -> Result<Option<(u32, Backend<A>)>, Drop> {
    if svc.flags & SERVICE_MAGLEV != 0
        && svc.count != 0
        && let Some(found) = maglev_backend(key, svc_key)
    {
        return Ok(Some(found));
    }
    select_backend(svc_key, svc.count, choice)
}

/// The frontend's Maglev table entry for the flow's hash, if the table is there and its
/// backend takes new flows (otherwise the caller picks at random: the agent is rewriting the
/// table, or the endpoint just left).
#[inline(always)]
fn maglev_backend<A: Family>(key: &CtKey<A>, svc_key: &ServiceKey<A>) -> Option<(u32, Backend<A>)> {
    let size = *CONFIG.get(CONFIG_MAGLEV_TABLE_SIZE)?;
    if size == 0 {
        return None;
    }
    let index = flow_hash(key) % size;
    // The frontend's own key (its scope included), at the chunk's slot.
    let chunk_key = ServiceKey {
        slot: (index / MAGLEV_CHUNK as u32) as u16,
        ..*svc_key
    };
    let chunk = unsafe { A::maglev().get(chunk_key) }?;
    // The mask keeps the index within the chunk for the verifier (MAGLEV_CHUNK is 2^10).
    let backend_id = chunk.ids[index as usize & (MAGLEV_CHUNK - 1)];
    let backend = unsafe { A::backends().get(backend_id) }.copied()?;
    if backend.flags & BACKEND_DRAINING != 0 || backend.proto != key.proto {
        return None;
    }
    Some((backend_id, backend))
}

/// sessionAffinity ClientIP: the backend of the client's last new flow to this frontend while
/// that is within the service's timeout and the backend takes new flows from this frontend
/// (a frontend's endpoints are the service port's, or for a Local traffic policy the local
/// ones: a policy changed to Local leaves entries naming remote ones); otherwise one picked
/// anew, remembered for the client's next flows.
#[inline(always)]
pub fn affinity_backend<A: Family>(
    key: &CtKey<A>,
    svc_key: &ServiceKey<A>,
    svc: &ServiceValue,
    now: u64,
    choice: u32,
) -> Result<Option<(u32, Backend<A>)>, Drop> {
    let client = AffinityKey {
        client: key.saddr,
        vip: key.daddr,
        vport: key.dport,
        proto: key.proto,
        pad: 0,
    };
    let timeout_ns = u64::from(svc.affinity_timeout_secs()) * 1_000_000_000;
    if let Some(last) = A::affinity().get_ptr_mut(client) {
        // SAFETY: an LRU map value; a concurrent update at worst gives another fresh backend.
        let last = unsafe { &mut *last };
        if now.saturating_sub(last.last_used_ns) <= timeout_ns
            && let Some(backend) = unsafe { A::backends().get(last.backend_id) }
            && backend.flags & BACKEND_DRAINING == 0
            && backend.proto == key.proto
            && (svc.flags & SERVICE_LOCAL_ONLY == 0 || backend.flags & BACKEND_LOCAL != 0)
        {
            last.last_used_ns = now;
            return Ok(Some((last.backend_id, *backend)));
        }
    }
    let picked = by_algorithm(key, svc_key, svc, choice)?;
    if let Some((backend_id, _)) = picked {
        let value = AffinityValue {
            backend_id,
            pad: 0,
            last_used_ns: now,
        };
        let _ = A::affinity().insert(client, value, 0);
    }
    Ok(picked)
}

/// The backend in slot `choice` (modulo the count) of the service `svc_key`, which had
/// `count` of them when its head was read; `None` when it has none.
#[inline(always)]
pub fn select_backend<A: Family>(
    svc_key: &ServiceKey<A>,
    count: u16,
    choice: u32,
) -> Result<Option<(u32, Backend<A>)>, Drop> {
    if count == 0 {
        return Ok(None);
    }
    if let Some(found) = pick(svc_key, count, choice) {
        return Ok(Some(found));
    }
    // The agent shrank the service between the head lookup and ours: read the count again.
    let count = match unsafe { A::services().get(svc_key) } {
        Some(ServiceValue { count: 0, .. }) | None => return Ok(None),
        Some(svc) => svc.count,
    };
    // Never pass a packet to a service address untranslated (it would follow the default
    // route): drop it, and the client retransmits.
    pick(svc_key, count, choice)
        .map(Some)
        .ok_or(Drop(DROP_NO_BACKEND))
}

#[inline(always)]
fn pick<A: Family>(svc_key: &ServiceKey<A>, count: u16, choice: u32) -> Option<(u32, Backend<A>)> {
    let slot = (choice % count as u32) as u16 + 1;
    // The frontend's own key (its scope included), at the slot.
    let slot_key = ServiceKey { slot, ..*svc_key };
    let backend_id = unsafe { A::services().get(slot_key) }?.backend_id;
    let backend = unsafe { A::backends().get(backend_id) }.copied()?;
    Some((backend_id, backend))
}
