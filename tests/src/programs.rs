//! The BPF programs loaded for BPF_PROG_TEST_RUN, with their maps pinned on a private bpffs,
//! programmed through the agent's own map writer. Shared by the datapath tests and the bench.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use anyhow::Context;
use aya::{
    Ebpf,
    maps::{Array, HashMap as BpfHashMap, Map, MapData, PerCpuArray, PerCpuValues},
    programs::{Program, TestRun, TestRunOptions},
};
use proxy_common::{
    Be32, Be128, CONFIG_SNAT_ADDR, CONFIG_SNAT_PORT_MAX, CONFIG_SNAT_PORT_MIN, CtKey, CtValue,
    DROPS_ICMP_PACE, ExternalIface, MAP_CONFIG, MAP_CONNTRACK, MAP_CT_LIFETIMES, MAP_DROPS,
    MAP_EXTERNAL_IFACES, MAP_NODE_ADDRS, MAP_NODE_ADDRS6, MAP_SOURCE_IFACES, NODE_ADDR_SNAT_ONLY,
};
use proxy_userspace::{
    dataplane::Scope,
    model::{
        Cidr, DesiredState, Endpoint, NamespacedName, Placement, Protocol, ServicePort,
        ServicePortName, TargetPort,
    },
    modes::ebpf::{self, MapSizes, MapWriter, WriterConfig, bpffs, writer::DEFAULT_DRAIN_PERIOD},
};

/// A bpffs mounted on a fresh temporary directory, unmounted and removed on drop.
pub struct PrivateBpffs {
    path: PathBuf,
}

