//! The ebpf mode: tc programs on pod-facing interfaces and socket programs for host-network
//! clients, driven by pinned BPF hash maps.
mod attach;
mod batch;
pub mod bpffs;
pub mod cgroup;
pub mod external;
pub mod features;
pub mod inspect;
mod link_events;
pub mod maglev;
pub mod netfilter_flows;
pub mod plan;
pub mod pod_interfaces;
pub mod sctp;
mod stale_sockets;
mod tc_link;
pub mod writer;

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use anyhow::{Context, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapInfo, MapType, PerCpuArray, ProgramArray},
    programs::{ProgramError, SchedClassifier, Xdp},
};
use proxy_common::{
    AGENT_STATE_ENTRIES, AGENT_STATE_LAYOUT, AGENT_STATE_NEXT_BACKEND_ID, AffinityKey,
    AffinityValue, Backend, Be128, CONFIG_ENTRIES, CT_STATE_TCP_ESTABLISHED,
    CT_STATE_TCP_HALF_CLOSED, CT_STATE_TCP_OPENING, CT_STATE_UDP, CT_STATES, CtKey, CtValue,
    DROP_REASON_NAMES, DROPS_ENTRIES, ExternalIface, FAMILY_PROG_EGRESS6, FAMILY_PROG_EXT_EGRESS6,
    FAMILY_PROG_EXT_INGRESS6, FAMILY_PROG_INGRESS6, FAMILY_PROGS_ENTRIES, FRAGMENTS_MAX, FragKey,
    FragKey6, FragValue, HOST_NETNS_ENTRIES, LAYOUT_VERSION, MAP_AFFINITY, MAP_AFFINITY6,
    MAP_AGENT_STATE, MAP_BACKENDS, MAP_BACKENDS6, MAP_CONFIG, MAP_CONNTRACK, MAP_CONNTRACK6,
    MAP_CT_LIFETIMES, MAP_DROPS, MAP_EXTERNAL_IFACES, MAP_FAMILY_PROGS, MAP_FRAGMENTS,
    MAP_FRAGMENTS6, MAP_HOST_NETNS, MAP_MAGLEV, MAP_MAGLEV6, MAP_NODE_ADDRS, MAP_NODE_ADDRS6,
    MAP_PRIMARY_ADDR6, MAP_SERVICES, MAP_SERVICES6, MAP_SOCK_REVNAT, MAP_SOCK_REVNAT6,
    MAP_SOURCE_IFACES, MAP_SOURCE_RANGES, MAP_SOURCE_RANGES6, MAP_XDP_FAMILY_PROGS, MaglevChunk,
    ServiceKey, ServiceValue, SockRevNatKey, SockRevNatValue, SourceRangeKey,
    XDP_FAMILY_PROGS_ENTRIES, XDP_PROG_IPV6, XDP_PROG_NEW_FLOW6,
};

use attach::detach_all;
pub use attach::{Attacher, ExternalConfig};
pub use writer::{MapWriter, WriterConfig};

use self::{
    external::{SnatPorts, XdpMode},
    features::{Features, MEMCG_ACCOUNTING, NETNS_COOKIE, SET_RETVAL},
    pod_interfaces::PodInterfaces,
};
use super::CtLifetimes;
use crate::{
    dataplane::{Dataplane, Scope},
    model::{DesiredState, Family},
    netfilter::rules::NetfilterConfig,
    node::NodePortAddresses,
};

/// The BPF object, embedded at build time (empty when built without bpf-linker).
pub static BPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf.o"));

pub const PROG_INGRESS: &str = "tc_ingress";
pub const PROG_EGRESS: &str = "tc_egress";
/// The IPv6 halves of [`PROG_INGRESS`] and [`PROG_EGRESS`] (tail-called, never attached).
pub const PROG_INGRESS6: &str = "tc_ingress6";
pub const PROG_EGRESS6: &str = "tc_egress6";
pub const PROG_EXT_INGRESS6: &str = "tc_external_ingress6";
pub const PROG_EXT_EGRESS6: &str = "tc_external_egress6";
pub const PROG_XDP: &str = "xdp_external";
/// The IPv6 half of [`PROG_XDP`], and where it starts new flows (tail-called, never attached).
pub const PROG_XDP6: &str = "xdp_external6";
pub const PROG_XDP_NEW_FLOW6: &str = "xdp_new_flow6";
pub const PROG_EXT_INGRESS: &str = "tc_external_ingress";
pub const PROG_EXT_EGRESS: &str = "tc_external_egress";

/// Map sizes, in entries. The defaults fit 100k service ports with ~10 endpoints each and 1M
/// IPv4 flows (two conntrack entries a flow). The IPv6 maps take the same sizes, but for
/// conntrack: preallocated (an LRU map), it would cost every node some 330 MiB of kernel memory
/// at IPv4's size, IPv4-only nodes included, so it has a size of its own.
#[derive(Clone, Copy, Debug)]
pub struct MapSizes {
    pub services: u32,
    pub backends: u32,
    pub conntrack: u32,
    pub conntrack6: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: 1 << 21,
            backends: 1 << 20,
            conntrack: 1 << 21,
            // 128k IPv6 flows, about 37 MiB.
            conntrack6: 1 << 18,
        }
    }
}

/// Loads the XDP program `name`; its fd.
fn load_xdp(ebpf: &mut Ebpf, name: &str) -> anyhow::Result<aya::programs::ProgramFd> {
    let xdp: &mut Xdp = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the BPF object"))?
        .try_into()?;
    load_retrying(name, || xdp.load())?;
    Ok(xdp.fd()?.try_clone()?)
}

/// Empties `index` of the program array `map`: a program left there by an earlier agent (the
/// array is pinned) must not serve where this one's was refused.
fn clear_program(ebpf: &mut Ebpf, map: &str, index: u32) -> anyhow::Result<()> {
    let mut array: ProgramArray<_> = ebpf
        .map_mut(map)
        .with_context(|| format!("map {map} missing"))?
        .try_into()?;
    match array.clear_index(&index) {
        // Never filled.
        Err(aya::maps::MapError::SyscallError(e))
            if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        r => r.with_context(|| format!("emptying {map}[{index}]")),
    }
}

