#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Discovery over random sysfs-like trees written to a temp dir: missing files, garbage
//! contents, huge files, symlink loops, dangling links, links out of the tree and
//! non-UTF-8 names. It must never panic, and every entry of `bus/pci/devices` it does not
//! list must be named in `skipped`.

use node_agent::host::discover;
use proptest::prelude::*;
use std::ffi::OsStr;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::symlink;
use std::path::Path;

/// What one attribute file holds.
#[derive(Clone, Debug)]
enum Content {
    Missing,
    Valid,
    Garbage(Vec<u8>),
    /// Far past a page: reads must stop at the cap, not load it all.
    Huge(u8),
    /// A directory where a file should be.
    Dir,
}

fn content() -> impl Strategy<Value = Content> {
    prop_oneof![
        1 => Just(Content::Missing),
        6 => Just(Content::Valid),
        2 => proptest::collection::vec(any::<u8>(), 0..40).prop_map(Content::Garbage),
        1 => any::<u8>().prop_map(Content::Huge),
        1 => Just(Content::Dir),
    ]
}

/// One entry of `bus/pci/devices`.
#[derive(Clone, Debug)]
enum Entry {
    /// A function directory under `devices/pci0000:00/`, with these attributes.
    Function(Vec<Content>),
    /// A link to itself (ELOOP).
    Loop,
    /// A link to nothing.
    Dangling,
    /// A link to a directory outside the sysfs root.
    Outside,
    /// A plain file, not a link.
    File,
}

fn entry() -> impl Strategy<Value = Entry> {
    prop_oneof![
        6 => proptest::collection::vec(content(), ATTRS.len()).prop_map(Entry::Function),
        1 => Just(Entry::Loop),
        1 => Just(Entry::Dangling),
        1 => Just(Entry::Outside),
        1 => Just(Entry::File),
    ]
}

/// An entry's name: usually a valid address, sometimes garbage or not UTF-8.
fn name() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => (0u8..4, 0u8..32, 0u8..8)
            .prop_map(|(b, d, f)| format!("0000:{b:02x}:{d:02x}.{f}").into_bytes()),
        1 => "[a-z0-9:.]{1,16}".prop_map(String::into_bytes),
        1 => proptest::collection::vec(1u8..=255, 1..16)
            .prop_filter("a file name", |v| !v.contains(&b'/') && v != b"." && v != b".."),
    ]
}

const ATTRS: [(&str, &str); 14] = [
    ("vendor", "0x10de"),
    ("device", "0x2330"),
    ("subsystem_vendor", "0x10de"),
    ("subsystem_device", "0x16c1"),
    ("revision", "0xa1"),
    ("class", "0x030200"),
    ("numa_node", "1"),
    ("current_link_speed", "16.0 GT/s PCIe"),
    ("current_link_width", "16"),
    ("max_link_speed", "32.0 GT/s PCIe"),
    ("max_link_width", "16"),
    ("sriov_totalvfs", "7"),
    ("aer_dev_fatal", "TLP 0\nTOTAL_ERR_FATAL 0"),
    ("aer_dev_nonfatal", "TLP 0\nTOTAL_ERR_NONFATAL 0"),
];

fn write_tree(root: &Path, outside: &Path, entries: &[(Vec<u8>, Entry)]) {
    let list = root.join("bus/pci/devices");
    fs::create_dir_all(&list).unwrap();
    fs::create_dir_all(root.join("devices/pci0000:00")).unwrap();
    fs::create_dir_all(outside).unwrap();
    for (raw, e) in entries {
        let name = OsStr::from_bytes(raw);
        let link = list.join(name);
        if link.symlink_metadata().is_ok() {
            continue; // a duplicate name: the first one stands
        }
        match e {
            Entry::Function(attrs) => {
                let dir = root.join("devices/pci0000:00").join(name);
                if fs::create_dir_all(&dir).is_err() {
                    continue;
                }
                for ((file, valid), c) in ATTRS.iter().zip(attrs) {
                    let p = dir.join(file);
                    match c {
                        Content::Missing => {}
                        Content::Valid => fs::write(&p, format!("{valid}\n")).unwrap(),
                        Content::Garbage(b) => fs::write(&p, b).unwrap(),
                        Content::Huge(b) => fs::write(&p, vec![*b; 256 * 1024]).unwrap(),
                        Content::Dir => fs::create_dir_all(&p).unwrap(),
                    }
                }
                let mut target = b"../../../devices/pci0000:00/".to_vec();
                target.extend_from_slice(raw);
                symlink(OsStr::from_bytes(&target), &link).unwrap();
            }
            Entry::Loop => symlink(name, &link).unwrap(),
            Entry::Dangling => symlink("../../../devices/pci0000:00/nothing", &link).unwrap(),
            Entry::Outside => symlink(outside, &link).unwrap(),
            Entry::File => fs::write(&link, "x").unwrap(),
        }
    }
    // Sometimes-broken extras discovery reads for details.
    fs::create_dir_all(root.join("bus/pci/slots/CPU1 SLOT1")).unwrap();
    fs::write(
        root.join("bus/pci/slots/CPU1 SLOT1/address"),
        "0000:00:01\n",
    )
    .unwrap();
    fs::create_dir_all(
        root.join("bus/pci/slots")
            .join(OsStr::from_bytes(b"\xff\xfe")),
    )
    .unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn discovery_never_panics_and_accounts_for_every_entry(
        entries in proptest::collection::vec((name(), entry()), 0..24)
    ) {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("sys");
        write_tree(&root, &dir.path().join("elsewhere/0000:00:1f.0"), &entries);
        let found = discover(&root);
        let listed = fs::read_dir(root.join("bus/pci/devices")).unwrap().count();
        prop_assert_eq!(
            found.devices.len() + found.skipped.len(),
            listed,
            "devices {:?}\nskipped {:?}",
            found.devices.iter().map(|d| d.id.to_string()).collect::<Vec<_>>(),
            &found.skipped
        );
        for d in &found.devices {
            prop_assert!(d.validate().is_ok(), "{:?}", d);
            // Everything listed came from a fully valid set of required attributes.
            prop_assert_eq!(d.vendor.to_string(), "10de");
        }
    }
}

#[test]
fn a_huge_attribute_is_read_only_up_to_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("sys");
    let mut attrs = vec![Content::Valid; ATTRS.len()];
    attrs[0] = Content::Huge(b'1');
    write_tree(
        &root,
        &dir.path().join("elsewhere"),
        &[(b"0000:00:01.0".to_vec(), Entry::Function(attrs))],
    );
    let found = discover(&root);
    assert!(found.devices.is_empty());
    assert_eq!(found.skipped.len(), 1);
    assert!(found.skipped[0].contains("vendor"), "{:?}", found.skipped);
}
