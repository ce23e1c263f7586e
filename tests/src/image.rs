//! The agent's image (`deploy/image.sh`), run as the DaemonSet (`deploy/kube-proxy-ebpf.yaml`)
//! runs it: by runc, in the node's network namespace (hostNetwork), with exactly the
//! container's securityContext (root, only the capabilities it adds, no privilege escalation, a
//! read-only root filesystem) and its volumes (bpffs, the cgroup2 directory of the socket
//! programs, `/run/xtables.lock`), both read from the DaemonSet itself. Least privilege is
//! proven by running, not by a schema. (crun would do too, but refuses a machine with cgroup v1
//! and v2 mounted side by side, as this one is.)
use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::agent::agent_bin;

/// The image's OCI layout, built once per test process from the agent binary the tests use.
pub fn layout() -> Result<&'static Path> {
    static LAYOUT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    LAYOUT
        .get_or_init(|| build().map_err(|e| format!("{e:#}")))
        .as_deref()
        .map_err(|e| anyhow::anyhow!("building the agent's image: {e}"))
}

fn build() -> Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // One test binary builds it at a time (cargo runs them in turn); each build starts afresh.
    let out = root.join("target/image-tests");
    let status = Command::new(root.join("deploy/image.sh"))
        .arg(agent_bin()?)
        .arg(&out)
        .status()
        .context("running deploy/image.sh")?;
    if !status.success() {
        bail!("deploy/image.sh failed ({status})");
    }
    Ok(out.join("layout"))
}

/// What the DaemonSet (`deploy/kube-proxy-ebpf.yaml`) gives the agent's container: its
/// capabilities and volumes' mount paths, checked to be what [`configure`] applies.
pub struct DaemonSetContainer {
    /// `capabilities.add` (after `drop: [ALL]`), as the runtime spells them (`CAP_BPF`).
    pub capabilities: Vec<String>,
    pub mount_paths: Vec<String>,
}

impl DaemonSetContainer {
    pub fn read() -> Result<Self> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kube-proxy-ebpf.yaml");
        let daemon_set = crate::rbac::load_document(&path, "DaemonSet")?;
        let containers = daemon_set["spec"]["template"]["spec"]["containers"]
            .as_sequence()
            .context("the DaemonSet has no containers")?;
        let container = containers
            .iter()
            .find(|c| c["name"] == "kube-proxy-ebpf")
            .context("no container kube-proxy-ebpf")?;
        let security = &container["securityContext"];
        // What configure() applies besides the capabilities.
        anyhow::ensure!(
            security["runAsUser"] == 0
                && security["allowPrivilegeEscalation"] == false
                && security["readOnlyRootFilesystem"] == true
                && security["capabilities"]["drop"][0] == "ALL",
            "the DaemonSet's securityContext changed: update tests/src/image.rs"
        );
        let strings = |v: &serde_yaml::Value| -> Vec<String> {
            v.as_sequence()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        };
        let capabilities = strings(&security["capabilities"]["add"])
            .into_iter()
            .map(|c| format!("CAP_{c}"))
            .collect();
        let mounts = container["volumeMounts"].as_sequence();
        let mount_paths = mounts
            .into_iter()
            .flatten()
            .filter_map(|m| m["mountPath"].as_str().map(str::to_owned))
            .collect();
        Ok(Self {
            capabilities,
            mount_paths,
        })
    }
}

/// The image unpacked into `bundle` (a runc bundle: `config.json` and `rootfs/`).
pub fn unpack(bundle: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(bundle);
    let out = Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:latest", layout()?.display()))
        .arg(bundle)
        .output()
        .context("running umoci")?;
    if !out.status.success() {
        bail!("umoci unpack: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Where the DaemonSet mounts the node's bpffs (the agent's default pin directory is under it).
pub const BPFFS: &str = "/sys/fs/bpf";
/// Where the DaemonSet mounts the cgroup2 directory of the socket programs (the agent's default
/// `--bpf-cgroup-path`).
pub const CGROUP: &str = "/run/kube-proxy-ebpf/cgroupv2";

/// Writes `bundle`'s `config.json` for the DaemonSet's container: `args` (the image's binary
/// first), `env`, in the network namespace at `netns`, with `volumes` (host path, path in the
/// container) besides the runtime's own mounts.
pub fn configure(
    bundle: &Path,
    args: &[String],
    env: &[String],
    netns: &Path,
    volumes: &[(&Path, &Path)],
) -> Result<()> {
    let path = bundle.join("config.json");
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path)?)?;
    config["process"]["terminal"] = json!(false);
    config["process"]["args"] = json!(args);
    let mut all_env: Vec<String> = config["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    all_env.extend(env.iter().cloned());
    config["process"]["env"] = json!(all_env);
    config["process"]["user"] = json!({"uid": 0, "gid": 0});
    config["process"]["noNewPrivileges"] = json!(true);
    let daemon_set = DaemonSetContainer::read()?;
    // The test's own directory (the manifest, a kubeconfig) aside, the DaemonSet's volumes.
    let mut paths: Vec<String> = volumes
        .iter()
        .map(|(_, inside)| inside.display().to_string())
        .filter(|inside| !inside.starts_with(&std::env::temp_dir().display().to_string()))
        .collect();
    paths.sort();
    let mut wanted = daemon_set.mount_paths.clone();
    wanted.sort();
    anyhow::ensure!(
        paths == wanted,
        "the DaemonSet mounts {wanted:?}, the test {paths:?}: update tests/src/agent.rs"
    );
    let capabilities = &daemon_set.capabilities;
    config["process"]["capabilities"] = json!({
        "bounding": capabilities,
        "effective": capabilities,
        "permitted": capabilities,
    });
    config["root"]["readonly"] = json!(true);
    config["hostname"] = json!("agent");
    let namespaces = config["linux"]["namespaces"]
        .as_array_mut()
        .context("no namespaces in config.json")?;
    for ns in namespaces.iter_mut() {
        if ns["type"] == "network" {
            ns["path"] = json!(netns);
        }
    }
    // The runtime's cgroupfs mount is left out: the agent needs only its own cgroup2 directory.
    let mounts = config["mounts"]
        .as_array_mut()
        .context("no mounts in config.json")?;
    mounts.retain(|m| m["destination"] != "/sys/fs/cgroup");
    for (source, destination) in volumes {
        mounts.push(json!({
            "destination": destination,
            "type": "bind",
            "source": source,
            "options": ["rbind", "rw"],
        }));
    }
    std::fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
    Ok(())
}

/// The DaemonSet's `/run/xtables.lock` (hostPath, FileOrCreate): the host's.
pub fn xtables_lock() -> Result<&'static Path> {
    let lock = Path::new("/run/xtables.lock");
    if !lock.exists() {
        std::fs::write(lock, b"")?;
    }
    Ok(lock)
}