/// Puts the loaded program `name` (`fd`) at `index` of the program array `map`.
fn put_program(
    ebpf: &mut Ebpf,
    map: &str,
    index: u32,
    name: &str,
    fd: &aya::programs::ProgramFd,
) -> anyhow::Result<()> {
    let mut array: ProgramArray<_> = ebpf
        .map_mut(map)
        .with_context(|| format!("map {map} missing"))?
        .try_into()?;
    array
        .set(index, fd, 0)
        .with_context(|| format!("putting {name} in {map}"))
}

/// Loads the tc and XDP programs (the socket programs are loaded when attached:
/// [`cgroup::attach`]), reusing the maps already pinned in `pin_dir` (so flows and services
/// survive an agent restart) or creating and pinning them there.
pub fn load(pin_dir: &Path, sizes: MapSizes) -> anyhow::Result<Loaded> {
    if BPF_OBJECT.is_empty() {
        bail!(
            "this binary was built without the BPF object; run `cargo xtask build-ebpf` and \
             rebuild, or pick another --proxy-mode"
        );
    }
    bpffs::ensure(pin_dir)?;
    let empty = !filled(pin_dir);
    let (next_backend_id, recreated) = check_pinned_layout(pin_dir)?;
    warn_on_size_changes(pin_dir, sizes);
    let features = Features::of_this_kernel()?;
    features.check()?;
    let has_set_retval = u8::from(features.has(&SET_RETVAL));
    let mut loader = EbpfLoader::new();
    loader
        .default_map_pin_directory(pin_dir)
        .map_max_entries(MAP_SERVICES, sizes.services)
        .map_max_entries(MAP_BACKENDS, sizes.backends)
        .map_max_entries(MAP_CONNTRACK, sizes.conntrack)
        .map_max_entries(MAP_SERVICES6, sizes.services)
        .map_max_entries(MAP_BACKENDS6, sizes.backends)
        .map_max_entries(MAP_CONNTRACK6, sizes.conntrack6)
        .override_global(GLOBAL_HAS_SET_RETVAL, &has_set_retval, true);
    if !features.has(&MEMCG_ACCOUNTING) {
        lift_memlock_limit()?;
        // Such kernels refuse a map whose memory cost reaches 4 GiB (1M chunks of 4 KiB).
        loader.map_max_entries(MAP_MAGLEV, 1 << 19);
        loader.map_max_entries(MAP_MAGLEV6, 1 << 19);
    }
    let mut ebpf = loader.load(BPF_OBJECT).with_context(|| {
        format!(
            "loading the BPF programs (maps pinned in {}); the agent needs CAP_BPF, \
                 CAP_NET_ADMIN and CAP_PERFMON, or root",
            pin_dir.display()
        )
    })?;
    for name in [PROG_INGRESS, PROG_EGRESS, PROG_EXT_INGRESS, PROG_EXT_EGRESS] {
        load_classifier(&mut ebpf, name)?;
    }
    // The IPv6 halves of the tc programs, which those tail-call: in place before anything is
    // attached.
    // Pinned, so the programs serving now (an earlier agent's, until these are attached) call
    // these too: the maps they share have the same layout (check_pinned_layout).
    // One the kernel's verifier refuses is left out (see `refused_ipv6`): its slot stays empty,
    // and the IPv4 program passes what it would have handled on untouched.
    let mut refused = Vec::new();
    for (index, name) in [
        (FAMILY_PROG_INGRESS6, PROG_INGRESS6),
        (FAMILY_PROG_EGRESS6, PROG_EGRESS6),
        (FAMILY_PROG_EXT_INGRESS6, PROG_EXT_INGRESS6),
        (FAMILY_PROG_EXT_EGRESS6, PROG_EXT_EGRESS6),
    ] {
        let loaded = load_classifier(&mut ebpf, name).and_then(|p| Ok(p.fd()?.try_clone()?));
        match loaded {
            Ok(fd) => put_program(&mut ebpf, MAP_FAMILY_PROGS, index, name, &fd)?,
            Err(e) if refused_by_verifier(&e) => {
                clear_program(&mut ebpf, MAP_FAMILY_PROGS, index)?;
                refused.push((name, e));
            }
            Err(e) => return Err(e),
        }
    }
    let xdp: &mut Xdp = ebpf
        .program_mut(PROG_XDP)
        .with_context(|| format!("program {PROG_XDP} missing from the BPF object"))?
        .try_into()?;
    load_retrying(PROG_XDP, || xdp.load())?;
    // XDP's IPv6 programs, which it tail-calls (XDP programs call only XDP programs: an array
    // of their own). Without them, XDP leaves IPv6 to the tc programs.
    for (index, name) in [
        (XDP_PROG_IPV6, PROG_XDP6),
        (XDP_PROG_NEW_FLOW6, PROG_XDP_NEW_FLOW6),
    ] {
        match load_xdp(&mut ebpf, name) {
            Ok(fd) => put_program(&mut ebpf, MAP_XDP_FAMILY_PROGS, index, name, &fd)?,
            Err(e) if refused_by_verifier(&e) => {
                clear_program(&mut ebpf, MAP_XDP_FAMILY_PROGS, index)?;
                refused.push((name, e));
            }
            Err(e) => return Err(e),
        }
    }
    warn_refused_ipv6(&refused);
    let mut state: Array<_, u64> = ebpf
        .map_mut(MAP_AGENT_STATE)
        .context("map AGENT_STATE missing")?
        .try_into()?;
    if let Some(id) = next_backend_id {
        state.set(AGENT_STATE_NEXT_BACKEND_ID, id, 0)?;
    }
    state.set(AGENT_STATE_LAYOUT, LAYOUT_VERSION, 0)?;
    Ok(Loaded {
        ebpf,
        recreated,
        empty,
        refused_ipv6: refused.into_iter().map(|(name, _)| name).collect(),
    })
}

