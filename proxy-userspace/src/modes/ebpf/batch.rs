//! `BPF_MAP_UPDATE_BATCH` and `BPF_MAP_LOOKUP_BATCH` (Linux 5.6), which aya 0.14 does not
//! wrap: many writes to one map, or reads of it, in one system call. A first sync of 30k
//! Services writes about 200k entries, and one call each spent more time entering the kernel
//! than writing; reading them back after a restart took two calls an entry.
use std::{
    io,
    marker::PhantomData,
    os::fd::{AsFd, AsRawFd, OwnedFd},
};

use aya::{
    Pod,
    maps::{HashMap, IterableMap, MapData},
};

/// Entries read a call: more than any hash bucket holds (the kernel returns a bucket whole).
const LOOKUP_CHUNK: usize = 4096;

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
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

/// A map's descriptor of its own, which another thread can write through while the map's owner
/// goes on; typed by the map's key and value, whose sizes aya checked when it opened the map.
pub struct Target<K, V> {
    fd: OwnedFd,
    types: PhantomData<fn(K, V)>,
}

impl<K: Pod, V: Pod> Target<K, V> {
    pub fn of(map: &HashMap<MapData, K, V>) -> io::Result<Self> {
        Ok(Self {
            fd: map.map().fd().as_fd().try_clone_to_owned()?,
            types: PhantomData,
        })
    }
}

/// Writes `keys[i] -> values[i]` into `map`, in order. On failure, the kernel has written the
/// first `.0` of them and none after (None: it failed before or after writing, and did not say).
pub fn update<K: Pod, V: Pod>(
    map: &Target<K, V>,
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
        map_fd: map.fd.as_raw_fd() as u32,
        ..BatchAttr::default()
    };
    // SAFETY: `keys` and `values` hold `count` plain-data elements of the map's key and value
    // sizes (aya checked the sizes of K and V against the map's when it made the map `map` was
    // taken from), and outlive the call.
    if let Err(error) = unsafe { bpf(BPF_MAP_UPDATE_BATCH, &mut attr) } {
        // The kernel sets `count` to the number it wrote, once it has started writing; an
        // unchanged count may also mean that it never started.
        let written = attr.count as usize;
        return Err(((written < keys.len()).then_some(written), error));
    }
    Ok(())
}

/// Every entry of `map`, read `LOOKUP_CHUNK` at a time. Meant for a map nothing else writes
/// meanwhile (as a hash map's iteration, it may miss or repeat entries that change).
pub fn entries<K: Pod, V: Pod>(map: &HashMap<MapData, K, V>) -> io::Result<Vec<(K, V)>> {
    let mut entries = Vec::new();
    let mut chunk = LOOKUP_CHUNK;
    let mut keys: Vec<K> = Vec::with_capacity(chunk);
    let mut values: Vec<V> = Vec::with_capacity(chunk);
    // The kernel's position in the map (a hash bucket's index, 4 bytes): none at first.
    let mut position: Option<u64> = None;
    let mut next = 0u64;
    loop {
        let mut attr = BatchAttr {
            in_batch: position.as_ref().map_or(0, |p| p as *const u64 as u64),
            out_batch: &mut next as *mut u64 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: u32::try_from(chunk).expect("a small chunk"),
            map_fd: map.map().fd().as_fd().as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        // SAFETY: `keys` and `values` have room for `count` elements of the map's key and
        // value sizes (checked by aya as in `update`), the positions for the kernel's 4-byte
        // token.
        let error = unsafe { bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) }.err();
        match error.as_ref().and_then(io::Error::raw_os_error) {
            // A bucket larger than the chunk: read it again with room for it.
            Some(libc::ENOSPC) => {
                chunk *= 2;
                keys.reserve(chunk);
                values.reserve(chunk);
                continue;
            }
            Some(libc::ENOENT) | None => {}
            Some(_) => return Err(error.expect("an error")),
        }
        let read = (attr.count as usize).min(chunk);
        // SAFETY: the kernel filled the first `read` elements of each buffer with plain data.
        unsafe {
            keys.set_len(read);
            values.set_len(read);
        }
        entries.extend(keys.drain(..).zip(values.drain(..)));
        // ENOENT: that was the last of the map.
        if error.is_some() {
            return Ok(entries);
        }
        position = Some(next);
    }
}

/// The bpf() system call `command` with `attr`.
///
/// # Safety
/// The buffers `attr` points to must be valid for what `command` reads and writes there.
unsafe fn bpf(command: libc::c_long, attr: &mut BatchAttr) -> io::Result<()> {
    // SAFETY: `attr` is a valid `bpf_attr` prefix of the size passed; its buffers are the
    // caller's to vouch for.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            attr as *mut BatchAttr,
            size_of::<BatchAttr>(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
