#!/bin/sh
# Builds the agent's OCI image without any registry: the root filesystem from Debian 12's
# packages (mmdebstrap), the agent binary added, assembled as an OCI layout (umoci), and packed
# as an OCI archive that `podman load`, `skopeo copy oci-archive:...` or `ctr images import`
# take. The same files as deploy/Containerfile's image (which needs a registry's base images).
#
#   deploy/image.sh AGENT_BINARY OUT_DIR
#
# OUT_DIR gets `layout/` (the OCI layout, tag `latest`) and `kube-proxy-ebpf.oci.tar`.
# Needs root (the root filesystem's owners), mmdebstrap and umoci (`cargo xtask setup`
# installs them). `cargo xtask image` runs it on the release build.
set -eu
agent=$1
out=$2
rm -rf "$out"
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# `mount` and `util-linux` (nsenter) for the DaemonSet's init container; `nftables`,
# `iptables` (legacy and nf_tables tools) and `conntrack` for the fallback modes, the removal
# of kube-proxy's rules and the ebpf mode's takeover. Documentation and locales left out.
mmdebstrap --quiet --variant=essential \
    --include=mount,util-linux,nftables,iptables,conntrack \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    bookworm "$work/rootfs.tar"
umoci init --layout "$out/layout"
umoci new --image "$out/layout:latest"
umoci unpack --image "$out/layout:latest" "$work/bundle"
tar -xf "$work/rootfs.tar" -C "$work/bundle/rootfs"
install -m 0755 "$agent" "$work/bundle/rootfs/usr/local/bin/proxy-userspace"
# Also as kube-proxy, the name that implies `agent`: kube-proxy's DaemonSet runs with only its
# image changed.
ln -s proxy-userspace "$work/bundle/rootfs/usr/local/bin/kube-proxy"
umoci repack --image "$out/layout:latest" "$work/bundle"
umoci config --image "$out/layout:latest" \
    --config.entrypoint /usr/local/bin/proxy-userspace \
    --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
umoci gc --layout "$out/layout"
tar -cf "$out/kube-proxy-ebpf.oci.tar" -C "$out/layout" .