/// Whether `e` (from [`load_retrying`]) is the verifier's refusal of a program, rather than a
/// missing program or permission.
fn refused_by_verifier(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<ProgramError>(),
        Some(ProgramError::LoadError { io_error, .. })
            if matches!(io_error.raw_os_error(), Some(libc::EACCES | libc::E2BIG | libc::EINVAL))
    )
}

/// Says which IPv6 programs this kernel's verifier refused, and what goes unserved for it.
/// Older verifiers count each function's stack in 32-byte units and give up sooner: the IPv6
/// programs, whose addresses are four words each, are the largest.
fn warn_refused_ipv6(refused: &[(&str, anyhow::Error)]) {
    for (name, e) in refused {
        let what = match *name {
            PROG_INGRESS6 | PROG_EGRESS6 => "pods' IPv6 Service traffic (cluster IPs) is",
            PROG_EXT_INGRESS6 | PROG_EXT_EGRESS6 => {
                "IPv6 NodePorts, external IPs and load balancer addresses are"
            }
            _ => "XDP's IPv6 path (the tc programs serve it instead) is",
        };
        let reason = format!("{:#}", e.root_cause());
        let reason = reason.lines().next().unwrap_or_default();
        tracing::warn!(
            program = name,
            "this kernel's verifier refuses {name} ({reason}): {what} not served by the ebpf \
             mode on this node (the nftables and iptables modes serve IPv6 here)"
        );
    }
}

/// Loads the tc program `name` of `ebpf`.
fn load_classifier<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut SchedClassifier> {
    let prog: &mut SchedClassifier = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the BPF object"))?
        .try_into()?;
    load_retrying(name, || prog.load())?;
    Ok(prog)
}

/// Loads a program through `load`, again while the kernel answers EAGAIN: its verifier gives up
/// when a signal is pending for the loading thread (a child process of ours ending, say), as
/// libbpf knows (it tries 5 times).
pub(crate) fn load_retrying(
    name: &str,
    mut load: impl FnMut() -> Result<(), ProgramError>,
) -> anyhow::Result<()> {
    const ATTEMPTS: u32 = 5;
    let mut attempt = 1;
    loop {
        match load() {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && attempt < ATTEMPTS =>
            {
                attempt += 1;
            }
            r => return r.with_context(|| format!("the kernel's verifier rejected {name}")),
        }
    }
}

/// The loaded programs, and whether a pinned map of another layout was recreated for them
/// (empty where the programs serving now, an earlier agent's, read their own old map), or
/// the maps held no service (created now, or left by a run that stopped before its first
/// sync): no program of this mode serves from them yet.
pub struct Loaded {
    pub ebpf: Ebpf,
    pub recreated: bool,
    pub empty: bool,
    /// The IPv6 programs this kernel's verifier refused (left out, see `warn_refused_ipv6`).
    pub refused_ipv6: Vec<&'static str>,
}

/// The constant of the socket programs that says whether they may call bpf_set_retval.
const GLOBAL_HAS_SET_RETVAL: &str = "HAS_SET_RETVAL";

/// Kernels before 5.11 charge map memory to RLIMIT_MEMLOCK (a few MiB by default).
fn lift_memlock_limit() -> anyhow::Result<()> {
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads the one struct passed.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) } != 0 {
        return Err(std::io::Error::last_os_error())
            .context("lifting RLIMIT_MEMLOCK for the maps (needs CAP_SYS_RESOURCE or root)");
    }
    Ok(())
}

/// A pinned map as this build lays it out.
struct Layout {
    name: &'static str,
    map_type: MapType,
    key_size: usize,
    value_size: usize,
    /// For arrays, whose indexes have meanings: the entries this build uses.
    entries: Option<u32>,
}

