//! The BPF programs loaded for BPF_PROG_TEST_RUN, with their maps pinned on a private bpffs,
//! programmed through the agent's own map writer. Shared by the datapath tests and the bench.
use std::{
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use anyhow::Context;
use aya::{
    Ebpf,
    maps::{HashMap as BpfHashMap, Map, MapData},
    programs::{SchedClassifier, TestRun, TestRunOptions},
};
use proxy_common::{CtKey, CtValue, MAP_CONNTRACK};
use proxy_userspace::{
    dataplane::Scope,
    ebpf::{self, MapSizes, ServiceMaps, WriterConfig, bpffs, maps::DEFAULT_DRAIN_PERIOD},
    model::{
        DesiredState, Endpoint, NamespacedName, Protocol, ServicePort, ServicePortName, TargetPort,
    },
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
    pub maps: ServiceMaps,
    // Dropped last: the maps are pinned there.
    pub bpffs: PrivateBpffs,
}

/// Verdicts the tc programs return.
/// "No verdict": the packet goes on to the next tc program (tcx: TCX_NEXT).
pub const TC_ACT_UNSPEC: u32 = u32::MAX;
pub const TC_ACT_SHOT: u32 = 2;

impl Programs {
    /// The programs and maps, with the agent's default drain period.
    pub fn load(sizes: MapSizes) -> anyhow::Result<Self> {
        Self::load_draining(sizes, DEFAULT_DRAIN_PERIOD)
    }

    /// The programs and maps; removed endpoints and services drain for `drain_period`.
    pub fn load_draining(sizes: MapSizes, drain_period: Duration) -> anyhow::Result<Self> {
        let bpffs = PrivateBpffs::new()?;
        let mut ebpf = ebpf::load(bpffs.path(), sizes)?;
        let writer = WriterConfig {
            drain_period,
            ..WriterConfig::default()
        };
        let maps = ServiceMaps::take_from(&mut ebpf, writer)?;
        Ok(Self { ebpf, maps, bpffs })
    }

    /// Programs `state` into the maps (a full sync, as the agent's first one).
    pub fn program(&mut self, state: &DesiredState) -> anyhow::Result<()> {
        self.maps.sync(state, Scope::All)
    }

    fn prog(&self, name: &str) -> &SchedClassifier {
        self.ebpf
            .program(name)
            .expect("program in the object")
            .try_into()
            .expect("a tc program")
    }

    /// Runs `prog` once on `frame`: the verdict and the frame as the program left it.
    pub fn run(&self, prog: &str, frame: &[u8]) -> (u32, Vec<u8>) {
        let (verdict, out, _) = self.run_timed(prog, frame);
        (verdict, out)
    }

    /// [`Programs::run`], also returning how long the run took in the kernel.
    pub fn run_timed(&self, prog: &str, frame: &[u8]) -> (u32, Vec<u8>, Duration) {
        let mut out = vec![0u8; frame.len() + 256];
        let result = self
            .prog(prog)
            .test_run(TestRunOptions {
                data_in: Some(frame),
                data_out: Some(&mut out),
                repeat: 1,
                ..Default::default()
            })
            .with_context(|| format!("BPF_PROG_TEST_RUN of {prog}"))
            .unwrap();
        out.truncate(result.data_size_out as usize);
        (result.return_value, out, result.duration)
    }

    /// The conntrack map, opened from its pin (to inspect entries, or age them as time would).
    pub fn conntrack(&self) -> BpfHashMap<MapData, CtKey, CtValue> {
        let data = MapData::from_pin(self.bpffs.path().join(MAP_CONNTRACK)).expect("conntrack pin");
        Map::LruHashMap(data).try_into().expect("conntrack map")
    }

    /// Runs `prog` `repeat` times on `frame` in the kernel; the mean time per run.
    pub fn time(&self, prog: &str, frame: &[u8], repeat: u32) -> anyhow::Result<Duration> {
        let mut out = vec![0u8; frame.len() + 256];
        let result = self.prog(prog).test_run(TestRunOptions {
            data_in: Some(frame),
            data_out: Some(&mut out),
            repeat,
            ..Default::default()
        })?;
        Ok(result.duration)
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

pub fn spn(name: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName::new(NamespacedName::new("default", name), "p", protocol)
}

/// Adds `svc` (its endpoints all ready) to `state`; returns its port name.
pub fn add_service(state: &mut DesiredState, svc: &Svc<'_>) -> ServicePortName {
    let key = spn(svc.name, svc.protocol);
    state.services.insert(
        key.clone(),
        ServicePort {
            cluster_ips: vec![IpAddr::V4(svc.vip)],
            port: svc.port,
            protocol: svc.protocol,
            target_port: TargetPort::Name("p".into()),
            node_port: None,
            external_ips: vec![],
            load_balancer_ips: vec![],
            session_affinity_timeout: None,
            external_traffic_local: false,
            internal_traffic_local: false,
            lb_algorithm: None,
            source_ranges: vec![],
            health_check_node_port: None,
        },
    );
    let endpoints = svc
        .endpoints
        .iter()
        .map(|(ip, port)| Endpoint {
            ip: IpAddr::V4(*ip),
            port: *port,
            ready: true,
            serving: true,
            terminating: false,
            node_name: None,
            zone: None,
        })
        .collect();
    state.endpoints.insert(key.clone(), endpoints);
    key
}
