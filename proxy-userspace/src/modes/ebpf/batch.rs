//! `BPF_MAP_UPDATE_BATCH` (Linux 5.6), which aya 0.14 does not wrap: many writes to one map in
//! one system call. A first sync of 30k Services writes about 200k entries, and one call each
//! spent more time entering the kernel than writing.
use std::{
    io,
    os::fd::{AsFd, AsRawFd},
};

use aya::{
    Pod,
    maps::{HashMap, IterableMap, MapData},
};

const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Writes `keys[i] -> values[i]` into `map`, in order. On failure, the kernel has written the
/// first `.0` of them and none after (None: it failed before or after writing, and did not say).
pub fn update<K: Pod, V: Pod>(
    map: &HashMap<MapData, K, V>,
    keys: &[K],
    values: &[V],
) -> Result<(), (Option<usize>, io::Error)> {
    assert_eq!(keys.len(), values.len(), "a value for each key");
    if keys.is_empty() {
        return Ok(());
    }
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: u32::try_from(keys.len()).expect("fewer than 2^32 writes"),
        map_fd: map.map().fd().as_fd().as_raw_fd() as u32,
        ..BatchAttr::default()
    };
    // SAFETY: `attr` is a valid `bpf_attr` prefix of the size passed; `keys` and `values` hold
    // `count` plain-data elements of the map's key and value sizes (aya checked the sizes of K
    // and V against the map's when it made `map`), and outlive the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_MAP_UPDATE_BATCH,
            &mut attr as *mut BatchAttr,
            size_of::<BatchAttr>(),
        )
    };
    if r < 0 {
        let error = io::Error::last_os_error();
        // The kernel sets `count` to the number it wrote, once it has started writing; an
        // unchanged count may also mean that it never started.
        let written = attr.count as usize;
        return Err(((written < keys.len()).then_some(written), error));
    }
    Ok(())
}