const LAYOUTS: [Layout; 28] = [
    Layout {
        name: MAP_SERVICES,
        map_type: MapType::Hash,
        key_size: size_of::<ServiceKey>(),
        value_size: size_of::<ServiceValue>(),
        entries: None,
    },
    Layout {
        name: MAP_BACKENDS,
        map_type: MapType::Hash,
        key_size: size_of::<u32>(),
        value_size: size_of::<Backend>(),
        entries: None,
    },
    Layout {
        name: MAP_CONNTRACK,
        map_type: MapType::LruHash,
        key_size: size_of::<CtKey>(),
        value_size: size_of::<CtValue>(),
        entries: None,
    },
    Layout {
        name: MAP_AGENT_STATE,
        map_type: MapType::Array,
        key_size: size_of::<u32>(),
        value_size: size_of::<u64>(),
        entries: Some(AGENT_STATE_ENTRIES),
    },
    Layout {
        name: MAP_AFFINITY,
        map_type: MapType::LruHash,
        key_size: size_of::<AffinityKey>(),
        value_size: size_of::<AffinityValue>(),
        entries: None,
    },
    Layout {
        name: MAP_MAGLEV,
        map_type: MapType::Hash,
        key_size: size_of::<ServiceKey>(),
        value_size: size_of::<MaglevChunk>(),
        entries: None,
    },
    Layout {
        name: MAP_CONFIG,
        map_type: MapType::Array,
        key_size: size_of::<u32>(),
        value_size: size_of::<u32>(),
        entries: Some(CONFIG_ENTRIES),
    },
    Layout {
        name: MAP_DROPS,
        map_type: MapType::PerCpuArray,
        key_size: size_of::<u32>(),
        value_size: size_of::<u64>(),
        entries: Some(DROPS_ENTRIES),
    },
    Layout {
        name: MAP_SOCK_REVNAT,
        map_type: MapType::LruHash,
        key_size: size_of::<SockRevNatKey>(),
        value_size: size_of::<SockRevNatValue>(),
        entries: None,
    },
    Layout {
        name: MAP_HOST_NETNS,
        map_type: MapType::Array,
        key_size: size_of::<u32>(),
        value_size: size_of::<u64>(),
        entries: Some(HOST_NETNS_ENTRIES),
    },
    Layout {
        name: MAP_NODE_ADDRS,
        map_type: MapType::Hash,
        key_size: size_of::<u32>(),
        value_size: size_of::<u32>(),
        entries: None,
    },
    Layout {
        name: MAP_EXTERNAL_IFACES,
        map_type: MapType::Hash,
        key_size: size_of::<u32>(),
        value_size: size_of::<ExternalIface>(),
        entries: None,
    },
    Layout {
        name: MAP_SOURCE_RANGES,
        map_type: MapType::LpmTrie,
        // The trie's key: a prefix length, then the data.
        key_size: size_of::<u32>() + size_of::<SourceRangeKey>(),
        value_size: size_of::<u8>(),
        entries: None,
    },
    Layout {
        name: MAP_FRAGMENTS,
        map_type: MapType::LruHash,
        key_size: size_of::<FragKey>(),
        value_size: size_of::<FragValue>(),
        entries: Some(FRAGMENTS_MAX),
    },
    Layout {
        name: MAP_SOURCE_IFACES,
        map_type: MapType::Hash,
        key_size: size_of::<u32>(),
        value_size: size_of::<u32>(),
        entries: None,
    },
    Layout {
        name: MAP_CT_LIFETIMES,
        map_type: MapType::Array,
        key_size: size_of::<u32>(),
        value_size: size_of::<u64>(),
        entries: Some(CT_STATES),
    },
    Layout {
        name: MAP_FAMILY_PROGS,
        map_type: MapType::ProgramArray,
        key_size: size_of::<u32>(),
        value_size: size_of::<u32>(),
        entries: Some(FAMILY_PROGS_ENTRIES),
    },
    Layout {
        name: MAP_SERVICES6,
        map_type: MapType::Hash,
        key_size: size_of::<ServiceKey<Be128>>(),
        value_size: size_of::<ServiceValue>(),
        entries: None,
    },
    Layout {
        name: MAP_BACKENDS6,
        map_type: MapType::Hash,
        key_size: size_of::<u32>(),
        value_size: size_of::<Backend<Be128>>(),
        entries: None,
    },
    Layout {
        name: MAP_CONNTRACK6,
        map_type: MapType::LruHash,
        key_size: size_of::<CtKey<Be128>>(),
        value_size: size_of::<CtValue<Be128>>(),
        entries: None,
    },
    Layout {
        name: MAP_AFFINITY6,
        map_type: MapType::LruHash,
        key_size: size_of::<AffinityKey<Be128>>(),
        value_size: size_of::<AffinityValue>(),
        entries: None,
    },
    Layout {
        name: MAP_MAGLEV6,
        map_type: MapType::Hash,
        key_size: size_of::<ServiceKey<Be128>>(),
        value_size: size_of::<MaglevChunk>(),
        entries: None,
    },
    Layout {
        name: MAP_NODE_ADDRS6,
        map_type: MapType::Hash,
        key_size: size_of::<Be128>(),
        value_size: size_of::<u32>(),
        entries: None,
    },
    Layout {
        name: MAP_SOCK_REVNAT6,
        map_type: MapType::LruHash,
        key_size: size_of::<SockRevNatKey<Be128>>(),
        value_size: size_of::<SockRevNatValue<Be128>>(),
        entries: None,
    },
    Layout {
        name: MAP_XDP_FAMILY_PROGS,
        map_type: MapType::ProgramArray,
        key_size: size_of::<u32>(),
        value_size: size_of::<u32>(),
        entries: Some(XDP_FAMILY_PROGS_ENTRIES),
    },
    Layout {
        name: MAP_PRIMARY_ADDR6,
        map_type: MapType::Array,
        key_size: size_of::<u32>(),
        value_size: size_of::<Be128>(),
        entries: Some(1),
    },
    Layout {
        name: MAP_SOURCE_RANGES6,
        map_type: MapType::LpmTrie,
        key_size: size_of::<u32>() + size_of::<SourceRangeKey<Be128>>(),
        value_size: size_of::<u8>(),
        entries: None,
    },
    Layout {
        name: MAP_FRAGMENTS6,
        map_type: MapType::LruHash,
        key_size: size_of::<FragKey6>(),
        value_size: size_of::<FragValue>(),
        entries: Some(FRAGMENTS_MAX),
    },
];