impl PrivateBpffs {
    pub fn new() -> anyhow::Result<Self> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        if COUNTER.load(Ordering::Relaxed) == 0 {
            unmount_stale();
        }
        let path = std::env::temp_dir().join(format!(
            "{PREFIX}{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        bpffs::mount_private(&path)?;
        Ok(Self { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

const PREFIX: &str = "proxy-bpffs-";

/// Unmounts the private bpffs of test processes that died without cleaning up (killed by a
/// timeout, say), so that reruns on the same machine do not pile them up.
fn unmount_stale() {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return;
    };
    let tmp = std::env::temp_dir();
    for mount_point in mounts.lines().filter_map(|l| l.split_whitespace().nth(1)) {
        let path = Path::new(mount_point);
        let Some(rest) = path
            .strip_prefix(&tmp)
            .ok()
            .and_then(|r| r.to_str()?.strip_prefix(PREFIX))
        else {
            continue;
        };
        let pid = rest.split('-').next().unwrap_or_default();
        if !pid.is_empty() && !Path::new("/proc").join(pid).exists() {
            let _ = bpffs::unmount(path);
            let _ = std::fs::remove_dir(path);
        }
    }
}

impl Drop for PrivateBpffs {
    fn drop(&mut self) {
        let _ = bpffs::unmount(&self.path);
        let _ = std::fs::remove_dir(&self.path);
    }
}

/// The loaded tc programs and the agent's map writer, on a private bpffs.
pub struct Programs {
    pub ebpf: Ebpf,
    pub maps: MapWriter,
    // Dropped last: the maps are pinned there.
    pub bpffs: PrivateBpffs,
}

/// Verdicts the tc programs return.
/// "No verdict": the packet goes on to the next tc program (tcx: TCX_NEXT).
pub const TC_ACT_UNSPEC: u32 = u32::MAX;
pub const TC_ACT_SHOT: u32 = 2;
/// Sent out of an interface by `bpf_redirect` / `bpf_redirect_neigh`.
pub const TC_ACT_REDIRECT: u32 = 7;

/// Verdicts the XDP program returns.
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_TX: u32 = 3;
pub const XDP_REDIRECT: u32 = 4;

impl Programs {
    /// The programs and maps, with the agent's default drain period.
    pub fn load(sizes: MapSizes) -> anyhow::Result<Self> {
        Self::load_draining(sizes, DEFAULT_DRAIN_PERIOD)
    }

    /// The programs and maps; removed endpoints and services drain for `drain_period`.
    pub fn load_draining(sizes: MapSizes, drain_period: Duration) -> anyhow::Result<Self> {
        Self::load_with(
            sizes,
            WriterConfig {
                drain_period,
                ..WriterConfig::default()
            },
        )
    }

    /// The programs and maps, written as `writer` says.
    pub fn load_with(sizes: MapSizes, writer: WriterConfig) -> anyhow::Result<Self> {
        let bpffs = PrivateBpffs::new()?;
        let loaded = ebpf::load(bpffs.path(), sizes)?;
        // The agent serves on with a program a verifier refuses (it warns), but every kernel
        // tested (5.10, 6.1, 6.12, this machine's) must take them all.
        anyhow::ensure!(
            loaded.refused_ipv6.is_empty(),
            "this kernel's verifier refused {}",
            loaded.refused_ipv6.join(", ")
        );
        let mut ebpf = loaded.ebpf;
        // The agent loads them only to attach them; loaded here so that every kernel's
        // verifier checks them (5.10's too, which cannot attach them).
        ebpf::cgroup::load_programs(&mut ebpf)?;
        let maps = MapWriter::take_from(&mut ebpf, writer)?;
        Ok(Self { ebpf, maps, bpffs })
    }

    /// Programs `state` into the maps (a full sync, as the agent's first one).
    pub fn program(&mut self, state: &DesiredState) -> anyhow::Result<()> {
        self.maps.sync(state, Scope::All)
    }

    /// One BPF_PROG_TEST_RUN of `prog` (a tc or the XDP program), `repeat` times on `frame`,
    /// with context `ctx` if given: the verdict, the frame as the program left it, and the
    /// mean time per run.
    fn test_run(
        &self,
        prog: &str,
        frame: &[u8],
        ctx: Option<&[u8]>,
        repeat: u32,
    ) -> anyhow::Result<(u32, Vec<u8>, Duration)> {
        let mut out = vec![0u8; frame.len() + 256];
        let options = TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            ctx_in: ctx,
            repeat,
            ..Default::default()
        };
        let result = match self.ebpf.program(prog) {
            Some(Program::SchedClassifier(p)) => p.test_run(options),
            Some(Program::Xdp(p)) => p.test_run(options),
            _ => anyhow::bail!("no tc or XDP program {prog} in the object"),
        }
        .with_context(|| format!("BPF_PROG_TEST_RUN of {prog}"))?;
        out.truncate(result.data_size_out as usize);
        Ok((result.return_value, out, result.duration))
    }

    /// Runs `prog` once on `frame`: the verdict and the frame as the program left it.
    pub fn run(&self, prog: &str, frame: &[u8]) -> (u32, Vec<u8>) {
        let (verdict, out, _) = self.run_timed(prog, frame);
        (verdict, out)
    }

    /// [`Programs::run`], also returning how long the run took in the kernel.
    pub fn run_timed(&self, prog: &str, frame: &[u8]) -> (u32, Vec<u8>, Duration) {
        self.test_run(prog, frame, None, 1).unwrap()
    }

    /// Runs the tc program `prog` once on `frame` as if it arrived on (or left by) interface
    /// `ifindex` of the calling thread's network namespace (the `__sk_buff` context's ifindex),
    /// so that its route lookups are made there.
    pub fn run_on(&self, prog: &str, frame: &[u8], ifindex: u32) -> (u32, Vec<u8>) {
        // struct __sk_buff up to its ifindex (offset 40); the kernel zero-fills the rest and
        // accepts only a few fields set (ifindex among them).
        let mut ctx = [0u8; 44];
        ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
        let (verdict, out, _) = self
            .test_run(prog, frame, Some(&ctx), 1)
            .with_context(|| format!("on ifindex {ifindex}"))
            .unwrap();
        (verdict, out)
    }

    /// Runs the XDP program once on `frame`, received on `ingress_ifindex` of the calling
    /// thread's network namespace (its route lookups are made there); `None`: on that
    /// namespace's loopback, as a test run without a context does.
    pub fn run_xdp(&self, frame: &[u8], ingress_ifindex: Option<u32>) -> (u32, Vec<u8>) {
        let ctx = xdp_md(frame, ingress_ifindex.unwrap_or(0));
        let ctx = ingress_ifindex.map(|_| &ctx[..]);
        let (verdict, out, _) = self.test_run(ebpf::PROG_XDP, frame, ctx, 1).unwrap();
        (verdict, out)
    }

    /// Whether this kernel's BPF_PROG_TEST_RUN of XDP takes an `xdp_md` context (Linux 5.15):
    /// without it a run cannot say which interface the frame arrived on. Probed with a frame
    /// that is no IPv4 (the program passes it) arriving on loopback.
    pub fn xdp_runs_take_a_context(&self) -> bool {
        let frame = [0u8; 64];
        let ctx = xdp_md(&frame, 1);
        self.test_run(ebpf::PROG_XDP, &frame, Some(&ctx), 1).is_ok()
    }

    /// Writes what the agent's attach thread writes for the external programs: the node
    /// addresses NodePorts answer on (NODE_ADDRS, replacing what was there) and the address
    /// LoadBalancer and external IP flows to other nodes' endpoints leave from (CONFIG).
    pub fn set_node_addrs(&self, addrs: &[Ipv4Addr], snat: Ipv4Addr) {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_NODE_ADDRS)).expect("node addrs");
        let mut map: BpfHashMap<_, u32, u32> = Map::HashMap(data).try_into().unwrap();
        let old: Vec<u32> = map.keys().map(Result::unwrap).collect();
        for k in old {
            map.remove(&k).unwrap();
        }
        for a in addrs {
            map.insert(Be32::from_octets(a.octets()).raw(), 0, 0)
                .unwrap();
        }
        let data = MapData::from_pin(self.bpffs.path().join(MAP_CONFIG)).expect("config");
        let mut config: Array<_, u32> = Map::Array(data).try_into().unwrap();
        config
            .set(CONFIG_SNAT_ADDR, Be32::from_octets(snat.octets()).raw(), 0)
            .unwrap();
    }

    /// The IPv6 node addresses NodePorts answer on (NODE_ADDRS6, replacing what was there).
    pub fn set_node_addrs6(&self, addrs: &[Ipv6Addr]) {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_NODE_ADDRS6)).expect("pin");
        let mut map: BpfHashMap<_, Be128, u32> = Map::HashMap(data).try_into().unwrap();
        let old: Vec<Be128> = map.keys().map(Result::unwrap).collect();
        for k in old {
            map.remove(&k).unwrap();
        }
        for a in addrs {
            map.insert(Be128::from_octets(a.octets()), 0, 0).unwrap();
        }
    }

    /// Lists `ifindex` as a pod interface whose packets' sources must be routed back through
    /// `route_back` (itself, or its bridge), as the attacher does under
    /// `--bpf-source-validation`.
    pub fn set_source_iface(&self, ifindex: u32, route_back: u32) {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_SOURCE_IFACES)).expect("pin");
        let mut map: BpfHashMap<_, u32, u32> = Map::HashMap(data).try_into().unwrap();
        map.insert(ifindex, route_back, 0).unwrap();
    }

    /// Sets the lifetime of conntrack's `state` (`CT_STATE_*`), as the agent's flags do.
    pub fn set_ct_lifetime(&self, state: u32, lifetime: Duration) {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_CT_LIFETIMES)).expect("lifetimes");
        let mut lifetimes: Array<_, u64> = Map::Array(data).try_into().unwrap();
        lifetimes.set(state, lifetime.as_nanos() as u64, 0).unwrap();
    }

    /// Sets the source port range of translated flows (`--bpf-snat-port-range`).
    pub fn set_snat_ports(&self, first: u16, last: u16) {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_CONFIG)).expect("config");
        let mut config: Array<_, u32> = Map::Array(data).try_into().unwrap();
        config
            .set(CONFIG_SNAT_PORT_MIN, u32::from(first), 0)
            .unwrap();
        config
            .set(CONFIG_SNAT_PORT_MAX, u32::from(last), 0)
            .unwrap();
    }

    /// Marks `ifindex` as an external interface with `flags` (`IFACE_XDP_FORWARD`: XDP may
    /// transmit there), as the attach thread does; no SNAT address of its own.
    pub fn set_external_iface(&self, ifindex: u32, flags: u32) {
        self.set_uplink(ifindex, flags, Ipv4Addr::UNSPECIFIED);
    }

    /// [`Self::set_external_iface`], with flows leaving by it sent from `snat` (an address
    /// NodePorts may not answer on: then add it as the attach thread does, with
    /// [`Self::add_snat_only_addr`]).
    pub fn set_uplink(&self, ifindex: u32, flags: u32, snat: Ipv4Addr) {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_EXTERNAL_IFACES)).expect("ifaces");
        let mut map: BpfHashMap<_, u32, ExternalIface> = Map::HashMap(data).try_into().unwrap();
        let value = ExternalIface {
            flags,
            snat_addr: Be32::from_octets(snat.octets()),
            ..ExternalIface::default()
        };
        map.insert(ifindex, value, 0).unwrap();
    }

    /// Adds `addr` to NODE_ADDRS as an address NodePorts do not answer on, only replies to the
    /// flows sent from it.
    pub fn add_snat_only_addr(&self, addr: Ipv4Addr) {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_NODE_ADDRS)).expect("node addrs");
        let mut map: BpfHashMap<_, u32, u32> = Map::HashMap(data).try_into().unwrap();
        map.insert(
            Be32::from_octets(addr.octets()).raw(),
            NODE_ADDR_SNAT_ONLY,
            0,
        )
        .unwrap();
    }

    /// How many packets were dropped for `reason` (`proxy_common::DROP_*`), on all CPUs.
    pub fn drops(&self, reason: u32) -> u64 {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_DROPS)).expect("drops");
        let map: PerCpuArray<_, u64> = Map::PerCpuArray(data).try_into().unwrap();
        map.get(&reason, 0).unwrap().iter().sum()
    }

    /// Forgets the ICMP errors every CPU sent lately: the next
    /// [`proxy_common::ICMP_ERRORS_BURST`] are due
    /// at once (for tests that send more rejects than the pace allows, as a long fuzz does).
    pub fn reset_icmp_pace(&self) {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_DROPS)).expect("drops");
        let mut map: PerCpuArray<_, u64> = Map::PerCpuArray(data).try_into().unwrap();
        let cpus = aya::util::nr_cpus().expect("counting the CPUs");
        let zeros = PerCpuValues::try_from(vec![0u64; cpus]).unwrap();
        map.set(DROPS_ICMP_PACE, zeros, 0).unwrap();
    }

    /// The conntrack map, opened from its pin (to inspect entries, or age them as time would).
    pub fn conntrack(&self) -> BpfHashMap<MapData, CtKey, CtValue> {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_CONNTRACK)).expect("conntrack pin");
        Map::LruHashMap(data).try_into().expect("conntrack map")
    }

    /// Runs `prog` `repeat` times on `frame` in the kernel; the mean time per run.
    pub fn time(&self, prog: &str, frame: &[u8], repeat: u32) -> anyhow::Result<Duration> {
        self.time_verdict(prog, frame, repeat).map(|(_, took)| took)
    }

    /// [`Programs::time`], with the verdict of the runs.
    pub fn time_verdict(
        &self,
        prog: &str,
        frame: &[u8],
        repeat: u32,
    ) -> anyhow::Result<(u32, Duration)> {
        let (verdict, _, took) = self.test_run(prog, frame, None, repeat)?;
        Ok((verdict, took))
    }
}

