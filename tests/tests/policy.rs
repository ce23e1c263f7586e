//! Service policies under BPF_PROG_TEST_RUN: terminating endpoints as the fallback when none is
//! ready (KEP-1669), internalTrafficPolicy: Local, sessionAffinity: ClientIP, Maglev.
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData, PerCpuArray};
use proxy_common::{
    AffinityKey, AffinityValue, DROP_NO_LOCAL_ENDPOINTS, MAP_AFFINITY, MAP_DROPS, MAP_MAGLEV,
    MaglevChunk, ServiceKey,
};
use proxy_tests::{
    fixtures::*,
    packet::Spec,
    privileged,
    programs::{Programs, Svc, TC_ACT_SHOT, add_service},
};
use proxy_userspace::{
    inspect::services_table,
    model::{DesiredState, Endpoint, Placement, Protocol, ServicePortName},
    modes::ebpf::{WriterConfig, inspect},
};

/// The TCP service `web` on VIP:80 with `endpoints` as given (conditions and node), on node1.
fn web(
    endpoints: Vec<Endpoint>,
    configure: impl FnOnce(&mut proxy_userspace::model::ServicePort),
) -> DesiredState {
    let mut state = DesiredState::new("node1");
    let key = add_service(
        &mut state,
        &Svc {
            name: "web",
            vip: VIP,
            port: 80,
            protocol: Protocol::Tcp,
            endpoints: &[],
        },
    );
    configure(state.port_mut(&key).unwrap());
    state.set_endpoints(key, endpoints);
    state
}

fn web_key(state: &DesiredState) -> ServicePortName {
    state.port_names().next().unwrap().clone()
}

/// An endpoint on port 8080 with these conditions, on `node`.
fn ep(ip: Ipv4Addr, node: &str, ready: bool, serving: bool, terminating: bool) -> Endpoint {
    Endpoint {
        ip: IpAddr::V4(ip),
        port: 8080,
        ready,
        serving,
        terminating,
        placement: Placement::shared(Some(node), None),
    }
}

/// The backends new connections from `client` reach (one SYN from each of `n` ports).
fn reached(p: &Programs, client: Ipv4Addr, ports: std::ops::Range<u16>) -> BTreeSet<Ipv4Addr> {
    ports
        .map(|sport| dnat(p, &Spec::tcp(client, sport, VIP, 80)).dst)
        .collect()
}

fn load(test: &str, state: &DesiredState) -> Option<Programs> {
    if !privileged(test) {
        return None;
    }
    let mut p = Programs::load(SMALL).expect("loading the BPF programs");
    p.program(state).expect("programming the maps");
    Some(p)
}

#[test]
fn terminating_endpoints_serve_when_none_is_ready() {
    // A rollout's last old pods: terminating and still serving; one of them no longer serves.
    let mut state = web(
        vec![
            ep(BE1, "node1", false, true, true),
            ep(BE2, "node1", false, false, true),
        ],
        |_| {},
    );
    let Some(mut p) = load("terminating_endpoints_serve_when_none_is_ready", &state) else {
        return;
    };
    assert_eq!(reached(&p, CLIENT, 40000..40030), BTreeSet::from([BE1]));
    // A ready endpoint appears: it takes every new connection.
    let key = web_key(&state);
    state.edit_endpoints(&key, |eps| eps.push(ep(BE3, "node2", true, true, false)));
    p.program(&state).unwrap();
    assert_eq!(reached(&p, CLIENT, 41000..41030), BTreeSet::from([BE3]));
}

#[test]
fn internal_traffic_policy_local_uses_only_this_nodes_endpoints() {
    let mut state = web(
        vec![
            ep(BE1, "node1", true, true, false),
            ep(BE3, "node2", true, true, false),
        ],
        |sp| sp.internal_traffic_local = true,
    );
    let Some(mut p) = load(
        "internal_traffic_policy_local_uses_only_this_nodes_endpoints",
        &state,
    ) else {
        return;
    };
    assert_eq!(reached(&p, CLIENT, 42000..42030), BTreeSet::from([BE1]));
    let shown = services_table(&inspect::services(p.bpffs.path()).unwrap());
    assert!(shown.contains("[internal traffic local]"), "{shown}");
    // No local endpoint left: dropped (and counted), as kube-proxy does; never sent elsewhere.
    let key = web_key(&state);
    state.edit_endpoints(&key, |eps| {
        eps.remove(0);
    });
    p.program(&state).unwrap();
    let (verdict, _) = p.run("tc_ingress", &Spec::tcp(CLIENT, 42100, VIP, 80).build());
    assert_eq!(verdict, TC_ACT_SHOT);
    let drops: PerCpuArray<_, u64> =
        Map::PerCpuArray(MapData::from_pin(p.bpffs.path().join(MAP_DROPS)).unwrap())
            .try_into()
            .unwrap();
    let counted: u64 = drops.get(&DROP_NO_LOCAL_ENDPOINTS, 0).unwrap().iter().sum();
    assert_eq!(counted, 1);
}