/// Maps pinned by another release are reused only if this build reads them right: the same
/// type and key and value sizes, and a layout version this build knows (its own or an older
/// one it reads as is). Any other pin is removed, with a log line saying what that resets, and
/// the load creates the map afresh. Returns the next backend id an older AGENT_STATE held, to
/// carry over into a recreated one (ids must never be reused while conntrack may name them),
/// and whether any pin was removed.
fn check_pinned_layout(pin_dir: &Path) -> anyhow::Result<(Option<u64>, bool)> {
    let state_pin = pin_dir.join(MAP_AGENT_STATE);
    let (version, next_backend_id) = match aya::maps::MapData::from_pin(&state_pin) {
        Ok(data) => {
            let entries = data.info()?.max_entries();
            let state: Array<_, u64> = aya::maps::Map::Array(data).try_into()?;
            let next = state.get(&AGENT_STATE_NEXT_BACKEND_ID, 0).ok();
            // Layout 1 had no version entry.
            let version = match entries > AGENT_STATE_LAYOUT {
                true => state.get(&AGENT_STATE_LAYOUT, 0).unwrap_or(1),
                false => 1,
            };
            (Some(version), next)
        }
        Err(_) => (None, None),
    };
    // Layout 1 maps mean what layout 2 reads (ids shared by services are adopted by one
    // service port; no entry is draining yet): reused as they are. Likewise layouts 2 and 3
    // for layout 4 (no external frontend, zero NAT fields in conntrack).
    let newer = version.is_some_and(|v| v > LAYOUT_VERSION);
    let mut recreated = false;
    for layout in &LAYOUTS {
        let pin = pin_dir.join(layout.name);
        let Ok(info) = MapInfo::from_pin(&pin) else {
            continue;
        };
        let fits = info.map_type().ok() == Some(layout.map_type)
            && info.key_size() as usize == layout.key_size
            && info.value_size() as usize == layout.value_size
            && layout.entries.is_none_or(|n| info.max_entries() == n);
        if fits && !newer {
            continue;
        }
        let what = match layout.name {
            MAP_CONNTRACK | MAP_CONNTRACK6 => "established flows are reset",
            MAP_SERVICES | MAP_BACKENDS | MAP_SERVICES6 | MAP_BACKENDS6 => {
                "services are programmed again by the first sync"
            }
            MAP_SOCK_REVNAT => {
                "host-network sockets connected earlier show their backend, not the service, \
                 as their peer"
            }
            MAP_AFFINITY | MAP_AFFINITY6 => "session affinity starts afresh",
            MAP_DROPS => "drop counters start from 0",
            MAP_FRAGMENTS | MAP_FRAGMENTS6 => "fragments in flight are dropped",
            _ => "this agent writes it again",
        };
        tracing::warn!(
            map = layout.name,
            pinned_layout = version.unwrap_or(1),
            layout = LAYOUT_VERSION,
            "the pinned map was left by an agent of another layout ({:?}, key {} bytes, value \
             {} bytes, {} entries); this one uses ({:?}, key {}, value {}): recreating it \
             ({what})",
            info.map_type().ok(),
            info.key_size(),
            info.value_size(),
            info.max_entries(),
            layout.map_type,
            layout.key_size,
            layout.value_size,
        );
        std::fs::remove_file(&pin).with_context(|| format!("removing {}", pin.display()))?;
        recreated = true;
    }
    Ok((next_backend_id, recreated))
}

/// The programs' drop counters (summed over CPUs), read from the loaded object, exported on
/// `/metrics` as `kubeproxy_bpf_dropped_packets_total{reason}`.
fn export_drop_counters(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let drops: PerCpuArray<_, u64> = ebpf
        .take_map(MAP_DROPS)
        .context("map DROPS missing")?
        .try_into()?;
    let drops = std::sync::Mutex::new(drops);
    crate::serve::metrics::METRICS.add_collector(Box::new(move |out| {
        use std::fmt::Write as _;
        let name = "kubeproxy_bpf_dropped_packets_total";
        let help = "Packets the BPF programs dropped, by reason";
        crate::serve::metrics::header(out, name, help, "counter");
        let drops = drops.lock().unwrap();
        for (index, reason) in DROP_REASON_NAMES.iter().enumerate() {
            let total: u64 = drops
                .get(&(index as u32), 0)
                .map_or(0, |per_cpu| per_cpu.iter().sum());
            let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {total}");
        }
    }));
    Ok(())
}

/// Maps already pinned are reused as they are (that is what keeps services and flows across a
/// restart), so a changed size flag takes effect only once the pin is gone: say so.
fn warn_on_size_changes(pin_dir: &Path, sizes: MapSizes) {
    let wanted = [
        (MAP_SERVICES, sizes.services, "--bpf-services-max"),
        (MAP_BACKENDS, sizes.backends, "--bpf-backends-max"),
        (MAP_CONNTRACK, sizes.conntrack, "--bpf-ct-max"),
        (MAP_SERVICES6, sizes.services, "--bpf-services-max"),
        (MAP_BACKENDS6, sizes.backends, "--bpf-backends-max"),
        (MAP_CONNTRACK6, sizes.conntrack6, "--bpf-ct6-max"),
    ];
    for (name, size, flag) in wanted {
        let Ok(info) = aya::maps::MapInfo::from_pin(pin_dir.join(name)) else {
            continue;
        };
        if info.max_entries() != size {
            tracing::warn!(
                map = name,
                pinned = info.max_entries(),
                requested = size,
                "the pinned map keeps its size; {flag} applies once the agent is stopped and \
                 `proxy-userspace agent --cleanup` has removed the pins (flows are then reset)"
            );
        }
    }
}

/// `agent --cleanup`: detaches the programs from the interfaces and from the cgroup, and
/// removes everything the agent pinned under `pin_dir`.
pub fn cleanup(pin_dir: &Path) -> anyhow::Result<()> {
    let detached = detach_all(pin_dir)? + cgroup::detach_all(pin_dir)?;
    netfilter_flows::release();
    sctp::remove_tables()?;
    let mut removed = 0;
    // Only what the agent pinned: a bpffs root also holds the kernel's own `*.debug` files.
    for name in LAYOUTS.map(|l| l.name) {
        let path = pin_dir.join(name);
        match std::fs::remove_file(&path) {
            Ok(()) => removed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
        }
    }
    // detach_all emptied it; an empty pin dir goes too unless bpffs is mounted right there.
    let _ = std::fs::remove_dir(pin_dir.join("links"));
    let _ = std::fs::remove_dir(pin_dir);
    tracing::info!(detached, removed, pin_dir = %pin_dir.display(), "cleaned up");
    Ok(())
}

/// The directory the maps are pinned in by default (`--bpf-pin-dir`).
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/kube-proxy-ebpf";

/// What the mode starts with (the agent's `--bpf-*`, `--pod-interfaces`, `--xdp-mode` and
/// load-balancing flags), and the programs loaded ahead.
pub struct StartConfig {
    pub pin_dir: PathBuf,
    pub sizes: MapSizes,
    pub writer: WriterConfig,
    pub pod_interfaces: PodInterfaces,
    pub xdp_mode: XdpMode,
    pub snat_ports: SnatPorts,
    /// `--bpf-source-validation`.
    pub validate_sources: bool,
    /// `--bpf-cgroup-path`; empty: host-network clients are not served.
    pub cgroup_path: PathBuf,
    /// `--bpf-socket-lb`.
    pub socket_lb: cgroup::SocketLb,
    pub preload: Preload,
    /// Removes what the programs replace (another mode's rules, kube-proxy's): run just before
    /// they take over, so that those rules serve until then.
    pub remove_replaced: Option<RemoveReplaced>,
}

