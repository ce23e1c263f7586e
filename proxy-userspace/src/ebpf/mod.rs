//! The ebpf mode: tc programs on pod-facing interfaces, driven by pinned BPF hash maps.
mod attach;
pub mod bpffs;
pub mod maps;

use std::path::Path;

use anyhow::{Context, bail};
use aya::{Ebpf, EbpfLoader, programs::SchedClassifier};
use proxy_common::{MAP_AGENT_STATE, MAP_BACKENDS, MAP_CONNTRACK, MAP_SERVICES};

pub use attach::Attacher;
use attach::detach_all;
pub use maps::ServiceMaps;

use crate::{
    dataplane::{Dataplane, Scope},
    model::DesiredState,
};

/// The BPF object, embedded at build time (empty when built without bpf-linker).
pub static BPF_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/proxy-ebpf.o"));

pub const PROG_INGRESS: &str = "tc_ingress";
pub const PROG_EGRESS: &str = "tc_egress";

/// Map sizes, in entries. The defaults fit 100k service ports with ~10 endpoints each and 1M
/// flows (two conntrack entries a flow).
#[derive(Clone, Copy, Debug)]
pub struct MapSizes {
    pub services: u32,
    pub backends: u32,
    pub conntrack: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        Self {
            services: 1 << 21,
            backends: 1 << 20,
            conntrack: 1 << 21,
        }
    }
}

/// Loads the programs, reusing the maps already pinned in `pin_dir` (so flows and services
/// survive an agent restart) or creating and pinning them there.
pub fn load(pin_dir: &Path, sizes: MapSizes) -> anyhow::Result<Ebpf> {
    if BPF_OBJECT.is_empty() {
        bail!(
            "this binary was built without the BPF object; run `cargo xtask build-ebpf` and \
             rebuild, or pick another --proxy-mode"
        );
    }
    bpffs::ensure(pin_dir)?;
    warn_on_size_changes(pin_dir, sizes);
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(pin_dir)
        .map_max_entries(MAP_SERVICES, sizes.services)
        .map_max_entries(MAP_BACKENDS, sizes.backends)
        .map_max_entries(MAP_CONNTRACK, sizes.conntrack)
        .load(BPF_OBJECT)
        .with_context(|| {
            format!(
                "loading the BPF programs (maps pinned in {}); the agent needs CAP_BPF, \
                 CAP_NET_ADMIN and CAP_PERFMON, or root",
                pin_dir.display()
            )
        })?;
    for name in [PROG_INGRESS, PROG_EGRESS] {
        let prog: &mut SchedClassifier = ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the BPF object"))?
            .try_into()?;
        prog.load()
            .with_context(|| format!("the kernel's verifier rejected {name}"))?;
    }
    Ok(ebpf)
}

/// Maps already pinned are reused as they are (that is what keeps services and flows across a
/// restart), so a changed size flag takes effect only once the pin is gone: say so.
fn warn_on_size_changes(pin_dir: &Path, sizes: MapSizes) {
    let wanted = [
        (MAP_SERVICES, sizes.services, "--bpf-services-max"),
        (MAP_BACKENDS, sizes.backends, "--bpf-backends-max"),
        (MAP_CONNTRACK, sizes.conntrack, "--bpf-ct-max"),
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

/// `agent --cleanup`: detaches the programs from the interfaces matching `pod_interfaces` and
/// removes everything the agent pinned under `pin_dir`.
pub fn cleanup(pin_dir: &Path, pod_interfaces: &str) -> anyhow::Result<()> {
    let detached = detach_all(pod_interfaces, pin_dir)?;
    let mut removed = 0;
    // Only what the agent pinned: a bpffs root also holds the kernel's own `*.debug` files.
    for name in [MAP_SERVICES, MAP_BACKENDS, MAP_CONNTRACK, MAP_AGENT_STATE] {
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

/// The ebpf [`Dataplane`]: the loaded programs, the maps they read, and the interfaces they
/// are attached to.
pub struct EbpfDataplane {
    ebpf: Ebpf,
    maps: ServiceMaps,
    attacher: Attacher,
}

impl EbpfDataplane {
    /// Loads the programs (see [`load`]) and attaches them to every interface whose name
    /// matches `pod_interfaces` (and to matching interfaces that appear later, in
    /// [`Dataplane::housekeeping`]).
    pub fn new(pin_dir: &Path, sizes: MapSizes, pod_interfaces: &str) -> anyhow::Result<Self> {
        let mut ebpf = load(pin_dir, sizes)?;
        let maps = ServiceMaps::take_from(&mut ebpf)?;
        let mut attacher = Attacher::new(pod_interfaces, pin_dir)?;
        attacher.scan(&mut ebpf)?;
        Ok(Self {
            ebpf,
            maps,
            attacher,
        })
    }

    /// The loaded object, e.g. to start aya-log's reader on it.
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}

impl Dataplane for EbpfDataplane {
    fn sync(&mut self, state: &DesiredState, scope: Scope<'_>) -> anyhow::Result<()> {
        self.maps.sync(state, scope)
    }

    fn housekeeping(&mut self) -> anyhow::Result<()> {
        self.attacher.scan(&mut self.ebpf)
    }
}

/// Forwards the programs' aya-log records to our log output (the `log` records become tracing
/// events through tracing-subscriber's bridge).
pub fn spawn_bpf_logger(ebpf: &mut Ebpf) {
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