fn affinity_map(p: &Programs) -> BpfHashMap<MapData, AffinityKey, AffinityValue> {
    let data = MapData::from_pin(p.bpffs.path().join(MAP_AFFINITY)).unwrap();
    Map::LruHashMap(data).try_into().unwrap()
}

/// Moves every affinity entry's last use `secs` into the past, as time passing would. False
/// (and a loud note) when the monotonic clock is younger than that (a VM just booted).
fn age_affinity(p: &Programs, secs: u64) -> bool {
    let mut map = affinity_map(p);
    let entries: Vec<_> = map.iter().map(Result::unwrap).collect();
    let ago = secs * 1_000_000_000;
    if entries.iter().any(|(_, v)| v.last_used_ns < ago) {
        eprintln!("\nSKIPPED the rest of this test: the clock started less than {secs} s ago\n");
        return false;
    }
    for (k, mut v) in entries {
        v.last_used_ns -= ago;
        map.insert(k, v, 0).unwrap();
    }
    true
}

#[test]
fn session_affinity_sends_a_clients_new_connections_to_one_backend() {
    let endpoints = [BE1, BE2, BE3]
        .map(|ip| ep(ip, "node1", true, true, false))
        .to_vec();
    let mut state = web(endpoints, |sp| {
        sp.session_affinity_timeout = std::num::NonZeroU32::new(60)
    });
    let Some(mut p) = load(
        "session_affinity_sends_a_clients_new_connections_to_one_backend",
        &state,
    ) else {
        return;
    };
    // Each client sticks to one backend over many connections; clients spread.
    let mut chosen = BTreeSet::new();
    for client in 1..=30u8 {
        let client = Ipv4Addr::new(10, 244, 1, 100 + client);
        let backends = reached(&p, client, 43000..43010);
        assert_eq!(backends.len(), 1, "client {client}: {backends:?}");
        chosen.extend(backends);
    }
    assert_eq!(chosen.len(), 3, "30 clients should reach all 3 backends");
    let shown = services_table(&inspect::services(p.bpffs.path()).unwrap());
    assert!(shown.contains("[affinity 60s]"), "{shown}");
    assert_eq!(inspect::affinity(p.bpffs.path()).unwrap().len(), 30);

    // The backend a client is bound to leaves the service: the client moves, and sticks again.
    let bound = *reached(&p, CLIENT, 46000..46001).first().unwrap();
    let key = web_key(&state);
    state.edit_endpoints(&key, |eps| eps.retain(|e| e.ip != IpAddr::V4(bound)));
    p.program(&state).unwrap();
    let moved = reached(&p, CLIENT, 46100..46110);
    assert!(moved.len() == 1 && !moved.contains(&bound), "{moved:?}");

    // Past the timeout, a client's next connection picks anew (and is remembered again).
    let mut after: BTreeSet<Ipv4Addr> = BTreeSet::new();
    for round in 0..40u16 {
        // Expired before each connection, so each one picks at random.
        if !age_affinity(&p, 61) {
            return;
        }
        after.extend(reached(&p, CLIENT, 45000 + round..45001 + round));
    }
    assert!(
        after.len() > 1,
        "expired affinity must pick anew: {after:?}"
    );
}

