//! Developer commands: `cargo xtask <command>`. Each one does the set-up it needs first.
use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what the project needs (Debian packages, rust-src, bpf-linker); quick when done.
    Setup,
    /// Build the BPF programs (proxy-ebpf) with the nightly toolchain.
    BuildEbpf,
    /// Set up, build, and run every test (unit, BPF program, sandbox end to end), then lint.
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Format check and clippy with warnings as errors.
    Lint,
    /// Run the kernel-facing tests (BPF programs, sandbox end to end) on another kernel:
    /// Debian's, under QEMU (older verifiers, tc attached through netlink instead of tcx).
    VmTest {
        /// The kernel series: 5.10 (bullseye), 6.1 (bookworm, with IPVS: its tests run there),
        /// 6.12 (bookworm-backports).
        #[arg(long, default_value = "6.1", value_parser = ["5.10", "6.1", "6.12"])]
        kernel: String,
        /// Only these test files of the tests/ crate (repeatable; default: every kernel-facing
        /// one, and the IPVS mode's unit tests).
        #[arg(long)]
        only: Vec<String>,
        /// Every kernel-facing test file but these (repeatable; the IPVS mode's unit tests
        /// still run).
        #[arg(long, conflicts_with = "only")]
        except: Vec<String>,
        /// Extra arguments for `cargo test`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Start the sandbox cluster and the agent, and show Services at work. Arguments after it
    /// go to the demo: `--proxy-mode nftables` (or iptables-legacy, iptables-nft, userspace; the
    /// default is ebpf) runs it in another mode.
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the agent's OCI image from Debian's packages, no registry needed
    /// (`deploy/image.sh` on the release build): `target/image/kube-proxy-ebpf.oci.tar`, for
    /// `podman load`, `skopeo copy oci-archive:...` or `ctr images import`.
    Image,
    /// Run a benchmark: `datapath` (the programs under BPF_PROG_TEST_RUN), `agent` (the agent
    /// on 1 to 30k services: time to its first full sync, memory), `external` (NodePorts from
    /// outside vs the pods) or `e2e` (ClusterIPs at 1 to 30k services vs the pods, sync time,
    /// one-change latency, memory; `--quick` for CI). Arguments after it go to the benchmark
    /// (`cargo xtask bench agent --help`).
    Bench {
        #[arg(default_value = "datapath", value_parser = ["datapath", "agent", "external", "e2e"])]
        which: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// Debian packages the tests, the demo and the sandbox use.
const DEB_PACKAGES: &[&str] = &[
    "iproute2",
    "iptables",
    "nftables",
    "ipset",
    "conntrack",
    "curl",
    "bpftool",
    "netcat-openbsd",
    "procps",
    "kmod",
    // ping: the sandbox test's check that a node answers from outside.
    "iputils-ping",
    // The agent's image (deploy/image.sh) and its tests, which run it as the DaemonSet does.
    "mmdebstrap",
    "umoci",
    "runc",
];
const NIGHTLY: &str = "nightly";

fn main() -> anyhow::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    env::set_current_dir(&root)?;
    match Cli::parse().command {
        Cmd::Setup => setup(),
        Cmd::BuildEbpf => prepare(),
        Cmd::Test { args } => {
            prepare()?;
            step("building the workspace");
            cargo(&["build", "--workspace", "--bins"])?;
            step("running the tests");
            let mut test = vec!["test", "--workspace"];
            test.extend(args.iter().map(String::as_str));
            cargo(&test)?;
            lint()
        }
        Cmd::Lint => lint(),
        Cmd::VmTest {
            kernel,
            only,
            except,
            args,
        } => {
            prepare()?;
            step(&format!(
                "preparing the VM (Debian's {kernel} kernel, once)"
            ));
            run(Command::new("bash")
                .arg(root.join("vmtest/setup.sh"))
                .arg(&kernel))?;
            step("building the workspace");
            cargo(&["build", "--workspace", "--bins"])?;
            step("running the kernel-facing tests inside the VM (software emulation: slow)");
            const KERNEL_FACING: [&str; 12] = [
                "datapath",
                "xdp",
                "change",
                "load",
                "attach",
                "e2e",
                "sandbox",
                "host",
                "policy",
                "external",
                "scenarios",
                "takeover",
            ];
            if let Some(unknown) = except.iter().find(|f| !KERNEL_FACING.contains(&f.as_str())) {
                anyhow::bail!("--except {unknown}: not a kernel-facing test file");
            }
            let files: Vec<&str> = match only.is_empty() {
                true => KERNEL_FACING
                    .into_iter()
                    .filter(|f| !except.iter().any(|e| e == f))
                    .collect(),
                false => only.iter().map(String::as_str).collect(),
            };
            let mut test = vec!["test", "-p", "proxy-tests"];
            for file in &files {
                test.extend(["--test", file]);
            }
            test.extend(args.iter().map(String::as_str));
            // The IPVS mode's kernel tests (this machine's kernel has no IPVS).
            let mut ipvs = vec!["test", "-p", "proxy-userspace", "--lib", "ipvs"];
            ipvs.extend(args.iter().map(String::as_str));
            // 6.1's results feed docs/parity.md (IPVS runs only there); the others' are kept
            // beside them.
            let parity_vm = match kernel.as_str() {
                "6.1" => root.join("target/parity-vm"),
                other => root.join(format!("target/parity-vm-{other}")),
            };
            std::fs::create_dir_all(&parity_vm)?;
            let in_vm = |args: &[&str]| -> anyhow::Result<()> {
                let mut cmd = cargo_cmd();
                cmd.args(args)
                    .env(
                        "CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER",
                        root.join("vmtest/cargo-runner.sh"),
                    )
                    .env("VM_KERNEL", &kernel)
                    .env("VM_MEM", "1536")
                    // Emulation is slow: wait longer, and run one test at a time.
                    .env("SANDBOX_TIMEOUT_SCALE", "5")
                    .env("RUST_TEST_THREADS", "1")
                    // The scenario suite's results on this kernel come back to the host (the
                    // guest's other writes stay in its overlay): docs/parity.md takes the modes
                    // that run only here (IPVS) from them.
                    .env("VM_RW_DIR", &parity_vm)
                    .env("PARITY_RESULTS_DIR", &parity_vm)
                    // These kernels have IPVS and SCTP: their tests must run, not skip.
                    .env("SANDBOX_NEED_IPVS", "1")
                    .env("SANDBOX_NEED_SCTP", "1")
                    .env(
                        "VM_PASS_ENV",
                        "SANDBOX_TIMEOUT_SCALE RUST_TEST_THREADS SANDBOX_NO_SKIP RUST_BACKTRACE \
                     PARITY_RESULTS_DIR SANDBOX_NEED_IPVS SANDBOX_NEED_SCTP",
                    );
                run(&mut cmd)
            };
            if only.is_empty() {
                in_vm(&ipvs)?;
            }
            in_vm(&test)
        }
        Cmd::Demo { args } => {
            build_release("building the agent and the sandbox (release)")?;
            run(Command::new(root.join("target/release/demo")).args(args))
        }
        Cmd::Image => {
            build_release("building the agent (release)")?;
            step("building the image from Debian's packages");
            run(Command::new(root.join("deploy/image.sh"))
                .arg(root.join("target/release/proxy-userspace"))
                .arg(root.join("target/image")))?;
            println!(
                "{}",
                root.join("target/image/kube-proxy-ebpf.oci.tar").display()
            );
            Ok(())
        }
        Cmd::Bench { which, args } => {
            build_release("building the benchmarks (release)")?;
            let mut cmd = Command::new(root.join("target/release/bench"));
            cmd.arg(which).args(args);
            run(&mut cmd)
        }
    }
}

fn step(what: &str) {
    eprintln!("\x1b[1m==> {what}\x1b[0m");
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// The cargo (stable) that runs this xtask.
fn cargo_cmd() -> Command {
    Command::new(env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn cargo(args: &[&str]) -> anyhow::Result<()> {
    run(cargo_cmd().args(args))
}

/// What every build needs first: the set-up and the BPF object the agent embeds.
fn prepare() -> anyhow::Result<()> {
    setup()?;
    build_ebpf()
}

fn build_release(what: &str) -> anyhow::Result<()> {
    prepare()?;
    step(what);
    cargo(&["build", "--release", "--workspace", "--bins"])
}

fn lint() -> anyhow::Result<()> {
    step("checking formatting and clippy");
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    run(nightly_cargo().args(["fmt", "--check"]))?;
    run(nightly_cargo().args([
        "clippy",
        "--release",
        "-Z",
        "build-std=core",
        "--target",
        BPF_TARGET,
        "--",
        "-D",
        "warnings",
    ]))
}

const BPF_TARGET: &str = "bpfel-unknown-none";

/// `cargo +nightly` in proxy-ebpf (whose .cargo/config.toml holds the BPF link flags), without
/// the variables the outer (stable) cargo sets, which would make the nightly build use the
/// stable compiler, nor RUSTFLAGS, which would replace those link flags.
fn nightly_cargo() -> Command {
    let mut cmd = Command::new("cargo");
    cmd.arg(format!("+{NIGHTLY}"))
        .current_dir("proxy-ebpf")
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .env_remove("RUSTDOC")
        .env_remove("CARGO")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS");
    cmd
}

fn build_ebpf() -> anyhow::Result<()> {
    step("building the BPF programs (proxy-ebpf, nightly, bpfel-unknown-none)");
    run(nightly_cargo().args([
        "build",
        "--release",
        "-Z",
        "build-std=core",
        "--target",
        BPF_TARGET,
    ]))
}

fn setup() -> anyhow::Result<()> {
    let started = Instant::now();
    install_debian_packages()?;
    install_rust_src()?;
    install_bpf_linker()?;
    install_kubernetes_validate()?;
    if started.elapsed().as_secs() > 2 {
        step(&format!("set-up done in {:.0?}", started.elapsed()));
    }
    Ok(())
}

fn install_debian_packages() -> anyhow::Result<()> {
    let missing: Vec<&str> = DEB_PACKAGES
        .iter()
        .copied()
        .filter(|p| {
            !Command::new("dpkg-query")
                .args(["-W", "-f=${Status}", p])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    step(&format!(
        "installing Debian packages: {}",
        missing.join(" ")
    ));
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!(
            "installing {} needs root: run `sudo apt-get install {}`",
            missing.join(" "),
            missing.join(" ")
        );
    }
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    let mut install = Command::new("apt-get");
    install
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive");
    run(&mut install)
}

fn install_rust_src() -> anyhow::Result<()> {
    let installed = Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", NIGHTLY])
        .output()
        .context("running rustup: is rustup installed?")?;
    if String::from_utf8_lossy(&installed.stdout)
        .lines()
        .any(|l| l.starts_with("rust-src"))
    {
        return Ok(());
    }
    step("adding rust-src to the nightly toolchain (the BPF build compiles core)");
    run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", NIGHTLY]))
}

/// The deploy tests validate the manifests offline against Kubernetes' schemas with the PyPI
/// package kubernetes-validate, installed in its own virtualenv (Debian's pip refuses system-wide
/// installs) and linked into /usr/local/bin.
fn install_kubernetes_validate() -> anyhow::Result<()> {
    let works = Command::new("kubernetes-validate")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if works {
        return Ok(());
    }
    step("installing kubernetes-validate (PyPI) into /opt/kubernetes-validate");
    let venv = Path::new("/opt/kubernetes-validate");
    if !venv.join("bin/pip").exists() {
        let created = Command::new("python3")
            .args(["-m", "venv"])
            .arg(venv)
            .status();
        if !created.is_ok_and(|s| s.success()) {
            // Debian's python3 ships venv separately.
            let mut apt = Command::new("apt-get");
            apt.args([
                "install",
                "-y",
                "-qq",
                "--no-install-recommends",
                "python3-venv",
            ])
            .env("DEBIAN_FRONTEND", "noninteractive");
            run(&mut apt)?;
            run(Command::new("python3").args(["-m", "venv"]).arg(venv))?;
        }
    }
    run(Command::new(venv.join("bin/pip")).args(["install", "-q", "kubernetes-validate==1.37.0"]))?;
    let link = Path::new("/usr/local/bin/kubernetes-validate");
    let _ = std::fs::remove_file(link);
    std::os::unix::fs::symlink(venv.join("bin/kubernetes-validate"), link)?;
    Ok(())
}

/// bpf-linker links the BPF object with the nightly's own LLVM: it is built against that
/// libLLVM through a prefix folder of two symlinks, which must outlive the install (the
/// binary's runpath points there), so it lives in CARGO_HOME.
fn install_bpf_linker() -> anyhow::Result<()> {
    let works = Command::new("bpf-linker")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains("0.13"));
    if works {
        return Ok(());
    }
    step("building bpf-linker 0.13 against the nightly's LLVM (about 2 minutes, once)");
    let sysroot = Command::new("rustc")
        .args([&format!("+{NIGHTLY}"), "--print", "sysroot"])
        .output()?;
    let sysroot = PathBuf::from(String::from_utf8(sysroot.stdout)?.trim());
    let lib_dir = sysroot.join("lib");
    let llvm = std::fs::read_dir(&lib_dir)?
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("libLLVM.so."))
        .with_context(|| format!("no libLLVM.so.* in {}", lib_dir.display()))?;
    let major = llvm
        .trim_start_matches("libLLVM.so.")
        .split('.')
        .next()
        .context("unexpected libLLVM file name")?
        .to_owned();
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .context("neither CARGO_HOME nor HOME is set")?;
    let prefix = cargo_home.join("bpf-linker-llvm");
    let prefix_lib = prefix.join("lib");
    std::fs::create_dir_all(&prefix_lib)?;
    for link in ["libLLVM.so".to_owned(), llvm.clone()] {
        let at = prefix_lib.join(link);
        let _ = std::fs::remove_file(&at);
        std::os::unix::fs::symlink(lib_dir.join(&llvm), &at)?;
    }
    let mut cmd = Command::new("cargo");
    cmd.args([
        "install",
        "bpf-linker",
        "--version",
        "^0.13",
        "--force",
        "--no-default-features",
        "--features",
        &format!("llvm-{major}"),
    ])
    .env("LLVM_PREFIX", &prefix);
    run(&mut cmd)
}