/// A ClusterIP service port, for building desired states by hand.
pub struct Svc<'a> {
    pub name: &'a str,
    pub vip: Ipv4Addr,
    pub port: u16,
    pub protocol: Protocol,
    pub endpoints: &'a [(Ipv4Addr, u16)],
}

/// The `struct xdp_md` test-run context of `frame` received on `ingress_ifindex`: data,
/// data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex (the kernel wants
/// data_end = the frame's length, no metadata).
fn xdp_md(frame: &[u8], ingress_ifindex: u32) -> [u8; 24] {
    let mut ctx = [0u8; 24];
    ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
    ctx[12..16].copy_from_slice(&ingress_ifindex.to_ne_bytes());
    ctx
}

pub fn spn(name: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName::new(NamespacedName::new("default", name), "p", protocol)
}

/// Adds `svc` (its endpoints all ready) to `state`; returns its port name.
pub fn add_service(state: &mut DesiredState, svc: &Svc<'_>) -> ServicePortName {
    let key = spn(svc.name, svc.protocol);
    state.insert_port(
        key.clone(),
        ServicePort {
            cluster_ips: [IpAddr::V4(svc.vip)].into(),
            port: svc.port,
            protocol: svc.protocol,
            target_port: TargetPort::Name("p".into()),
            node_port: None,
            external_ips: Box::default(),
            load_balancer_ips: Box::default(),
            session_affinity_timeout: None,
            external_traffic_local: false,
            internal_traffic_local: false,
            lb_algorithm: None,
            source_ranges: Box::default(),
            health_check_node_port: None,
        },
    );
    let endpoints = svc
        .endpoints
        .iter()
        .map(|(ip, port)| ready_endpoint((*ip).into(), *port))
        .collect();
    state.set_endpoints(key.clone(), endpoints);
    key
}