#[test]
fn maglev_picks_the_same_backend_on_every_node_and_moves_few_flows() {
    let five: Vec<Endpoint> = (1..=5)
        .map(|i| ep(Ipv4Addr::new(10, 244, 3, i), "node1", true, true, false))
        .collect();
    let maglev = |sp: &mut proxy_userspace::model::ServicePort| {
        sp.lb_algorithm = Some(proxy_userspace::model::LbAlgorithm::Maglev)
    };
    let state = web(five.clone(), maglev);
    let Some(node1) = load(
        "maglev_picks_the_same_backend_on_every_node_and_moves_few_flows",
        &state,
    ) else {
        return;
    };
    // Another node, whose backend ids differ (another service was programmed first).
    let mut node2 = Programs::load(SMALL).unwrap();
    let mut other = state.clone();
    add_service(
        &mut other,
        &Svc {
            name: "aaa",
            vip: Ipv4Addr::new(10, 96, 9, 9),
            port: 80,
            protocol: Protocol::Tcp,
            endpoints: &[(BE3, 80), (BE2, 80)],
        },
    );
    node2.program(&other).unwrap();
    let shown = services_table(&inspect::services(node1.bpffs.path()).unwrap());
    assert!(shown.contains("[maglev]"), "{shown}");
    let flows: Vec<Spec> = (0..300u16)
        .map(|i| {
            Spec::tcp(
                Ipv4Addr::new(10, 244, 1, (i % 50) as u8 + 1),
                20000 + i,
                VIP,
                80,
            )
        })
        .collect();
    let on = |p: &Programs| -> Vec<Ipv4Addr> { flows.iter().map(|f| dnat(p, f).dst).collect() };
    let before = on(&node1);
    assert_eq!(before, on(&node2), "every node must pick alike");
    let spread: BTreeSet<_> = before.iter().collect();
    assert_eq!(spread.len(), 5, "300 flows should reach all 5 backends");
    // One endpoint goes (a third node programmed without it): only its flows move.
    let gone = Ipv4Addr::new(10, 244, 3, 1);
    let four = web(
        five.into_iter()
            .filter(|e| e.ip != IpAddr::V4(gone))
            .collect(),
        maglev,
    );
    let node3 = load(
        "maglev_picks_the_same_backend_on_every_node_and_moves_few_flows",
        &four,
    )
    .unwrap();
    let after = on(&node3);
    let kept = before
        .iter()
        .zip(&after)
        .filter(|(b, a)| **b != gone && b == a)
        .count();
    let stayed = before.iter().filter(|b| **b != gone).count();
    assert!(
        kept * 100 >= stayed * 95,
        "{kept} of {stayed} flows not on the removed backend kept theirs"
    );
    assert!(!after.contains(&gone));
}

/// A restart with another `--lb-maglev-table-size`: the programs read the pinned tables with
/// their own size until the first full sync has rewritten them all, then the new tables with
/// the new size, as a node started with that size does; no chunk of the larger old tables is
/// left behind.
#[test]
fn a_new_maglev_table_size_takes_effect_with_its_tables() {
    const TEST: &str = "a_new_maglev_table_size_takes_effect_with_its_tables";
    let five: Vec<Endpoint> = (1..=5)
        .map(|i| ep(Ipv4Addr::new(10, 244, 3, i), "node1", true, true, false))
        .collect();
    let state = web(five, |sp| {
        sp.lb_algorithm = Some(proxy_userspace::model::LbAlgorithm::Maglev)
    });
    let Some(mut node) = load(TEST, &state) else {
        return;
    };
    let small = WriterConfig {
        maglev_table_size: 1021,
        ..WriterConfig::default()
    };
    let mut fresh_small = Programs::load_with(SMALL, small).unwrap();
    fresh_small.program(&state).unwrap();
    let as_before = load(TEST, &state).unwrap();
    // Flows not seen yet (each check its own source ports: conntrack remembers the others).
    let flows = |first: u16| -> Vec<Spec> {
        (0..200u16)
            .map(|i| {
                Spec::tcp(
                    Ipv4Addr::new(10, 244, 1, (i % 50) as u8 + 1),
                    first + i,
                    VIP,
                    80,
                )
            })
            .collect()
    };
    let on = |p: &Programs, flows: &[Spec]| -> Vec<Ipv4Addr> {
        flows.iter().map(|f| dnat(p, f).dst).collect()
    };
    restart_with(&mut node, SMALL, small);
    let waiting = flows(20000);
    assert_eq!(
        on(&node, &waiting),
        on(&as_before, &waiting),
        "before the first sync, the pinned tables are read with their own size"
    );
    node.program(&state).unwrap();
    let synced = flows(30000);
    assert_eq!(
        on(&node, &synced),
        on(&fresh_small, &synced),
        "after it, the new tables with the new size"
    );
    let chunks: BpfHashMap<MapData, ServiceKey, MaglevChunk> =
        Map::HashMap(MapData::from_pin(node.bpffs.path().join(MAP_MAGLEV)).unwrap())
            .try_into()
            .unwrap();
    let slots: BTreeSet<u16> = chunks.keys().map(|k| k.unwrap().slot).collect();
    assert_eq!(
        slots,
        BTreeSet::from([0]),
        "1021 entries: one chunk a frontend"
    );
}
