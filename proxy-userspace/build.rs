//! Embeds the BPF object built by `cargo xtask build-ebpf`, so the agent ships as one file.
//! Without it (a machine with no bpf-linker) the build still succeeds; the ebpf mode then
//! refuses to start and says how to build the object.
use std::{env, fs, path::PathBuf};

fn main() {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").unwrap());
    let object = manifest_dir.join("../proxy-ebpf/target/bpfel-unknown-none/release/proxy-ebpf");
    let out = PathBuf::from(env::var_os("OUT_DIR").unwrap()).join("proxy-ebpf.o");
    println!("cargo:rerun-if-changed={}", object.display());
    match fs::read(&object) {
        Ok(bytes) => fs::write(&out, bytes).expect("writing OUT_DIR/proxy-ebpf.o"),
        Err(_) => {
            println!(
                "cargo:warning=BPF object not found at {}: the ebpf proxy mode will be unavailable \
                 in this build; run `cargo xtask build-ebpf` first",
                object.display()
            );
            fs::write(&out, []).expect("writing OUT_DIR/proxy-ebpf.o");
        }
    }
}
