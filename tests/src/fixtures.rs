//! What the program tests share (`tests/datapath.rs`, `tests/change.rs`): a small cluster's
//! addresses, the programs loaded with a web (TCP) and a dns (UDP) service on one address, and
//! checks every translated frame must pass.
use proxy_common::{Be16, Be32, CtKey};
use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use proxy_userspace::{
    model::{DesiredState, Protocol, ServicePortName},
    modes::ebpf::{MapSizes, MapWriter, WriterConfig},
};

use crate::{
    packet::{self, ETH_HLEN, Spec, TCP},
    privileged,
    programs::{Programs, Svc, TC_ACT_UNSPEC, add_service},
};

pub const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 10);
pub const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
pub const BE1: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 11);
pub const BE2: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 12);
pub const BE3: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 11);

pub const SMALL: MapSizes = MapSizes {
    services: 1024,
    backends: 1024,
    conntrack: 4096,
    conntrack6: 4096,
};

pub fn setup(test: &str, endpoints: &[(Ipv4Addr, u16)]) -> Option<(Programs, DesiredState)> {
    if !privileged(test) {
        return None;
    }
    let mut p = Programs::load(SMALL).expect("loading the BPF programs");
    let mut state = DesiredState::default();
    for (name, proto) in [("web", Protocol::Tcp), ("dns", Protocol::Udp)] {
        add_service(
            &mut state,
            &Svc {
                name,
                vip: VIP,
                port: 80,
                protocol: proto,
                endpoints,
            },
        );
    }
    p.program(&state).expect("programming the maps");
    Some((p, state))
}

/// Sets the endpoints of the TCP service `web` (the VIP, port 80).
pub fn set_web(state: &mut DesiredState, endpoints: &[(Ipv4Addr, u16)]) -> ServicePortName {
    let svc = Svc {
        name: "web",
        vip: VIP,
        port: 80,
        protocol: Protocol::Tcp,
        endpoints,
    };
    add_service(state, &svc)
}

/// Runs ingress on a frame to the VIP and checks what every DNAT must satisfy.
pub fn dnat(p: &Programs, spec: &Spec) -> packet::Seen {
    let frame = spec.build();
    let (verdict, out) = p.run("tc_ingress", &frame);
    assert_eq!(verdict, TC_ACT_UNSPEC);
    assert_eq!(out.len(), frame.len(), "length must not change");
    let seen = packet::read(&out);
    assert_eq!(
        (IpAddr::from(seen.src), seen.sport),
        (spec.src, spec.sport),
        "source must not change"
    );
    assert_ne!(seen.dst, spec.dst, "destination must be rewritten");
    packet::assert_checksums(&out, spec.udp_zero_checksum);
    // Nothing but addresses, ports and checksums may change.
    let csum_off = ETH_HLEN + 20 + spec.ip_options.len() + if spec.proto == TCP { 16 } else { 6 };
    for (i, (a, b)) in frame.iter().zip(&out).enumerate() {
        let rewritable = (ETH_HLEN + 10..ETH_HLEN + 12).contains(&i)
            || (ETH_HLEN + 16..ETH_HLEN + 20).contains(&i)
            || (csum_off..csum_off + 2).contains(&i)
            || (ETH_HLEN + 20 + spec.ip_options.len() + 2..ETH_HLEN + 24 + spec.ip_options.len())
                .contains(&i);
        assert!(rewritable || a == b, "byte {i} changed ({a:#x} -> {b:#x})");
    }
    seen
}

pub fn untouched(p: &Programs, prog: &str, frame: &[u8]) {
    let (verdict, out) = p.run(prog, frame);
    assert_eq!(verdict, TC_ACT_UNSPEC, "{prog} must pass the frame");
    assert_eq!(out, frame, "{prog} must not change the frame");
}

/// Moves every conntrack entry's last use `secs` into the past, as time passing would.
/// False (and a loud note) when the monotonic clock is younger than `secs` (a VM just booted),
/// so that so long ago cannot be written down.
pub fn age_conntrack(p: &Programs, secs: u64) -> bool {
    let mut ct = p.conntrack();
    let entries: Vec<_> = ct.iter().map(Result::unwrap).collect();
    let ago = secs * 1_000_000_000;
    if entries.iter().any(|(_, v)| v.last_seen_ns < ago) {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "\nSKIPPED the rest of this test: the clock started less than {secs} s ago\n"
        );
        return false;
    }
    for (k, mut v) in entries {
        v.last_seen_ns -= ago;
        ct.insert(k, v, 0).unwrap();
    }
    true
}

pub fn reply_to(spec: &Spec, backend: Ipv4Addr, port: u16, tcp_flags: u8) -> Vec<u8> {
    Spec {
        src: backend.into(),
        sport: port,
        dst: spec.src,
        dport: spec.sport,
        tcp_flags,
        ..spec.clone()
    }
    .build()
}

/// What a restarted agent does: load again (reusing the pins) and take the maps with a new
/// map writer.
pub fn restart(p: &mut Programs, sizes: MapSizes, drain_period: Duration) {
    restart_with(
        p,
        sizes,
        WriterConfig {
            drain_period,
            ..WriterConfig::default()
        },
    );
}

/// [`restart`], the new writer configured as `writer` says.
pub fn restart_with(p: &mut Programs, sizes: MapSizes, writer: WriterConfig) {
    let mut reloaded = proxy_userspace::modes::ebpf::load(p.bpffs.path(), sizes)
        .unwrap()
        .ebpf;
    p.maps = MapWriter::take_from(&mut reloaded, writer).unwrap();
}

/// The conntrack key of the 5-tuple `src` -> `dst` of protocol `proto`.
pub fn ct_key(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), proto: u8) -> CtKey {
    CtKey {
        saddr: Be32::from_octets(src.0.octets()),
        daddr: Be32::from_octets(dst.0.octets()),
        sport: Be16::new(src.1),
        dport: Be16::new(dst.1),
        proto,
        pad: [0; 3],
    }
}