/// See [`StartConfig::remove_replaced`].
pub type RemoveReplaced = Box<dyn FnOnce() -> anyhow::Result<()> + Send>;

impl StartConfig {
    /// What [`prepare`] needs of it, to be sent to the preload's thread.
    pub fn prepare_config(&self) -> PrepareConfig {
        PrepareConfig {
            pin_dir: self.pin_dir.clone(),
            sizes: self.sizes,
            writer: self.writer,
            cgroup_path: self.cgroup_path.clone(),
            socket_lb: self.socket_lb,
        }
    }
}

/// See [`StartConfig::prepare_config`].
pub struct PrepareConfig {
    pin_dir: PathBuf,
    sizes: MapSizes,
    writer: WriterConfig,
    cgroup_path: PathBuf,
    socket_lb: cgroup::SocketLb,
}

/// The cgroup the socket programs go on, the agent's network namespace (its cookie) and
/// `--bpf-socket-lb`.
type HostClients = (PathBuf, u64, cgroup::SocketLb);

/// What can be made before the source's first view, touching none of the node's traffic: the
/// programs loaded (the socket programs too, where host-network clients are served), and the
/// map writer's record of what the pinned maps hold.
pub struct Prepared {
    loaded: Loaded,
    maps: MapWriter,
    host_clients: Option<HostClients>,
}

fn prepare(config: &PrepareConfig) -> anyhow::Result<Prepared> {
    let mut loaded = load(&config.pin_dir, config.sizes)?;
    let kernel = Features::of_this_kernel()?;
    let mut host_clients = None;
    if config.cgroup_path.as_os_str().is_empty() {
        tracing::warn!("--bpf-cgroup-path is empty: host-network clients do not reach services");
    } else if kernel.has(&NETNS_COOKIE) {
        let netns = cgroup::own_netns_cookie().context("the agent's network namespace")?;
        // Loaded while the object still holds every map (the writer takes some).
        cgroup::load_programs(&mut loaded.ebpf)?;
        host_clients = Some((config.cgroup_path.clone(), netns, config.socket_lb));
    }
    let maps = MapWriter::take_from(&mut loaded.ebpf, config.writer)?;
    Ok(Prepared {
        loaded,
        maps,
        host_clients,
    })
}

/// Starts the mode: the pin directory locked (held as long as the dataplane lives), the
/// programs loaded (ahead or now), the maps taken over, the programs attached (where the load
/// found the maps empty or recreated them, once the first sync has filled them). `node_ips`:
/// the Node object's addresses, for `node_port_addresses` (`--nodeport-addresses`). A failed
/// start removes whatever it pinned: another mode may follow. Pins another agent holds are
/// left alone.
pub fn start(
    node_ips: Vec<IpAddr>,
    node_port_addresses: NodePortAddresses,
    ct_lifetimes: CtLifetimes,
    netfilter: NetfilterConfig,
    config: &mut StartConfig,
) -> anyhow::Result<EbpfDataplane> {
    let lock = config.preload.lock(&config.pin_dir)?;
    let started = config
        .preload
        .prepare(&config.prepare_config())
        .and_then(|mut prepared| {
            ct_lifetimes.write(&mut prepared.loaded.ebpf)?;
            let external = ExternalConfig {
                addresses: node_port_addresses,
                primary: node_ips,
                mode: config.xdp_mode,
                snat_ports: config.snat_ports,
            };
            EbpfDataplane::new(prepared, config, external, netfilter)
        });
    match started {
        Ok(mut dp) => {
            tracing::info!(pin_dir = %config.pin_dir.display(), "ebpf dataplane loaded");
            dp.pin_dir_lock = Some(lock);
            Ok(dp)
        }
        Err(e) => {
            if let Err(cleanup) = cleanup(&config.pin_dir) {
                tracing::warn!("removing the partly started ebpf mode: {cleanup:#}");
            }
            Err(e)
        }
    }
}

impl CtLifetimes {
    /// Writes them into [`MAP_CT_LIFETIMES`] (zero: the programs' default,
    /// [`proxy_common::ct_lifetime_ns`]) before any program is attached; every state is
    /// written, so an earlier run's setting never outlives a flag's removal.
    fn write(&self, ebpf: &mut Ebpf) -> anyhow::Result<()> {
        let mut map: Array<_, u64> = ebpf
            .map_mut(MAP_CT_LIFETIMES)
            .context("map CT_LIFETIMES missing")?
            .try_into()?;
        let mut lifetimes = [0u64; CT_STATES as usize];
        for (state, lifetime) in [
            (CT_STATE_TCP_ESTABLISHED, self.tcp_established),
            (CT_STATE_TCP_OPENING, self.tcp_opening),
            (CT_STATE_TCP_HALF_CLOSED, self.tcp_half_closed),
            (CT_STATE_UDP, self.udp),
        ] {
            lifetimes[state as usize] = u64::try_from(lifetime.as_nanos()).unwrap_or(u64::MAX);
        }
        for (state, lifetime) in (0..).zip(lifetimes) {
            map.set(state, lifetime, 0)
                .with_context(|| format!("writing conntrack lifetime {state}"))?;
        }
        Ok(())
    }
}

/// The programs loaded ahead of the mode's start, and the pin directory's lock taken for it.
#[derive(Default)]
pub struct Preload {
    lock: Option<bpffs::PinDirLock>,
    prepared: Option<std::thread::JoinHandle<anyhow::Result<Prepared>>>,
}