/// A ready endpoint at `ip`:`port`, on no node.
pub fn ready_endpoint(ip: IpAddr, port: u16) -> Endpoint {
    Endpoint {
        ip,
        port,
        ready: true,
        serving: true,
        terminating: false,
        placement: None,
    }
}

/// A service port with frontends for clients outside the node (NodePort, LoadBalancer and
/// external IPs), its endpoints each on a named node: those on [`DesiredState::node_name`] are
/// local.
pub struct ExternalSvc<'a> {
    pub name: &'a str,
    pub cluster_ip: Ipv4Addr,
    pub port: u16,
    pub protocol: Protocol,
    pub node_port: Option<u16>,
    pub load_balancer_ips: &'a [Ipv4Addr],
    pub external_ips: &'a [Ipv4Addr],
    /// externalTrafficPolicy Local.
    pub external_traffic_local: bool,
    /// loadBalancerSourceRanges.
    pub source_ranges: &'a [(Ipv4Addr, u8)],
    /// Address, port and node of each endpoint (all ready).
    pub endpoints: &'a [(Ipv4Addr, u16, &'a str)],
}

/// Adds `svc` to `state`; returns its port name.
pub fn add_external_service(state: &mut DesiredState, svc: &ExternalSvc<'_>) -> ServicePortName {
    let endpoints: Vec<(Ipv4Addr, u16)> = svc.endpoints.iter().map(|e| (e.0, e.1)).collect();
    let key = add_service(
        state,
        &Svc {
            name: svc.name,
            vip: svc.cluster_ip,
            port: svc.port,
            protocol: svc.protocol,
            endpoints: &endpoints,
        },
    );
    let sp = state.port_mut(&key).expect("just added");
    let v4 = |ips: &[Ipv4Addr]| ips.iter().copied().map(IpAddr::V4).collect();
    sp.node_port = svc.node_port;
    sp.load_balancer_ips = v4(svc.load_balancer_ips);
    sp.external_ips = v4(svc.external_ips);
    sp.external_traffic_local = svc.external_traffic_local;
    sp.source_ranges = svc
        .source_ranges
        .iter()
        .map(|(ip, len)| Cidr::v4(*ip, *len))
        .collect();
    state.edit_endpoints(&key, |eps| {
        for (ep, (_, _, node)) in eps.iter_mut().zip(svc.endpoints) {
            ep.placement = Placement::shared(Some(node), None);
        }
    });
    key
}
