//! Running the tools the fallback modes write their rules with.
use std::{
    io::Write as _,
    process::{Command, Stdio},
};

use anyhow::{Context, bail};

/// Runs `program args` with `input` on its stdin (one transaction for `iptables-restore`,
/// `nft -f -` and `ipset restore`); an error carries what it printed to stderr.
pub fn pipe(program: &str, args: &[&str], input: &str) -> anyhow::Result<()> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program}"))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(input.as_bytes())
        .with_context(|| format!("writing to {program}"))?;
    let output = child.wait_with_output()?;
    if !output.status.success() {
        bail!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Runs `program args`: its output, or an error with what it printed.
pub fn run(program: &str, args: &[&str], package: &str) -> anyhow::Result<String> {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running {program} (the {package} package)"))?;
    if !output.status.success() {
        bail!(
            "{program} {} failed ({}): {}{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim(),
            // SAFETY: geteuid has no preconditions.
            match unsafe { libc::geteuid() } {
                0 => "",
                _ => " (it needs root)",
            }
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