impl Preload {
    /// Locks the pin directory and [`prepare`]s on a thread of its own, while the source
    /// lists or reads (the verifier, the maps and their read-back take 0.2-0.6 s, which the
    /// list of 30k Services hides). This attaches nothing and removes no rule (of the maps,
    /// only slots no service counts are dropped): the node's traffic is touched only once the
    /// source's first view is in. A failure here is met again, and reported, when the mode
    /// starts.
    pub fn start(&mut self, config: PrepareConfig) {
        let Ok(lock) = lock_pin_dir(&config.pin_dir) else {
            return;
        };
        self.lock = Some(lock);
        self.prepared = Some(std::thread::spawn(move || prepare(&config)));
    }

    /// The pin directory's lock: the one taken ahead, else taken now.
    fn lock(&mut self, pin_dir: &Path) -> anyhow::Result<bpffs::PinDirLock> {
        self.lock.take().map_or_else(|| lock_pin_dir(pin_dir), Ok)
    }

    /// What was prepared ahead, else prepared now.
    fn prepare(&mut self, config: &PrepareConfig) -> anyhow::Result<Prepared> {
        let Some(thread) = self.prepared.take() else {
            return prepare(config);
        };
        thread
            .join()
            .map_err(|_| anyhow::anyhow!("loading the BPF programs panicked"))?
    }
}

/// The pin directory (bpffs mounted there when missing), locked against a second agent.
pub fn lock_pin_dir(pin_dir: &Path) -> anyhow::Result<bpffs::PinDirLock> {
    bpffs::ensure(pin_dir)?;
    bpffs::PinDirLock::acquire(pin_dir)
}

/// Whether an ebpf-mode run's maps are pinned in `pin_dir`, or one of its SCTP ports' tables
/// is here.
pub fn installed(pin_dir: &Path) -> bool {
    pin_dir.join(proxy_common::MAP_SERVICES).exists() || sctp::installed()
}

/// Whether the maps pinned in `pin_dir` hold services: an earlier run synced (and took over)
/// at least once. An agent loads the programs, creating the maps, before its first sync, and
/// may stop before it (the API server unreachable, say).
fn filled(pin_dir: &Path) -> bool {
    aya::maps::MapData::from_pin(pin_dir.join(MAP_SERVICES))
        .and_then(|data| {
            aya::maps::HashMap::<_, ServiceKey, ServiceValue>::try_from(aya::maps::Map::HashMap(
                data,
            ))
        })
        .is_ok_and(|services| services.keys().next().is_some())
}

/// The ebpf [`Dataplane`]: the maps the programs read, and the programs, attached to the pod
/// interfaces by a thread of their own (so that a new pod never waits for a sync).
pub struct EbpfDataplane {
    maps: MapWriter,
    /// The SCTP Service ports, which netfilter translates.
    sctp: sctp::SctpPorts,
    programs: Programs,
    pin_dir: PathBuf,
    /// Host-network UDP sockets are told when their endpoint leaves: the socket programs serve
    /// this namespace's host-network clients, and the kernel can destroy sockets.
    tell_host_udp_sockets: bool,
    /// Held while the dataplane lives: a second agent on the same pins is refused.
    pin_dir_lock: Option<bpffs::PinDirLock>,
}

/// The programs: loaded and ready, then attached: at once, or where the load found the maps
/// empty or recreated them, once the first sync has filled them (what serves meanwhile keeps serving:
/// an earlier agent's programs with their own maps, or another mode's rules, kube-proxy's).
enum Programs {
    Ready(Box<TakeOver>),
    Attached(attach::AttachThread),
    /// Attaching them failed: nothing is served by them.
    Failed(String),
}

/// What attaching the programs needs.
struct TakeOver {
    prepared: attach::PreparedAttach,
    /// The socket programs' cgroup, this network namespace's cookie and whose connections they
    /// translate; None: not attached.
    cgroup: Option<HostClients>,
    pin_dir: PathBuf,
    remove_replaced: Option<RemoveReplaced>,
}

impl TakeOver {
    /// Removes what the programs replace, leaving the connections netfilter translates to it
    /// ([`netfilter_flows`]), and attaches the programs.
    fn attach(mut self) -> anyhow::Result<attach::AttachThread> {
        let held = netfilter_flows::hold();
        if let Some(remove) = self.remove_replaced.take()
            && let Err(e) = remove()
        {
            // The programs run ahead of whatever is left: the next start removes it.
            tracing::warn!("removing another mode's rules failed ({e:#}); taking over anyway");
        }
        if held {
            netfilter_flows::leave_to_netfilter(&self.pin_dir);
        }
        if let Some((cgroup, netns, scope)) = &self.cgroup {
            cgroup::attach(
                &mut self.prepared.ebpf,
                cgroup,
                &self.pin_dir,
                *netns,
                *scope,
            )?;
        }
        attach::AttachThread::start(self.prepared)
    }
}

impl EbpfDataplane {
    /// Takes the programs [`load`] loaded from the pin directory, starts forwarding their logs
    /// and exporting their drop counters, and attaches them as `config` says (at once, or where
    /// the load found the maps empty or recreated them, after the first sync: [`Programs`]): the socket
    /// programs to the cgroup (for the clients of this process's network namespace), the tc
    /// programs to every pod interface, then and as such interfaces appear, and the external
    /// programs to the interfaces carrying the node addresses `external` selects.
    fn new(
        prepared: Prepared,
        config: &mut StartConfig,
        external: ExternalConfig,
        netfilter: NetfilterConfig,
    ) -> anyhow::Result<Self> {
        let pin_dir = config.pin_dir.as_path();
        let Prepared {
            loaded:
                Loaded {
                    mut ebpf,
                    recreated,
                    empty,
                    ..
                },
            maps,
            host_clients,
        } = prepared;
        let kernel = Features::of_this_kernel()?;
        spawn_bpf_logger(&mut ebpf);
        export_drop_counters(&mut ebpf)?;
        features::export(kernel);
        let prepared = attach::AttachThread::prepare(
            ebpf,
            &config.pod_interfaces,
            external,
            pin_dir,
            config.validate_sources,
        )?;
        let mut dataplane = Self {
            maps,
            sctp: sctp::SctpPorts::new(netfilter),
            pin_dir: pin_dir.to_owned(),
            tell_host_udp_sockets: host_clients.is_some(),
            programs: Programs::Ready(Box::new(TakeOver {
                prepared,
                cgroup: host_clients,
                pin_dir: pin_dir.to_owned(),
                remove_replaced: config.remove_replaced.take(),
            })),
            pin_dir_lock: None,
        };
        if recreated {
            tracing::warn!(
                "maps were recreated: the programs serving now keep their own until the first \
                 sync has filled the new ones, then these programs take over"
            );
        } else if empty {
            tracing::info!(
                "the programs take over once the first sync has filled the maps (another \
                 mode's rules, kube-proxy's, serve until then)"
            );
        } else {
            // The maps are the ones being served from: the programs take over now, so that
            // interfaces appearing during a long first sync get them at once.
            dataplane.take_over()?;
        }
        Ok(dataplane)
    }

    /// Attaches the programs, unless they are already (or failed to be). Where the load
    /// created or recreated maps, after the first sync (whatever could be written is); a
    /// failure then is reported by every sync from then on.
    fn take_over(&mut self) -> anyhow::Result<()> {
        let programs = std::mem::replace(&mut self.programs, Programs::Failed(String::new()));
        self.programs = match programs {
            Programs::Ready(take_over) => match take_over.attach() {
                Ok(thread) => {
                    tracing::info!("programs attached");
                    Programs::Attached(thread)
                }
                Err(e) => Programs::Failed(format!("{e:#}")),
            },
            other => other,
        };
        match &self.programs {
            Programs::Failed(e) => {
                bail!("attaching the BPF programs failed ({e}); restart the agent")
            }
            _ => Ok(()),
        }
    }
}

impl EbpfDataplane {
    /// After a sync in which UDP endpoints left their service ports: the host-network sockets
    /// connected to them through the socket programs are told ([`stale_sockets`]). A failure
    /// is logged, not the sync's (the maps are right), and retried at the next sync, unless
    /// the kernel cannot do it at all.
    fn tell_stale_udp_sockets(&mut self) {
        if !self.maps.udp_departed() || !self.tell_host_udp_sockets {
            return;
        }
        let told = stale_sockets::terminate(&self.pin_dir, &self.maps.udp_routes());
        let unsupported = told
            .as_ref()
            .is_err_and(|e| e.is::<stale_sockets::Unsupported>());
        if told.is_ok() || unsupported {
            self.maps.udp_departures_handled();
        }
        match told {
            Ok(0) => {}
            Err(e) if unsupported => {
                tracing::warn!("{e}");
                self.tell_host_udp_sockets = false;
            }
            Ok(sockets) => tracing::info!(
                sockets,
                "destroyed host-network UDP sockets connected to endpoints that left their \
                 Service (the kernel disconnects them: a receive fails with ECONNABORTED, a \
                 send with EDESTADDRREQ; connecting again picks a serving endpoint)"
            ),
            Err(e) => {
                tracing::warn!("telling host-network UDP sockets (retried at the next sync): {e:#}")
            }
        }
    }
}

impl Dataplane for EbpfDataplane {
    fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        let synced = self.maps.sync(state, scope);
        self.take_over()?;
        self.tell_stale_udp_sockets();
        // Whatever the maps could take (a full map is reported, and the sync is not failed).
        let sctp = self.sctp.sync(state, scope);
        synced.and(sctp)
    }

    /// Both.
    fn families(&self) -> Vec<Family> {
        Family::ALL.to_vec()
    }

    /// Also ends the drains whose period is over (full syncs do too, but they come once an
    /// hour).
    fn housekeeping(&mut self) -> anyhow::Result<()> {
        if let Programs::Attached(thread) = &self.programs {
            thread.check()?;
        }
        self.maps
            .expire(std::time::Instant::now())
            .context("expiring drained entries")
    }
}

/// Forwards the programs' aya-log records to our log output (the `log` records become tracing
/// events through tracing-subscriber's bridge).
fn spawn_bpf_logger(ebpf: &mut Ebpf) {
    let logger = match aya_log::EbpfLogger::init(ebpf) {
        Ok(logger) => logger,
        Err(e) => {
            tracing::warn!("BPF program logs unavailable: {e}");
            return;
        }
    };
    // SAFETY: the logger owns its ring buffer's fd, which stays open and the same for as long
    // as the logger lives, and the AsyncFd owns the logger.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    };
    let mut logger = match registered {
        Ok(fd) => fd,
        Err(e) => {
            tracing::warn!("BPF program logs unavailable: {e}");
            return;
        }
    };
    tokio::spawn(async move {
        loop {
            let Ok(mut guard) = logger.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn interrupted() -> ProgramError {
        ProgramError::LoadError {
            io_error: std::io::Error::from_raw_os_error(libc::EAGAIN),
            verifier_log: aya_obj::VerifierLog::new(String::new()),
        }
    }

    #[test]
    fn a_load_interrupted_by_a_signal_is_tried_again() {
        let mut calls = 0;
        let loaded = load_retrying("p", || {
            calls += 1;
            if calls < 3 {
                Err(interrupted())
            } else {
                Ok(())
            }
        });
        assert!(loaded.is_ok(), "{loaded:?}");
        assert_eq!(calls, 3);
        // Interrupted every time: it gives up after 5 tries, naming the program.
        let mut calls = 0;
        let e = load_retrying("p", || {
            calls += 1;
            Err(interrupted())
        })
        .unwrap_err();
        assert_eq!(calls, 5);
        assert!(format!("{e:#}").contains("verifier rejected p"), "{e:#}");
        // Any other error at once.
        let mut calls = 0;
        let _ = load_retrying("p", || {
            calls += 1;
            Err(ProgramError::AlreadyLoaded)
        });
        assert_eq!(calls, 1);
    }
}
